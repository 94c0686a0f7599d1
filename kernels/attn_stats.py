"""Exact attention statistics in Triton: two flash-like passes over q.k, no probability buffer.

All query heads of a layer go in one launch; query head h reads KV head h // (Hq // Hkv) straight
from k (no repeat). Scores accumulate in fp32 (`tl.dot`; IEEE fp32 for fp32 inputs, not TF32), and
every sum is fp32. Extra memory is the outputs: O(n) per head, plus the pooled maps asked for.

- Pass 1 (`row_lse`): per 128-row block an online softmax over the causal keys gives each row's
  log-sum-exp and, on request, its entropy (carried online as H = log l - E[s - m] in the running
  frame, so no cancellation against the row maximum).
- Pass 2 (`attention_sums`): p = exp(s - lse) recomputed on every causal 64 x 64 tile. A program
  walks one tile diagonal (row block - key block = t constant) in chunks of `chunk` tiles, so the
  mass by offset i - j needs one skew per program, not per tile: the tiles of a diagonal add up in a
  64 x 64 accumulator whose entry (r, c) is offset 64 t + r - c, read along its diagonals once with
  `tl.gather` at the end. Column sums of each tile go out by atomic adds (64 per tile), on request the
  rows' sums of p log p too (the entropy: pass 2 alone serves a caller that already holds the lse, as
  the forward's own attention gives it, `workbench.core.stream`), tile masses
  and pooled maps by plain stores where a tile owns its cells (cell divides 64) or atomic add / max
  where a cell spans tiles (cell > 64). Programs of neighbouring diagonals run side by side and read
  the same key block at the same step (L2 reuse), but each step loads its q tile too. The other walk
  (`walk="rows"`: a program per row block, q loaded once, one skew and 128 atomic adds per tile) is
  kept to be timed against it (`workbench bench analysis --sweep`).
- `column_offset_mass`: a query-block x gathered-column-block product, p from lse, scattered by
  offset i - j (atomic adds) into one row per prefix level; the nested budgets are a cumulative sum.
  Each head's columns go in ascending key order (with their levels), so a block of 64 columns starts
  at the row of its first column and skips the rows above it.
- `captured_mass`: one program per (head, row block) walks a `TokenRule`'s tiles (pieces and column
  strips, as the prefill kernel does) and sums p over the kept tokens; it also counts them, so a caller
  can check that the rule is the index's exact logical set. Dense rows (`VSTiles.dense_from`) keep all their
  mass and every causal key.

The references are in `attn_stats_ref` (same arguments, same results up to fp32 summation order).
"""
from __future__ import annotations

import math
from collections.abc import Collection

import torch
import triton
import triton.language as tl

from .attn_stats_ref import (
    MAPS,
    LayerStats,
    LayerSums,
    TokenRule,
    cell_sizes,
    check_qk,
    check_rows,
    offset_rows,
    prefix_levels,
    stats_layout,
)
from .index_ref import expand_groups
from .tiling import BLOCK, LN2, LOG2E

MASKED = tl.constexpr(-1e30)  # finite "minus infinity" of a score (log2 units): 2^(MASKED - m) = 0, 0 * MASKED = 0
CHUNK = 32  # tiles per pass-2 program along its diagonal


def pooling_supported(cell: int) -> bool:
    """Whether the kernels pool at `cell` positions: a divisor of 64 (1, 2, ..., 64), or any cell > 64."""
    return cell > BLOCK or BLOCK % cell == 0


@triton.jit
def _online(s, m_i, l_i, t_i, ENTROPY: tl.constexpr):
    """One online-softmax step on scores `s` in log2 units (MASKED where masked): running max m_i,
    l_i = sum 2^(s - m_i), t_i = sum 2^(s - m_i) (s - m_i) (the entropy's numerator, same frame)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    x = s - m_new[:, None]
    p = tl.math.exp2(x)
    if ENTROPY:  # masked entries add 0 * (-1e30) = 0
        t_i = alpha * (t_i + l_i * (m_i - m_new)) + tl.sum(p * x, 1)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, t_i


@triton.jit
def _row_lse_kernel(Q, K, LSE, ENT, qk_scale, N, G, ROW0, ROW1, sqh, sqn, skh, skn,
                    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    ENTROPY: tl.constexpr, PREC: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)  # head offsets pass 2^31 elements at 1M tokens
    start = ROW0 // BLOCK_M * BLOCK_M + (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # late rows first
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = (rows >= ROW0) & (rows < ROW1)
    dims = tl.arange(0, DP)
    q = tl.load(Q + h * sqh + rows[:, None] * sqn + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < D),
                other=0.0)
    kbase = K + (h // G) * skh
    lanes = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, start, BLOCK_N):  # keys below the block: causal for all its rows, no mask
        k = tl.load(kbase + (j0 + lanes)[:, None] * skn + dims[None, :], mask=dims[None, :] < D, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        m_i, l_i, t_i = _online(s, m_i, l_i, t_i, ENTROPY)
    for j0 in range(start, tl.minimum(start + BLOCK_M, ROW1), BLOCK_N):  # the diagonal: causal mask
        keys = j0 + lanes
        k = tl.load(kbase + keys[:, None] * skn + dims[None, :], mask=(keys[:, None] < N) & (dims[None, :] < D),
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        s = tl.where(keys[None, :] <= rows[:, None], s, MASKED)
        m_i, l_i, t_i = _online(s, m_i, l_i, t_i, ENTROPY)
    log_l = tl.math.log2(l_i)
    tl.store(LSE + h * N + rows, (m_i + log_l) * LN2, mask=row_ok)
    if ENTROPY:
        tl.store(ENT + h * N + rows, (log_l - t_i / l_i) * LN2, mask=row_ok)


@triton.jit
def _combine(OUT, v, a, b, R, A0, RA, ok, MAX: tl.constexpr):
    """Atomically add (or max) the scalar v into cell (a, b) of OUT, which holds rows A0 .. A0 + RA - 1
    of R columns, when ok and the cell is there."""
    mask = ok & (a >= A0) & (a - A0 < RA) & (b < R)
    if MAX:
        tl.atomic_max(OUT + (a - A0) * R + b, v, mask=mask, sem="relaxed")
    else:
        tl.atomic_add(OUT + (a - A0) * R + b, v, mask=mask, sem="relaxed")


@triton.jit
def _reduce(x, MAX: tl.constexpr):
    if MAX:
        return tl.max(tl.max(x, 1), 0)
    return tl.sum(tl.sum(x, 1), 0)


@triton.jit
def _pool_tile(p, whole, OUT, m, kb, R, A0, RA, BLOCK: tl.constexpr, CELL: tl.constexpr, MAX: tl.constexpr):
    """Pool tile p (rows m*BLOCK.., keys kb*BLOCK..) into the cells of OUT (CELL x CELL squares; OUT holds
    cell rows A0 .. A0 + RA - 1 of R columns): sum, or max with MAX (`whole`: the tile's sum or max,
    computed once by the caller). A cell that divides BLOCK belongs to one tile (stores); a larger one
    adds up over the tiles it covers (atomics; a tile lies in one cell when BLOCK divides CELL, else it
    may straddle 2 x 2)."""
    if CELL == BLOCK:
        tl.store(OUT + (m - A0) * R + kb, whole, mask=(m >= A0) & (m - A0 < RA) & (kb < R))
    elif CELL < BLOCK:
        A: tl.constexpr = BLOCK // CELL
        x = tl.reshape(p, (A, CELL, A, CELL))
        if MAX:
            y = tl.max(tl.max(x, 3), 1)
        else:
            y = tl.sum(tl.sum(x, 3), 1)
        a = tl.arange(0, A)
        ra = m * A + a
        cb = kb * A + a
        there = (ra[:, None] >= A0) & (ra[:, None] - A0 < RA) & (cb[None, :] < R)
        tl.store(OUT + (ra[:, None] - A0).to(tl.int64) * R + cb[None, :], y, mask=there)
    elif CELL % BLOCK == 0:  # the tile lies in one cell
        _combine(OUT, whole, m * BLOCK // CELL, kb * BLOCK // CELL, R, A0, RA, True, MAX)
    else:
        i0 = m * BLOCK
        j0 = kb * BLOCK
        a0 = i0 // CELL
        b0 = j0 // CELL
        a1 = (i0 + BLOCK - 1) // CELL
        b1 = (j0 + BLOCK - 1) // CELL
        if (a0 == a1) & (b0 == b1):
            _combine(OUT, whole, a0, b0, R, A0, RA, True, MAX)
        else:
            r = tl.arange(0, BLOCK)
            top = (r < (a0 + 1) * CELL - i0)[:, None]
            left = (r < (b0 + 1) * CELL - j0)[None, :]
            _combine(OUT, _reduce(tl.where(top & left, p, 0.0), MAX), a0, b0, R, A0, RA, True, MAX)
            _combine(OUT, _reduce(tl.where(top & ~left, p, 0.0), MAX), a0, b1, R, A0, RA, b1 > b0, MAX)
            _combine(OUT, _reduce(tl.where(~top & left, p, 0.0), MAX), a1, b0, R, A0, RA, a1 > a0, MAX)
            _combine(OUT, _reduce(tl.where(~top & ~left, p, 0.0), MAX), a1, b1, R, A0, RA, (a1 > a0) & (b1 > b0),
                     MAX)


@triton.jit
def _tile_probs(q, kbase, LSE2, hN, m, kb, ROW0, ROW1, N, qk_scale, skn, dims, r,
                D: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
    """(p, log2 p) `[BLOCK, BLOCK]` of rows m*BLOCK.. and keys kb*BLOCK.. (p is 0 outside causal rows
    [ROW0, ROW1); log2 p is finite everywhere, so p * log2 p is 0 there). Always masked: a branch on the
    tile's position around the dot breaks Triton 3.6's software pipeliner."""
    rows = m * BLOCK + r
    keys = kb * BLOCK + r
    k = tl.load(kbase + keys[:, None] * skn + dims[None, :], mask=(keys[:, None] < N) & (dims[None, :] < D), other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    row_ok = (rows >= ROW0) & (rows < ROW1)
    lse = tl.load(LSE2 + hN + rows, mask=row_ok, other=0.0)
    keep = row_ok[:, None] & (keys[None, :] <= rows[:, None])
    logp = s * qk_scale - lse[:, None]
    p = tl.where(keep, tl.math.exp2(logp), 0.0)
    return p, logp


@triton.jit
def _entropy_out(p, logp, ENT, hN, m, N, r, BLOCK: tl.constexpr):
    """Add this tile's sum of p log2 p per row to ENT (the rows' entropy in bits, negated)."""
    rows = m * BLOCK + r
    tl.atomic_add(ENT + hN + rows, tl.sum(p * logp, 1), mask=rows < N, sem="relaxed")


@triton.jit
def _tile_out(p, m, kb, h, hN, COL, TILE, MAXM, SUMM, N, TR, TA0, TRA, MR, r, BLOCK: tl.constexpr,
              COLS: tl.constexpr, TILE_CELL: tl.constexpr, MAP_CELL: tl.constexpr, MAX_MAP: tl.constexpr,
              MEAN_MAP: tl.constexpr):
    """Everything of one tile but its offsets: column sums, tile masses (TILE holds cell rows TA0 ..
    TA0 + TRA - 1 of TR columns per head), pooled maps (the tile's sum is the sum of its column sums;
    what a setting does not read, the compiler drops)."""
    col = tl.sum(p, 0)
    whole = tl.sum(col, 0)
    if COLS:
        keys = kb * BLOCK + r
        tl.atomic_add(COL + hN + keys, col, mask=keys < N, sem="relaxed")
    if TILE_CELL > 0:
        _pool_tile(p, whole, TILE + h * TRA * TR, m, kb, TR, TA0, TRA, BLOCK, TILE_CELL, False)
    if MAX_MAP:
        _pool_tile(p, _reduce(p, True), MAXM + h * MR * MR, m, kb, MR, 0, MR, BLOCK, MAP_CELL, True)
    if MEAN_MAP:
        _pool_tile(p, whole, SUMM + h * MR * MR, m, kb, MR, 0, MR, BLOCK, MAP_CELL, False)


@triton.jit
def _offsets_out(acc, t, DIAG, hN, N, r, BLOCK: tl.constexpr):
    """Add tile(s) `acc` of tile diagonal t (entry (r, c) at offset BLOCK t + r - c) to the offset sums."""
    skew = tl.gather(acc, ((r[:, None] - r[None, :]) & (BLOCK - 1)).to(tl.int32), 1)  # [r, x] = acc[r, r - x mod B]
    below = r[:, None] >= r[None, :]
    near = tl.sum(tl.where(below, skew, 0.0), 0)  # offset BLOCK t + x
    far = tl.sum(tl.where(below, 0.0, skew), 0)  # offset BLOCK t + x - BLOCK
    off = t * BLOCK + r
    tl.atomic_add(DIAG + hN + off, near, mask=off < N, sem="relaxed")
    tl.atomic_add(DIAG + hN + off - BLOCK, far, mask=(r > 0) & (off >= BLOCK) & (off - BLOCK < N), sem="relaxed")


@triton.jit
def _diagonal_walk_kernel(Q, K, LSE2, COL, DIAG, TILE, MAXM, SUMM, ENT, qk_scale, N, G, ROW0, ROW1, CHUNK_T, TR, TA0,
                          TRA, MR, sqh, sqn, skh, skn,
                          D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr,
                          DIAGS: tl.constexpr, TILE_CELL: tl.constexpr, MAP_CELL: tl.constexpr,
                          MAX_MAP: tl.constexpr, MEAN_MAP: tl.constexpr, ENTROPY: tl.constexpr, PREC: tl.constexpr):
    # One program: CHUNK_T tiles of tile diagonal t (row block m reads key block m - t); their sum is
    # skewed once at the end.
    t = tl.program_id(0)
    h = tl.program_id(2).to(tl.int64)  # head offsets pass 2^31 elements at 1M tokens
    m_hi = (ROW1 - 1) // BLOCK
    first = tl.maximum(ROW0 // BLOCK, t) + tl.program_id(1) * CHUNK_T
    last = tl.minimum(first + CHUNK_T, m_hi + 1)
    r = tl.arange(0, BLOCK)
    dims = tl.arange(0, DP)
    kbase = K + (h // G) * skh
    hN = h * N
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for m in range(first, last):
        rows = m * BLOCK + r
        q = tl.load(Q + h * sqh + rows[:, None] * sqn + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D),
                    other=0.0)
        p, logp = _tile_probs(q, kbase, LSE2, hN, m, m - t, ROW0, ROW1, N, qk_scale, skn, dims, r, D, BLOCK, PREC)
        if DIAGS:
            acc += p
        if ENTROPY:
            _entropy_out(p, logp, ENT, hN, m, N, r, BLOCK)
        _tile_out(p, m, m - t, h, hN, COL, TILE, MAXM, SUMM, N, TR, TA0, TRA, MR, r, BLOCK, COLS, TILE_CELL, MAP_CELL,
                  MAX_MAP, MEAN_MAP)
    if DIAGS:
        if last > first:
            _offsets_out(acc, t, DIAG, hN, N, r, BLOCK)


@triton.jit
def _row_walk_kernel(Q, K, LSE2, COL, DIAG, TILE, MAXM, SUMM, ENT, qk_scale, N, G, ROW0, ROW1, TR, TA0, TRA, MR,
                     sqh, sqn, skh, skn,
                     D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr,
                     DIAGS: tl.constexpr, TILE_CELL: tl.constexpr, MAP_CELL: tl.constexpr,
                     MAX_MAP: tl.constexpr, MEAN_MAP: tl.constexpr, ENTROPY: tl.constexpr, PREC: tl.constexpr):
    # One program: row block m (late ones first) against key blocks 0..m, q loaded once; every tile
    # is skewed on its own.
    m = ROW0 // BLOCK + tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # head offsets pass 2^31 elements at 1M tokens
    r = tl.arange(0, BLOCK)
    dims = tl.arange(0, DP)
    rows = m * BLOCK + r
    q = tl.load(Q + h * sqh + rows[:, None] * sqn + dims[None, :], mask=(rows[:, None] < N) & (dims[None, :] < D),
                other=0.0)
    kbase = K + (h // G) * skh
    hN = h * N
    for kb in range(0, m + 1):
        p, logp = _tile_probs(q, kbase, LSE2, hN, m, kb, ROW0, ROW1, N, qk_scale, skn, dims, r, D, BLOCK, PREC)
        if ENTROPY:
            _entropy_out(p, logp, ENT, hN, m, N, r, BLOCK)
        _tile_out(p, m, kb, h, hN, COL, TILE, MAXM, SUMM, N, TR, TA0, TRA, MR, r, BLOCK, COLS, TILE_CELL, MAP_CELL,
                  MAX_MAP, MEAN_MAP)
        if DIAGS:
            _offsets_out(p, m - kb, DIAG, hN, N, r, BLOCK)


@triton.jit
def _column_offset_kernel(Q, K, LSE2, COLS, LEVEL, OUT, qk_scale, N, G, V, L, ROW0, ROW1, RCHUNK,
                          sqh, sqn, skh, skn, sch,
                          D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                          PREC: tl.constexpr):
    h = tl.program_id(2).to(tl.int64)  # head offsets pass 2^31 elements at 1M tokens
    ci = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col = tl.load(COLS + h * sch + ci, mask=ci < V, other=-1)
    lvl = tl.load(LEVEL + h * sch + ci, mask=ci < V, other=0)
    valid = col >= 0
    dims = tl.arange(0, DP)
    k = tl.load(K + (h // G) * skh + col[:, None] * skn + dims[None, :], mask=valid[:, None] & (dims[None, :] < D),
                other=0.0)
    jmin = tl.min(tl.where(valid, col, N), 0)
    start = ROW0 // BLOCK_M * BLOCK_M + tl.program_id(1) * RCHUNK
    lo = tl.maximum(start, jmin // BLOCK_M * BLOCK_M)  # rows above every column read nothing
    hi = tl.minimum(start + RCHUNK, ROW1)
    r = tl.arange(0, BLOCK_M)
    hN = h * N
    out = OUT + h * L * N  # + level * N + offset: 32-bit offsets into this head's [L, N] sums
    slot = lvl[None, :] * N - col[None, :]
    for r0 in range(lo, hi, BLOCK_M):
        rows = r0 + r
        row_ok = (rows >= ROW0) & (rows < ROW1)
        q = tl.load(Q + h * sqh + rows[:, None] * sqn + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < D),
                    other=0.0)
        lse = tl.load(LSE2 + hN + rows, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        d = rows[:, None] - col[None, :]
        keep = row_ok[:, None] & valid[None, :] & (d >= 0)
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        tl.atomic_add(out + (slot + rows[:, None]), p, mask=keep, sem="relaxed")


@triton.jit
def _kept_sum(q, kbase, keys, ok, rows, row_ok, lse, KEYS, OFFS, qk_scale, skn, dims, mass, count,
              D: tl.constexpr, SETS: tl.constexpr, PREC: tl.constexpr):
    """Add the probabilities (and the count) of the kept tokens among `keys` to each row's mass."""
    k = tl.load(kbase + keys[:, None] * skn + dims[None, :], mask=ok[:, None] & (dims[None, :] < D), other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    keep = ok[None, :] & row_ok[:, None] & (keys[None, :] <= rows[:, None])
    if SETS:
        d = rows[:, None] - keys[None, :]
        kept = tl.load(KEYS + keys, mask=ok, other=0)[None, :] != 0
        kept = kept | (tl.load(OFFS + d, mask=keep, other=0) != 0)
        keep = keep & kept
    p = tl.where(keep, tl.math.exp2(s * qk_scale - lse[:, None]), 0.0)
    return mass + tl.sum(p, 1), count + tl.sum(keep.to(tl.int32), 1)


@triton.jit
def _captured_kernel(Q, K, LSE2, MASS, COUNT, BlockCount, BlockOffset, ColumnCount, ColumnIndex, KEYS, OFFS,
                     qk_scale, N, G, M, NS, NC, sqh, sqn, skh, skn,
                     D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                     SETS: tl.constexpr, PREC: tl.constexpr):
    m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # head offsets pass 2^31 elements at 1M tokens
    rows = m * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < N
    dims = tl.arange(0, DP)
    lanes = tl.arange(0, BLOCK_N)
    hN = h * N
    q = tl.load(Q + h * sqh + rows[:, None] * sqn + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < D),
                other=0.0)
    lse = tl.load(LSE2 + hN + rows, mask=row_ok, other=0.0)
    kbase = K + (h // G) * skh
    mass = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.int32)
    tile = h * M + m
    n_col = tl.load(ColumnCount + tile)
    for c0 in range(0, n_col, BLOCK_N):  # column strips
        ok = c0 + lanes < n_col
        keys = tl.load(ColumnIndex + tile * NC + c0 + lanes, mask=ok, other=0)
        mass, count = _kept_sum(q, kbase, keys, ok, rows, row_ok, lse, KEYS + hN, OFFS + hN, qk_scale, skn,
                                dims, mass, count, D, SETS, PREC)
    n_blk = tl.load(BlockCount + tile)
    base = BlockOffset + tile * NS
    for t in range(0, n_blk):  # piece t covers [p_t, min(p_t + BLOCK_N, p_t+1))
        p0 = tl.load(base + t)
        nxt = tl.load(base + t + 1, mask=t + 1 < n_blk, other=1 << 30)
        keys = p0 + lanes
        ok = (keys >= 0) & (keys < N) & (keys < nxt)
        mass, count = _kept_sum(q, kbase, keys, ok, rows, row_ok, lse, KEYS + hN, OFFS + hN, qk_scale, skn,
                                dims, mass, count, D, SETS, PREC)
    tl.store(MASS + hN + rows, mass, mask=row_ok)
    tl.store(COUNT + hN + rows, count, mask=row_ok)


def _geometry(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int, str]:
    """(Hq, N, D, padded D, group size, dot precision) of a checked layer; fp32 dots in IEEE fp32."""
    Hq, n, d = q.shape
    return Hq, n, d, max(16, triton.next_power_of_2(d)), Hq // k.shape[0], "ieee" if q.dtype == torch.float32 else "tf32"


def _rows_contiguous(q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """q and k in one dtype (fp32 when they differ), head_dim with stride 1 (any strides for heads, tokens)."""
    if q.dtype != k.dtype:
        q, k = q.float(), k.float()
    return [x if x.stride(-1) == 1 else x.contiguous() for x in (q, k)]


@torch.no_grad()
def row_lse(q: torch.Tensor, k: torch.Tensor, scale: float, rows: tuple[int, int] | None = None,
            entropy: bool = False, block_m: int | None = None, num_warps: int | None = None,
            num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pass 1: (lse `[Hq, N]` natural log, entropy `[Hq, N]` in nats or None) of the query rows `rows`
    (default all; other rows hold 0). q `[Hq, N, D]`, k `[Hkv, N, D]`. `block_m` rows per program (64 or
    128; default 128, 64 for head_dim > 128), `num_warps` (default 8 for 128 rows, else 4), `num_stages`:
    launch settings (`workbench bench analysis --sweep` compares them)."""
    q, k = _rows_contiguous(q, k)
    Hq, n, d, dp, g, prec = _geometry(q, k)
    r0, r1 = check_rows(rows, n)
    lse = torch.zeros(Hq, n, device=q.device)
    ent = torch.zeros(Hq, n, device=q.device) if entropy else lse
    block_m = block_m or (64 if dp > 128 else 128)
    grid = (triton.cdiv(r1, block_m) - r0 // block_m, Hq)
    _row_lse_kernel[grid](q, k, lse, ent, scale * LOG2E, n, g, r0, r1, q.stride(0), q.stride(1), k.stride(0),
                          k.stride(1), D=d, DP=dp, BLOCK_M=block_m, BLOCK_N=64, ENTROPY=entropy, PREC=prec,
                          num_warps=num_warps or (8 if block_m == 128 else 4), num_stages=num_stages)
    return lse, ent if entropy else None


@torch.no_grad()
def attention_sums(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor,
                   rows: tuple[int, int] | None = None, *, columns: bool = True, diagonals: bool = True,
                   block: int = 0, cell: int = 0, max_map: bool = False, mean_map: bool = False,
                   entropy: bool = False, walk: str = "diagonal", chunk: int = CHUNK, num_warps: int = 4,
                   num_stages: int = 2) -> dict[str, torch.Tensor]:
    """Pass 2: reductions of p = exp(scale q.k - lse) over the query rows `rows` (default all).

    Returns the requested ones, fp32: "column_mass" `[Hq, N]` (sum over rows), "diag_mass" `[Hq, N]`
    (by offset i - j), "block_mass" `[Hq, m1 - m0, M]` (`block` x `block` tile sums of the row blocks
    m0 = r0 // block .. m1 = ceil(r1 / block) that meet `rows`, M = ceil(N / block): `[Hq, M, M]` for all rows),
    "max_map" / "sum_map" `[Hq, R, R]` (max / sum over `cell` x `cell` squares, R = ceil(N / cell)),
    "row_entropy" `[Hq, N]` (-sum of p ln p over each row's keys, nats; 0 outside `rows`).
    `block` and `cell` must satisfy `pooling_supported`; 0 = not requested. `walk`: "diagonal" (programs
    along tile diagonals, `chunk` tiles each, one skew per program) or "rows" (a program per row block,
    one skew per tile); `num_warps`, `num_stages`: launch settings."""
    q, k = _rows_contiguous(q, k)
    Hq, n, d, dp, g, prec = _geometry(q, k)
    r0, r1 = check_rows(rows, n)
    for name, size in (("block", block), ("cell", cell)):
        if size and not pooling_supported(size):
            raise ValueError(f"{name}={size}: the kernel pools at a divisor of {BLOCK} or any size above it")
    if (max_map or mean_map) and not cell:
        raise ValueError("max_map / mean_map need a cell size")
    dev = q.device
    empty = torch.empty(1, device=dev)
    TR, MR = (math.ceil(n / block) if block else 1), (math.ceil(n / cell) if cell else 1)
    TA0, TRA = (r0 // block, math.ceil(r1 / block) - r0 // block) if block else (0, 1)  # the tile rows kept
    out = {"column_mass": torch.zeros(Hq, n, device=dev) if columns else None,
           "diag_mass": torch.zeros(Hq, n, device=dev) if diagonals else None,
           "block_mass": torch.zeros(Hq, TRA, TR, device=dev) if block else None,
           "max_map": torch.zeros(Hq, MR, MR, device=dev) if max_map else None,
           "sum_map": torch.zeros(Hq, MR, MR, device=dev) if mean_map else None,
           "row_entropy": torch.zeros(Hq, n, device=dev) if entropy else None}
    lse2 = (lse.float() * LOG2E).contiguous()
    m_lo, m_hi = r0 // BLOCK, (r1 - 1) // BLOCK
    outs = [empty if out[name] is None else out[name] for name in out]
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    flags = dict(D=d, DP=dp, BLOCK=BLOCK, COLS=columns, DIAGS=diagonals, TILE_CELL=block, MAP_CELL=cell,
                 MAX_MAP=max_map, MEAN_MAP=mean_map, ENTROPY=entropy, PREC=prec, num_warps=num_warps,
                 num_stages=num_stages)
    if walk == "diagonal":
        grid = (m_hi + 1, triton.cdiv(m_hi - m_lo + 1, chunk), Hq)
        _diagonal_walk_kernel[grid](q, k, lse2, *outs, scale * LOG2E, n, g, r0, r1, chunk, TR, TA0, TRA, MR, *strides,
                                    **flags)
    elif walk == "rows":
        _row_walk_kernel[(m_hi - m_lo + 1, Hq)](q, k, lse2, *outs, scale * LOG2E, n, g, r0, r1, TR, TA0, TRA, MR,
                                                *strides, **flags)
    else:
        raise ValueError(f"walk={walk!r}: use 'diagonal' or 'rows'")
    if entropy:  # the kernels add up sum p log2 p
        out["row_entropy"].mul_(-LN2.value)
    return {name: t for name, t in out.items() if t is not None}


def layer_stats(q: torch.Tensor, k: torch.Tensor, scale: float, resolution: int = 1024, block: int = BLOCK,
                maps: Collection[str] = MAPS, lse: torch.Tensor | None = None) -> LayerStats:
    """`attn_stats_ref.layer_stats` in two passes: the pooling cell ceil(N / resolution) and `block` must
    satisfy `pooling_supported`. `lse` `[Hq, N]` (natural log, e.g. from the forward's attention) saves
    pass 1; the entropy then comes from pass 2, as it does whenever pass 2 runs."""
    check_qk(q, k)
    Hq, n, _ = q.shape
    want, cell = stats_layout(n, resolution, block, maps)
    ent = None
    if want == {"row_entropy"}:  # one pass
        lse, ent = row_lse(q, k, scale, entropy=True)
    elif lse is None:
        lse, _ = row_lse(q, k, scale)
    pooled = bool(want & {"max_map", "mean_map"})
    sums = {} if ent is not None else attention_sums(
        q, k, scale, lse, columns="column_mass" in want, diagonals="diag_mass" in want,
        block=block if "block_mass" in want else 0, cell=cell if pooled else 0, max_map="max_map" in want,
        mean_map="mean_map" in want, entropy="row_entropy" in want)
    ent = sums.get("row_entropy", ent)
    mean = sums.get("sum_map")
    if mean is not None:
        sizes = cell_sizes(n, cell, q.device)
        mean = mean / (sizes[:, None] * sizes[None, :])
    return LayerStats(n, cell, block, sums.get("max_map"), mean, sums.get("block_mass"), sums.get("column_mass"),
                      sums.get("diag_mass"), ent)


def layer_sums(q: torch.Tensor, k: torch.Tensor, scale: float, block: int = BLOCK,
               rows: tuple[int, int] | None = None, lse: torch.Tensor | None = None) -> LayerSums:
    """`attn_stats_ref.layer_sums` in two passes (`block` must satisfy `pooling_supported`). `lse` `[Hq, N]`
    (natural log; at least the rows `rows`, e.g. an earlier call's over all rows) saves pass 1."""
    check_qk(q, k)
    r0, r1 = check_rows(rows, q.shape[1])
    if lse is None:
        lse, _ = row_lse(q, k, scale, rows=(r0, r1))
    else:  # the segment's rows only, as pass 1 over them gives
        seg, lse = lse, torch.zeros_like(lse)
        lse[:, r0:r1] = seg[:, r0:r1]
    sums = attention_sums(q, k, scale, lse, rows=(r0, r1), block=block)
    return LayerSums(sums["column_mass"], sums["diag_mass"], sums["block_mass"], lse, (r0, r1), block)


@torch.no_grad()
def column_offset_mass(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor,
                       column_sets: list[torch.Tensor], prefixes: list[list[int]] | None = None,
                       rows: int | tuple[int, int] | None = None, row_chunk: int = 1024) -> list[torch.Tensor]:
    """`attn_stats_ref.column_offset_mass` (same arguments and results) in one launch per column set."""
    q, k = _rows_contiguous(q, k)
    Hq, n, d, dp, g, prec = _geometry(q, k)
    r0, r1 = offset_rows(rows, n)
    nested = prefixes is not None
    prefixes = prefixes or [[cols.shape[-1]] for cols in column_sets]
    lse2 = (lse.float() * LOG2E).contiguous()
    block_m, block_c = 64, 64
    row_chunk = max(block_m, row_chunk // block_m * block_m)
    out = []
    for cols, pre in zip(column_sets, prefixes):
        cols = cols[:, :max(pre)].to(q.device)
        V, L = cols.shape[-1], len(pre)
        acc = torch.zeros(Hq, L, n, device=q.device)
        if V and r1 > r0:
            cols, order = torch.where(cols >= 0, cols.long(), n).sort(-1)  # ascending keys, padding last
            level = prefix_levels(pre, V, q.device)[order].to(torch.int32)  # [Hq, V]: each column's level
            cols = torch.where(cols < n, cols, -1).to(torch.int32).contiguous()
            grid = (triton.cdiv(V, block_c), triton.cdiv(r1 - r0 // block_m * block_m, row_chunk), Hq)
            _column_offset_kernel[grid](q, k, lse2, cols, level, acc, scale * LOG2E, n, g, V, L, r0, r1, row_chunk,
                                        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cols.stride(0),
                                        D=d, DP=dp, BLOCK_M=block_m, BLOCK_C=block_c, PREC=prec, num_warps=8,
                                        num_stages=2)
        out.append(acc.cumsum(1).transpose(0, 1))
    return out if nested else [t[0] for t in out]


@torch.no_grad()
def captured_mass(q: torch.Tensor, k: torch.Tensor, scale: float, rule: TokenRule,
                  lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the dense probability mass of the tokens `rule` keeps and how many it keeps:
    (mass `[Hq, N]` fp32 in [0, 1], count `[Hq, N]` int32). `lse` `[Hq, N]` (natural log) saves pass 1."""
    check_qk(q, k)
    q, k = _rows_contiguous(q, k)
    Hq, n, d, dp, g, prec = _geometry(q, k)
    tiles = rule.tiles.to(q.device)
    if tiles.shape[1] != Hq and Hq % tiles.shape[1] == 0:
        tiles = expand_groups(tiles, Hq // tiles.shape[1])
    M = -(-n // tiles.block)
    if tuple(tiles.shape) != (1, Hq, M):
        raise ValueError(f"the rule's tiles are [B, H, M] = {tuple(tiles.shape)} but q needs (1, {Hq}, {M}) "
                         f"(block {tiles.block}): build the index for this layer's {Hq} query heads and {n} tokens")
    if lse is None:
        lse, _ = row_lse(q, k, scale)
    lse2 = (lse.float() * LOG2E).contiguous()
    sets = rule.keys is not None or rule.offsets is not None
    dev = q.device
    none = torch.zeros(Hq, n, dtype=torch.int8, device=dev) if sets else torch.empty(1, dtype=torch.int8, device=dev)
    keys = none if rule.keys is None else rule.keys.to(device=dev, dtype=torch.int8).expand(Hq, n).contiguous()
    offs = none if rule.offsets is None else rule.offsets.to(device=dev, dtype=torch.int8).expand(Hq, n).contiguous()
    mass = torch.zeros(Hq, n, device=dev)
    count = torch.zeros(Hq, n, dtype=torch.int32, device=dev)
    bc, bo = tiles.block_count.contiguous(), tiles.block_offset.contiguous()
    cc, ci = tiles.column_count.contiguous(), tiles.column_index.contiguous()
    _captured_kernel[(M, Hq)](q, k, lse2, mass, count, bc, bo, cc, ci, keys, offs, scale * LOG2E, n, g, M,
                              bo.shape[-1], ci.shape[-1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              D=d, DP=dp, BLOCK=tiles.block, BLOCK_N=tiles.piece, SETS=sets, PREC=prec,
                              num_warps=4 if tiles.block == 64 else 8, num_stages=2)
    if tiles.dense_from is not None:  # a dense row keeps every causal key: all of its mass
        rows = torch.arange(n, device=dev)
        dense = rows >= tiles.dense_from[0].to(dev)[:, None]
        mass = torch.where(dense, 1.0, mass)
        count = torch.where(dense, (rows + 1).int(), count)
    return mass, count
