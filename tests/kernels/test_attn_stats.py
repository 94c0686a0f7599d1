"""Triton attention statistics against the PyTorch reference (CPU: Triton interpreter, fp32/fp16; GPU: bf16),
and the reference's token rules against the patterns' own masks."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_kernels_compile import compile_env
from workbench_kernels import attn_stats
from workbench_kernels import attn_stats_ref as ref
from workbench_kernels.attn_stats_ref import MAPS, TokenRule

from workbench.analysis import metrics, stats
from workbench.patterns import AShape, BlockSparse, Dense, Stack, VerticalSlash
from workbench.patterns.trishape import TriShape

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-4  # masses (units: rows), entropies (nats), log-normalisers


def qk(hq, hkv, n, d, dtype=torch.float32, seed=0, spread=1.5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(h, n, d, generator=g) * spread).to(DEV, dtype) for h in (hq, hkv)]


def close(got, want, atol=ATOL):
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=1e-5)


# n not a multiple of 64; GQA 3:1 and 4:1; d 64 / 128 / 256; cells that divide 64 (1, 16), span tiles
# (67: tiles straddle cells) or are multiples of 64 (128); blocks 16, 64, 128
@pytest.mark.parametrize("n,hq,hkv,d,resolution,block,dtype", [
    (200, 6, 2, 64, 1024, 64, torch.float32),
    (333, 4, 1, 128, 5, 16, torch.float16),
    (200, 3, 1, 64, 13, 64, torch.float32),
    (140, 3, 1, 256, 1, 128, torch.float32),
])
def test_layer_stats_kernel_equals_reference(n, hq, hkv, d, resolution, block, dtype):
    q, k = qk(hq, hkv, n, d, dtype, seed=n)
    got = attn_stats.layer_stats(q, k, d ** -0.5, resolution=resolution, block=block)
    want = ref.layer_stats(q, k, d ** -0.5, resolution=resolution, block=block)
    assert (got.n, got.cell, got.block) == (want.n, want.cell, want.block)
    for name in MAPS:
        close(getattr(got, name), getattr(want, name))
    close(got.block_mass.sum((1, 2)), torch.full((hq,), float(n)), atol=1e-3)  # every row adds up to 1


def test_layer_stats_kernel_computes_only_the_requested_maps():
    q, k = qk(4, 2, 130, 32)
    full = ref.layer_stats(q, k, 0.2, resolution=40)
    for name in MAPS:
        st = attn_stats.layer_stats(q, k, 0.2, resolution=40, maps=[name])
        assert all(getattr(st, other) is None for other in MAPS if other != name)
        close(getattr(st, name), getattr(full, name))


def test_both_walks_of_pass_two_give_the_same_sums():
    n = 150
    q, k = qk(3, 1, n, 32, seed=4)
    lse = attn_stats.row_lse(q, k, 0.2)[0]
    want = ref.layer_stats(q, k, 0.2, resolution=75, block=16)
    for walk, chunk in (("diagonal", 1), ("rows", 0)):
        got = attn_stats.attention_sums(q, k, 0.2, lse, block=16, cell=2, max_map=True, entropy=True, walk=walk,
                                        chunk=chunk or 32)
        for name in ("column_mass", "diag_mass", "block_mass", "max_map", "row_entropy"):
            close(got[name], getattr(want, name))


def test_layer_stats_kernel_reads_a_given_lse_and_skips_pass_one():
    """With the rows' lse given (as the streamed forward hands it over) the statistics equal the two-pass
    ones; a wrong lse shows in every mass (so it is read, not recomputed)."""
    n, d = 200, 64
    q, k = qk(6, 2, n, d, seed=7)
    want = ref.layer_stats(q, k, 0.125, resolution=50, block=16)
    lse = attn_stats.row_lse(q, k, 0.125)[0]
    got = attn_stats.layer_stats(q, k, 0.125, resolution=50, block=16, lse=lse)
    for name in MAPS:
        close(getattr(got, name), getattr(want, name))
    off = attn_stats.layer_stats(q, k, 0.125, resolution=50, block=16, lse=lse + 1.0)
    close(off.column_mass, want.column_mass / torch.e)
    assert stats.layer_stats(q, k, 0.125, resolution=50, block=16, lse=lse).column_mass is not None


@pytest.mark.parametrize("rows", [None, (136, 200), (13, 77), (199, 200)])
def test_layer_sums_kernel_equals_reference_on_row_segments(rows):
    q, k = qk(6, 2, 200, 64, seed=1)
    got = attn_stats.layer_sums(q, k, 0.15, rows=rows)
    want = ref.layer_sums(q, k, 0.15, rows=rows)
    assert got.rows == want.rows and got.n_rows == want.n_rows and got.block_rows == want.block_rows
    again = attn_stats.layer_sums(q, k, 0.15, rows=rows, lse=attn_stats.row_lse(q, k, 0.15)[0])  # pass 1 of all rows
    for name in ("column_mass", "diag_mass", "block_mass", "lse"):
        close(getattr(got, name), getattr(want, name))
        close(getattr(again, name), getattr(want, name))


@pytest.mark.parametrize("block", [16, 128])
def test_segment_tile_masses_hold_the_segments_row_blocks_in_both_walks(block):
    """A segment's tile masses are `[H, m1 - m0, M]` for cells that divide a tile (stores) and span tiles
    (atomics), in both walks of pass 2."""
    q, k = qk(3, 1, 330, 32, seed=block)
    rows = (141, 330)
    want = ref.layer_sums(q, k, 0.2, block=block, rows=rows)
    lse = attn_stats.row_lse(q, k, 0.2, rows=rows)[0]
    assert want.block_mass.shape == (3, 330 // block + 1 - 141 // block, -(-330 // block))
    for walk in ("diagonal", "rows"):
        got = attn_stats.attention_sums(q, k, 0.2, lse, rows=rows, block=block, walk=walk, chunk=2)
        close(got["block_mass"], want.block_mass)
        close(got["column_mass"], want.column_mass)


def test_row_lse_and_entropy_equal_an_explicit_softmax():
    n = 150
    q, k = qk(4, 1, n, 32, seed=2)
    lse, ent = attn_stats.row_lse(q, k, 0.3, entropy=True)
    s = (q.double() @ k.double().repeat_interleave(4, 0).transpose(1, 2)) * 0.3
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=DEV).triu(1), float("-inf"))
    p = s.softmax(-1)
    close(lse, s.logsumexp(-1))
    close(ent, -(p * p.clamp_min(1e-300).log()).sum(-1))


@pytest.mark.parametrize("rows", [None, 120, (140, 200)])
def test_column_offset_mass_kernel_equals_reference_with_nested_prefixes(rows):
    n, hq = 200, 8
    q, k = qk(hq, 2, n, 64, seed=3)
    lse = ref.layer_sums(q, k, 0.15, rows=rows if isinstance(rows, tuple) else None).lse
    g = torch.Generator().manual_seed(3)
    cols = torch.stack([torch.randperm(n, generator=g)[:90] for _ in range(hq)]).to(DEV)
    cols[:3, 70:] = -1  # padding inside a set
    got = attn_stats.column_offset_mass(q, k, 0.15, lse, [cols, cols[:, :5]], prefixes=[[10, 64, 90], [5]], rows=rows)
    want = ref.column_offset_mass(q, k, 0.15, lse, [cols, cols[:, :5]], prefixes=[[10, 64, 90], [5]], rows=rows)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        close(a, b)
    flat = attn_stats.column_offset_mass(q, k, 0.15, lse, [cols], rows=rows)[0]
    close(flat, want[0][-1])


def patterns(n, h):
    """Indexes of every tile shape the kernel walks: band pieces + sink columns, key blocks, VS pieces
    (overhanging) + columns, dense, a stack of two kinds, tri-shape (dense question rows)."""
    g = torch.Generator().manual_seed(n)
    m = -(-n // 64)
    blocks = torch.randint(0, m, (h, m, 2), generator=g)
    cols = torch.stack([torch.randperm(n, generator=g)[:9] for _ in range(h)])
    offs = torch.stack([torch.randperm(n, generator=g)[:7] for _ in range(h)])
    heads = torch.arange(h)
    return {"ashape": AShape(heads * 7 % 71, 1 + heads * 13 % 90),
            "block": BlockSparse(blocks),
            "vs": VerticalSlash(cols, offs),
            "dense": Dense(h),
            "stack": Stack([AShape(4, 17, h // 2), BlockSparse(blocks[h // 2:])]),
            "trishape": TriShape(2, 20, 50, h)}


def set_rule(name, index, n):
    """Tiles + the token sets that make VS and tri-shape rules exact."""
    if name == "vs":
        return TokenRule(index.to_tiles(n), index.column_set(n), index.offset_set(n))
    j = torch.arange(n)[None]
    return TokenRule(index.to_tiles(n), j < index.ashape.sink[:, None], j < index.ashape.window[:, None])


@pytest.mark.parametrize("n", [64, 200])
def test_token_rules_are_the_patterns_masks(n):
    """The reference rules: tiles + band (exact for A-shape, block, dense, stacks of them), tiles + token
    sets (exact for VS and tri-shape), tiles alone (a cover of VS's and tri-shape's masks)."""
    for name, index in patterns(n, 4).items():
        rule, mask = stats.kernel_rule(index, n), index.row_mask(0, n, n)
        if name in ("vs", "trishape"):
            assert not (mask & ~rule.row_mask(0, n, n)).any()
            assert torch.equal(set_rule(name, index, n).row_mask(0, n, n), mask)
        else:
            assert torch.equal(rule.row_mask(0, n, n), mask), name


@pytest.mark.parametrize("n,hq,hkv", [(200, 4, 1), (130, 6, 2)])
def test_captured_mass_kernel_equals_reference_and_counts_the_logical_edges(n, hq, hkv):
    q, k = qk(hq, hkv, n, 64, seed=n)
    for name, index in patterns(n, hq).items():
        rule = set_rule(name, index, n) if name in ("vs", "trishape") else stats.kernel_rule(index, n)
        mass, count = attn_stats.captured_mass(q, k, 0.15, rule)
        close(mass, ref.captured_mass(q, k, 0.15, index), atol=1e-5)
        assert torch.equal(count.sum(1).cpu().long(), index.edges(n)), name
    vs = patterns(n, hq)["vs"]  # tiles alone keep more (pieces overhang): caught, the reference runs instead
    _, count = attn_stats.captured_mass(q, k, 0.15, stats.kernel_rule(vs, n))
    assert (count.sum(1).cpu() > vs.edges(n)).any()
    tri = patterns(n, hq)["trishape"]  # band on the lists, every key on the dense rows: exact as it runs
    mass, count = attn_stats.captured_mass(q, k, 0.15, stats.kernel_rule(tri, n))
    assert torch.equal(count.sum(1).cpu().long(), tri.edges(n))
    close(mass, ref.captured_mass(q, k, 0.15, tri), atol=1e-5)


def test_search_scores_on_the_kernels_equal_the_reference():
    """`layer_scores` on the kernel path (all-row sums; the answer rows, column-offset masses and the
    method candidates' captured masses from the same pass 1) equals the reference's, every default and
    method candidate, n not a multiple of 64, GQA 3:1."""
    from workbench.search.search import default_candidates, layer_scores, method_candidates

    n = 200
    q, k = qk(6, 2, n, 32, seed=7)
    cands = default_candidates(n) + method_candidates(n)
    with stats.backend("torch"):
        want = layer_scores(q, k, 0.2, cands)
    with stats.backend("triton"):
        got = layer_scores(q, k, 0.2, cands)
    for name in ("mass", "tail", "oracle", "tiles", "edges"):
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_workbench_functions_dispatch_to_the_kernels_with_equal_results():
    """backend("triton") runs the kernels on these CPU tensors (interpreter), backend("torch") the reference;
    a cell the kernel does not pool at (19) and an index whose tiles overcover (VS) fall back."""
    n = 130
    q, k = qk(6, 2, n, 32, seed=5)
    index = patterns(n, 6)
    out = {}
    for name in ("triton", "torch"):
        with stats.backend(name):
            assert stats.use_triton(q) == (name == "triton")
            sums = metrics.layer_sums(q, k, 0.15, rows=(n - 64, n))
            out[name] = [stats.layer_stats(q, k, 0.15, resolution=33, maps=["diag_mass", "max_map"]).max_map,
                         stats.layer_stats(q, k, 0.15, resolution=7, maps=["max_map"]).max_map,
                         sums.column_mass, sums.lse,
                         metrics.column_offset_mass(q, k, 0.15, sums.lse, [index["vs"].columns], rows=(n - 64, n))[0],
                         stats.captured_mass(q, k, 0.15, index["stack"]),
                         stats.captured_mass(q, k, 0.15, index["vs"])]
    for got, want in zip(*out.values()):
        close(got, want)
    with pytest.raises(ValueError, match="backend 'cuda' is unknown"):
        with stats.backend("cuda"):
            pass
    with pytest.raises(ValueError, match="cell=20"):
        attn_stats.attention_sums(q, k, 0.15, out["torch"][3], cell=20, max_map=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,hq,hkv,d", [(4000, 32, 8, 128), (2500, 12, 4, 64), (1100, 8, 2, 256)])
def test_gpu_bf16_statistics_equal_the_reference(n, hq, hkv, d):
    """bf16 q/k on the GPU: every statistic equals the fp32 reference on the same bf16 values."""
    q, k = qk(hq, hkv, n, d, torch.bfloat16, seed=n)
    scale = d ** -0.5
    for resolution in (1024, 250, 40, 20):  # cells that divide 64, larger ones straddling tiles, others (reference)
        with stats.backend("torch"):
            want = stats.layer_stats(q, k, scale, resolution=resolution)
        got = stats.layer_stats(q, k, scale, resolution=resolution)
        for name in MAPS:
            close(getattr(got, name), getattr(want, name))
    for rows in (None, (n - 64, n)):
        got, want = attn_stats.layer_sums(q, k, scale, rows=rows), ref.layer_sums(q, k, scale, rows=rows)
        for name in ("column_mass", "diag_mass", "block_mass", "lse"):
            close(getattr(got, name), getattr(want, name))
        cols = torch.stack([torch.randperm(n, device=DEV)[:300] for _ in range(hq)])
        got_o = attn_stats.column_offset_mass(q, k, scale, want.lse, [cols], prefixes=[[30, 300]], rows=rows)[0]
        want_o = ref.column_offset_mass(q, k, scale, want.lse, [cols], prefixes=[[30, 300]], rows=rows)[0]
        close(got_o, want_o)
    for index in patterns(n, hq).values():
        with stats.backend("torch"):
            want_m = stats.captured_mass(q, k, scale, index)
        close(stats.captured_mass(q, k, scale, index), want_m, atol=1e-5)


POINTERS = {"Q": "*bf16", "K": "*bf16", "COLS": "*i32", "LEVEL": "*i32", "COUNT": "*i32", "BlockCount": "*i32",
            "BlockOffset": "*i32", "ColumnCount": "*i32", "ColumnIndex": "*i32", "KEYS": "*i8", "OFFS": "*i8", "FIRST": "*i32"}
INTS = {"N", "G", "ROW0", "ROW1", "CHUNK_T", "TR", "TA0", "TRA", "MR", "V", "L", "RCHUNK", "M", "NS", "NC"}


def compile_for_hopper() -> None:
    """Compile every kernel of `attn_stats` for sm_90 as the launcher would at 128K tokens (bf16 q/k, 16-divisible
    pointers and strides): Triton's whole compiler and ptxas, no GPU needed. Run without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dims = dict(D=128, DP=128, PREC="tf32")
    sums = dict(dims, BLOCK=64, COLS=True, DIAGS=True, TILE_CELL=64, MAX_MAP=True, MEAN_MAP=True)
    cases = [(attn_stats._row_lse_kernel, 8, dict(dims, BLOCK_M=128, BLOCK_N=64, ENTROPY=True)),
             *[(attn_stats._diagonal_walk_kernel, 4, dict(sums, MAP_CELL=c)) for c in (16, 128, 80)],
             (attn_stats._row_walk_kernel, 4, dict(sums, MAP_CELL=128)),
             (attn_stats._column_offset_kernel, 8, dict(dims, BLOCK_M=64, BLOCK_C=64)),
             (attn_stats._captured_kernel, 4, dict(dims, BLOCK=64, BLOCK_N=64, SETS=True))]
    for kernel, warps, constexprs in cases:
        names = kernel.arg_names
        sig = {a: "constexpr" if a in constexprs else "fp32" if a == "qk_scale" else "i32" if a in INTS or a.islower()
               else POINTERS.get(a, "*fp32") for a in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
                 if sig[a].startswith("*") or a in ("N", "ROW1", "sqh", "sqn", "skh", "skn", "sch")}
        compiled = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": 2})
        assert 0 < compiled.metadata.shared <= 200 * 1024 and ".entry" in compiled.asm["ptx"]
        print(kernel.fn.__name__, "compiled")


def test_kernels_compile_for_the_gpu():
    """The interpreter runs Python; this runs Triton's compiler down to sm_90 code (globals, layouts, gathers,
    atomics, reshapes that only the compiler checks), in a process without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia")
    code = "import test_attn_stats as t; t.compile_for_hopper()"
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=compile_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("compiled") == 7
