"""Vertical-Slash index building on the GPU for all heads of a layer, with no host synchronisation.

The fast path of `workbench.patterns.vs_proxy` at its defaults (probability-sum aggregation, plain
diagonal sums, first 30 columns and 100 smallest offsets forced): the last r = 64 query rows score all
keys; column sums and diagonal sums of the softmax probabilities pick the columns and slash offsets.

Two Triton passes over 64-key blocks counted from the end of the sequence (block u = keys
[n - 64(u+1), n - 64u)): pass 1 writes each block's row max and row sum of exp (combined into the
rows' log-sum-exp by one small launch); pass 2 recomputes the scores of blocks u+1 and u side by side as a
64 x 128 tile X, sums the probabilities of block u over rows (column sums) and reads X along its
diagonals with one `tl.gather` (row r, offset 64u + t sits at column 64 + r - t), so each program
owns the diagonal sums of offsets [64u, 64u + 64) without atomics. Top-k selection is `topk.top_positions`,
the one `workbench.patterns.vs_proxy` uses (a Triton top-k with one program per row took 3.6-11x its device time on
the H200 at 32K-128K: kernels/NOTES.md).

The tile conversion (`vs_tiles`, the same tiles as `index_ref.vs_to_tiles`) is two Triton launches and
no torch op between them: one program per head sorts its offsets and columns (`tl.sort`), dedupes the
columns and places the pieces (the greedy cover of `index_ref.vs_pieces`, from the offsets, never over
n-sized arrays; `vs_cover`), then one program per row block finds its pieces by a two-level search of
the head's piece ends, expands them and packs the surviving columns.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from .index_ref import VSTiles, max_pieces_total, selected_block_tiles, vs_tile_bounds
from .order import order_key
from .tiling import LOG2E, ints_on
from .topk import budget, top_blocks, top_positions

ROWS = 64
MAX_TOPK_BLOCKS = 16384  # longest score row the block top-k kernel holds in registers (1M tokens)
_LOG_MIN = 7  # the block top-k kernel's narrowest row: 128 scores


@triton.jit
def _row_stats_kernel(Q, K, Mpart, Lpart, qk_scale, N, H, G, U,
                      sqb, sqh, sqn, skb, skh, skn, D: tl.constexpr, R: tl.constexpr, BN: tl.constexpr):
    bh = tl.program_id(0)
    u = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = N - R + tl.arange(0, R)
    dims = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :], mask=rows[:, None] >= 0, other=0.0)
    keys = N - BN * (u + 1) + tl.arange(0, BN)
    k = tl.load(K + b * skb + (h // G) * skh + keys[:, None] * skn + dims[None, :], mask=keys[:, None] >= 0,
                other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where((keys[None, :] >= 0) & (keys[None, :] <= rows[:, None]), s, float("-inf"))
    m = tl.max(s, 1)
    l = tl.sum(tl.math.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), 1)
    out = (bh * U + u) * R + tl.arange(0, R)
    tl.store(Mpart + out, m)
    tl.store(Lpart + out, l)


@triton.jit
def _combine_lse_kernel(Mpart, Lpart, Lse, U, R: tl.constexpr, CHUNK: tl.constexpr):
    """Log2-sum-exp2 of each of the R rows of one head over its U key blocks' (row max, row sum) partials
    `[U, R]`: a running max and rescaled sum over CHUNK blocks at a time (rows without a key: -inf)."""
    bh = tl.program_id(0)
    r = tl.arange(0, R)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    for u0 in range(0, U, CHUNK):
        u = u0 + tl.arange(0, CHUNK)
        at = (bh * U + u).to(tl.int64)[:, None] * R + r[None, :]
        mp = tl.load(Mpart + at, mask=u[:, None] < U, other=float("-inf"))
        lp = tl.load(Lpart + at, mask=u[:, None] < U, other=0.0)
        m_new = tl.maximum(m, tl.max(mp, 0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.math.exp2(m - base) + tl.sum(lp * tl.math.exp2(mp - base[None, :]), 0)
        m = m_new
    tl.store(Lse + bh * R + r, tl.where(l > 0, m + tl.math.log2(tl.maximum(l, 1e-30)), float("-inf")))


@triton.jit
def _col_diag_kernel(Q, K, Lse, Col, Diag, qk_scale, N, H, G,
                     sqb, sqh, sqn, skb, skh, skn, D: tl.constexpr, R: tl.constexpr):
    bh = tl.program_id(0)
    u = tl.program_id(1)
    b = bh // H
    h = bh % H
    r = tl.arange(0, R)
    rows = N - R + r
    dims = tl.arange(0, D)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqn + dims[None, :], mask=rows[:, None] >= 0, other=0.0)
    lse = tl.load(Lse + bh * R + r)
    kbase = K + b * skb + (h // G) * skh
    keys = N - R * (u + 2) + tl.arange(0, 2 * R)  # block u+1 then block u
    k = tl.load(kbase + keys[:, None] * skn + dims[None, :], mask=keys[:, None] >= 0, other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    ok = (keys[None, :] >= 0) & (keys[None, :] <= rows[:, None]) & (rows[:, None] >= 0)
    p = tl.where(ok, tl.math.exp2(s - lse[:, None]), 0.0)  # [R, 2R]
    # column sums of block u (the right half)
    col = tl.sum(tl.where(tl.arange(0, 2 * R)[None, :] >= R, p, 0.0), 0)
    cpos = keys
    tl.store(Col + bh * N + cpos, col, mask=(tl.arange(0, 2 * R) >= R) & (cpos >= 0))
    # diagonal sums of offsets 64u + t: row r reads column R + r - t
    t = tl.arange(0, R)
    diag = tl.sum(tl.gather(p, (R + r[:, None] - t[None, :]).to(tl.int32), 1), 0)
    off = R * u + t
    tl.store(Diag + bh * N + off, diag, mask=off < N)


@torch.no_grad()
def vs_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Column and diagonal sums of the last 64 rows' softmax probabilities, Float32 `[B, Hq, N]` each
    (column j; offset d = i - j). q `[B, Hq, N, D]`, k `[B, Hkv, N, D]`."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    U = -(-N // ROWS)
    mpart = torch.empty(B * Hq, U, ROWS, dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    args = (scale * LOG2E, N, Hq, Hq // Hkv)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    _row_stats_kernel[(B * Hq, U)](q, k, mpart, lpart, *args, U, *strides, D=D, R=ROWS, BN=ROWS, num_warps=4)
    lse = torch.empty(B * Hq, ROWS, dtype=torch.float32, device=q.device)  # log2 units
    _combine_lse_kernel[(B * Hq,)](mpart, lpart, lse, U, R=ROWS, CHUNK=64, num_warps=4)
    col = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)  # (every key lies in one block u: all written)
    diag = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    _col_diag_kernel[(B * Hq, U)](q, k, lse, col, diag, *args, *strides, D=D, R=ROWS, num_warps=4)
    return col, diag


@torch.no_grad()
def vs_index(q: torch.Tensor, k: torch.Tensor, scale: float, vertical: int = 1000, slash: int = 6096,
             sink: int = 30, local: int = 100, group_shared: bool = False,
             per_head: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical-Slash index of every head of a layer -> (columns Long `[B, Hq, vertical]`, offsets Long
    `[B, Hq, slash]`), ascending, -1 padded; same selection as `vs_proxy` at its defaults.
    `per_head`: (columns, offsets) budgets Long `[Hq]` on q's device, or None where every head takes
    `vertical` / `slash` (then the largest): each head keeps its first choices, as `vs_proxy` with per-head budgets.
    `group_shared`: one index per KV head (`[B, Hkv, ...]`) from the column and diagonal sums added
    over its G query heads, for the GQA-packed kernel (`per_head` budgets are then per KV head, `[Hkv]`)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [B, Hq, N, D] and k [B, Hkv, N, D] with Hq a multiple of Hkv; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    heads = k.shape[1] if group_shared else q.shape[1]
    if any(b is not None and b.numel() != heads for b in per_head):
        raise ValueError(f"per_head budgets must hold one budget per {'KV' if group_shared else 'query'} head "
                         f"({heads}), got {[None if b is None else b.numel() for b in per_head]}")
    col, diag = vs_scores(q, k, scale)
    if group_shared:
        col, diag = (x.unflatten(1, (k.shape[1], -1)).sum(2) for x in (col, diag))
    return top_positions(col, sink, vertical, per_head[0]), top_positions(diag, max(local, 1), slash, per_head[1])


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _vs_cover_kernel(Offsets, Columns, Ends, Covered, Cols, H, KS, KV, P, L, N, sob, soh, sok, scb, sch, sck,
                     B_ROW: tl.constexpr, W: tl.constexpr, KPAD: tl.constexpr, CPAD: tl.constexpr):
    """One head (program (b, h)): its KS offsets and KV columns in any order (< 0 or >= N: invalid) ->
    Cols (the columns sorted, invalid and repeated ones = N), Ends and Covered (`index_ref.vs_pieces`).

    The offsets plus offset 0, invalid ones = N, sorted (KPAD >= KS + 1, pads N), are covered greedily in
    d-space. Offset o_i covers d in [o_i - B_ROW + 1, o_i]. Walking the offsets in order with `reach` =
    the last d covered so far: if reach <= o_i - B_ROW (a reset) the pieces restart at o_i - B_ROW + 1;
    else they continue at reach + 1; either way reach becomes the first value >= o_i in the residue of
    the reset's o_r - B_ROW mod W. So reach_i = o_r - B_ROW + W * ceil((o_i - o_r + B_ROW) / W), r = the
    last reset <= i (o_r when W divides B_ROW; W > B_ROW overhangs o_r), and a reset needs a gap
    o_i - o_{i-1} >= B_ROW. The resets are found by fixed-point iteration
    (start: every such gap; each pass settles at least the first unsettled one, usually 2-4 passes),
    then offset i writes its ceil((o_i - lo_i) / W) <= B_ROW / W pieces (lo_i: the d below its
    first piece) and marks their d's in `Covered` (zeroed first by this program)."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    i = tl.arange(0, KPAD)
    for s in range(0, L, KPAD):
        tl.store(Covered + bh * L + s + i, 0, mask=s + i < L)
    j = tl.arange(0, CPAD)
    c = tl.load(Columns + b * scb + h * sch + j * sck, mask=j < KV, other=N)
    c = tl.sort(tl.where((c >= 0) & (c < N), c, N).to(tl.int32))
    dup = (j > 0) & (c == tl.gather(c, tl.maximum(j - 1, 0), 0))
    tl.store(Cols + bh * KV + j, tl.where(dup, N, c), mask=j < KV)
    o = tl.load(Offsets + b * sob + h * soh + (i - 1) * sok, mask=(i >= 1) & (i <= KS), other=N)  # i = 0: offset 0
    o = tl.sort(tl.where(i == 0, 0, tl.where((o >= 0) & (o < N), o, N)).to(tl.int32))
    o_prev = tl.where(i >= 1, tl.gather(o, tl.maximum(i - 1, 0), 0), -(1 << 30))
    gap = o - o_prev >= B_ROW  # i = 0 (offset 0) always
    reset = gap
    reach_prev = o_prev
    changed = 1
    while changed > 0:
        last = tl.associative_scan(tl.where(reset, o, -(1 << 30)), 0, _max)  # value of the last reset <= i
        o_r = tl.gather(last, tl.maximum(i - 1, 0), 0)
        reach_prev = o_r - B_ROW + tl.cdiv(o_prev - o_r + B_ROW, W) * W  # reach after offset i - 1
        new = gap & ((i == 0) | (reach_prev <= o - B_ROW))
        changed = tl.sum((new != reset).to(tl.int32), 0)
        reset = new
    lo = tl.where(reset, o - B_ROW, reach_prev)
    count = tl.where(o < N, tl.maximum(tl.cdiv(o - lo, W), 0), 0)
    pos = tl.cumsum(count, 0) - count
    tl.debug_barrier()  # the zeros above are stored before any thread marks
    for k in tl.static_range((B_ROW + W - 1) // W):  # an offset adds at most ceil(B_ROW / W) pieces
        end = lo + (k + 1) * W  # the piece's d of its lowest key
        tl.store(Ends + bh * P + pos + k, end, mask=k < count)
        for t in range(W):
            d = end - t
            tl.store(Covered + bh * L + d + B_ROW - 1, 1, mask=(k < count) & (d < N))
    for s in range(tl.sum(count, 0), P, KPAD):
        tl.store(Ends + bh * P + s + i, 2147483647, mask=s + i < P)


def _vs_heads(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int,
              width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One `_vs_cover_kernel` launch over columns `[B, H, KV]` and offsets `[B, H, KS]` (any integer dtype,
    order, strides) -> (ends Int32 `[B, H, max_pieces_total]` ascending, INT32_MAX padded; covered Int8
    `[B, H, n + block - 1]`; cols Int32 `[B, H, KV]`, `index_ref.unique_columns`)."""
    B, H, KS = offsets.shape
    KV = columns.shape[-1]
    dev = offsets.device
    ends = torch.empty(B, H, max_pieces_total(n, KS, block, width), dtype=torch.int32, device=dev)
    covered = torch.empty(B, H, n + block - 1, dtype=torch.int8, device=dev)
    cols = torch.empty(B, H, KV, dtype=torch.int32, device=dev)
    kpad, cpad = triton.next_power_of_2(KS + 1), triton.next_power_of_2(max(KV, 1))
    _vs_cover_kernel[(B * H,)](offsets, columns, ends, covered, cols, H, KS, KV, ends.shape[-1], covered.shape[-1], n,
                               *offsets.stride(), *columns.stride(), B_ROW=block, W=width, KPAD=kpad, CPAD=cpad,
                               num_warps=max(4, min(16, max(kpad, cpad) // 256)))
    return ends, covered, cols


@torch.no_grad()
def vs_cover(offsets: torch.Tensor, n: int, block: int = 64, width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`index_ref.vs_pieces(offsets, n, block, static=True, width=width)` by one Triton program per head:
    (ends Int32 `[B, H, max_pieces_total]` ascending, INT32_MAX padded; covered Int8 `[B, H, n + block - 1]`)."""
    return _vs_heads(offsets[..., :0], offsets, n, block, width or block)[:2]


@triton.jit
def _expand_tiles_kernel(Ends, Covered, Cols, BlockCount, BlockOffset, ColumnCount, ColumnIndex,
                         P, L, KV, NS, NC, M, N, BLOCK: tl.constexpr, W: tl.constexpr, CHUNK: tl.constexpr):
    """Row block m of one head: its pieces, the ends e with m*BLOCK - N < e <= m*BLOCK + W - 1 (start
    m*BLOCK - e), and its columns (< m*BLOCK and not covered, in order)."""
    bh = tl.program_id(0)
    m = tl.program_id(1)
    row0 = m * BLOCK
    lanes = tl.arange(0, CHUNK)
    tile = bh * M + m
    # the ends <= x for x = (row0 - N, row0 + W - 1): first counted on every S-th end, then within one stride
    x = tl.where(tl.arange(0, 2) == 0, row0 - N, row0 + W - 1)[:, None]
    S = tl.cdiv(P, CHUNK)
    sample = tl.load(Ends + bh * P + lanes * S, mask=lanes * S < P, other=2147483647)
    base = tl.maximum(tl.sum((sample[None, :] <= x).to(tl.int32), 1) - 1, 0) * S  # [2]
    below = base
    for s0 in range(0, S, CHUNK):
        t = base[:, None] + s0 + lanes[None, :]
        e = tl.load(Ends + bh * P + t, mask=(s0 + lanes[None, :] < S) & (t < P), other=2147483647)
        below += tl.sum((e <= x).to(tl.int32), 1)
    hi = tl.max(below, 0)
    count = tl.minimum(hi - tl.min(below, 0), NS)
    tl.store(BlockCount + tile, count)
    # pieces: ends[hi - count : hi], written in ascending key order (start = row0 - end)
    for t0 in range(0, count, CHUNK):
        t = t0 + lanes
        e = tl.load(Ends + bh * P + hi - 1 - t, mask=t < count, other=0)
        tl.store(BlockOffset + tile.to(tl.int64) * NS + t, row0 - e, mask=t < count)
    # columns: keep those < row0 and not under a piece, packed in order
    kept = 0
    for c0 in range(0, KV, CHUNK):
        c = tl.load(Cols + bh * KV + c0 + lanes, mask=c0 + lanes < KV, other=2147483647)
        d = tl.minimum(tl.maximum(row0 - c, 1), L - BLOCK)
        cov = tl.load(Covered + bh * L + d + BLOCK - 1, mask=c < row0, other=1)
        keep = (c < row0) & (cov == 0)
        pos = kept + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(ColumnIndex + tile.to(tl.int64) * NC + pos, c, mask=keep & (pos < NC))
        kept += tl.sum(keep.to(tl.int32), 0)
    tl.store(ColumnCount + tile, tl.minimum(kept, NC))


@torch.no_grad()
def vs_tiles(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int = 64, width: int = 0,
             head_columns: bool = False) -> VSTiles:
    """Same tiles as `index_ref.vs_to_tiles` (static widths `vs_tile_bounds`) from columns `[B, H, KV]` and
    offsets `[B, H, KS]` in any order: two Triton launches (per head, then per row block), no host sync, no
    torch ops (only `torch.empty`), no `[B, H, M, width]` intermediates. Entries past the counts are left
    unwritten. `head_columns`: also the columns per head (`VSTiles.head_columns` / `covered`, one sort more),
    so that the Gluon kernel can take the tiles on sm_90 (`prefill.sparse_prefill`'s route)."""
    tiles, cov, cols = _expand_tiles(columns, offsets, n, block, width, with_columns=True, sort=head_columns)
    return dataclasses.replace(tiles, head_columns=cols, covered=cov) if head_columns else tiles


def _expand_tiles(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int, width: int,
                  with_columns: bool, sort: bool) -> tuple[VSTiles, torch.Tensor, torch.Tensor]:
    """`_vs_heads`, then one `_expand_tiles_kernel` launch per (head, row block) -> (tiles, covered, cols; `sort`:
    cols ascending, the head columns the Gluon kernel packs); without columns the column loop is skipped
    (column_count 0, column_index `[B, H, M, 1]` = -1)."""
    B, H, KV = columns.shape
    M = -(-n // block)
    w = width or block
    ends, cov, cols = _vs_heads(columns, offsets, n, block, w)
    NS, NC = vs_tile_bounds(n, KV, offsets.shape[-1], block, w)
    dev = columns.device
    column_index = (torch.empty(B, H, M, NC, dtype=torch.int32, device=dev) if with_columns
                    else torch.full((B, H, M, 1), -1, dtype=torch.int32, device=dev))
    tiles = VSTiles(torch.empty(B, H, M, dtype=torch.int32, device=dev),
                    torch.empty(B, H, M, NS, dtype=torch.int32, device=dev),
                    torch.empty(B, H, M, dtype=torch.int32, device=dev), column_index, block, width, disjoint=True,
                    columns=with_columns)
    kv, nc = (KV, NC) if with_columns else (0, 0)  # KV = 0: column_count = min(0, NC) = 0
    _expand_tiles_kernel[(B * H, M)](ends, cov, cols, tiles.block_count, tiles.block_offset, tiles.column_count,
                                     tiles.column_index, ends.shape[-1], cov.shape[-1], kv, NS, nc, M, n,
                                     BLOCK=block, W=w, CHUNK=256, num_warps=4)
    return tiles, cov, cols.sort(-1).values if sort else cols


@triton.jit
def _select_row(Score, Budget, Out, Count, ColCount, ColIndex, bh, m, M, H, K, NPAD: tl.constexpr,
                KPAD: tl.constexpr, PER_HEAD: tl.constexpr, TILES: tl.constexpr, UNIT: tl.constexpr):
    """Query block m (< NPAD) of head bh keeps its diagonal plus the best k - 1 causal key blocks before it,
    k = min(budget, m + 1) (budget: Budget[h] with PER_HEAD, else K), written ascending. The threshold is found
    exactly by bisection on the order-preserving int32 image of the fp32 scores, between the row's smallest and
    largest candidate, stopping as soon as exactly k - 1 candidates reach it (a gap between the (k-1)-th and k-th
    score: ~15-25 passes instead of 32); ties at the threshold go to the lowest block ids. TILES: the row's 64-row
    tile instead (`VSTiles` fields: key offsets block * UNIT in Out, k in Count, no columns), as
    `selected_block_tiles` makes of the table (UNIT: 64 with TILES, else 1)."""
    j = tl.arange(0, NPAD)
    cand = j < m
    row = (bh * M + m).to(tl.int64)
    x = tl.load(Score + row * M + j, mask=cand, other=0.0)
    key = tl.where(cand, order_key(x), -2147483647 - 1)
    top = tl.load(Budget + bh % H).to(tl.int32) if PER_HEAD else K
    k = tl.minimum(tl.maximum(top, 1), m + 1) - 1  # candidates to keep, <= m
    # invariant: count(key >= lo) = cnt >= k and count(key > hi) < k; done when cnt == k or lo == hi
    lo = tl.min(tl.where(cand, key, 2147483647), 0).to(tl.int64)
    hi = tl.max(key, 0).to(tl.int64)
    lo = tl.where(k == 0, 2147483647, lo)
    cnt = m
    while (cnt > k) & (lo < hi):
        mid = (lo + hi + 1) >> 1
        c = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), 0)
        enough = c >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
        cnt = tl.where(enough, c, cnt)
    t = lo.to(tl.int32)
    above = cand & (key > t)
    tie = cand & (key == t)
    keep = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= k - tl.sum(above.to(tl.int32), 0)))
    pos = tl.cumsum(keep.to(tl.int32), 0) - 1
    out = Out + row * K
    tl.store(out + pos, j * UNIT, mask=keep)
    tl.store(out + k, m * UNIT)  # the diagonal, after the k kept candidates
    slot = tl.arange(0, KPAD)
    tl.store(out + slot, -1, mask=(slot > k) & (slot < K))
    if TILES:
        tl.store(Count + row, k + 1)
        tl.store(ColCount + row, 0)
        tl.store(ColIndex + row, -1)


@triton.jit
def _block_topk_kernel(Score, Budget, Out, Count, ColCount, ColIndex, M, H, K, M_LO, M_HI, LOG_LO: tl.constexpr,
                       LOG_HI: tl.constexpr, KPAD: tl.constexpr, PER_HEAD: tl.constexpr, TILES: tl.constexpr,
                       UNIT: tl.constexpr):
    """One query block m in [M_LO, M_HI) of one head per program (`_select_row`), its scores held in registers of
    the narrowest width 2^p (LOG_LO <= p <= LOG_HI) above m: rows of every band of this launch in one grid."""
    pid = tl.program_id(0)
    rows = M_HI - M_LO
    bh = pid // rows
    m = M_LO + pid % rows
    for p in tl.static_range(LOG_LO, LOG_HI + 1):
        if p == LOG_LO:
            here = m < (1 << p)
        else:
            here = (m < (1 << p)) & (m >= (1 << (p - 1)))
        if here:
            _select_row(Score, Budget, Out, Count, ColCount, ColIndex, bh, m, M, H, K, 1 << p, KPAD, PER_HEAD,
                        TILES, UNIT)


@triton.jit
def _block_scores_kernel(QP, KP, Score, M, H, G, D: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Scores of one BT x BT tile (query blocks x key blocks) of one head, head_dim in DK-wide chunks (one
    128-wide product at a time: the tensor-core path at head_dim 256 too); tiles wholly above the diagonal
    are left unwritten (the selection never reads past the diagonal)."""
    bh = tl.program_id(0)
    i = tl.program_id(1)
    j = tl.program_id(2)
    if j <= i:
        rows = i * BT + tl.arange(0, BT)
        cols = j * BT + tl.arange(0, BT)
        kvh = (bh // H) * (H // G) + (bh % H) // G
        s = tl.zeros([BT, BT], tl.float32)
        for d0 in tl.static_range(0, D, DK):
            dims = d0 + tl.arange(0, DK)
            qp = tl.load(QP + (bh * M + rows).to(tl.int64)[:, None] * D + dims[None, :], mask=rows[:, None] < M,
                         other=0.0)
            kp = tl.load(KP + (kvh * M + cols).to(tl.int64)[:, None] * D + dims[None, :], mask=cols[:, None] < M,
                         other=0.0)
            s = tl.dot(qp, tl.trans(kp), acc=s, input_precision=PRECISION)
        tl.store(Score + (bh * M + rows).to(tl.int64)[:, None] * M + cols[None, :], s,
                 mask=(rows < M)[:, None] & (cols < M)[None, :])


@torch.no_grad()
def pool_blocks(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """`block`-token means of x `[B, H, N, D]` (a last partial block averages its own tokens) -> Float32
    `[B, H, ceil(N / block), D]`, contiguous, accumulated in fp32 without an fp32 copy of x: one reduction launch
    when N is a multiple of `block` (a Triton pooling kernel ran at half its bandwidth on the H200: NOTES)."""
    n = x.shape[2]
    full = n // block
    parts = [x[:, :, : full * block].unflatten(2, (full, block)).mean(3, dtype=torch.float32)] if full else []
    if n % block:
        parts.append(x[:, :, full * block:].mean(2, keepdim=True, dtype=torch.float32))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 2)


@torch.no_grad()
def pooled_scores(q: torch.Tensor, k: torch.Tensor, block: int = 64, group_shared: bool = False,
                  precision: str | None = None) -> torch.Tensor:
    """Block scores of every head of a layer, Float32 `[B, Hq (Hkv if group_shared), M, M]` (only the
    causal part j <= m is written): 64-token means of q and k (bf16/fp16 pooled with fp32 accumulation,
    no fp32 copy of q and k; a last partial block averages its own tokens), then q-means . k-means.
    On CUDA (or under the Triton interpreter) one Triton launch over the lower-triangle tiles, products
    in `precision`: "tf32x3" (three TF32 tensor-core products, about fp32 accuracy: near-ties may select
    apart from `block_proxy`; 18x faster than IEEE on the H200 at 128K, 0.86 vs 15.7 ms) or "ieee" (fp32
    FMA, as `block_proxy`'s fp32 matmul up to summation order). None: Triton's own knob
    `TRITON_F32_DEFAULT` when it names one of the two (tests/conftest.py sets "ieee"), else "tf32x3" on a
    GPU and "ieee" under the interpreter; without either, one grouped fp32 matmul. group_shared: summed
    over each KV head's G query heads."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [B, Hq, N, D] and k [B, Hkv, N, D] with Hq a multiple of Hkv; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    if precision is None:
        knob = os.environ.get("TRITON_F32_DEFAULT")
        precision = knob if knob in ("tf32x3", "ieee") else "tf32x3" if q.is_cuda else "ieee"
    if precision not in ("tf32x3", "ieee"):
        raise ValueError(f"precision={precision!r}: use 'tf32x3' or 'ieee'")
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    qp, kp = pool_blocks(q, block), pool_blocks(k, block)  # [B, H, M, D]
    M = qp.shape[2]
    if q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        score = torch.empty(B, Hq, M, M, dtype=torch.float32, device=q.device)
        bt = 64  # 64 x 64 tiles over 128-wide chunks of head_dim (head_dim 256 as 32 x 32 tiles over all 256 took
        # 5.4 ms at 128K on the H200 (Gemma-3 shape, 4 heads) against 0.93 ms for the Llama shape's 32: no wgmma)
        grid = (B * Hq, triton.cdiv(M, bt), triton.cdiv(M, bt))
        _block_scores_kernel[grid](qp, kp, score, M, Hq, Hq // Hkv, D=D, DK=min(D, 128),
                                   BT=bt, PRECISION=precision, num_warps=4)
    else:
        score = (qp.view(B, Hkv, (Hq // Hkv) * M, D) @ kp.transpose(-1, -2)).view(B, Hq, M, M)
    return score.unflatten(1, (Hkv, -1)).sum(2) if group_shared else score


@torch.no_grad()
def select_blocks(score: torch.Tensor, topk: int | torch.Tensor = 100) -> torch.Tensor:
    """Per query block its diagonal plus the best causal key blocks of `pooled_scores` `[B, H, M, M]`,
    `topk` in all (an int, or Long per query head: tables per KV head take their group's largest)
    -> Int32 `[B, H, M, max topk]`, ascending, -1 padded. Each Triton program selects one query block
    (exact k-th value by bisection, no sort, no host sync) over the power-of-two width above m, so a row
    scans at most twice its candidates, with ~32 scores per thread (fewer registers, more programs per SM:
    2.7-2.9x faster than 4-8 rows per program on the H200, kernels/NOTES.md); one launch for the rows up to
    1024 blocks, one per wider power of two (`_launch_bands`); on the CPU without the Triton interpreter
    `topk.top_blocks` (the same blocks)."""
    n_budgets = torch.as_tensor(topk).numel()
    H = score.shape[1]
    if n_budgets > 1 and n_budgets % H:
        raise ValueError(f"topk has {n_budgets} budgets: give one, or one per query head (a multiple of {H})")
    k_max, per_head = budget(topk, max(n_budgets, H) if n_budgets > 1 else H, "topk")
    if per_head is not None:
        per_head = per_head.view(H, -1).amax(1)  # tables per KV head: the group's largest
    return _select(score, k_max, per_head, tiles=False)


def _select(score: torch.Tensor, k_max: int, per_head: torch.Tensor | None, tiles: bool) -> torch.Tensor | VSTiles:
    """`select_blocks` (tiles False) / `block_tiles`' selection (tiles True: `VSTiles` written by the kernel) with
    the largest budget `k_max` and integer `[H]` budgets `per_head` (None: every head takes k_max)."""
    B, H, M, _ = score.shape
    kernel = score.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not kernel or k_max == 0 or M > MAX_TOPK_BLOCKS:
        table = top_blocks(score, k_max, per_head)
        return selected_block_tiles(table) if tiles else table
    dev = score.device
    budgets = ints_on(per_head, dev) if per_head is not None else None
    out = torch.empty(B, H, M, k_max, dtype=torch.int32, device=dev)
    count, col_count, col_index = ([torch.empty(B, H, M, *s, dtype=torch.int32, device=dev) for s in ((), (), (1,))]
                                   if tiles else (out, out, out))  # (unused without tiles)
    score = score.contiguous()
    for log_lo, log_hi in _launch_bands(M):  # rows m in [2^(p-1), 2^p) hold < 2^p candidates: no row scans past
        lo, hi = (0 if log_lo == _LOG_MIN else 1 << (log_lo - 1)), min(M, 1 << log_hi)  # twice its own width
        _block_topk_kernel[(B * H * (hi - lo),)](score, out if budgets is None else budgets, out, count, col_count,
                                                 col_index, M, H, k_max, lo, hi, LOG_LO=log_lo, LOG_HI=log_hi,
                                                 KPAD=triton.next_power_of_2(k_max), PER_HEAD=budgets is not None,
                                                 TILES=tiles, UNIT=ROWS if tiles else 1,
                                                 num_warps=max(1, (1 << log_hi) // 1024))
    return VSTiles(count, out, col_count, col_index, ROWS, 0, True, False) if tiles else out


def _launch_bands(m: int) -> list[tuple[int, int]]:
    """(LOG_LO, LOG_HI) of each `_block_topk_kernel` launch for m query blocks: rows up to 1024 candidates wide share
    one launch (one warp a row), each wider power of two its own (width / 1024 warps; fewer launches: the index of a
    layer with few heads is launch-bound)."""
    top = max(_LOG_MIN, (m - 1).bit_length())
    return [(_LOG_MIN, min(top, 10))] + [(p, p) for p in range(11, top + 1)]


@torch.no_grad()
def block_index(q: torch.Tensor, k: torch.Tensor, topk: int | torch.Tensor = 100, block: int = 64,
                group_shared: bool = False) -> torch.Tensor:
    """Block-sparse index of every head of a layer: the selection of `workbench.patterns.block_proxy`
    (64-token mean-pooled q.k, block-causal, diagonal forced, top-k; `topk` an int or Long `[Hq]`)
    -> Int32 `[B, Hq, M, max topk]`, ascending, -1 padded: `select_blocks(pooled_scores(...))`.
    `group_shared`: one table per KV head (`[B, Hkv, M, K]`, InfLLM-V2 style) from the pooled scores
    added over its G query heads (budget: the group's largest), for the GQA-packed kernel."""
    budget(topk, q.shape[1], "topk")  # a per-head budget must match the query heads
    return select_blocks(pooled_scores(q, k, block, group_shared), topk)


@torch.no_grad()
def block_tiles(q: torch.Tensor, k: torch.Tensor, topk: int | torch.Tensor = 100,
                per_head: torch.Tensor | None = None) -> VSTiles:
    """`block_index`'s selection as 64-row tiles (`selected_block_tiles(block_index(q, k, topk))`): one pooling
    reduction per q and k, one score launch, one selection launch per power-of-two band of row blocks, no torch
    op between them (the index of a layer with few heads is launch-bound: kernels/NOTES.md). `per_head`: Long
    `[Hq]` budgets on q's device with `topk` their largest (no host copy or sync: capturable in a CUDA graph)."""
    if per_head is None:  # one budget, or one per query head (checked once, before the scores)
        topk, per_head = budget(topk, q.shape[1], "topk")
        per_head = None if per_head is None else ints_on(per_head, q.device)
    elif per_head.shape != (q.shape[1],) or per_head.device != q.device:
        raise ValueError(f"per_head must be [Hq] = [{q.shape[1]}] budgets on {q.device}; got "
                         f"{tuple(per_head.shape)} on {per_head.device}")
    return _select(pooled_scores(q, k, ROWS), int(topk), per_head, True)


@torch.no_grad()
def vs_slash_tiles(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int = 64,
                   width: int = 0) -> tuple[VSTiles, torch.Tensor, torch.Tensor]:
    """`vs_tiles`' pieces without its per-row-block column lists, for a kernel that walks each head's columns
    packed once (`prefill_ws.ws_vertical_slash`); no host sync. Returns (tiles: the pieces of `vs_tiles`,
    column_count 0, column_index `[B, H, M, 1]` = -1; covered Int8 `[B, H, n + block - 1]`: index d + block - 1
    is 1 iff d lies under a piece (d = m*block - key, the same for every row block m); cols Int32 `[B, H, KV]`:
    the head's unique valid columns ascending, then n for the -1, out-of-range and repeated ones). Row block m
    keeps column c iff c < m*block and covered[m*block - c + block - 1] == 0 (what `vs_to_tiles` keeps).
    `width`: piece width (0 = block; 128 with block 64: 128-key pieces, `vs_to_tiles(..., width=128)`'s)."""
    return _expand_tiles(columns, offsets, n, block, width, with_columns=False, sort=True)
