"""Sparse prefill kernels against exact masked attention (CPU: Triton interpreter, fp32/fp16; GPU: bf16)."""
from __future__ import annotations

import pytest
import torch
from workbench_kernels.index_ref import (
    VSTiles,
    ashape_to_tiles,
    block_sparse_to_tiles,
    expand_groups,
    merge_tiles,
    narrow_pieces,
    tiles_to_mask,
    vs_tile_bounds,
    vs_to_tiles,
)
from workbench_kernels.prefill import ashape_prefill, block_sparse_prefill, sparse_prefill, vertical_slash_prefill
from workbench_kernels.prefill_ref import masked_attention_ref
from workbench_kernels.tiling import NO_WINDOW

from workbench.patterns import AShape, BlockSparse, VerticalSlash
from workbench.patterns.trishape import TriShape

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if DEV == "cuda" else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def vs_mask(columns, offsets, n):
    """Logical VS mask Bool `[B, H, n, n]` from the pattern class (the kernels' tiles must cover it)."""
    return torch.stack([VerticalSlash(c, o).to_mask(n) for c, o in zip(columns, offsets)])


def block_sparse_mask(index, n):
    return torch.stack([BlockSparse(i).to_mask(n) for i in index])


def ashape_mask(sink, window, n):
    return AShape(torch.as_tensor(sink), torch.as_tensor(window), len(sink)).to_mask(n)


def qkv(B, Hq, Hkv, n, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g).to(DEV, dtype) for h in (Hq, Hkv, Hkv)]


def check(out, ref, dtype):
    (o, lse), (ro, rlse) = out, ref
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.float(), ro.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse, rlse, atol=TOL[dtype] * 4, rtol=TOL[dtype])


def coverage_counts(tiles, n):
    """How many times each (row block, key) is computed: pieces with the next-piece cut, plus columns."""
    B, H, M = tiles.shape
    w = tiles.piece
    cnt = torch.zeros(B, H, M, n + 2 * tiles.block, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for m in range(M):
                k = int(tiles.block_count[b, h, m])
                st = tiles.block_offset[b, h, m, :k].tolist()
                assert st == sorted(st) and len(set(st)) == k and all(-w < p < n for p in st)
                for t, p in enumerate(st):
                    end = min(p + w, st[t + 1] if t + 1 < k else 1 << 30)
                    cnt[b, h, m, max(p, 0):end] += 1
                cols = tiles.column_index[b, h, m, : int(tiles.column_count[b, h, m])]
                assert (cols < m * tiles.block).all() and (cols >= 0).all()
                cnt[b, h, m, cols.long()] += 1
    return cnt[..., :n]


@pytest.mark.parametrize("block,width", [(64, 0), (128, 0), (128, 64)])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 333])
def test_vs_tiles_cover_logical_keys_exactly_once(n, block, width):
    g = torch.Generator().manual_seed(n)
    B, H = 2, 3
    cols = torch.randint(-1, n + 5, (B, H, 9), generator=g)
    offs = torch.cat([torch.randint(-1, n + 5, (B, H, 6), generator=g),
                      torch.randint(0, 100, (B, H, 6), generator=g)], -1)
    tiles = vs_to_tiles(cols, offs, n, block, width=width)
    assert coverage_counts(tiles, n).max() <= 1  # no key counted twice
    phys = tiles_to_mask(tiles, n)
    assert not (vs_mask(cols, offs, n) & ~phys).any()  # every logical edge is computed
    ns, nc = vs_tile_bounds(n, cols.shape[-1], offs.shape[-1], block, width)
    static = vs_to_tiles(cols, offs, n, block, max_pieces=ns, max_columns=nc, width=width)
    assert torch.equal(tiles_to_mask(static, n), phys)


@pytest.mark.parametrize("block,width", [(64, 0), (128, 0), (128, 64)])
@pytest.mark.parametrize("n", [65, 333, 700])
def test_vs_pieces_are_the_fewest_that_cover_each_row_block(n, block, width):
    """Per row block, the piece count equals the minimum number of `piece`-wide key intervals covering
    its slash ranges (a plain sequential greedy over keys); pieces never overlap. The old chopping of
    each merged range from its own end failed this wherever a range's overhang reached the next."""
    g = torch.Generator().manual_seed(n + block + width)
    offs = torch.cat([torch.randint(0, n, (2, 3, 12), generator=g), torch.randint(0, 200, (2, 3, 8), generator=g)], -1)
    tiles = vs_to_tiles(torch.full((2, 3, 1), -1), offs, n, block, width=width)
    w = tiles.piece
    for b in range(2):
        for h in range(3):
            off = set(offs[b, h].tolist()) | {0}
            for m in range(tiles.shape[-1]):
                top = m * block + block - 1  # highest key a row of this block reaches
                keys = [j for j in range(min(top, n - 1), -1, -1) if any(m * block - j <= o <= top - j for o in off)]
                fewest, reach = 0, None
                for j in keys:  # from the diagonal down: open an interval at the first key not covered
                    if reach is None or j < reach:
                        fewest, reach = fewest + 1, j - w + 1
                st = tiles.block_offset[b, h, m, : int(tiles.block_count[b, h, m])].tolist()
                # full row blocks: the minimum; a last partial one may pay one piece for the d-space
                # cover of its missing rows (shared by all row blocks)
                assert fewest <= len(st) <= fewest + (top >= n), (b, h, m)
                assert all(p + w <= q for p, q in zip(st, st[1:]))


def test_vs_tiles_drop_covered_and_duplicate_columns():
    n = 256
    cols = torch.tensor([[[5, 5, 5, 130, 190, -1, 999]]])  # 130 and 190 lie under slash ranges of block 3
    offs = torch.tensor([[[0, 60, 60, 70, 5000]]])  # duplicate, and an offset >= n
    tiles = vs_to_tiles(cols, offs, n)
    # block 3 (rows 192..255): offsets {0, 60, 70} give key ranges merging into [122, 256), chopped from
    # the end into pieces 192, 128, 64; 130 and 190 are covered, 5 stays a column.
    assert tiles.block_offset[0, 0, 3, : tiles.block_count[0, 0, 3]].tolist() == [64, 128, 192]
    assert tiles.column_index[0, 0, 3, : tiles.column_count[0, 0, 3]].tolist() == [5]
    # blocks 1 and 2: the merged ranges reach key 0, so column 5 is covered too
    assert tiles.column_count[0, 0, :3].tolist() == [0, 0, 0]
    assert coverage_counts(tiles, n).max() <= 1


def test_seed_worked_example_reference():
    # DIGEST: n=8, d=2, C={1}, D={0,2}, query 6 -> weights over keys {1,4,6} give o6 = (1.266, 0.732).
    n = 8
    q = torch.zeros(1, 1, n, 2)
    k = torch.zeros(1, 1, n, 2)
    v = torch.zeros(1, 1, n, 2)
    q[0, 0, 6] = torch.tensor([1.0, 1.0])
    k[0, 0, 1], k[0, 0, 4], k[0, 0, 6] = torch.tensor([2.0, 0]), torch.tensor([0, 1.0]), torch.tensor([1.0, 1])
    v[0, 0, 1], v[0, 0, 4], v[0, 0, 6] = torch.tensor([1.0, 0]), torch.tensor([0, 2.0]), torch.tensor([2.0, 1])
    mask = vs_mask(torch.tensor([[[1]]]), torch.tensor([[[0, 2]]]), n)
    assert mask[0, 0, 6].nonzero().flatten().tolist() == [1, 4, 6]
    assert mask[0, 0, 1].nonzero().flatten().tolist() == [1]  # 1 - 2 < 0 is dropped
    o, _ = masked_attention_ref(q, k, v, mask, scale=1.0)
    torch.testing.assert_close(o[0, 0, 6], torch.tensor([1.266, 0.732]), atol=2e-3, rtol=0)


CASES = [  # (n, Hq, Hkv, D)
    (1, 3, 1, 64), (63, 3, 1, 64), (64, 4, 1, 64), (65, 3, 1, 128), (200, 4, 1, 64), (200, 6, 2, 128),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,Hq,Hkv,D", CASES)
def test_vertical_slash_matches_reference(n, Hq, Hkv, D, dtype):
    B = 2
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=n + D)
    g = torch.Generator().manual_seed(n)
    cols = torch.randint(-1, n + 3, (B, Hq, 12), generator=g)
    cols[:, 0, :4] = 3  # duplicates
    offs = torch.randint(-1, 2 * n + 3, (B, Hq, 6), generator=g)  # some larger than any row
    tiles = vs_to_tiles(cols, offs, n)
    out = vertical_slash_prefill(q, k, v, cols.to(DEV), offs.to(DEV))
    check(out, masked_attention_ref(q, k, v, tiles_to_mask(tiles, n).to(DEV)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vertical_slash_empty_columns_and_covered_columns(dtype):
    n, B, Hq, Hkv, D = 200, 1, 3, 1, 64
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype)
    offs = torch.tensor([0, 1, 2, 3, 64, 130]).expand(B, Hq, -1)
    for cols in (torch.zeros(B, Hq, 0, dtype=torch.long), torch.tensor([0, 70, 131, 135]).expand(B, Hq, -1)):
        tiles = vs_to_tiles(cols, offs, n)
        out = vertical_slash_prefill(q, k, v, cols.to(DEV), offs.to(DEV))
        check(out, masked_attention_ref(q, k, v, tiles_to_mask(tiles, n).to(DEV)), dtype)
    # pure local band: physical keys of row i are exactly its row block's causal band plus the pieces
    assert not (vs_mask(cols, offs, n) & ~tiles_to_mask(tiles, n)).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,Hq,Hkv,D", [(1, 3, 1, 64), (65, 4, 1, 128), (200, 3, 1, 64)])
def test_block_sparse_matches_reference(n, Hq, Hkv, D, dtype):
    B = 2
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=7)
    M = -(-n // 64)
    g = torch.Generator().manual_seed(1)
    index = torch.randint(-1, M + 1, (B, Hq, M, 3), generator=g, dtype=torch.int32)  # above-diagonal ids dropped
    out = block_sparse_prefill(q, k, v, index.to(DEV))
    check(out, masked_attention_ref(q, k, v, block_sparse_mask(index, n).to(DEV)), dtype)
    assert torch.equal(tiles_to_mask(block_sparse_to_tiles(index, n), n), block_sparse_mask(index, n))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 65, 200])
def test_ashape_matches_reference(n, dtype):
    B, Hq, Hkv, D = 2, 4, 1, 64
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=3)
    sink, window = torch.tensor([4, 0, 70, 1]), torch.tensor([10, 64, 30, 129])
    out = ashape_prefill(q, k, v, sink, window)
    check(out, masked_attention_ref(q, k, v, ashape_mask(sink, window, n).unsqueeze(0).to(DEV)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_pattern_layer_in_one_launch(dtype):
    n, B, Hq, Hkv, D = 200, 2, 6, 2, 64
    M = -(-n // 64)
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=11)
    g = torch.Generator().manual_seed(2)
    vs_heads, bs_heads, a_heads = [0, 4], [1, 5], [2, 3]
    cols = torch.randint(0, n, (B, 2, 8), generator=g)
    offs = torch.randint(0, n, (B, 2, 5), generator=g)
    index = torch.randint(-1, M, (B, 2, M, 2), generator=g)
    sink, window = torch.tensor([3, 0]), torch.tensor([20, 70])
    tiles = merge_tiles([(vs_heads, vs_to_tiles(cols, offs, n)), (bs_heads, block_sparse_to_tiles(index, n)),
                         (a_heads, ashape_to_tiles(sink, window, n, B))], Hq)
    sinks = torch.zeros(Hq, dtype=torch.long)
    windows = torch.full((Hq,), NO_WINDOW)
    sinks[a_heads], windows[a_heads] = sink, window
    out = sparse_prefill(q, k, v, tiles, sink=sinks, window=windows)
    mask = torch.zeros(B, Hq, n, n, dtype=torch.bool)
    mask[:, vs_heads] = vs_mask(cols, offs, n)
    mask[:, bs_heads] = block_sparse_mask(index, n)
    mask[:, a_heads] = ashape_mask(sink, window, n)
    mask[:, vs_heads] = tiles_to_mask(vs_to_tiles(cols, offs, n), n)  # VS computes its physical tiles
    check(out, masked_attention_ref(q, k, v, mask.to(DEV)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_rows_beside_lists_in_one_launch(dtype):
    """Tri-shape heads (their question as dense rows outside the lists) merged with Vertical-Slash and block-sparse
    heads, GQA 6 / 2, batch 2, N not a multiple of 64: one launch equals attention under `tiles_to_mask`, which holds
    every causal key on the dense rows; as group-shared tiles (one start per KV head) too."""
    n, B, Hq, Hkv, D = 200, 2, 6, 2, 64
    M = -(-n // 64)
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=13)
    g = torch.Generator().manual_seed(4)
    cols, offs = torch.randint(0, n, (B, 2, 8), generator=g), torch.randint(0, n, (B, 2, 5), generator=g)
    index = torch.randint(-1, M, (B, 2, M, 2), generator=g)
    tri = TriShape(torch.tensor([3, 0]), torch.tensor([20, 70]), torch.tensor([30, 137]))
    tiles = merge_tiles([([0, 4], vs_to_tiles(cols, offs, n)), ([1, 5], block_sparse_to_tiles(index, n)),
                         ([2, 3], tri.to_tiles(n, B))], Hq)
    assert tiles.dense_rows == 137 and tiles.dense_from[0].tolist() == [NO_WINDOW] * 2 + [170, 63] + [NO_WINDOW] * 2
    mask = tiles_to_mask(tiles, n)
    assert torch.equal(mask[:, 2:4], tiles_to_mask(tri.to_tiles(n, B), n))
    assert not (tri.to_mask(n) & ~mask[0, 2:4]).any()
    check(sparse_prefill(q, k, v, tiles), masked_attention_ref(q, k, v, mask.to(DEV)), dtype)
    no_question = TriShape(torch.tensor([3, 0]), torch.tensor([20, 70]), torch.tensor([0, 0])).to_tiles(n, B)
    assert no_question.dense_from is None and no_question.dense_rows == 0
    tiles = merge_tiles([([0, 4], vs_to_tiles(cols, offs, n)), ([1, 5], tri.to_tiles(n, B)), ([2, 3], no_question)], Hq)
    assert tiles.dense_from[0].tolist() == [NO_WINDOW, 170, NO_WINDOW, NO_WINDOW, NO_WINDOW, 63]
    check(sparse_prefill(q, k, v, tiles), masked_attention_ref(q, k, v, tiles_to_mask(tiles, n).to(DEV)), dtype)
    shared = TriShape(torch.tensor([3, 0]), torch.tensor([20, 70]), torch.tensor([0, 64])).to_tiles(n, B)
    check(sparse_prefill(q, k, v, shared),
          masked_attention_ref(q, k, v, tiles_to_mask(expand_groups(shared, Hq // Hkv), n).to(DEV)), dtype)


def test_last_rows_attention_is_causal_attention_of_the_last_rows():
    """In key chunks that do not divide N, GQA 6 / 2: the last rows of full causal attention; rows > N clamp."""
    from workbench_kernels.prefill_ref import last_rows_attention

    n = 150
    q, k, v = qkv(1, 6, 2, n, 32, torch.float32, seed=3)
    ro, rlse = masked_attention_ref(q, k, v, torch.ones(n, n, dtype=torch.bool, device=DEV).tril().expand(1, 6, n, n))
    for rows in (1, 40, 150, 400):
        o, lse = last_rows_attention(q, k, v, rows, chunk=37)
        r = min(rows, n)
        check((o, lse), (ro[:, :, n - r:], rlse[:, :, n - r:]), torch.float32)


@pytest.mark.parametrize("block,width", [(128, 0), (128, 64)])
def test_128_row_tiles_match_reference(block, width):
    n, B, Hq, Hkv, D, dtype = 200, 1, 3, 1, 64, DTYPES[0]
    M64 = -(-n // 64)
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=5)
    g = torch.Generator().manual_seed(3)
    cols, offs = torch.randint(0, n, (B, Hq, 10), generator=g), torch.randint(0, n, (B, Hq, 7), generator=g)
    tiles = vs_to_tiles(cols, offs, n, block, width=width)
    check(vertical_slash_prefill(q, k, v, cols.to(DEV), offs.to(DEV), block=block, width=width),
          masked_attention_ref(q, k, v, tiles_to_mask(tiles, n).to(DEV)), dtype)
    index = torch.randint(-1, M64, (B, Hq, M64, 2), generator=g)
    bs = block_sparse_to_tiles(index, n, block, width)
    assert not (block_sparse_mask(index, n) & ~tiles_to_mask(bs, n)).any()
    check(block_sparse_prefill(q, k, v, index.to(DEV), block=block, width=width),
          masked_attention_ref(q, k, v, tiles_to_mask(bs, n).to(DEV)), dtype)
    sink, window = torch.tensor([4, 0, 70]), torch.tensor([10, 64, 130])
    check(ashape_prefill(q, k, v, sink, window, block=block, width=width),
          masked_attention_ref(q, k, v, ashape_mask(sink, window, n).unsqueeze(0).to(DEV)), dtype)


def test_bad_tiles_name_the_problem():
    q, k, v = qkv(1, 3, 1, 100, 64, torch.float32)
    tiles = vs_to_tiles(torch.zeros(1, 3, 1, dtype=torch.long), torch.zeros(1, 3, 1, dtype=torch.long), 300)
    with pytest.raises(ValueError, match="rebuild the tiles"):
        sparse_prefill(q, k, v, tiles)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sparse_prefill(q, k.expand(1, 2, 100, 64), v.expand(1, 2, 100, 64), tiles)


def test_more_row_blocks_than_the_grid_takes_need_the_persistent_launch():
    """Past 65535 row-block programs per head (4M tokens) a launch of one program per row block is refused by name
    before any work (the default switches to the persistent launch)."""
    n = 65536 * 64 + 1
    q = torch.zeros(1, 1, n, 16, dtype=torch.float16, device=DEV)
    tiles = ashape_to_tiles([0], [64], n, device=DEV)
    with pytest.raises(ValueError, match="persistent=True or None"):
        sparse_prefill(q, q, q, tiles, persistent=False, warp_specialize=False)


def test_warp_specialized_kernel_is_chosen_only_where_it_takes_the_tiles():
    """The Gluon kernel takes 64 x 64 block tiles without columns or A-shape masks, per head or with an even group,
    on sm_90; elsewhere the default is the Triton-language loop, and forcing the Gluon kernel names why not."""
    from workbench_kernels.prefill_ws import ws_takes

    n = 256
    q, k, v = qkv(1, 4, 2, n, 128, DTYPES[0])
    index = torch.randint(-1, 4, (1, 4, 4, 2), generator=torch.Generator().manual_seed(0))
    blocks = block_sparse_to_tiles(index, n)
    vs = vs_to_tiles(torch.zeros(1, 4, 3, dtype=torch.long), torch.zeros(1, 4, 1, dtype=torch.long), n)
    sm90 = DEV == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert ws_takes(q, blocks, None) == sm90
    assert blocks.columns is False and vs.columns  # known without looking at the counts
    assert not ws_takes(q, vs, None)  # a column list (one column: as wide as a block tile's empty list)
    assert not ws_takes(q, blocks, torch.zeros(4))  # A-shape mask
    assert not ws_takes(q, block_sparse_to_tiles(index, n, 128, 64), None)  # 128-row tiles
    assert not ws_takes(q[:, :3], block_sparse_to_tiles(index[:, :1], n), None)  # a group of 3 query heads
    if not sm90:
        with pytest.raises(ValueError, match="sm_90"):
            sparse_prefill(*(x.half() for x in (q, k, v)), blocks, warp_specialize=True)
    check(sparse_prefill(q, k, v, blocks), sparse_prefill(q, k, v, blocks, warp_specialize=False), DTYPES[0])


@pytest.mark.parametrize("Hq,Hkv,block,width", [(4, 1, 64, 0), (8, 2, 64, 0), (4, 2, 128, 64), (6, 2, 64, 0)])
def test_group_shared_tiles_run_gqa_packed_and_match_reference(Hq, Hkv, block, width):
    """Tiles for the KV heads (each group of G query heads shares them) run G heads per program
    (G = 3 falls back to per-head programs) and equal attention under the expanded mask."""
    n, B, D, dtype = 200, 2, 64, DTYPES[0]
    G = Hq // Hkv
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=Hq + block)
    g = torch.Generator().manual_seed(Hq)
    M64 = -(-n // 64)
    cols, offs = torch.randint(0, n, (B, Hkv, 9), generator=g), torch.randint(0, n, (B, Hkv, 6), generator=g)
    index = torch.randint(-1, M64, (B, Hkv, M64, 2), generator=g)
    for tiles in (vs_to_tiles(cols, offs, n, block, width=width), block_sparse_to_tiles(index, n, block, width)):
        out = sparse_prefill(q, k, v, tiles)
        check(out, masked_attention_ref(q, k, v, tiles_to_mask(expand_groups(tiles, G), n).to(DEV)), dtype)
    sink, window = torch.tensor([3, 3, 0, 0, 70, 70, 1, 1][:Hq]), torch.tensor([10, 10, 64, 64, 30, 30, 129, 129][:Hq])
    check(ashape_prefill(q, k, v, sink, window, block=block, width=width),
          masked_attention_ref(q, k, v, ashape_mask(sink, window, n).unsqueeze(0).to(DEV)), dtype)


@pytest.mark.parametrize("n", [1, 64, 200, 333])
def test_narrow_pieces_compute_the_same_keys(n):
    """Vertical-Slash (overlapping pieces), block-sparse (disjoint) and A-shape (starts below 0) tiles in pieces of
    32 and 16 keys: each key computed at most once and the same keys as the 64-wide tiles."""
    g = torch.Generator().manual_seed(n)
    B, H, M = 2, 3, -(-n // 64)
    cols, offs = torch.randint(-1, n + 5, (B, H, 9), generator=g), torch.randint(-1, n + 5, (B, H, 12), generator=g)
    sink, window = [3, 0, 70], [10, 64, 129]
    count = torch.zeros(1, 1, M, dtype=torch.int32)  # pieces that overlap the next: [0, 20), [20, 84), [130, 194)
    count[..., -1] = 3 if n > 130 else 0
    offset = torch.tensor([0, 20, 130], dtype=torch.int32).expand(1, 1, M, 3).contiguous()
    empty = torch.zeros(1, 1, M, 1, dtype=torch.int32)
    overlapping = VSTiles(count, offset, count * 0, empty, columns=False)
    for tiles, band in ((vs_to_tiles(cols, offs, n), None), (overlapping, None),
                        (block_sparse_to_tiles(torch.randint(-1, M, (B, H, M, 3), generator=g), n), None),
                        (ashape_to_tiles(sink, window, n, B), (torch.tensor(sink), torch.tensor(window)))):
        phys = tiles_to_mask(tiles, n, *(band or ()))
        for width in (32, 16):
            narrow = narrow_pieces(tiles, width, n)
            assert narrow.piece == width and narrow.disjoint == tiles.disjoint
            assert coverage_counts(narrow, n).max() <= 1
            assert torch.equal(tiles_to_mask(narrow, n, *(band or ())), phys)
    with pytest.raises(ValueError, match="width must divide"):
        narrow_pieces(tiles, 48, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_narrow_pieces_match_reference_at_head_dim_256(dtype):
    """The loop over 32-key pieces of Vertical-Slash tiles (`narrow_pieces`) equals masked attention at head_dim 256."""
    n, B, Hq, Hkv, D = 130, 1, 4, 1, 256
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=32)
    g = torch.Generator().manual_seed(32)
    cols, offs = torch.randint(0, n, (B, Hq, 7), generator=g), torch.randint(0, n, (B, Hq, 5), generator=g)
    tiles = narrow_pieces(vs_to_tiles(cols, offs, n), 32, n)
    mask = tiles_to_mask(tiles, n)
    check(sparse_prefill(q, k, v, tiles), masked_attention_ref(q, k, v, mask.to(DEV)), dtype)


@pytest.mark.parametrize("shared", [False, True], ids=["per_head", "group_shared"])
def test_head_dim_256_matches_reference(shared):
    """Gemma-3-270M's attention shape (4 query heads, 1 KV head, head_dim 256): Vertical-Slash,
    block-sparse and A-shape tiles, per head and GQA-packed (64 rows per program: 16 of each head)."""
    n, B, Hq, Hkv, D, dtype = 130, 1, 4, 1, 256, DTYPES[0]
    H = Hkv if shared else Hq
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=256)
    g = torch.Generator().manual_seed(256)
    cols, offs = torch.randint(0, n, (B, H, 7), generator=g), torch.randint(0, n, (B, H, 5), generator=g)
    index = torch.randint(-1, 3, (B, H, 3, 2), generator=g)
    for tiles in (vs_to_tiles(cols, offs, n), block_sparse_to_tiles(index, n)):
        mask = tiles_to_mask(expand_groups(tiles, Hq // H), n)
        check(sparse_prefill(q, k, v, tiles), masked_attention_ref(q, k, v, mask.to(DEV)), dtype)
    sink, window = (torch.tensor([8] * 4), torch.tensor([70] * 4)) if shared else (
        torch.tensor([4, 0, 70, 1]), torch.tensor([10, 64, 30, 129]))
    check(ashape_prefill(q, k, v, sink, window),
          masked_attention_ref(q, k, v, ashape_mask(sink, window, n).unsqueeze(0).to(DEV)), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="bf16 at the models' shapes needs CUDA")
@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 128), (4, 1, 256), (9, 3, 64)], ids=["llama", "gemma", "smollm2"])
def test_bf16_model_shapes_every_pattern_per_head_and_packed(Hq, Hkv, D):
    """bf16 at a Llama-like shape (G = 4, head_dim 128), Gemma-3-270M's (4 / 1 heads, head_dim 256) and SmolLM2's
    (9 / 3, head_dim 64: per-head block-sparse tiles take the Gluon kernel on sm_90, the rest the loop):
    Vertical-Slash and block-sparse tiles from the Triton index builders, per head and GQA-packed, and
    A-shape, against fp32 attention under the tiles' mask (relative error of o)."""
    from workbench_kernels.index_build import block_index, vs_index, vs_tiles
    from workbench_kernels.index_ref import selected_block_tiles

    n = 2048
    q, k, v = qkv(1, Hq, Hkv, n, D, torch.bfloat16, seed=21)
    for shared in (False, True):
        cols, offs = vs_index(q, k, D ** -0.5, 100, 200, group_shared=shared)
        for tiles in (selected_block_tiles(block_index(q, k, 6, group_shared=shared)), vs_tiles(cols, offs, n)):
            o, _ = sparse_prefill(q, k, v, tiles)
            ro, _ = masked_attention_ref(q, k, v, tiles_to_mask(expand_groups(tiles, Hq // tiles.shape[1]), n))
            assert torch.isfinite(o).all()
            assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2
    sink, window = torch.full((Hq,), 64), torch.full((Hq,), 512)
    o, _ = ashape_prefill(q, k, v, sink, window)
    ro, _ = masked_attention_ref(q, k, v, ashape_mask(sink, window, n).unsqueeze(0).to(DEV))
    assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2
    tri = TriShape(64, 512, 100, n_heads=Hq).to_tiles(n)  # the question as dense rows after the lists
    o, _ = sparse_prefill(q, k, v, tri)
    ro, _ = masked_attention_ref(q, k, v, tiles_to_mask(tri, n).to(DEV))
    assert ((o.float() - ro.float()).norm() / ro.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="2^31 elements per tensor need a GPU")
def test_heads_past_two_to_the_31_elements():
    """Head offsets past 2^31 elements (Llama's 32 heads at 1M tokens; here head 8 of 2M x 128): a window-only
    A-shape on its last rows equals the reference on a slice (a window is the same at every position)."""
    n, d, w, h = 1 << 21, 128, 64, 9
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, x, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for x in (h, 1, 1))
    o, _ = sparse_prefill(q, k, v, ashape_to_tiles([0] * h, [w] * h, n, device="cuda"),
                          sink=torch.zeros(h, dtype=torch.long), window=torch.full((h,), w), warp_specialize=False)
    tail = slice(n - 4 * w, n)
    ro, _ = masked_attention_ref(q[:, :, tail], k[:, :, tail], v[:, :, tail],
                                 ashape_mask([0] * h, [w] * h, 4 * w).unsqueeze(0).to(DEV))
    torch.testing.assert_close(o[:, :, -2 * w:].float(), ro[:, :, -2 * w:].float(), atol=2e-2, rtol=2e-2)


VARIANTS = {"split": {"split": True}, "tma": {"split": True, "tma": True}, "single": {"split": False},
            "tma_persistent": {"split": True, "tma": True, "persistent": True, "kv_major": True},
            "split_persistent": {"split": True, "tma": False, "persistent": True}}  # Vertical-Slash's default on Hopper


@pytest.mark.parametrize("variant,block,width", [(v, b, w) for v in ("split", "tma", "single")
                                                 for b, w in ((64, 0), (128, 64), (128, 0))]
                         + [("tma_persistent", 128, 64), ("split_persistent", 64, 0)])
def test_long_tiles_prefix_interior_suffix_match_reference(variant, block, width):
    """n = 700: row blocks with masked prefix pieces (window edge, starts below 0), unmasked interior
    pieces and masked suffix pieces, per head and GQA-packed, for every piece loop of the kernel and
    the persistent schedule (TMA: also the masked pieces, whose rows outside [0, n) read as zeros)."""
    variant = VARIANTS[variant]
    n, B, Hq, Hkv, D, dtype = 700, 1, 4, 2, 64, DTYPES[0]
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=block + width)
    g = torch.Generator().manual_seed(block)
    M64 = -(-n // 64)
    cols, offs = torch.randint(0, n, (B, Hq, 9), generator=g), torch.randint(0, n, (B, Hq, 12), generator=g)
    index = torch.randint(-1, M64, (B, Hkv, M64, 6), generator=g)
    for tiles in (vs_to_tiles(cols, offs, n, block, width=width), block_sparse_to_tiles(index, n, block, width)):
        out = sparse_prefill(q, k, v, tiles, **variant)
        mask = tiles_to_mask(expand_groups(tiles, Hq // tiles.shape[1]), n)
        check(out, masked_attention_ref(q, k, v, mask.to(DEV)), dtype)
    for sink, window in (([5, 0, 70, 1], [300, 64, 130, 450]), ([64] * Hq, [260] * Hq)):
        sink, window = torch.tensor(sink), torch.tensor(window)
        tiles = ashape_to_tiles(sink[:: Hq // Hkv] if sink.unique().numel() == 1 else sink,
                                window[:: Hq // Hkv] if window.unique().numel() == 1 else window, n, B, block,
                                width=width)
        out = sparse_prefill(q, k, v, tiles, sink=sink, window=window, **variant)
        check(out, masked_attention_ref(q, k, v, ashape_mask(sink, window, n).unsqueeze(0).to(DEV)), dtype)


def test_vertical_slash_per_head_at_head_dim_256_matches_reference():
    """Gemma-3's shape (4 query heads on 1 KV head, head_dim 256), per-head Vertical-Slash tiles at n = 700:
    the kernel's default loop (on Hopper: split with TMA loads, `loop_variant`) and the TMA loop named
    explicitly both equal masked attention over the tiles."""
    n, B, Hq, Hkv, D, dtype = 700, 1, 4, 1, 256, DTYPES[0]
    q, k, v = qkv(B, Hq, Hkv, n, D, dtype, seed=256)
    g = torch.Generator().manual_seed(256)
    cols, offs = torch.randint(0, n, (B, Hq, 9), generator=g), torch.randint(0, n, (B, Hq, 12), generator=g)
    tiles = vs_to_tiles(cols, offs, n, 64)
    ref = masked_attention_ref(q, k, v, tiles_to_mask(tiles, n).to(DEV))
    for variant in ({}, VARIANTS["tma"]):
        check(sparse_prefill(q, k, v, tiles, **variant), ref, dtype)


def test_work_order_takes_every_item_once_most_pieces_first():
    """The persistent kernels' order is a permutation of the items, the most pieces first (over all heads, or
    within each KV head's run of heads, runs in order)."""
    from workbench_kernels.schedule import work_order

    B, H, n = 2, 3, 300
    M = -(-n // 64)
    index = torch.randint(-1, M, (B, H, M, 4), generator=torch.Generator().manual_seed(0))
    tiles = block_sparse_to_tiles(index, n, 64, 0)
    cost = tiles.block_count.reshape(-1)
    for sub in (1, 2):
        order = work_order(tiles, sub).long()
        assert torch.equal(order.sort().values, torch.arange(B * H * M * sub))
        assert (cost[order // sub].diff() <= 0).all()
    H, group = 4, 2  # by KV head first: heads (0, 1) of batch 0, then (2, 3), then batch 1's
    index = torch.randint(-1, M, (B, H, M, 4), generator=torch.Generator().manual_seed(1))
    tiles = block_sparse_to_tiles(index, n, 64, 0)
    cost = tiles.block_count.reshape(-1)
    for sub in (1, 2):
        order = work_order(tiles, sub, group).long()
        assert torch.equal(order.sort().values, torch.arange(B * H * M * sub))
        run = order // (group * M * sub)
        assert torch.equal(run, run.sort().values) and run.unique().numel() == B * H // group
        for r in range(B * H // group):
            assert (cost[order[run == r] // sub].diff() <= 0).all()
    g = torch.Generator().manual_seed(2)  # column strips count: a strip of up to 64 columns is one more item
    n = 2000
    tiles = vs_to_tiles(torch.randint(0, n, (B, H, 400), generator=g), torch.randint(0, n, (B, H, 3), generator=g), n)
    assert tiles.columns and (tiles.column_count > 64).any()
    cost = (tiles.block_count + (tiles.column_count + 63) // 64).reshape(-1)
    order = work_order(tiles, 1).long()
    assert torch.equal(order.sort().values, torch.arange(cost.numel())) and (cost[order].diff() <= 0).all()


def test_band_on_copies_host_values_once_and_casts_tensors_in_place():
    """`tiling.band_on`: host sink / window become Int32 copies on the device, cached (a second call gets the same
    tensors: no host-to-device copy, which waits for the GPU's queue); windows past `NO_WINDOW` clamp to it; Long
    tensors already on the device are clamped and cast, not cached; Int32 ones pass as they are."""
    from workbench_kernels.tiling import NO_WINDOW, band_on

    sink, window = band_on([4, 0], [64, 1 << 40], DEV)
    assert sink.dtype == window.dtype == torch.int32 and sink.device.type == window.device.type == DEV
    assert sink.tolist() == [4, 0] and window.tolist() == [64, NO_WINDOW]
    again = band_on((4, 0), [64, 1 << 41], DEV)  # the same values once clamped: the same copies
    assert again[0] is sink and again[1] is window
    on = torch.tensor([7, 1 << 40], device=DEV)
    assert band_on(on, on, DEV)[1].tolist() == [7, NO_WINDOW] and band_on(on, on, DEV)[0] is not band_on(on, on, DEV)[0]
    on32 = on.clamp(max=99).to(torch.int32)
    assert band_on(on32, on32, DEV)[0].data_ptr() == on32.data_ptr()  # no copy
