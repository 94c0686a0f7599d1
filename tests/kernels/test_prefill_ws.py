"""The warp-specialised Gluon prefill (`workbench_kernels.prefill_ws`): it compiles for sm_90 on any machine
(Gluon's compiler pipeline ahead of time, the ptxas the triton wheel ships) into warp-specialised partitions
with wgmma, TMA, no spills and its shared memory within the H200's; on an H200 it matches exact masked
attention in bf16; inputs it does not take raise ValueError naming the field (checked on the CPU).

Vertical-Slash (`ws_vertical_slash`) and A-shape (`ws_ashape`) run on an H200 against the same reference; for VS
the pieces and packed columns it builds (`index_build.vs_slash_tiles`,
`pack_columns`; Triton's interpreter on a CPU) keep exactly `vs_to_tiles`' keys.

The compiles run in a fresh process (this file as a script), as in test_kernels_compile.py: a process where
the interpreter ran kernels cannot `triton.compile`."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from test_kernels_compile import SMEM_SM90, compile_env
from workbench_kernels.index_ref import block_sparse_to_tiles, narrow_pieces, tiles_to_mask, vs_to_tiles
from workbench_kernels.prefill_ref import masked_attention_ref

CASES = {  # id: (consumers, stages, overlap, head_dim, share_kv, pattern: block / vs / ashape[, keys per item[,
    # V stages[, pair: two items per step[, persistent: programs taking turns (the GPU tests run 5 of them)]]]])
    "two_consumers_2_stages": (2, 2, True, 128, False, "block"),  # the default
    "two_consumers_3_stages": (2, 3, True, 128, False, "block"),
    "one_consumer": (1, 2, True, 128, False, "block"),
    "no_overlap": (2, 2, False, 128, False, "block"),
    "head_dim_64": (2, 2, True, 64, False, "block"),
    "shared_kv_3_stages": (2, 3, True, 128, True, "block"),
    "shared_kv_4_stages": (2, 4, True, 128, True, "block"),
    "vs_two_consumers_2_stages": (2, 2, True, 128, False, "vs"),  # ws_vertical_slash's default
    "vs_two_consumers_3_stages": (2, 3, True, 128, False, "vs"),
    "vs_one_consumer": (1, 2, True, 128, False, "vs"),
    "vs_one_consumer_3_stages": (1, 3, True, 128, False, "vs"),
    "vs_no_overlap": (2, 2, False, 128, False, "vs"),
    "vs_head_dim_64": (2, 2, True, 64, False, "vs"),
    "vs_shared_kv_4_stages": (2, 4, True, 128, True, "vs"),  # group-shared index: two query heads on one ring
    "ashape_two_consumers_2_stages": (2, 2, True, 128, False, "ashape"),  # ws_ashape's default
    "ashape_one_consumer": (1, 2, True, 128, False, "ashape"),
    "ashape_no_overlap": (2, 2, False, 128, False, "ashape"),
    "ashape_head_dim_64": (2, 2, True, 64, False, "ashape"),
    "ashape_shared_kv_4_stages": (2, 4, True, 128, True, "ashape"),
    "ashape_per_head_3_stages": (2, 3, True, 128, False, "ashape"),  # ASHAPE_PER_HEAD_LAUNCH (224 KB)
    # 128 keys per step (`ws_ashape(width=128)`): 64 x 128 score tiles, 32 KB K / V tiles at head_dim 128
    "ashape_keys128_shared_kv_2_stages": (2, 2, True, 128, True, "ashape", 128),
    "ashape_keys128_shared_kv_3_stages": (2, 3, True, 128, True, "ashape", 128),
    "ashape_keys128_head_dim_64": (2, 3, True, 64, False, "ashape", 128),
    # per-head rings of 128-key steps at head_dim 128: 2 K stages, 1 V stage (224 KB); a V ring shallower than K's
    # (VS with overlap there spills ~1 KB: its strip masks on top of two 64 x 128 score tiles)
    "ashape_keys128_k2_v1": (2, 2, True, 128, False, "ashape", 128, 1),
    "ashape_keys128_k2_v1_no_overlap": (2, 2, False, 128, False, "ashape", 128, 1),
    "vs_keys128_k2_v1_no_overlap": (2, 2, False, 128, False, "vs", 128, 1),
    "block_3_stages_v2": (2, 3, True, 128, False, "block", 64, 2),
    # two 64-key items per step (`ws_prefill(pair=True)`): 128-key slots filled by two TMA copies, 64 x 128 scores
    # (with overlap one consumer spills ~64 bytes, as 128-key VS steps do)
    "pair_one_consumer_k2_v1": (1, 2, False, 128, False, "block", 64, 1, True),
    "pair_two_consumers_k2_v1": (2, 2, False, 128, False, "block", 64, 1, True),  # HEAD_LAUNCH (sparse_prefill)
    "pair_shared_kv_3_stages": (2, 3, False, 128, True, "block", 64, None, True),  # SHARED_LAUNCH
    "pair_head_dim_64": (1, 3, False, 64, False, "block", 64, None, True),  # HEAD_LAUNCH_D64
    "vs_pair_one_consumer_k2_v1": (1, 2, False, 128, False, "vs", 64, 1, True),
    "vs_pair_two_consumers_k2_v1": (2, 2, False, 128, False, "vs", 64, 1, True),  # HEAD_LAUNCH, the deployed VS route
    "vs_pair_shared_kv_3_stages": (2, 3, False, 128, True, "vs", 64, None, True),
    "head_dim_256": (2, 1, False, 256, False, "block"),  # HEAD_LAUNCH_D256
    "head_dim_256_shared_kv": (2, 2, False, 256, True, "block"),  # SHARED_LAUNCH_D256
    "vs_head_dim_256": (2, 1, False, 256, False, "vs"),  # HEAD_LAUNCH_D256 on head columns
    "head_dim_256_keys32": (2, 2, False, 256, False, "block", 32),  # 32-key items, rings of 2 slots (197 KB)
    # one consumer at head_dim 256 (`launch_config`: 168 / 240 registers; ptxas refuses 128), rings of 2 (164 KB)
    "head_dim_256_one_consumer": (1, 2, True, 256, False, "block"),
    # A-shape at head_dim 256: two heads of one band on one shared ring of two 64-key slots, overlap (197 KB;
    # `ASHAPE_LAUNCH_D256`; Triton 3.6 spills 8 / 16 bytes there, 3.9 none)
    "ashape_head_dim_256_shared_kv": (2, 2, True, 256, True, "ashape"),
    # a persistent grid (programs taking turns), one case per producer path: the shared ring (`ASHAPE_LAUNCH`), one
    # consumer, two rings
    "persistent_ashape_keys128_shared_kv_3_stages": (2, 3, True, 128, True, "ashape", 128, None, False, True),
    "persistent_pair_head_dim_64": (1, 3, False, 64, False, "block", 64, None, True, True),
    "persistent_ashape_per_head_3_stages": (2, 3, True, 128, False, "ashape", 64, None, False, True),
}
# defaults: 64 keys per item, as many V stages as K stages, one item per step, one program per turn
CASES = {case: (*args, *(64, None, False, False)[len(args) - 6:]) for case, args in CASES.items()}
BLOCK_CASES, VS_CASES, ASHAPE_CASES = ([case for case, args in CASES.items() if args[5] == pattern]
                                       for pattern in ("block", "vs", "ashape"))


def compile_ws(consumers: int, stages: int, overlap: bool, d: int, share: bool, pattern: str, keys: int = 64,
               v_stages: int | None = None, pair: bool = False, persistent: bool = False, dtype: str = "bf16"):
    """`_ws_prefill_kernel` compiled for sm_90 (descriptor arguments typed as `ws_prefill` builds them; K / V
    tiles of `keys` rows, two per ring slot with `pair`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from workbench_kernels import prefill_ws

    fn = prefill_ws._ws_prefill_kernel
    def desc(rows: int) -> str:
        return f"tensordesc<{dtype}[{rows}, {d}],{gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)!r}>"

    pointers = {"O": f"*{dtype}", "LSE": "*fp32", "BlockCount": "*i32", "BlockOffset": "*i32", "ColCount": "*i32",
                "Keep": "*i32", "Sink": "*i32", "Window": "*i32", "Order": "*i32",
                "Pairs": "*i32", "Claimed": "*i32"}
    types = {"q_desc": desc(64), "k_desc": desc(keys), "v_desc": desc(keys), "kc_desc": desc(keys), "vc_desc": desc(keys),
             "qk_scale": "fp32", **pointers}
    cfg = prefill_ws.launch_config(consumers, d)
    constants = dict(CONSUMERS=consumers, STAGES=stages, V_STAGES=v_stages or stages, OVERLAP=overlap, SHARE=share,
                     VS=pattern == "vs", ASHAPE=pattern == "ashape", PAIR=pair, PERSIST=persistent,
                     CONSUMER_REGS=cfg["consumer_regs"])
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    source = GluonASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cfg["maxnreg"]})


def ptxas_report(ptx: str) -> str:
    """`ptxas -v` of the PTX for sm_90a (registers, spill stores / loads)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    return run.stdout + run.stderr


def compile_all() -> dict[str, dict]:
    """Per case: shared memory, wgmma / TMA instructions in the PTX, partitions and their register counts in
    the TTGIR, ptxas registers and spills (or the error)."""
    out: dict[str, dict] = {}
    for case, args in CASES.items():
        try:
            kernel = compile_ws(*args)
            ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
            report = ptxas_report(ptx)
            spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
            out[case] = {"shared": kernel.metadata.shared,
                         "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                         "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                         "partitions": len(re.findall(r"\bpartition\d+\(", ttgir)),
                         "requested_regs": re.findall(r"requestedRegisters = array<i32: ([\d, ]+)>", ttgir),
                         "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
                         "local": ptx.count(".local"), "spills": spills,
                         "registers": [int(x) for x in re.findall(r"Used (\d+) registers", report)]}
        except Exception as e:  # noqa: BLE001 - reported by the test of this case
            out[case] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    return out


def gluon_hopper_reason() -> str | None:
    """Why this Triton cannot build the kernel (None: it can)."""
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError as e:
        return f"the installed Triton has no Gluon for Hopper: {e}"
    return None


def compiled_by(script: str) -> dict:
    """The JSON a test module prints when run as a script (its sm_90 compiles, in a fresh process); skips where this
    Triton has no Gluon for Hopper."""
    reason = gluon_hopper_reason()
    if reason:
        pytest.skip(reason)
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, env=compile_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return compiled_by(__file__)


@pytest.mark.xdist_group("ws_compile")  # one worker runs the module's compile fixture (~65 s on 2 cores), not both
@pytest.mark.parametrize("case", list(CASES))
def test_ws_prefill_compiles_for_sm90(compiled, case):
    """Worker partitions (producer, and the second consumer) beside the default one, registers moved between
    them with setmaxnreg; per consumer 8 (head_dim 128) or 4 wgmma for Q K^T and 4 for P V per code path;
    TMA loads; no local memory, no spills; shared memory within the H200's."""
    result = compiled[case]
    assert "error" not in result, result.get("error")
    consumers, stages, overlap, d, _, _, keys, _, pair, _ = CASES[case]
    assert result["partitions"] == consumers, result  # workers: producer (+ the second consumer)
    assert result["setmaxnreg"], result
    per_path = d // 16 + keys * (1 + pair) // 16  # Q K^T over head_dim, P V over a step's keys, in k-steps of 16
    assert result["wgmma"] == consumers * per_path * (2 if overlap else 1), result  # overlap: + prologue/epilogue
    assert result["tma_loads"] > 0
    assert result["local"] == 0 and not any(result["spills"]), result
    assert result["shared"] <= SMEM_SM90


def block_index(B: int, H: int, n: int, keep: float, seed: int) -> torch.Tensor:
    """Random causal key blocks Int `[B, H, M, M]` (-1 = dropped); block_sparse_to_tiles adds the diagonal."""
    M = -(-n // 64)
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(M).expand(B, H, M, M)
    return torch.where(torch.rand(B, H, M, M, generator=g) < keep, idx, -1).to(torch.int32)


def qkv(B: int, Hq: int, Hkv: int, n: int, D: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g).to("cuda", torch.bfloat16) for h in (Hq, Hkv, Hkv)]


def assert_bf16_close(o: torch.Tensor, lse: torch.Tensor, ro: torch.Tensor, rlse: torch.Tensor) -> None:
    """o / lse finite and within 16-bit rounding of the fp32 reference (o 2e-2; lse 8e-2 absolute, 2e-2 relative)."""
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse, atol=8e-2, rtol=2e-2)


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="ws_prefill runs on sm_90 (H100 / H200) only")
@pytest.mark.parametrize("case", BLOCK_CASES)
@pytest.mark.parametrize("keep", [1.0, 0.3], ids=["dense_causal", "block_sparse"])
def test_ws_prefill_matches_masked_attention_bf16(case, keep):
    """Every causal block and random selections (the diagonal always in; shared K/V: one per KV head), N not a
    multiple of 64, GQA 4:1, an odd number of row blocks (the last program's second consumer has no work): o and
    lse against fp32 attention under the tiles' mask."""
    from workbench_kernels.prefill_ws import ws_prefill

    consumers, stages, overlap, d, share, _, keys, v_stages, pair, persistent = CASES[case]
    B, Hq, Hkv, n = 2, 8, 2, 1000
    q, k, v = qkv(B, Hq, Hkv, n, d, seed=int(keep * 10))
    index = block_index(B, Hkv if share else Hq, n, keep, seed=1)  # share_kv: one selection per KV head
    tiles = narrow_pieces(block_sparse_to_tiles(index.repeat_interleave(Hq // index.shape[1], 1), n), keys, n).to("cuda")
    o, lse = ws_prefill(q, k, v, tiles, stages=stages, consumers=consumers, overlap=overlap, share_kv=share,
                        v_stages=v_stages, pair=pair, persistent=5 if persistent else False)
    ro, rlse = masked_attention_ref(q, k, v, tiles_to_mask(tiles, n))
    assert_bf16_close(o, lse, ro, rlse)
    if share:  # the group-shared tiles themselves (one list per KV head): the same launch
        grouped = block_sparse_to_tiles(index, n).to("cuda")
        o2, lse2 = ws_prefill(q, k, v, grouped, stages=stages, consumers=consumers, overlap=overlap, share_kv=True,
                              v_stages=v_stages, pair=pair, persistent=5 if persistent else False)
        assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="ws_prefill runs on sm_90 (H100 / H200) only")
@pytest.mark.parametrize("share", [False, True], ids=["per_head", "group_shared"])
def test_sparse_prefill_takes_the_gluon_launches_at_head_dim_256(share):
    """`sparse_prefill(warp_specialize=True)` at Gemma-3's head_dim 256 (`HEAD_LAUNCH_D256`, group-shared tiles
    `SHARED_LAUNCH_D256`; GQA 4:1) equals the Triton-language loop on the same tiles (bf16)."""
    from workbench_kernels.prefill import sparse_prefill

    B, Hq, Hkv, n = 1, 4, 1, 1000
    q, k, v = qkv(B, Hq, Hkv, n, 256, seed=3)
    tiles = block_sparse_to_tiles(block_index(B, Hkv if share else Hq, n, 0.3, seed=4), n).to("cuda")
    o, lse = sparse_prefill(q, k, v, tiles, warp_specialize=True)
    ro, rlse = sparse_prefill(q, k, v, tiles, warp_specialize=False)
    torch.testing.assert_close(o.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse, atol=2e-2, rtol=2e-2)


def vs_index(B: int, H: int, n: int, n_cols: int, n_offs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Vertical-Slash index (columns Long `[B, H, n_cols]`, offsets Long `[B, H, n_offs]`, unsorted) with
    repeated, -1 and >= n entries, and offsets both near the diagonal and scattered."""
    g = torch.Generator().manual_seed(seed)
    cols = torch.randint(-1, n + 20, (B, H, n_cols), generator=g)
    cols[..., 1::7] = cols[..., ::7][..., : cols[..., 1::7].shape[-1]]  # repeats
    near = torch.randint(-1, 200, (B, H, n_offs // 2), generator=g)
    far = torch.randint(0, n + 40, (B, H, n_offs - n_offs // 2), generator=g)
    return cols, torch.cat([near, far, near[..., :3]], -1)


@pytest.mark.parametrize("n,width", [(333, 64), (1000, 64), (1000, 128)])
def test_vs_packed_columns_keep_the_reference_keys(n, width):
    """`vs_slash_tiles` gives `vs_to_tiles`' pieces (64 or 128 keys wide); the packed columns' prefix < m*64 of
    row block m, less the covered ones (the kernel's strip mask: `strip_keep`'s bits), is `vs_to_tiles`' column list
    of that row block; kc / vc rows are the columns' K / V rows of the query head's KV head (GQA 4:1), padded to whole strips.
    `pack_vertical_slash`, what `ws_vertical_slash` launches on, returns these pieces, rows, counts and bits."""
    import triton
    from workbench_kernels.index_build import vs_slash_tiles
    from workbench_kernels.prefill_ws import pack_columns, pack_vertical_slash, strip_keep

    if os.environ.get("TRITON_INTERPRET") == "1" and triton.__version__.startswith("3.6"):
        pytest.skip("Triton 3.6's interpreter cannot run index_build._vs_cover_kernel (test_kernels_index fails alike)")
    B, Hq, Hkv, D = 2, 8, 2, 16
    cols, offs = vs_index(B, Hq, n, 150, 40, seed=n)
    w = 0 if width == 64 else width
    ref = vs_to_tiles(cols, offs, n, width=w)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the cover kernel: compiled on a GPU, else interpreted
    tiles, covered, packed = vs_slash_tiles(cols.to(dev), offs.to(dev), n, 64, w)
    tiles, covered, packed = tiles.to("cpu"), covered.cpu(), packed.cpu()
    assert torch.equal(tiles.block_count, ref.block_count) and not tiles.column_count.any()
    live = torch.arange(ref.block_offset.shape[-1]) < ref.block_count.unsqueeze(-1)
    assert torch.equal(tiles.block_offset[..., : live.shape[-1]][live], ref.block_offset[live])
    k, v = (torch.randn(B, Hkv, n, D) for _ in range(2))
    kc, vc, pc, count = pack_columns(k, v, packed, Hq, width)
    kvp = pc.shape[-1]
    assert kvp % width == 0 and kc.shape == vc.shape == (B * Hq * kvp, D)
    words = strip_keep(pc.to(dev), count.to(dev), covered.to(dev)).cpu()
    assert words.shape == (B, Hq, ref.shape[-1], kvp // 32)
    once, strips = pack_vertical_slash(k.to(dev), v.to(dev), cols, offs, Hq, width)
    assert torch.equal(once.block_count.cpu(), ref.block_count)
    assert torch.equal(once.block_offset.cpu()[..., : live.shape[-1]][live], ref.block_offset[live])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(strips, (kc, vc, count, words), strict=True))
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # bit j of word w: packed column 32w + j
    bits = bits.flatten(-2).bool()
    for b in range(B):
        for h in range(Hq):
            valid = pc[b, h][pc[b, h] < n].long()
            assert torch.equal(valid, torch.unique(cols[b, h][(cols[b, h] >= 0) & (cols[b, h] < n)]))
            rows = (b * Hq + h) * kvp + torch.arange(len(valid))
            assert torch.equal(kc[rows], k[b, h // 4, valid]) and torch.equal(vc[rows], v[b, h // 4, valid])
            for m in range(ref.shape[-1]):
                prefix = pc[b, h, : count[b, h, m]].long()
                assert (prefix < m * 64).all() and (pc[b, h, count[b, h, m]:] >= m * 64).all()
                kept = prefix[covered[b, h, m * 64 - prefix + 63] == 0]
                assert torch.equal(kept, ref.column_index[b, h, m, : ref.column_count[b, h, m]].long()), (b, h, m)
                assert torch.equal(pc[b, h][bits[b, h, m]].long(), kept), (b, h, m)  # the strip lanes' bits


def test_strip_keep_rejects_columns_not_padded_to_words():
    """`strip_keep` packs 32 columns a word: a column list not padded by `pack_columns` is refused, naming the fix."""
    from workbench_kernels.prefill_ws import strip_keep

    with pytest.raises(ValueError, match="multiple of 32 packed columns.*pack_columns"):
        strip_keep(torch.zeros(1, 2, 40, dtype=torch.int32), torch.zeros(1, 2, 3, dtype=torch.int32),
                   torch.zeros(1, 2, 255, dtype=torch.int8))


def test_head_columns_are_the_column_lists_and_survive_a_merge():
    """`vs_tiles(head_columns=True)`: row block m's head columns < m*64 that no piece covers are its `column_index`
    list; a merge with block-sparse and dense heads keeps them for the VS heads (n padding, covered 0 for the
    others), and a merge with a kind whose column lists have no head columns (A-shape sinks) drops them, so that
    only the loop, which reads the lists, takes those tiles."""
    import triton
    from workbench_kernels.index_build import vs_tiles
    from workbench_kernels.index_ref import ashape_to_tiles, merge_tiles

    if os.environ.get("TRITON_INTERPRET") == "1" and triton.__version__.startswith("3.6"):
        pytest.skip("Triton 3.6's interpreter cannot run index_build._vs_cover_kernel (test_kernels_index fails alike)")
    B, H, n = 2, 3, 700
    cols, offs = vs_index(B, H, n, 90, 30, seed=5)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    vs = vs_tiles(cols.to(dev), offs.to(dev), n, head_columns=True).to("cpu")
    ref = vs_to_tiles(cols, offs, n)
    assert torch.equal(vs.column_count, ref.column_count) and vs.covered.shape == (B, H, n + 63)
    for b in range(B):
        for h in range(H):
            hc = vs.head_columns[b, h].long()
            assert torch.equal(hc[hc < n], torch.unique(cols[b, h][(cols[b, h] >= 0) & (cols[b, h] < n)]))
            for m in range(ref.shape[-1]):
                below = hc[hc < m * 64]
                kept = below[vs.covered[b, h, m * 64 - below + 63] == 0]
                assert torch.equal(kept, ref.column_index[b, h, m, : ref.column_count[b, h, m]].long()), (b, h, m)
    block = block_sparse_to_tiles(block_index(B, 2, n, 0.4, seed=2), n)
    dense = ashape_to_tiles([0], [n], n, B)
    assert not dense.columns and not block.columns
    merged = merge_tiles([([0, 3, 5], vs), ([1, 4], block), ([2], dense)], 6)
    assert not merged.columns or merged.head_columns is not None
    assert torch.equal(merged.head_columns[:, [0, 3, 5], : vs.head_columns.shape[-1]], vs.head_columns)
    assert (merged.head_columns[:, [1, 2, 4]] == n).all() and not merged.covered[:, [1, 2, 4]].any()
    assert torch.equal(merged.covered[:, [0, 3, 5]], vs.covered)
    sinks = ashape_to_tiles([4], [64], n, B)
    assert merge_tiles([([0, 1, 2], vs), ([3], sinks)], 4).head_columns is None


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 (H100 / H200) only")
def test_a_mixed_layer_with_vertical_slash_runs_the_gluon_kernel():
    """SparsePrefill's deployed path on one layer of VS, block-sparse and dense heads (GQA 2:1, bf16, N = 1000,
    head_dim 128): the merged tiles carry the VS heads' columns per head, so `sparse_prefill` takes the Gluon kernel
    by default; its output and the loop's equal the PyTorch reference path's on the same index. (Head_dim 64 ran
    too on the H200 at 45fc3b0; left out of the lane, whose cold compiles took 537 of its 540 s there.)"""
    from test_methods_kernel import mixed_prefill
    from workbench_kernels.prefill import sparse_prefill
    from workbench_kernels.prefill_ws import ws_takes

    entries = [("vs", {"vertical": 40, "slash": 30}), ("block", {"topk": 3}), ("dense", {}),
               ("vs", {"vertical": 8, "slash": 90})]
    sp, _, q, k, v = mixed_prefill(entries, n=1000, hkv=2, d=128, seed=4)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    groups = sp.group_tiles(0, q, k, 0.1, triton=True)  # what layer_index merges for the "triton" backend
    tiles, sink, window = sp.merge(groups, q, 0)
    assert tiles.head_columns is not None and sink is None and ws_takes(q, tiles, sink)
    got = sparse_prefill(q, k, v, tiles, scale=0.1, warp_specialize=True)[0]
    assert torch.equal(got, sp.layer_kernel(0, (tiles, sink, window), q, k, v, 0.1, "triton"))
    loop = sparse_prefill(q, k, v, tiles, scale=0.1, warp_specialize=False)[0]
    ref = sp.reference(groups, q.float(), k.float(), v.float(), 0.1)
    for o in (got, loop):
        torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 (H100 / H200) only")
def test_an_ashape_layer_runs_the_shared_ring_where_heads_pair_else_per_head_rings(monkeypatch):
    """SparsePrefill on a layer of A-shape heads only (4 heads, batch 2, bf16, N = 1000, head_dim 128) takes A-shape's
    own kernel (`AShape.layer_attention`: `ws_ashape`): where each KV group's heads pair up by band, two of a band on
    one K/V ring (GQA 2:1 with heads 2j and 2j + 1 alike; GQA 4:1 with the bands in turn, so the pairs are heads 0 / 3
    and 1 / 2), else per-head rings (`ashape_launch`); equal to `ashape_prefill`'s output, close to the PyTorch
    reference path and to the loop over the merged tiles."""
    import workbench_kernels.prefill_ws as ws
    from test_methods_kernel import mixed_prefill
    from workbench_kernels.prefill import ashape_prefill, sparse_prefill

    calls = []
    real = ws.ws_ashape
    monkeypatch.setattr(ws, "ws_ashape", lambda *a, **kw: calls.append(kw["share_kv"]) or real(*a, **kw))
    bands = [(64, 300), (64, 300), (0, 129), (0, 129)]
    cases = [(bands, 2, True), ([(64, 300), (0, 129), (0, 129), (64, 300)], 1, True),
             ([(64, 300), (64, 200)] + bands[2:], 2, False)]
    for heads, hkv, shared in cases:
        sp, _, q, k, v = mixed_prefill([("ashape", {"sink": g, "window": w}) for g, w in heads], n=1000, hkv=hkv,
                                       d=128, seed=5)
        q, k, v = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
        calls.clear()
        index = sp.layer_index(0, q, k, 0.1, "triton")
        got = sp.layer_kernel(0, index, q, k, v, 0.1, "triton")
        assert calls == [shared]
        sink, window = (torch.tensor(x) for x in zip(*heads))
        assert torch.equal(got, ashape_prefill(q, k, v, sink, window, scale=0.1)[0])
        loop = sparse_prefill(q, k, v, index[0], sink=index[1], window=index[2], scale=0.1)[0]
        ref = sp.reference(sp.group_tiles(0, q, k, 0.1, triton=True), q.float(), k.float(), v.float(), 0.1)
        for o in (got, loop):
            torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 (H100 / H200) only")
def test_a_trishape_layer_runs_the_band_on_the_shared_ring_then_its_dense_rows(monkeypatch):
    """SparsePrefill on a layer of Tri-shape heads only (GQA 2:1, bf16, N = 1000, head_dim 128; questions of 64, 100, 0
    and 1 rows) takes A-shape's Gluon kernel over the band (on one ring where heads 2j and 2j + 1 share a band, else
    per-head rings) and then the dense rows (`TriShape.layer_attention`), close to the PyTorch reference path and to
    the one launch over the merged tiles."""
    import workbench_kernels.prefill_ws as ws
    from test_methods_kernel import trishape_layer_on_gpu
    from workbench_kernels.prefill import sparse_prefill

    calls = []
    real = ws.ws_ashape
    monkeypatch.setattr(ws, "ws_ashape", lambda *a, **kw: calls.append(kw["share_kv"]) or real(*a, **kw))
    heads = [(64, 300, 64), (64, 300, 100), (0, 129, 0), (0, 129, 1)]
    for alike in (True, False):
        params = heads if alike else [(64, 300, 64), (64, 200, 100)] + heads[2:]
        calls.clear()
        q, k, v, index, got, ref = trishape_layer_on_gpu(params, hkv=2, d=128, seed=6)
        assert calls == [alike]
        loop = sparse_prefill(q, k, v, index[0], sink=index[1], window=index[2], scale=0.1)[0]
        for o in (got, loop):
            torch.testing.assert_close(o.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="ws_vertical_slash runs on sm_90 (H100 / H200) only")
@pytest.mark.parametrize("case", VS_CASES)
@pytest.mark.parametrize("n", [1000, 4096])
def test_ws_vertical_slash_matches_masked_attention_bf16(case, n):
    """Random columns / offsets (repeats, -1, >= N, near and far offsets), N = 1000 (not a multiple of 64) and
    4096 (more columns than one strip per row block), GQA 4:1: o and lse against fp32 attention under
    `vs_to_tiles`' mask; shared-K/V cases take a group-shared index (`[B, Hkv, K]`, two query heads on a ring)."""
    from workbench_kernels.index_ref import expand_groups
    from workbench_kernels.prefill_ws import ws_vertical_slash

    consumers, stages, overlap, d, share, _, keys, v_stages, pair, persistent = CASES[case]
    B, Hq, Hkv = 2, 8, 2
    q, k, v = qkv(B, Hq, Hkv, n, d, seed=n)
    cols, offs = vs_index(B, Hkv if share else Hq, n, 300, 60, seed=n)
    o, lse = ws_vertical_slash(q, k, v, cols.cuda(), offs.cuda(), stages=stages, consumers=consumers, overlap=overlap,
                               v_stages=v_stages, width=keys, pair=pair, persistent=5 if persistent else False)
    tiles = expand_groups(vs_to_tiles(cols.cuda(), offs.cuda(), n, width=0 if keys == 64 else keys), Hq // Hkv if share else 1)
    ro, rlse = masked_attention_ref(q, k, v, tiles_to_mask(tiles, n))
    assert_bf16_close(o, lse, ro, rlse)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="ws_ashape runs on sm_90 (H100 / H200) only")
@pytest.mark.parametrize("case", ASHAPE_CASES)
def test_ws_ashape_matches_masked_attention_bf16(case):
    """Per-head sinks (0, inside the first piece, over a strip, over a window piece) and windows (1, a piece's
    width, wider than N, none), N = 1000, GQA 4:1: o and lse against fp32 attention under the A-shape mask."""
    from workbench_kernels.index_ref import ashape_to_tiles
    from workbench_kernels.prefill_ws import ws_ashape
    from workbench_kernels.tiling import NO_WINDOW

    consumers, stages, overlap, d, share, _, keys, v_stages, _, persistent = CASES[case]
    B, Hq, Hkv, n = 2, 8, 2, 1000
    sink = torch.tensor([0, 4, 64, 100, 4, 0, 130, 700])
    window = torch.tensor([64, 100, 1, 300, NO_WINDOW, 1200, 65, 17])
    if share:  # each KV group's four heads in two bands, in the order a b b a: `head_pairs` pairs heads 0 / 3, 1 / 2
        sink, window = sink[[0, 2, 2, 0, 4, 6, 6, 4]], window[[1, 3, 3, 1, 5, 7, 7, 5]]
    q, k, v = qkv(B, Hq, Hkv, n, d, seed=3)
    o, lse = ws_ashape(q, k, v, sink, window, stages=stages, consumers=consumers, overlap=overlap, share_kv=share,
                       width=keys, v_stages=v_stages, persistent=5 if persistent else False)
    mask = tiles_to_mask(ashape_to_tiles(sink, window, n, B, device="cuda"), n, sink.cuda(), window.cuda())
    ro, rlse = masked_attention_ref(q, k, v, mask.cuda())
    assert_bf16_close(o, lse, ro, rlse)


def error_cases() -> dict[str, tuple]:
    """id: (q, k, v, tiles, extra kwargs, the field the message must name); CPU tensors."""
    n = 200
    q, k, v = (torch.randn(1, h, n, 128, dtype=torch.bfloat16) for h in (8, 2, 2))
    tiles = block_sparse_to_tiles(block_index(1, 8, n, 0.5, seed=0), n)
    shared = block_sparse_to_tiles(block_index(1, 2, n, 0.5, seed=0), n)
    vs = vs_to_tiles(torch.tensor([[[3, 90]] * 8]), torch.tensor([[[0, 70]] * 8]), n)
    q32, k32 = (torch.randn(1, h, n, 32, dtype=torch.bfloat16) for h in (8, 2))
    return {
        "columns": (q, k, v, vs, {}, "column"),
        "group_shared": (q, k, v, shared, {}, "expand_groups"),
        "block_128": (q, k, v, block_sparse_to_tiles(block_index(1, 8, n, 0.5, seed=0), n, block=128), {},
                      "tiles.block"),
        "head_dim_32": (q32, k32, k32, tiles, {}, "head_dim"),
        "fp32": (q.float(), k.float(), v.float(), tiles, {}, "dtype"),
        "window": (q, k, v, tiles, {"sink": torch.zeros(8), "window": torch.full((8,), 64)}, "window"),
        "overlapping_pieces": (q, k, v, dataclasses.replace(tiles, disjoint=False), {}, "tiles.disjoint"),
        "share_kv_unequal_heads": (q, k, v, tiles, {"share_kv": True}, "share_kv"),
        "v_stages_deeper_than_k": (q, k, v, tiles, {"v_stages": 3}, "v_stages"),
        "not_hopper": (q, k, v, tiles, {}, "Hopper"),
    }


@pytest.mark.parametrize("case", list(error_cases()))
def test_ws_prefill_rejects_unsupported_inputs(case):
    """Each unsupported input raises ValueError naming the field and the way out (sparse_prefill, expand_groups,
    block 64); on a CPU tensor the last check is the device's."""
    if gluon_hopper_reason():
        pytest.skip(gluon_hopper_reason())
    from workbench_kernels.prefill_ws import ws_prefill

    q, k, v, tiles, kwargs, field = error_cases()[case]
    if case == "not_hopper" and hopper():
        pytest.skip("this machine is a Hopper GPU")
    with pytest.raises(ValueError, match=field):
        ws_prefill(q, k, v, tiles, **kwargs)


def test_head_pairs_pair_each_kv_groups_heads_by_band():
    """`head_pairs`: a KV group's heads stay in place where heads 2j and 2j + 1 share a band, else they are sorted by
    band; None for an odd group, a band held by an odd number of a group's heads, or not one band per head."""
    if gluon_hopper_reason():
        pytest.skip(gluon_hopper_reason())
    from workbench_kernels.prefill_ws import head_pairs

    t = torch.tensor
    assert head_pairs(4, 2, t([0, 0, 4, 4]), t([64, 64, 9, 9])) == (0, 1, 2, 3)
    assert head_pairs(8, 2, t([0] * 8), t([64, 9, 9, 64, 9, 9, 9, 9])) == (1, 2, 0, 3, 4, 5, 6, 7)
    assert head_pairs(4, 1, t([0, 4, 0, 4]), t([9] * 4)) == (0, 2, 1, 3)
    assert head_pairs(4, 1, t([0] * 4), t([64, 9, 9, 9])) is None
    assert head_pairs(6, 2, t([0] * 6), t([9] * 6)) is None
    assert head_pairs(4, 2, t([0] * 3), t([9] * 3)) is None
    assert head_pairs(6, 4, t([0] * 6), t([9] * 6)) is None  # no whole KV groups


def test_ashape_launch_takes_the_shared_ring_at_head_dim_256_only_where_heads_pair():
    """`ashape_launch`: at head_dim 128 the shared ring where heads pair up by band, else per-head rings; at 256 the
    shared ring of 64-key slots where they pair, else None (the row-block pairs or the loop run)."""
    if gluon_hopper_reason():
        pytest.skip(gluon_hopper_reason())
    from workbench_kernels.prefill_ws import ASHAPE_LAUNCH, ASHAPE_LAUNCH_D256, ASHAPE_PER_HEAD_LAUNCH, ashape_launch

    t = torch.tensor
    alike, differ = (t([0] * 4), t([9] * 4)), (t([0] * 4), t([64, 9, 32, 9]))
    assert ashape_launch(4, 1, *alike) == ASHAPE_LAUNCH and ashape_launch(4, 1, *differ) == ASHAPE_PER_HEAD_LAUNCH
    assert ashape_launch(4, 1, *alike, 256) == ASHAPE_LAUNCH_D256
    assert ASHAPE_LAUNCH_D256["share_kv"] and ASHAPE_LAUNCH_D256["width"] == 64
    assert ashape_launch(4, 1, *differ, 256) is None and ashape_launch(3, 1, t([0] * 3), t([9] * 3), 256) is None
    assert ashape_launch(4, 1, *alike, 64) is None


@pytest.mark.parametrize("case", ["sink_shape", "window_dtype", "share_unequal", "width", "persistent", "not_hopper"])
def test_ws_ashape_rejects_unsupported_inputs(case):
    """One integer sink and window per query head, share_kv only where each KV group's heads pair up by band, 64 or
    128 keys per step, persistent a bool or a count of programs, an sm_90 GPU; else ValueError naming the field."""
    if gluon_hopper_reason():
        pytest.skip(gluon_hopper_reason())
    from workbench_kernels.prefill_ws import ws_ashape

    if case == "not_hopper" and hopper():
        pytest.skip("this machine is a Hopper GPU")
    q, k, v = (torch.randn(1, h, 200, 128, dtype=torch.bfloat16) for h in (8, 2, 2))
    sink, window = torch.full((8,), 4), torch.full((8,), 64)
    args, field = {"sink_shape": ((q, k, v, sink[:2], window), "sink"),
                   "window_dtype": ((q, k, v, sink, window.float()), "window"),
                   "share_unequal": ((q, k, v, sink, torch.arange(8) + 64), "share_kv"),
                   "width": ((q, k, v, sink, window), "width"),
                   "persistent": ((q, k, v, sink, window), "persistent"),
                   "not_hopper": ((q, k, v, sink, window), "Hopper")}[case]
    with pytest.raises(ValueError, match=field):
        ws_ashape(*args, share_kv=case == "share_unequal", width=96 if case == "width" else 64,
                  persistent=-1 if case == "persistent" else False)


def test_programs_per_sm_count_registers_and_shared_memory():
    """`programs_per_sm`: one program of two consumers per SM (their registers), two of one consumer where both fit
    in shared memory, one where they do not."""
    if gluon_hopper_reason():
        pytest.skip(gluon_hopper_reason())
    from workbench_kernels.prefill_ws import programs_per_sm

    assert programs_per_sm(2, True, (3, 3), 128, 128) == 1  # ASHAPE_LAUNCH: 224 KB
    assert programs_per_sm(1, False, (3, 3), 128, 64) == 2  # HEAD_LAUNCH_D64's pairs: 104 KB
    assert programs_per_sm(1, False, (2, 2), 128, 128) == 1  # 144 KB: two would overflow 228 KB
    assert programs_per_sm(1, False, (2, 2), 64, 256) == 1  # head_dim 256: 168 registers (`launch_config`)


@pytest.mark.parametrize("case", ["columns_shape", "offsets_dtype", "fp32", "share_unequal", "width", "not_hopper"])
def test_ws_vertical_slash_rejects_unsupported_inputs(case):
    """Integer index per query head ([B, Hq]) or per KV head ([B, Hkv]) for both, bf16 / fp16, share_kv only over
    equal lists of heads 2j and 2j + 1, 64 or 128 keys per step, an sm_90 GPU; else ValueError."""
    if gluon_hopper_reason():
        pytest.skip(gluon_hopper_reason())
    from workbench_kernels.prefill_ws import ws_vertical_slash

    if case == "not_hopper" and hopper():
        pytest.skip("this machine is a Hopper GPU")
    q, k, v = (torch.randn(1, h, 200, 128, dtype=torch.bfloat16) for h in (8, 2, 2))
    cols, offs = torch.tensor([[[3, 90]] * 8]), torch.tensor([[[0, 70]] * 8])
    varied = cols.clone()
    varied[0, 1, 0] = 5  # head 1's columns differ from head 0's
    args, field = {"columns_shape": ((q, k, v, cols[:, :3], offs), "columns"),
                   "offsets_dtype": ((q, k, v, cols, offs.float()), "offsets"),
                   "fp32": ((q.float(), k.float(), v.float(), cols, offs), "dtype"),
                   "share_unequal": ((q, k, v, varied, offs), "share_kv"),
                   "width": ((q, k, v, cols, offs), "width"),
                   "not_hopper": ((q, k, v, cols, offs), "Hopper")}[case]
    with pytest.raises(ValueError, match=field):
        ws_vertical_slash(*args, share_kv=case == "share_unequal" or None, width=96 if case == "width" else 64)


if __name__ == "__main__":
    print(json.dumps(compile_all()))
