"""Vertical-Slash index building on the GPU for all heads of a layer, with no host synchronisation.

The fast path of `workbench.patterns.vs_proxy` at its defaults (probability-sum aggregation, plain
diagonal sums, first 30 columns and 100 smallest offsets forced): the last r = 64 query rows score all
keys; column sums and diagonal sums of the softmax probabilities pick the columns and slash offsets.

Two Triton passes over 64-key blocks counted from the end of the sequence (block u = keys
[n - 64(u+1), n - 64u)): pass 1 writes each block's row max and row sum of exp (combined into the
rows' log-sum-exp in torch); pass 2 recomputes the scores of blocks u+1 and u side by side as a
64 x 128 tile X, sums the probabilities of block u over rows (column sums) and reads X along its
diagonals with one `tl.gather` (row r, offset 64u + t sits at column 64 + r - t), so each program
owns the diagonal sums of offsets [64u, 64u + 64) without atomics. Top-k selection is the shared
`topk.top_positions` (the one `workbench.patterns.vs_proxy` uses); the tile conversion is `vs_pieces`
(torch) plus one Triton pass that expands pieces and packs surviving columns per row block.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .index_ref import VSTiles, max_pieces_total, piece_ranges, unique_columns, vs_pieces
from .topk import budget, top_blocks, top_positions

LOG2E = 1.4426950408889634
ROWS = 64
MAX_TOPK_BLOCKS = 16384  # longest score row the block top-k kernel holds in registers (1M tokens)


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
    m = mpart.amax(1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    lse = (m[:, 0] + torch.log2((lpart * torch.exp2(mpart - m)).sum(1))).contiguous()  # [B*Hq, R], log2 units
    col = torch.zeros(B, Hq, N, dtype=torch.float32, device=q.device)
    diag = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    _col_diag_kernel[(B * Hq, U)](q, k, lse, col, diag, *args, *strides, D=D, R=ROWS, num_warps=4)
    return col, diag


@torch.no_grad()
def vs_index(q: torch.Tensor, k: torch.Tensor, scale: float, vertical: int = 1000, slash: int = 6096,
             sink: int = 30, local: int = 100, group_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical-Slash index of every head of a layer -> (columns Long `[B, Hq, vertical]`, offsets Long
    `[B, Hq, slash]`), ascending, -1 padded; same selection as `vs_proxy` at its defaults.
    `group_shared`: one index per KV head (`[B, Hkv, ...]`) from the column and diagonal sums added
    over its G query heads, for the GQA-packed kernel."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [B, Hq, N, D] and k [B, Hkv, N, D] with Hq a multiple of Hkv; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    col, diag = vs_scores(q, k, scale)
    if group_shared:
        col, diag = (x.unflatten(1, (k.shape[1], -1)).sum(2) for x in (col, diag))
    return top_positions(col, sink, vertical, None), top_positions(diag, max(local, 1), slash, None)


@triton.jit
def _expand_tiles_kernel(Ends, Hi, Covered, Cols, BlockCount, BlockOffset, ColumnCount, ColumnIndex,
                         P, L, KV, NS, NC, M, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    bh = tl.program_id(0)
    m = tl.program_id(1)
    row0 = m * BLOCK
    lanes = tl.arange(0, CHUNK)
    tile = bh * M + m
    # pieces: ends[hi - count : hi], written in ascending key order (start = row0 - end)
    count = tl.load(BlockCount + tile)
    hi = tl.load(Hi + tile)
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
def vs_tiles(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int = 64, width: int = 0) -> VSTiles:
    """Same tiles as `index_ref.vs_to_tiles` (static widths), without the `[B, H, M, width]` torch
    intermediates and without host sync. Entries past the counts are left unwritten."""
    B, H, KV = columns.shape
    M = -(-n // block)
    w = width or block
    ends, covered = vs_pieces(offsets, n, block, static=True, width=w)
    cols = unique_columns(columns, n).to(torch.int32).contiguous()
    P = ends.shape[-1]
    NS = min(2 * (-(-n // w)) + 4, max_pieces_total(n, offsets.shape[-1], block, w))
    NC = max(KV, 1)
    dev = columns.device
    hi, count = piece_ranges(ends, n, block, w)
    tiles = VSTiles(count.clamp(max=NS).contiguous(),
                    torch.empty(B, H, M, NS, dtype=torch.int32, device=dev),
                    torch.empty(B, H, M, dtype=torch.int32, device=dev),
                    torch.empty(B, H, M, NC, dtype=torch.int32, device=dev), block, width)
    cov = covered.to(torch.int8).contiguous()
    _expand_tiles_kernel[(B * H, M)](ends, hi.contiguous(), cov, cols, tiles.block_count, tiles.block_offset,
                                     tiles.column_count,
                                     tiles.column_index, P, cov.shape[-1], KV, NS, NC, M, BLOCK=block,
                                     CHUNK=256, num_warps=4)
    return tiles


@triton.jit
def _block_topk_kernel(Score, Budget, Out, M, H, K, NPAD: tl.constexpr, KPAD: tl.constexpr):
    """One query block (row of Score): its diagonal plus the best causal key blocks, k = min(budget,
    m + 1) of them, written ascending. The k-th largest score is found exactly by bisection on the
    order-preserving int32 image of the fp32 scores (32 counting passes over the row in registers);
    ties at the threshold go to the lowest block ids."""
    row = tl.program_id(0)
    m = row % M
    h = (row // M) % H
    j = tl.arange(0, NPAD)
    valid = j <= m
    x = tl.load(Score + row.to(tl.int64) * M + j, mask=valid, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order == float order
    key = tl.where(j == m, 2147483647, tl.where(valid, key, -2147483647 - 1))
    k = tl.minimum(tl.maximum(tl.load(Budget + h), 1), m + 1)
    lo = tl.full([], -2147483648, tl.int64)
    hi = tl.full([], 2147483647, tl.int64)
    key64 = key.to(tl.int64)
    for _ in range(32):  # largest T with #(key >= T) >= k
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((key64 >= mid).to(tl.int32), 0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key64 > lo
    tie = (key64 == lo) & valid
    keep = valid & (above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= k - tl.sum(above.to(tl.int32), 0))))
    pos = tl.cumsum(keep.to(tl.int32), 0) - 1
    out = Out + row.to(tl.int64) * K
    tl.store(out + pos, j, mask=keep)
    slot = tl.arange(0, KPAD)
    tl.store(out + slot, -1, mask=(slot >= k) & (slot < K))


@torch.no_grad()
def block_index(q: torch.Tensor, k: torch.Tensor, topk: int | torch.Tensor = 100, block: int = 64,
                group_shared: bool = False) -> torch.Tensor:
    """Block-sparse index of every head of a layer: the selection of `workbench.patterns.block_proxy`
    (64-token mean-pooled q.k, block-causal, diagonal forced, top-k; `topk` an int or Long `[Hq]`)
    -> Int32 `[B, Hq, M, max topk]`, ascending, -1 padded.

    Pools bf16/fp16 inputs with fp32 accumulation (no fp32 copy of q and k), scores all heads with one
    grouped fp32 matmul, then one Triton program per query block selects its blocks from the score row
    (exact k-th value by bisection, no sort, no host sync). On the CPU without the Triton interpreter
    the selection is `topk.top_blocks` (the same blocks). `group_shared`: one table per KV head
    (`[B, Hkv, M, K]`, InfLLM-V2 style) from the pooled scores added over its G query heads (budget:
    the group's largest), for the GQA-packed kernel."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [B, Hq, N, D] and k [B, Hkv, N, D] with Hq a multiple of Hkv; "
                         f"got {tuple(q.shape)} and {tuple(k.shape)}")
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    full = n // block

    def pool(x: torch.Tensor) -> torch.Tensor:
        parts = [x[:, :, : full * block].unflatten(2, (full, block)).sum(3, dtype=torch.float32) / block]
        if n % block:
            parts.append(x[:, :, full * block:].sum(2, keepdim=True, dtype=torch.float32) / (n % block))
        return torch.cat(parts, 2)

    qp, kp = pool(q), pool(k)  # [B, H, M, D]
    M = qp.shape[2]
    score = (qp.view(B, Hkv, (Hq // Hkv) * M, D) @ kp.transpose(-1, -2)).view(B, Hq, M, M)
    k_max, per_head = budget(topk, Hq, "topk")
    if group_shared:
        score = score.unflatten(1, (Hkv, -1)).sum(2)
        per_head = per_head.view(Hkv, -1).amax(1) if per_head is not None else None
    H = score.shape[1]
    kernel = q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not kernel or k_max == 0 or M > MAX_TOPK_BLOCKS:
        return top_blocks(score, k_max, per_head)
    budgets = (per_head if per_head is not None else torch.full((H,), k_max)).to(q.device, torch.int32)
    out = torch.empty(B, H, M, k_max, dtype=torch.int32, device=q.device)
    npad = triton.next_power_of_2(M)
    _block_topk_kernel[(B * H * M,)](score.contiguous(), budgets, out, M, H, k_max, NPAD=npad,
                                      KPAD=triton.next_power_of_2(k_max), num_warps=4 if npad <= 4096 else 8)
    return out
