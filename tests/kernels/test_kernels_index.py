"""Triton VS index builder against the patterns helper's torch proxy and an explicit computation."""
from __future__ import annotations

import pytest
import torch
from workbench_kernels.index_build import vs_index, vs_scores, vs_tiles
from workbench_kernels.index_ref import (
    block_sparse_to_tiles,
    selected_block_tiles,
    tiles_to_mask,
    vs_tile_count,
    vs_to_tiles,
)

from workbench.patterns.proxy import vs_proxy

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def explicit_sums(q, k, scale):
    """Column and diagonal sums of the last 64 rows' probabilities, by plain loops over rows."""
    B, Hq, n, _ = q.shape
    G = Hq // k.shape[1]
    r = min(64, n)
    col = torch.zeros(B, Hq, n)
    diag = torch.zeros(B, Hq, n)
    for h in range(Hq):
        for i in range(n - r, n):
            p = torch.softmax((k[:, h // G, : i + 1] @ q[:, h, i, :, None]).squeeze(-1) * scale, -1)  # [B, i+1]
            col[:, h, : i + 1] += p
            diag[:, h, : i + 1] += p.flip(-1)  # key j sits at offset i - j
    return col, diag


@pytest.mark.parametrize("n,D", [(1, 64), (64, 64), (65, 64), (200, 64), (130, 256)])
def test_vs_scores_match_explicit_sums(n, D):
    B, Hq, Hkv = 2, 3, 1
    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(B, Hq, n, D, generator=g), torch.randn(B, Hkv, n, D, generator=g)
    col, diag = vs_scores(q.to(DEV), k.to(DEV), 0.125)
    ref_col, ref_diag = explicit_sums(q, k, 0.125)
    tol = 1e-5 if DEV == "cpu" else 2e-3  # tf32 dots on the GPU
    torch.testing.assert_close(col.cpu(), ref_col, atol=tol, rtol=tol)
    torch.testing.assert_close(diag.cpu(), ref_diag, atol=tol, rtol=tol)
    assert torch.allclose(col.sum(-1).cpu(), torch.full((B, Hq), float(min(64, n))), atol=1e-3)


@pytest.mark.parametrize("n,Hq,Hkv", [(65, 3, 1), (300, 4, 1)])
def test_vs_index_selects_what_the_torch_proxy_selects(n, Hq, Hkv):
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, Hq, n, 64, generator=g), torch.randn(1, Hkv, n, 64, generator=g)
    planted = q.clone()
    planted[..., -64:, :] += 3 * k[:, :, 37:38].repeat_interleave(Hq // Hkv, 1)  # a strong vertical at key 37
    cols, _ = vs_index(planted.to(DEV), k.to(DEV), 0.125, vertical=24, slash=20, sink=3, local=5)
    assert (cols.cpu() == 37).any(-1).all()
    # (the planted vertical makes its diagonals tie, so compare selections on the unplanted input)
    cols, offs = vs_index(q.to(DEV), k.to(DEV), 0.125, vertical=24, slash=20, sink=3, local=5)
    ref_cols, ref_offs = vs_proxy(q, k, 0.125, 24, 20, sink=3, local=5)
    if DEV == "cpu":
        assert torch.equal(cols, ref_cols) and torch.equal(offs, ref_offs)
    else:  # tf32 scores: allow near-tie swaps
        for a, b in ((cols.cpu(), ref_cols), (offs.cpu(), ref_offs)):
            same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)))
            assert same >= 0.9 * b.numel()


def test_vs_index_per_head_budgets_cut_as_the_proxy_cuts():
    """Per-head budgets (a mixed layer's VS heads): each head keeps its own first choices of columns and offsets,
    the rest -1, as `vs_proxy` with Long `[Hq]` budgets; a budget per query head with group_shared is refused."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 4, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    vertical, slash = torch.tensor([24, 5, 3, 24]), torch.tensor([20, 20, 7, 1])
    cols, offs = vs_index(q.to(DEV), k.to(DEV), 0.125, 24, 20, sink=3, local=5,
                          per_head=(vertical.to(DEV), slash.to(DEV)))
    ref_cols, ref_offs = vs_proxy(q, k, 0.125, vertical, slash, sink=3, local=5)
    assert cols.shape == ref_cols.shape == (1, 4, 24) and offs.shape == ref_offs.shape == (1, 4, 20)
    assert torch.equal((cols >= 0).sum(-1).cpu(), vertical[None]) and torch.equal((offs >= 0).sum(-1).cpu(), slash[None])
    if DEV == "cpu":
        assert torch.equal(cols, ref_cols) and torch.equal(offs, ref_offs)
    with pytest.raises(ValueError, match="per_head"):
        vs_index(q.to(DEV), k.to(DEV), 0.125, 24, 20, group_shared=True, per_head=(vertical.to(DEV), None))


def test_pool_blocks_means_each_block_of_any_layout():
    """`pool_blocks`' 64-token means against a plain per-block mean: a last partial block averages its own tokens,
    a head_dim that is not a power of two, a non-contiguous (transposed) input, bf16 accumulated in fp32."""
    from workbench_kernels.index_build import pool_blocks

    g = torch.Generator().manual_seed(9)
    for n, d, dtype in ((130, 80, torch.float32), (64, 64, torch.bfloat16), (5, 256, torch.float32)):
        x = torch.randn(2, n, 3, d, generator=g).to(dtype).transpose(1, 2)  # [B, H, N, D], strided
        want = torch.stack([x[:, :, i:i + 64].float().mean(2) for i in range(0, n, 64)], 2)
        torch.testing.assert_close(pool_blocks(x.to(DEV)).cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,block,width", [(65, 64, 0), (333, 64, 0), (333, 128, 64), (333, 64, 128)])
def test_vs_tiles_kernel_equals_reference_conversion(n, block, width):
    g = torch.Generator().manual_seed(n)
    cols = torch.randint(-1, n, (2, 3, 17), generator=g)
    offs = torch.cat([torch.randint(0, 130, (2, 3, 9), generator=g), torch.randint(-1, n + 9, (2, 3, 5), generator=g)], -1)
    assert_same_tiles(vs_tiles(cols.to(DEV), offs.to(DEV), n, block, width), vs_to_tiles(cols, offs, n, block, width=width), n)


@pytest.mark.parametrize("block,width", [(64, 0), (128, 64)])
def test_vs_tiles_kernel_sorts_and_dedupes_its_inputs(block, width):
    """Unsorted offsets and columns, each value repeated, with -1, -5 and >= n entries, as strided views:
    the kernel's own sort and dedupe give the reference tiles."""
    n = 333
    g = torch.Generator().manual_seed(block + width)
    offs = torch.randint(-8, 140, (2, 20, 3), generator=g)
    offs = torch.cat([offs, offs.flip(1)], 1)  # [2, 40, 3]: every value twice, unsorted
    offs[:, 3], offs[:, 11], offs[0, 17] = -5, n + 3, n
    offs[1, 25:32] = torch.randint(140, n, (7, 3), generator=g)  # scattered ranges far from the diagonal
    cols = torch.randint(-1, n, (2, 15, 3), generator=g)
    cols = torch.cat([cols, cols[:, torch.randperm(15, generator=g)]], 1)
    cols[:, 4], cols[1, 9] = -5, n + 3
    offs, cols = offs.transpose(1, 2), cols.transpose(1, 2)  # [2, 3, 40], [2, 3, 30], not contiguous
    assert_same_tiles(vs_tiles(cols.to(DEV), offs.to(DEV), n, block, width), vs_to_tiles(cols, offs, n, block, width=width), n)


def logged_launches(monkeypatch, kernels: tuple[str, ...]):
    """(calls, mode): `index_build`'s `kernels` stubbed to append their name to calls when launched, and a torch
    dispatch mode that appends each torch op's name ("empty", "mean", ...) while it is active."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from workbench_kernels import index_build

    calls = []

    class Launch:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(self.name)

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func).split(".")[1])
            return func(*args, **(kwargs or {}))

    for name in kernels:
        monkeypatch.setattr(index_build, name, Launch(name))
    return calls, Log()


def test_vs_tiles_is_two_launches_and_allocations(monkeypatch):
    """`vs_tiles` runs no torch op but `torch.empty` around its two Triton launches (on the GPU each op is a
    launch of ~30 us host time; the kernels are stubbed here, so the interpreter's own torch calls do not count)."""
    calls, log = logged_launches(monkeypatch, ("_vs_cover_kernel", "_expand_tiles_kernel"))
    cols, offs = torch.randint(0, 300, (1, 2, 9)), torch.randint(0, 300, (1, 2, 5))
    with log:
        vs_tiles(cols, offs, 300)
    assert [c for c in calls if c != "empty"] == ["_vs_cover_kernel", "_expand_tiles_kernel"]


def assert_same_tiles(fast, ref, n):
    """`vs_tiles` output equals `vs_to_tiles`' on the counts, the live piece starts and the computed keys."""
    assert torch.equal(fast.block_count.cpu(), ref.block_count)
    assert torch.equal(fast.column_count.cpu(), ref.column_count)
    assert fast.disjoint and ref.disjoint
    ns = ref.block_offset.shape[-1]  # the exact widest row block
    live = torch.arange(ns) < ref.block_count.unsqueeze(-1)
    assert torch.equal(torch.where(live, fast.block_offset.cpu()[..., :ns], -1), ref.block_offset)
    assert torch.equal(tiles_to_mask(fast, n).cpu(), tiles_to_mask(ref, n))


def tile_count_of(tiles) -> torch.Tensor:
    """Tiles a VS kernel computes from its full `VSTiles`: pieces plus columns packed `block` at a time."""
    return tiles.block_count.long().sum(-1) + (-(-tiles.column_count.long() // tiles.block)).sum(-1)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 333, 1000, 1500])
def test_vs_tile_count_equals_the_built_tiles(n):
    """The count-only tile count (no [M, Kv] tensor) equals the tiles `vs_to_tiles` builds: random columns
    (padding, duplicates, >= n), clustered and scattered offsets with gaps around the row block, in row-block
    chunks of any size."""
    g = torch.Generator().manual_seed(n)
    for _ in range(3):
        kv, ks = (int(x) for x in torch.randint(1, 80, (2,), generator=g))
        cols = torch.randint(-1, n + 5, (2, 3, kv), generator=g)
        clustered = torch.randint(0, 140, (2, 3, ks), generator=g).cumsum(-1)
        offs = torch.where(torch.rand(2, 3, ks, generator=g) < 0.5, clustered, torch.randint(-1, n + 9, (2, 3, ks), generator=g))
        want = tile_count_of(vs_to_tiles(cols, offs, n))
        for budget in (1 << 25, 7, 1):
            assert torch.equal(vs_tile_count(cols, offs, n, budget=budget), want)


@pytest.mark.parametrize("block,width", [(64, 0), (128, 64), (128, 0), (64, 128)])
def test_vs_cover_kernel_places_the_reference_pieces(block, width):
    """The Triton cover (one program per head, resets found by fixed-point iteration) writes the same
    piece ends and covered d's as `vs_pieces`' greedy cover by pointer doubling, on offsets whose gaps
    sit around the row block (where a range's overhang decides whether the next range restarts)."""
    from workbench_kernels.index_build import vs_cover
    from workbench_kernels.index_ref import vs_pieces

    w = width or block
    g = torch.Generator().manual_seed(block + w)
    gaps = torch.randint(block - 3, block + w + 3, (2, 3, 40), generator=g)
    gaps[..., ::7] = torch.randint(0, 10, gaps[..., ::7].shape, generator=g)
    offs = torch.cat([gaps.cumsum(-1), torch.full((2, 3, 2), -1), torch.randint(0, 9, (2, 3, 4), generator=g)], -1)
    n = int(offs.max()) - 40  # some offsets >= n
    ends, covered = vs_cover(offs.to(DEV), n, block, width)
    ref_ends, ref_covered = vs_pieces(offs, n, block, static=True, width=width)
    assert torch.equal(ends.cpu(), ref_ends)
    assert torch.equal(covered.cpu().bool(), ref_covered)


def test_index_builders_at_head_dim_256():
    """Gemma-3-270M's shape (4 query heads, 1 KV head, head_dim 256): the Triton VS and block indexes
    select what the torch proxies select."""
    from workbench_kernels.index_build import block_index

    from workbench.patterns.proxy import block_proxy

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 200, 256, generator=g), torch.randn(1, 1, 200, 256, generator=g)
    cols, offs = vs_index(q.to(DEV), k.to(DEV), 0.0625, vertical=16, slash=12, sink=3, local=4)
    ref_cols, ref_offs = vs_proxy(q, k, 0.0625, 16, 12, sink=3, local=4)
    fast, ref = block_index(q.to(DEV), k.to(DEV), 2).cpu(), block_proxy(q, k, 2)
    if DEV == "cpu":
        assert torch.equal(cols, ref_cols) and torch.equal(offs, ref_offs) and torch.equal(fast, ref)
    else:  # tf32 scores: near-tie swaps
        for a, b in ((cols.cpu(), ref_cols), (offs.cpu(), ref_offs), (fast.flatten(1, 2), ref.flatten(1, 2))):
            same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)))
            assert same >= 0.9 * b.numel()


@pytest.mark.parametrize("n", [1, 130, 256])
def test_block_index_selects_what_the_torch_proxy_selects(n):
    from workbench_kernels.index_build import block_index, block_tiles

    from workbench.patterns.proxy import block_proxy

    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(2, 6, n, 64, generator=g), torch.randn(2, 2, n, 64, generator=g)
    per_head = torch.tensor([1, 2, 3, 3, 2, 4])  # budgets per query head, as a mixed layer has them
    for topk in (3, per_head):
        fast = block_index(q.to(DEV), k.to(DEV), topk)
        ref = block_proxy(q, k, topk)
        if DEV == "cpu":
            assert torch.equal(fast, ref)
        else:
            assert (fast.cpu() == ref).float().mean() > 0.95
        slow = block_sparse_to_tiles(fast, n)
        quick = selected_block_tiles(fast)
        assert torch.equal(quick.block_count, slow.block_count)
        assert torch.equal(tiles_to_mask(quick, n), tiles_to_mask(slow, n))
        direct = block_tiles(q.to(DEV), k.to(DEV), topk)  # written by the selection's own launches
        # budgets already on the device (what a CUDA graph captures: no host copy)
        on_device = block_tiles(q.to(DEV), k.to(DEV), int(torch.as_tensor(topk).max()),
                                per_head=torch.as_tensor(topk).expand(6).to(DEV))
        for tiles in (direct, on_device):
            for name in ("block_count", "block_offset", "column_count", "column_index"):
                assert torch.equal(getattr(tiles, name).cpu(), getattr(quick, name).cpu()), name
            assert (tiles.block, tiles.piece, tiles.disjoint, tiles.columns) == (quick.block, 64, True, False)
    with pytest.raises(ValueError, match="per_head"):
        block_tiles(q.to(DEV), k.to(DEV), 4, per_head=per_head[:3].to(DEV))


def test_block_index_kernel_on_long_rows_and_budgets():
    """The Triton selection (bisection on the score row) against torch.topk where rows are long."""
    from workbench_kernels.index_build import block_index

    from workbench.patterns.proxy import block_proxy

    n = 3000 if DEV == "cpu" else 65536 + 8 * 64  # (GPU: 1032 row blocks, so two selection launches)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, n, 64, generator=g), torch.randn(1, 1, n, 64, generator=g)
    for topk in (1, 40, torch.tensor([0, 7, 40, 100])):
        fast, ref = block_index(q.to(DEV), k.to(DEV), topk).cpu(), block_proxy(q, k, topk)
        assert fast.shape == ref.shape
        assert ((fast >= 0).sum(-1) == (ref >= 0).sum(-1)).all()  # k = min(budget, m + 1), at least 1
        agree = (fast == ref).float().mean()
        assert agree == 1 if DEV == "cpu" else agree > 0.95


def test_block_selection_over_every_band_of_rows():
    """`select_blocks` runs one program per query block, its row held at the power-of-two width above m
    (m < 128, 128..255, 256..511 here, all in one launch): each band selects what torch.topk selects; ties at the
    threshold go to the lowest block ids."""
    from workbench_kernels.index_build import select_blocks
    from workbench_kernels.topk import top_blocks

    g = torch.Generator().manual_seed(11)
    score = torch.randn(1, 2, 264, 264, generator=g)
    for topk, per_head in ((9, None), (torch.tensor([3, 140]), torch.tensor([3, 140]))):
        got = select_blocks(score.to(DEV), topk).cpu()
        assert torch.equal(got, top_blocks(score, int(torch.as_tensor(topk).max()), per_head))
    score[0, 1, 200, :150] = 0.0  # 150 tied candidates; the row's other 50 are random
    row = select_blocks(score[:, 1:, :201, :201].contiguous().to(DEV), 140).cpu()[0, 0, 200]  # rows up to 200
    above = (score[0, 1, 200, :200] > 0).nonzero().flatten()
    want = torch.cat([above, torch.arange(139 - len(above)), torch.tensor([200])]).sort().values
    assert torch.equal(row[:140].long(), want)


def test_block_tiles_launches(monkeypatch):
    """`block_tiles` at 64K tokens (1024 row blocks) is two pooling reductions, one score launch and one selection
    launch (rows up to 1024 wide share it; each wider power of two adds one), with per-head budgets on the device
    as they are (no copy): on the GPU each launch costs the host ~30 us and the index of a few heads is
    launch-bound. The kernels are stubbed here."""
    from workbench_kernels import index_build

    calls, log = logged_launches(monkeypatch, ("_block_scores_kernel", "_block_topk_kernel"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    budgets = torch.tensor([3, 5], dtype=torch.int32)
    for blocks, selections in ((1024, 1), (1025, 2), (4096, 3)):
        q = torch.zeros(1, 2, blocks * 64, 16, dtype=torch.bfloat16)
        k = q[:, :1]
        calls.clear()
        with log:
            index_build.block_tiles(q, k, 5, per_head=budgets)
        launches = [c for c in calls if c not in ("empty", "view", "alias", "slice", "_unsafe_view")]  # (no launch)
        assert launches == ["mean"] * 2 + ["_block_scores_kernel"] + ["_block_topk_kernel"] * selections, launches


def test_group_shared_indexes_select_from_the_summed_group_scores():
    """group_shared=True: one index per KV head, chosen from the scores added over its query heads."""
    from workbench_kernels.index_build import block_index
    from workbench_kernels.topk import top_blocks, top_positions

    from workbench.patterns.proxy import _grouped_scores

    n = 300
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 4, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)

    def pool(x):  # 64-token means, the last block holds 44 tokens
        return torch.cat([x[:, :, :256].unflatten(2, (4, 64)).mean(3), x[:, :, 256:].mean(2, keepdim=True)], 2)

    shared = block_index(q.to(DEV), k.to(DEV), 3, group_shared=True).cpu()
    want = top_blocks(_grouped_scores(pool(q), pool(k)).unflatten(1, (2, 2)).sum(2), 3)
    assert shared.shape == (1, 2, 5, 3)
    assert (shared == want).float().mean() > (0.99 if DEV == "cpu" else 0.9)
    cols, offs = vs_index(q.to(DEV), k.to(DEV), 0.125, vertical=20, slash=10, sink=3, local=4, group_shared=True)
    col, diag = (x.unflatten(1, (2, 2)).sum(2) for x in explicit_sums(q, k, 0.125))
    assert cols.shape == (1, 2, 20) and offs.shape == (1, 2, 10)
    if DEV == "cpu":
        assert torch.equal(cols, top_positions(col, 3, 20)) and torch.equal(offs, top_positions(diag, 4, 10))
    # the torch proxy of the `vs_group` kind picks the same, with budgets per KV head on both
    budgets = (torch.tensor([20, 6]), torch.tensor([4, 10]))
    cols, offs = vs_index(q.to(DEV), k.to(DEV), 0.125, 20, 10, sink=3, local=4, group_shared=True,
                          per_head=tuple(b.to(DEV) for b in budgets))
    ref_cols, ref_offs = vs_proxy(q, k, 0.125, *budgets, sink=3, local=4, group_shared=True)
    assert torch.equal((cols >= 0).sum(-1).cpu(), budgets[0][None]) and torch.equal((offs >= 0).sum(-1).cpu(), budgets[1][None])
    if DEV == "cpu":
        assert torch.equal(cols, ref_cols) and torch.equal(offs, ref_offs)



@pytest.mark.parametrize("n", [40, 200])
def test_flexprefill_sums_from_the_vs_passes_equal_the_reference(n):
    """FlexPrefill's column / diagonal sums of the last 64 rows from `vs_scores` (its Triton route) against its
    PyTorch reference, N below and above one block, GQA 2:1; the decisions built on them agree."""
    from workbench.patterns.flexprefill import flexprefill, flexprefill_scores

    torch.manual_seed(n)
    q, k = torch.randn(4, n, 16, device=DEV) * 2, torch.randn(2, n, 16, device=DEV) * 2
    want = flexprefill_scores(q, k, 0.25)
    got = flexprefill_scores(q, k, 0.25, triton=True)
    for key in ("column", "diagonal", "block_score"):
        torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4)
    # (a square root of the JS divergence: fp32 rounding of ~1e-7 reads ~3e-4 where the distance is 0)
    torch.testing.assert_close(got["distance"], want["distance"], atol=1e-3, rtol=1e-3)
    a, b = flexprefill(q, k, 0.25, 0.9, 0.1, 16), flexprefill(q, k, 0.25, 0.9, 0.1, 16, triton=True)
    assert torch.equal(a.to_mask(n), b.to_mask(n))
