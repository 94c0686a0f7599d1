"""Row-block pairs on one ring (`workbench_kernels.prefill_pair`): its work items hold each pair's union and bits
(CPU); the kernel compiles for sm_90 on any machine (two consumer partitions and a loader, wgmma, TMA, no spills,
shared memory within the H100's); on an H100 / H200 it matches exact masked attention in bf16 and fp16, agrees
with the loop, and takes per-head tiles only.

The compile runs in a fresh process (this file as a script), as in test_prefill_ws.py."""
from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch
from test_kernels_compile import SMEM_SM90
from test_kernels_prefill import DEV
from test_prefill_ws import assert_bf16_close, block_index, compiled_by, hopper, ptxas_report, vs_index
from workbench_kernels.index_ref import block_sparse_to_tiles, tiles_to_mask
from workbench_kernels.prefill_ref import masked_attention_ref


def compile_pair() -> dict:
    """`_pair_kernel` compiled for sm_90 (bf16) in its three modes at head_dim 256: no strips ("block"), packed
    Vertical-Slash strips ("vs"), A-shape's sink strips and band mask ("ashape"); and the first two at head_dim 128
    ("block128", "vs128", `RING`'s deeper ring): shared memory, wgmma / TMA instructions, worker partitions, ptxas
    spills; and ptxas spills of `_pair_union_kernel` over lists 128 and 4096 wide."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource
    from workbench_kernels import prefill_pair

    fn = prefill_pair._pair_kernel
    pointers = {"Q": "*bf16", "O": "*bf16", "LSE": "*fp32", "Union": "*i32", "Bits": "*i32", "Count": "*i32",
                "ColCount": "*i32", "Keep": "*i32", "Sink": "*i32", "Window": "*i32",
                "Order": "*i32"}
    spills = r"(\d+) bytes spill (?:stores|loads)"
    out = {}
    modes = {"block": (256, prefill_pair.NO_STRIPS.value, False), "vs": (256, prefill_pair.PACKED.value, False),
             "ashape": (256, prefill_pair.SINKS.value, True), "block128": (128, prefill_pair.NO_STRIPS.value, False),
             "vs128": (128, prefill_pair.PACKED.value, False)}
    for name, (d, strips, band) in modes.items():
        lay = prefill_pair.layouts(d, torch.bfloat16)
        desc = f"tensordesc<bf16[64, {d}],{lay['KV_SMEM']!r}>"
        types = {**{x: desc for x in ("k_desc", "v_desc", "kc_desc", "vc_desc")}, "qk_scale": "fp32", **pointers}
        constants = {"D": d, "STAGES": prefill_pair.RING[d], "STRIPS": strips, "BAND": band,
                     "CONSUMER_REGS": prefill_pair.LAUNCH["consumer_regs"],
                     **{x: lay[x] for x in ("Q_SMEM", "Q_LAYOUT", "S_LAYOUT", "O_LAYOUT")}}
        signature = {a: "constexpr" if a in constants else types.get(a, "i32") for a in fn.arg_names}
        attrs = {(fn.arg_names.index(x),): [["tt.divisibility", 16]] for x in pointers}
        kernel = triton.compile(GluonASTSource(fn, signature, constexprs=constants, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "maxnreg": prefill_pair.LAUNCH["maxnreg"]})
        ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
        out[name] = {"shared": kernel.metadata.shared, "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
                     "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                     "partitions": len(re.findall(r"\bpartition\d+\(", ttgir)), "local": ptx.count(".local"),
                     "spills": [int(x) for x in re.findall(spills, ptxas_report(ptx))]}
    merge = {nsp: triton.compile(ASTSource(prefill_pair._pair_union_kernel,
                                           {a: "constexpr" if a in ("NSP", "STEPS") else "i32" if a in ("M", "NS", "U")
                                            else "*i32" for a in prefill_pair._pair_union_kernel.arg_names},
                                           constexprs={"NSP": nsp, "STEPS": nsp.bit_length()}),
                                 target=GPUTarget("cuda", 90, 32), options={"num_warps": prefill_pair.merge_warps(nsp)})
             for nsp in (128, 4096)}
    out["merge_spills"] = {str(nsp): [int(x) for x in re.findall(spills, ptxas_report(m.asm["ptx"]))]
                           for nsp, m in merge.items()}
    return out


def random_tiles(B: int, H: int, n: int, seed: int, most: int = 5):
    """Block-sparse tiles `[B, H, ceil(n / 64)]` of 1-`most` random causal key blocks per row block."""
    rng = random.Random(seed)
    M = -(-n // 64)
    idx = torch.full((B, H, M, most), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for m in range(M):
                keys = sorted(rng.sample(range(m + 1), min(rng.randint(1, most), m + 1)))
                idx[b, h, m, :len(keys)] = torch.tensor(keys, dtype=torch.int32)
    return block_sparse_to_tiles(idx, n)


@pytest.mark.parametrize("merge", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("n", [130, 1000, 1024])
def test_pair_items_hold_each_pairs_union_and_who_holds_each_piece(n, merge):
    """Per (b, head, pair j): the ascending union of row blocks 2j and 2j + 1's piece starts, bit 0 / 1 set where
    2j / 2j + 1 holds the piece, no bits past the count; an odd M's last pair has one member; launched head by head,
    each head's pairs last first. Both the one-launch merge (on the GPU where there is one, else Triton's
    interpreter) and the torch reference."""
    from workbench_kernels.index_ref import pair_items_ref
    from workbench_kernels.prefill_pair import pair_items

    B, H = 2, 3
    tiles = random_tiles(B, H, n, seed=n).to(DEV)
    items = (pair_items if merge else pair_items_ref)(tiles)
    M, bc, bo = -(-n // 64), tiles.block_count, tiles.block_offset
    MP = -(-M // 2)
    for b in range(B):
        for h in range(H):
            for j in range(MP):
                item = (b * H + h) * MP + j
                own = [set(bo[b, h, r, :bc[b, h, r]].tolist()) if r < M else set() for r in (2 * j, 2 * j + 1)]
                union = sorted(own[0] | own[1])
                count = int(items.count[item])
                assert items.union[item, :count].tolist() == union
                assert items.bits[item, :count].tolist() == [(p in own[0]) + 2 * (p in own[1]) for p in union]
                assert not items.bits[item, count:].any()
    assert items.order.tolist() == [bh * MP + j for bh in range(B * H) for j in reversed(range(MP))]


def test_pair_items_of_long_lists_equal_the_reference():
    """Lists of up to ~100 pieces (top-100: 128-wide lists, 8-step binary searches) give the reference's items,
    field by field."""
    from workbench_kernels.index_ref import pair_items_ref
    from workbench_kernels.prefill_pair import pair_items

    tiles = random_tiles(1, 2, 12000, seed=7, most=100).to(DEV)
    got, want = pair_items(tiles), pair_items_ref(tiles)
    assert int(tiles.block_count.max()) > 64  # lists past 64: the merge runs 128 wide
    assert torch.equal(got.count, want.count) and torch.equal(got.order, want.order)
    assert torch.equal(got.bits, want.bits)
    for item, count in enumerate(got.count.tolist()):
        assert torch.equal(got.union[item, :count], want.union[item, :count])


def test_pair_items_of_padded_lists_are_the_same():
    """The same pieces in a table 1024 entries wider (a merge program over lists 1024 wider) give the same items,
    and the bits are 0 past each count."""
    from workbench_kernels.prefill_pair import pair_items

    tiles = random_tiles(1, 2, 1000, seed=3).to(DEV)
    wide = dataclasses.replace(tiles, block_offset=torch.nn.functional.pad(tiles.block_offset, (0, 1024)))
    narrow, padded = pair_items(tiles), pair_items(wide)
    assert torch.equal(narrow.count, padded.count) and torch.equal(narrow.order, padded.order)
    for item, count in enumerate(narrow.count.tolist()):
        assert torch.equal(narrow.union[item, :count], padded.union[item, :count])
        assert torch.equal(narrow.bits[item, :count], padded.bits[item, :count])
        assert not padded.bits[item, count:].any()


@pytest.fixture(scope="module")
def compiled() -> dict:
    return compiled_by(__file__)


@pytest.mark.parametrize("kind", ["block", "vs", "ashape", "block128", "vs128"])
def test_pair_kernel_compiles_for_sm90(compiled, kind):
    """Two worker partitions (the second consumer, the loader) beside the default consumer; per consumer and piece
    walk head_dim / 16 wgmma for Q K^T (k-steps of 16) and 4 for P V (64 keys), the strips (Vertical-Slash's
    packed columns, A-shape's sinks) a second walk; TMA loads; no local memory, no spills, within the H100's shared
    memory."""
    got = compiled[kind]
    d = 128 if kind.endswith("128") else 256
    assert got["partitions"] == 2, got
    assert got["wgmma"] == 2 * (1 + (not kind.startswith("block"))) * (d // 16 + 64 // 16), got
    assert got["tma_loads"] > 0
    assert got["local"] == 0 and not any(got["spills"]), got
    assert got["shared"] <= SMEM_SM90


def test_pair_union_merge_compiles_without_spills(compiled):
    """`pair_items`' merge program over lists 128 wide (top-100) and 4096 wide, at `merge_warps`' warp count, holds
    its lists and binary searches in registers (4 warps at 4096 spill)."""
    spills = compiled["merge_spills"]
    assert set(spills) == {"128", "4096"} and all(s and not any(s) for s in spills.values()), compiled


def test_pair_prefill_refuses_what_it_does_not_take():
    """On a CPU (or at another head_dim, dtype, tile kind) `pair_takes` says no, `sparse_prefill`'s default runs the
    loop, and `pair_prefill` / `pair_ashape` raise ValueError naming the fix."""
    from workbench_kernels.prefill import ashape_program, default_program, groups_share_band
    from workbench_kernels.prefill_pair import pair_ashape, pair_prefill, pair_takes

    q = torch.zeros(1, 4, 200, 256, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 1, 200, 256, dtype=torch.bfloat16)
    tiles = random_tiles(1, 4, 200, seed=0)
    assert not pair_takes(q, tiles, None) and default_program(q, tiles) == "loop"
    with pytest.raises(ValueError, match="use sparse_prefill"):
        pair_prefill(q, k, v, tiles)
    sink, window = torch.tensor([64] * 4), torch.tensor([128] * 4)
    assert ashape_program(q, k, sink, window) == "loop"
    assert groups_share_band(sink, window, 4, 1) and groups_share_band(torch.tensor([64, 64, 0, 0]), window, 4, 2)
    assert not groups_share_band(torch.tensor([64, 0, 64, 0]), window, 4, 2)
    with pytest.raises(ValueError, match="use prefill.ashape_prefill"):
        pair_ashape(q, k, v, sink, window)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="pair_prefill runs on sm_90 (H100 / H200) only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("keep", [1.0, 0.3], ids=["dense_causal", "block_sparse"])
@pytest.mark.parametrize("n", [936, 1000])
def test_pair_prefill_matches_masked_attention(dtype, keep, n):
    """Every causal block and random selections (the diagonal always in), GQA 4:1, B = 2, N not a multiple of 64,
    an odd (936: the last pair's second row block absent) and an even number of row blocks: o and lse against
    fp32 attention under the tiles' mask."""
    from workbench_kernels.prefill_pair import pair_prefill

    B, Hq, Hkv, D = 2, 4, 1, 256
    g = torch.Generator().manual_seed(int(keep * 10) + n)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to("cuda", dtype) for h in (Hq, Hkv, Hkv))
    tiles = block_sparse_to_tiles(block_index(B, Hq, n, keep, seed=1), n).to("cuda")
    o, lse = pair_prefill(q, k, v, tiles)
    ro, rlse = masked_attention_ref(q, k, v, tiles_to_mask(tiles, n))
    assert_bf16_close(o, lse, ro, rlse)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="pair_prefill runs on sm_90 (H100 / H200) only")
def test_pair_prefill_agrees_with_the_loop_and_takes_per_head_tiles_only():
    """At head_dim 256 `pair_prefill` is within bf16 of `sparse_prefill`'s loop on the same per-head tiles and is
    `sparse_prefill`'s default there (the same output, bit for bit); `pair_takes` refuses group-shared tiles (one
    list per KV head), which the default sends to the loop, and `pair_prefill` raises on them."""
    from workbench_kernels.prefill import default_program, sparse_prefill
    from workbench_kernels.prefill_pair import pair_prefill, pair_takes

    B, Hq, Hkv, n = 1, 4, 1, 1000
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, h, n, 256, generator=g).to("cuda", torch.bfloat16) for h in (Hq, Hkv, Hkv))
    tiles = block_sparse_to_tiles(block_index(B, Hq, n, 0.3, seed=6), n).to("cuda")
    assert pair_takes(q, tiles, None)
    o, lse = pair_prefill(q, k, v, tiles)
    ro, rlse = sparse_prefill(q, k, v, tiles, warp_specialize=False)
    torch.testing.assert_close(o.float(), ro.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, rlse, atol=2e-2, rtol=2e-2)
    assert default_program(q, tiles) == "pair"
    do, dlse = sparse_prefill(q, k, v, tiles)
    assert torch.equal(do, o) and torch.equal(dlse, lse)
    shared = block_sparse_to_tiles(block_index(B, Hkv, n, 0.3, seed=7), n).to("cuda")
    assert not pair_takes(q, shared, None) and default_program(q, shared) == "loop"
    with pytest.raises(ValueError, match="per-head tiles"):
        pair_prefill(q, k, v, shared)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="pair_prefill runs on sm_90 (H100 / H200) only")
@pytest.mark.parametrize("n", [936, 1000])
def test_pair_prefill_runs_vertical_slash_with_its_columns_packed(n):
    """Vertical-Slash's deployed tiles (`vs_tiles(head_columns=True)`: ~250 columns per head, several 64-key strips,
    some under slash pieces), GQA 4:1, B = 2, an odd and an even number of row blocks: `sparse_prefill`'s default
    takes the pair route, o and lse are within bf16 of fp32 attention under the tiles' mask and of the loop; the
    same tiles without head columns (the loop's column lists only) are not taken."""
    from workbench_kernels.index_build import vs_tiles
    from workbench_kernels.prefill import default_program, sparse_prefill
    from workbench_kernels.prefill_pair import pair_prefill, pair_takes

    B, Hq, Hkv, D = 2, 4, 1, 256
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to("cuda", torch.bfloat16) for h in (Hq, Hkv, Hkv))
    cols, offs = (x.cuda() for x in vs_index(B, Hq, n, 300, 20, seed=n))
    tiles = vs_tiles(cols, offs, n, head_columns=True)
    assert pair_takes(q, tiles, None) and default_program(q, tiles) == "pair"
    assert int(tiles.column_count.max()) > 64  # a row block reads columns from two strips or more
    o, lse = pair_prefill(q, k, v, tiles)
    ro, rlse = masked_attention_ref(q, k, v, tiles_to_mask(tiles, n))
    assert_bf16_close(o, lse, ro, rlse)
    do, dlse = sparse_prefill(q, k, v, tiles)
    assert torch.equal(do, o) and torch.equal(dlse, lse)
    lo, llse = sparse_prefill(q, k, v, tiles, warp_specialize=False)
    torch.testing.assert_close(o.float(), lo.float(), atol=2e-2, rtol=2e-2)
    lists = vs_tiles(cols, offs, n)
    assert not pair_takes(q, lists, None) and default_program(q, lists) == "loop"


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="pair_prefill runs on sm_90 (H100 / H200) only")
@pytest.mark.parametrize("n", [936, 1000])
def test_ashape_runs_on_the_pairs_at_head_dim_256(n):
    """A-shape at head_dim 256 (GQA 4:1, B = 2, bf16), per-head sinks and windows: a sink over two strips, one not a
    multiple of 64, none; a window of 1, one within a row block, one over several pieces; then no sink at all (no
    strips). `ashape_prefill` takes the pair route (`ashape_program`); o and lse are within bf16 of fp32
    attention under the exact token mask and of the loop over the same tiles. One band for the whole KV group stays
    on the GQA-packed loop at this length (the Gluon shared ring takes it from 24K tokens: the next test)."""
    from workbench_kernels.index_ref import band_tiles
    from workbench_kernels.prefill import ashape_prefill, ashape_program, sparse_prefill
    from workbench_kernels.prefill_pair import pair_ashape

    B, Hq, Hkv, D = 2, 4, 1, 256
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to("cuda", torch.bfloat16) for h in (Hq, Hkv, Hkv))
    assert ashape_program(q, k, torch.tensor([64] * 4), torch.tensor([300] * 4)) == "loop"
    for sink, window in (([64, 100, 0, 130], [300, 129, 70, 1]), ([0] * 4, [64, 200, 500, 1000])):
        sink, window = torch.tensor(sink), torch.tensor(window)
        assert ashape_program(q, k, sink, window) == "pair"
        o, lse = pair_ashape(q, k, v, sink, window)
        tiles, band = band_tiles(sink, window, n, B, 64, q.device)
        assert tiles.columns == bool(sink.any())
        ro, rlse = masked_attention_ref(q, k, v, tiles_to_mask(tiles, n, *band))
        assert_bf16_close(o, lse, ro, rlse)
        do, dlse = ashape_prefill(q, k, v, sink, window)
        assert torch.equal(do, o) and torch.equal(dlse, lse)
        lo, _ = sparse_prefill(q, k, v, tiles, sink=band[0], window=band[1], warp_specialize=False)
        torch.testing.assert_close(o.float(), lo.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="the Gluon kernel runs on sm_90 (H100 / H200) only")
def test_ashape_at_head_dim_256_takes_the_shared_ring_from_24k_tokens():
    """A-shape at Gemma-3's global shape (4 q / 1 KV head, head_dim 256, bf16) at `ASHAPE_D256_MIN_TOKENS` (24K):
    one band for the group (sink 128, window 4096) and two bands in turn (heads 0 / 2 and 1 / 3 pair) take the Gluon
    shared ring (`ashape_program` "gluon", `prefill_ws.ASHAPE_LAUNCH_D256`); the output equals `ws_ashape` at that
    launch and is within bf16 of the loop over the same per-head tiles; 16 tokens fewer and the old routes run."""
    from workbench_kernels.index_ref import band_tiles
    from workbench_kernels.prefill import ashape_prefill, ashape_program, sparse_prefill
    from workbench_kernels.prefill_ws import ASHAPE_D256_MIN_TOKENS, ASHAPE_LAUNCH_D256, ws_ashape

    n = ASHAPE_D256_MIN_TOKENS
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 256, generator=g).to("cuda", torch.bfloat16) for h in (4, 1, 1))
    for sink, window, short in (([128] * 4, [4096] * 4, "loop"), ([128] * 4, [4096, 2048] * 2, "pair")):
        sink, window = torch.tensor(sink), torch.tensor(window)
        assert ashape_program(q, k, sink, window) == "gluon"
        assert ashape_program(q[:, :, :n - 16], k[:, :, :n - 16], sink, window) == short
        o, lse = ashape_prefill(q, k, v, sink, window)
        wo, wlse = ws_ashape(q, k, v, sink, window, **ASHAPE_LAUNCH_D256)
        assert torch.equal(o, wo) and torch.equal(lse, wlse)
        tiles, band = band_tiles(sink, window, n, 1, 64, q.device)
        lo, llse = sparse_prefill(q, k, v, tiles, sink=band[0], window=band[1], warp_specialize=False)
        assert_bf16_close(o, lse, lo, llse)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="pair_prefill runs on sm_90 (H100 / H200) only")
def test_a_trishape_layer_at_head_dim_256_runs_its_band_on_the_pairs_or_the_shared_ring(monkeypatch):
    """SparsePrefill on a layer of Tri-shape heads only at Gemma-3's shape (4 q / 1 KV head, head_dim 256, bf16,
    N = 1000; questions of 64, 100, 0 and 1 rows): where the heads' bands differ, the band runs on the pairs
    (`pair_ashape`) and then the dense rows (`TriShape.layer_attention`); one band for the group runs on the Gluon
    shared ring (`ws_ashape`, its 24K-token floor lowered for the test). Both are close to the PyTorch reference
    path."""
    import workbench_kernels.prefill_pair as pp
    import workbench_kernels.prefill_ws as pws
    from test_methods_kernel import trishape_layer_on_gpu

    monkeypatch.setattr(pws, "ASHAPE_D256_MIN_TOKENS", 0)
    calls = []
    for module, name in ((pp, "pair_ashape"), (pws, "ws_ashape")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, name=name, real=real, **kw: calls.append(name) or real(*a, **kw))
    differ = [(64, 300, 64), (64, 200, 100), (0, 129, 0), (0, 70, 1)]
    alike = [(64, 300, 64), (64, 300, 100), (64, 300, 0), (64, 300, 1)]
    for params, route in ((differ, "pair_ashape"), (alike, "ws_ashape")):
        calls.clear()
        *_, got, ref = trishape_layer_on_gpu(params, hkv=1, d=256, seed=7)
        assert calls == [route]
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="pair_prefill runs on sm_90 (H100 / H200) only")
def test_a_mixed_layer_at_head_dim_256_runs_per_kind_with_vs_and_block_on_the_pairs():
    """SparsePrefill's default on one layer of VS, block-sparse and A-shape heads at Gemma-3's global-layer shape
    (4 q / 1 KV head, head_dim 256, bf16, N = 1000): the A-shape band would keep one merged launch on the loop, so
    the layer runs one launch per kind (`gluon_takes_kinds`), each on the pairs (VS and block tiles through
    `sparse_prefill`, the A-shape head, alone in its group, through `AShape.layer_attention`); its output is within
    bf16 of the merged launch's and of the PyTorch reference path's on the same index."""
    from test_methods_kernel import mixed_prefill
    from workbench_kernels.prefill import ashape_program, default_program

    entries = [("vs", {"vertical": 40, "slash": 30}), ("block", {"topk": 3}), ("ashape", {"sink": 64, "window": 300}),
               ("vs", {"vertical": 8, "slash": 90})]
    runs = {}
    for per_kind in (None, False):
        sp, _, q, k, v = mixed_prefill(entries, n=1000, hkv=1, d=256, seed=5, per_kind=per_kind, graph_index=False)
        q, k, v = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
        index = sp.layer_index(0, q, k, 0.1, "triton")
        runs[per_kind] = sp.layer_kernel(0, index, q, k, v, 0.1, "triton")
        if per_kind is None:
            assert isinstance(index, dict), "the default merged the kinds into one launch"
            routes = {kind: default_program(q[:, heads], tiles) for kind, (heads, tiles, band) in index.items()
                      if band is None}
            assert routes == {"vs": "pair", "block": "pair"}, routes
            assert ashape_program(q[:, [2]], k, torch.tensor([64]), torch.tensor([300])) == "pair"
            ref = sp.reference(index, q.float(), k.float(), v.float(), 0.1)
    torch.testing.assert_close(runs[None].float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(runs[None].float(), runs[False].float(), atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    print(json.dumps(compile_pair()))
