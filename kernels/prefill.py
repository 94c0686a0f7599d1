"""Triton sparse prefill attention over `VSTiles` (one launch per layer, any mix of patterns).

Every pattern is first turned into the same per-(batch, head, row block) format (`index_ref`):
Vertical-Slash (pieces along the merged slash ranges + packed vertical columns), Block-Sparse (pieces =
selected key blocks) and A-shape (window pieces + sink columns, plus the exact per-token mask from
`sink` / `window`). One program computes one row block of one query head: it first walks the column
strips (`block` gathered keys at a time, all strictly causal, no mask but padding), then the pieces
(masked only where needed: the causal edge, key range edges, overlap with the next piece, A-shape
window edge). Online softmax in fp32 with exp2; the masks go in as -inf before the max.

Query head h reads KV head h // (Hq // Hkv) straight from k/v (no repeat_kv). Group-shared tiles (one
tile list per KV head, as InfLLM-V2 selects) run GQA-packed: one program takes pack_rows / G rows of
each of the G query heads, so every K/V tile is loaded once per 128 query rows and the dots are
128 rows tall. Programs are ordered longest-first (late row blocks first) to reduce the launch tail.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .index_ref import VSTiles, band_tiles, block_sparse_to_tiles, expand_groups, vs_to_tiles
from .prefill_ref import check_prefill_args, last_rows_attention
from .schedule import sm_count, work_order
from .tiling import LN2, LOG2E, band_on

GRID_Y = 65535  # CUDA's largest grid along y: one program per row block reaches it past 4M tokens (64-row blocks)
SMEM_SM90 = 232448  # bytes of shared memory one program may use on an H100 / H200 (sm_90)
PACKED_Q_BYTES = 64 << 10  # the largest query tile (rows x head_dim x element size) a GQA-packed program holds; past
# it (fp32 at head_dim 256: 128 rows x 256 x 4 = 128 KiB of q and as much accumulator per program) group-shared
# tiles run per head


@triton.jit
def _online_update(qk, qk_scale, v, m_i, l_i, acc):
    """One online-softmax step on raw scores `qk` (-inf = masked; times qk_scale = log2 units) and `v`."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet stays at zero
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk * qk_scale - m_use[:, None])  # one FMA per score
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _pieces(q, Kbase, Vbase, kdesc, vdesc, Offsets, lo, hi, n_blk, rows, N, sink, window, qk_scale, m_i, l_i, acc,
            skn, svn, dims, lanes, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CUT: tl.constexpr,
            HAS_WINDOW: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over pieces lo..hi-1 of one tile. MASK: every mask (key range, the cut at the next
    piece, causal, sink/window); else no mask but, with CUT, the cut where a piece overlaps the next.
    TMA: K/V through tensor descriptors over this KV head's [N, D] rows (rows outside [0, N) read as
    zeros), else pointer loads."""
    p = tl.load(Offsets + lo, mask=lo < n_blk, other=0)
    for t in range(lo, hi):
        # the next start, carried as a value: K/V addresses then never wait on a load of this iteration,
        # so the pipeliner can prefetch the tiles num_stages - 1 pieces ahead
        nxt = tl.load(Offsets + t + 1, mask=t + 1 < n_blk, other=1 << 30)
        keys = p + lanes
        if MASK:
            in_seq = (keys >= 0) & (keys < N)
            if TMA:
                k = kdesc.load([p, 0])
            else:
                k = tl.load(Kbase + keys[:, None] * skn + dims[None, :], mask=in_seq[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
            keep = in_seq[None, :] & (keys[None, :] < nxt) & (keys[None, :] <= rows[:, None])
            if HAS_WINDOW:
                keep = keep & ((rows[:, None] - keys[None, :] < window[:, None]) | (keys[None, :] < sink[:, None]))
            s = tl.where(keep, s, float("-inf"))
            if TMA:
                v = vdesc.load([p, 0])
            else:
                v = tl.load(Vbase + keys[:, None] * svn + dims[None, :], mask=in_seq[:, None], other=0.0)
        else:
            if TMA:
                k = kdesc.load([p, 0])
            else:
                k = tl.load(Kbase + keys[:, None] * skn + dims[None, :])
            s = tl.dot(q, tl.trans(k))
            if CUT:
                if p + BLOCK_N > nxt:
                    s = tl.where(keys[None, :] < nxt, s, float("-inf"))
            if TMA:
                v = vdesc.load([p, 0])
            else:
                v = tl.load(Vbase + keys[:, None] * svn + dims[None, :])
        m_i, l_i, acc = _online_update(s, qk_scale, v, m_i, l_i, acc)
        p = nxt
    return m_i, l_i, acc


@triton.jit
def _row_block(Q, K, V, O, LSE, BlockCount, BlockOffset, ColumnCount, ColumnIndex, Sink, Window, bh, mid,
               qk_scale, N, HT, G, M, NS, NC, sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
               D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr,
               ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, CUT: tl.constexpr,
               TMA: tl.constexpr):
    """Work item (bh, mid): ROWS query rows of each of PACK query heads that share one tile list (PACK =
    1: one head, ROWS = BLOCK; PACK = G: the G heads of a KV head, ROWS = pack_rows / G of each), so each
    K/V tile loads once for PACK * ROWS rows. HT = heads of the tile list; mid = row block m, sub-block."""
    SUB: tl.constexpr = BLOCK // ROWS
    m = mid // SUB
    b = (bh // HT).to(tl.int64)
    ht = (bh % HT).to(tl.int64)  # head offsets pass 2^31 elements at 1M tokens x 32 heads
    r = tl.arange(0, PACK * ROWS)
    head = ht * PACK + r // ROWS  # query head of each row, [PACK * ROWS]
    kvh = (ht * PACK) // G
    row_lo = m * BLOCK + (mid % SUB) * ROWS
    rows = row_lo + r % ROWS
    dims = tl.arange(0, D)
    lanes = tl.arange(0, BLOCK_N)
    Kbase = K + b * skb + kvh * skh
    Vbase = V + b * svb + kvh * svh
    if TMA:
        kdesc = tl.make_tensor_descriptor(Kbase, shape=[N, D], strides=[skn, 1], block_shape=[BLOCK_N, D])
        vdesc = tl.make_tensor_descriptor(Vbase, shape=[N, D], strides=[svn, 1], block_shape=[BLOCK_N, D])
    else:
        kdesc = Kbase  # unused
        vdesc = Vbase
    if TMA and PACK == 1:
        qdesc = tl.make_tensor_descriptor(Q + b * sqb + ht * sqh, shape=[N, D], strides=[sqn, 1],
                                          block_shape=[ROWS, D])
        q = qdesc.load([row_lo, 0])
    else:
        q = tl.load(Q + b * sqb + head[:, None] * sqh + rows[:, None] * sqn + dims[None, :],
                    mask=rows[:, None] < N, other=0.0)
    m_i = tl.full([PACK * ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([PACK * ROWS], tl.float32)
    acc = tl.zeros([PACK * ROWS, D], tl.float32)
    tile = bh * M + m
    # Vertical columns: packed strips, every column < m * BLOCK (strictly causal).
    n_col = tl.load(ColumnCount + tile)
    cols = ColumnIndex + tile.to(tl.int64) * NC
    col_next = tl.load(cols + lanes, mask=lanes < n_col, other=0)
    for c0 in range(0, n_col, BLOCK_N):
        ok = c0 + lanes < n_col
        col = col_next  # loaded one strip ahead, as the pieces' starts below
        col_next = tl.load(cols + c0 + BLOCK_N + lanes, mask=c0 + BLOCK_N + lanes < n_col, other=0)
        k = tl.load(Kbase + col[:, None] * skn + dims[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s, float("-inf"))
        v = tl.load(Vbase + col[:, None] * svn + dims[None, :], mask=ok[:, None], other=0.0)
        m_i, l_i, acc = _online_update(s, qk_scale, v, m_i, l_i, acc)
    if HAS_WINDOW:
        sink = tl.load(Sink + head)
        window = tl.load(Window + head)
        sink_lo = tl.min(sink, 0)
        window_lo = tl.min(window, 0)
    else:
        sink = rows  # unused
        window = rows
    # Pieces: piece t covers [p_t, min(p_t + BLOCK_N, p_{t+1})), causal.
    n_blk = tl.load(BlockCount + tile)
    base = tile.to(tl.int64) * NS
    if SPLIT:
        # Ascending pieces split into three runs: a prefix that needs masks (starts below 0, or the
        # window's lower edge), an interior with no mask (keys in range, causal and inside every window
        # for all rows), a suffix that needs masks (the causal edge, keys past N).
        lim = -1
        if HAS_WINDOW:
            lim = tl.maximum(row_lo + ROWS - 1 - window_lo, -1)
        t_lo = tl.full([], 0, tl.int32)
        p_t = tl.load(BlockOffset + base, mask=n_blk > 0, other=1 << 30)
        while p_t <= lim:
            t_lo += 1
            p_t = tl.load(BlockOffset + base + t_lo, mask=t_lo < n_blk, other=1 << 30)
        t_hi = n_blk
        p_t = tl.load(BlockOffset + base + t_hi - 1, mask=t_hi > t_lo, other=-(1 << 30))
        while (p_t + BLOCK_N - 1 > row_lo) | (p_t + BLOCK_N > N):
            t_hi -= 1
            p_t = tl.load(BlockOffset + base + t_hi - 1, mask=t_hi > t_lo, other=-(1 << 30))
        m_i, l_i, acc = _pieces(q, Kbase, Vbase, kdesc, vdesc, BlockOffset + base, 0, t_lo, n_blk, rows, N, sink,
                                window, qk_scale, m_i, l_i, acc, skn, svn, dims, lanes, BLOCK_N, True, False,
                                HAS_WINDOW, TMA)
        m_i, l_i, acc = _pieces(q, Kbase, Vbase, kdesc, vdesc, BlockOffset + base, t_lo, t_hi, n_blk, rows, N, sink,
                                window, qk_scale, m_i, l_i, acc, skn, svn, dims, lanes, BLOCK_N, False, CUT,
                                HAS_WINDOW, TMA)
        m_i, l_i, acc = _pieces(q, Kbase, Vbase, kdesc, vdesc, BlockOffset + base, t_hi, n_blk, n_blk, rows, N, sink,
                                window, qk_scale, m_i, l_i, acc, skn, svn, dims, lanes, BLOCK_N, True, False,
                                HAS_WINDOW, TMA)
    else:
        p = tl.load(BlockOffset + base, mask=n_blk > 0, other=0)
        for t in range(0, n_blk):
            nxt = tl.load(BlockOffset + base + t + 1, mask=t + 1 < n_blk, other=1 << 30)
            keys = p + lanes
            in_seq = (keys >= 0) & (keys < N)
            k = tl.load(Kbase + keys[:, None] * skn + dims[None, :], mask=in_seq[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
            edge = (p < 0) | (p + BLOCK_N > nxt) | (p + BLOCK_N > N) | (p + BLOCK_N - 1 > row_lo)
            if HAS_WINDOW:
                edge = edge | ((p <= row_lo + ROWS - 1 - window_lo) & (p + BLOCK_N > sink_lo))
            if edge:
                keep = in_seq[None, :] & (keys[None, :] < nxt) & (keys[None, :] <= rows[:, None])
                if HAS_WINDOW:
                    keep = keep & ((rows[:, None] - keys[None, :] < window[:, None]) | (keys[None, :] < sink[:, None]))
                s = tl.where(keep, s, float("-inf"))
            v = tl.load(Vbase + keys[:, None] * svn + dims[None, :], mask=in_seq[:, None], other=0.0)
            m_i, l_i, acc = _online_update(s, qk_scale, v, m_i, l_i, acc)
            p = nxt
    out = acc / l_i[:, None]
    row_ok = rows < N
    if TMA and PACK == 1:
        odesc = tl.make_tensor_descriptor(O + b * sob + ht * soh, shape=[N, D], strides=[son, 1],
                                          block_shape=[ROWS, D])
        odesc.store([row_lo, 0], out.to(O.dtype.element_ty))
    else:
        tl.store(O + b * sob + head[:, None] * soh + rows[:, None] * son + dims[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + (b * HT * PACK + head) * N + rows, (m_i + tl.math.log2(l_i)) * LN2, mask=row_ok)


@triton.jit(do_not_specialize=["N", "HT", "G", "M", "NS", "NC", "n_work"])
def _sparse_prefill_kernel(Q, K, V, O, LSE, BlockCount, BlockOffset, ColumnCount, ColumnIndex, Sink, Window, Order,
                           qk_scale, N, HT, G, M, NS, NC, n_work,
                           sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                           D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr,
                           ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, LONGEST_FIRST: tl.constexpr,
                           SPLIT: tl.constexpr, CUT: tl.constexpr, TMA: tl.constexpr,
                           PERSISTENT: tl.constexpr):
    # Work items (bh, mid), bh = b * HT + tile head, mid = m * SUB + sub-block. PERSISTENT: a fixed grid
    # of programs, each taking items n_work apart from `Order` (most pieces first); else one program
    # per item, late row blocks (the most keys) first when LONGEST_FIRST.
    SUB: tl.constexpr = BLOCK // ROWS
    if PERSISTENT:
        for w in range(tl.program_id(0), n_work, tl.num_programs(0)):
            item = tl.load(Order + w)
            _row_block(Q, K, V, O, LSE, BlockCount, BlockOffset, ColumnCount, ColumnIndex, Sink, Window,
                       item // (M * SUB), item % (M * SUB), qk_scale, N, HT, G, M, NS, NC,
                       sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                       D, BLOCK, BLOCK_N, PACK, ROWS, HAS_WINDOW, SPLIT, CUT, TMA)
    else:
        mid = tl.program_id(1)
        if LONGEST_FIRST:
            mid = M * SUB - 1 - mid
        _row_block(Q, K, V, O, LSE, BlockCount, BlockOffset, ColumnCount, ColumnIndex, Sink, Window,
                   tl.program_id(0), mid, qk_scale, N, HT, G, M, NS, NC,
                   sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
                   D, BLOCK, BLOCK_N, PACK, ROWS, HAS_WINDOW, SPLIT, CUT, TMA)


def loop_variant(pack: int, columns: bool, hopper: bool, head_dim: int = 128) -> tuple[bool, bool, bool]:
    """(split, tma, persistent) that ran fastest on the H200 (bf16, 32/8/128, 64K and 128K; kernels/NOTES.md):
    GQA-packed programs over tiles without columns (block-sparse, A-shape): the single loop (split at
    head_dim 256, where the single loop's three stages overflow shared memory); per-head programs over
    tiles with columns (Vertical-Slash) at head_dim <= 128: split with pointer loads (TMA 1.19x slower at
    128); the rest (per-head block-sparse and A-shape, packed Vertical-Slash, per-head Vertical-Slash at
    head_dim 256: TMA 1.20x / 1.22x faster at 64K / 128K on the Gemma-3 shape): split with TMA loads where
    there is TMA. Vertical-Slash at head_dim 128 on Hopper: the persistent longest-first schedule (its row
    blocks differ most in work: 12 % faster per head, 7 % group-shared; block-sparse and A-shape ran slower
    with it; at head_dim 64 the embedded shape's VS ran 5-19 % slower with it, 2026-12-01 vs 12-02 runs)."""
    persistent = columns and hopper and head_dim == 128
    if pack > 1 and not columns and head_dim <= 128:
        return False, False, persistent
    return True, hopper and not (pack == 1 and columns and head_dim <= 128), persistent


def default_config(d: int, rows: int, pack: int, piece: int = 64, element_size: int = 2,
                   smem: int = SMEM_SM90) -> tuple[int, int]:
    """(num_warps, num_stages) per program shape: 4 warps (one warpgroup) for 64-row programs, 8 for 128
    rows; up to 3 stages (K/V tiles load two pieces ahead; 2 stages load the next piece only after this one's
    math, no overlap), as many as fit `smem` bytes of shared memory. A stage that does not fit costs a whole
    compile before the launch fails (fp32 at head_dim 256 under IEEE dots: ~100 s on the H200's host), so the
    count is estimated first as the query tile + stages x (a K and a V piece) at the tiles' element size: exact
    for 16-bit tiles at 3 stages on sm_90 (64 rows x 128 dims 112 KB, two programs per SM; 128 rows 128 KB; 64
    rows x 256 dims 224 KB of 227; 128 rows x 256 dims 256 KB, so 2 stages), an upper bound for fp32 ones (64 rows
    x 256 dims, 1 stage: 128 KB GQA-packed with TF32 dots, 80 KB per head with IEEE ones, where 2 stages take 192
    KB: fp32 is the parity path, so it runs the stages the bound allows). `sparse_prefill` still steps down if a
    launch runs out of shared memory. On the H200 at head_dim 256 (Gemma-3, 64K) 4 warps ran
    64-row VS, block-sparse and A-shape at 0.60 / 0.73 / 0.61 of dense SDPA's TFLOP/s, 8 warps at 0.38 / 0.41 /
    0.39 (kernels/NOTES.md)."""
    q_tile, kv_stage = pack * rows * d * element_size, 2 * piece * d * element_size
    stages = min(3, (smem - q_tile) // kv_stage)
    return (4 if pack * rows == 64 else 8), max(1, stages)


@functools.lru_cache(maxsize=16)
def _smem_per_block(device: torch.device) -> int:
    """Shared memory one program may use on `device` (bytes; the H200's off a GPU). Cached: called per launch."""
    if device.type != "cuda":
        return SMEM_SM90
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", SMEM_SM90)


_FITTING_STAGES: dict[tuple, int] = {}  # program kind -> the most stages that fit the GPU's shared memory


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for device-side tensor descriptors (`triton.set_allocator`)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: VSTiles,
                   sink: torch.Tensor | None = None, window: torch.Tensor | None = None,
                   scale: float | None = None, num_warps: int | None = None,
                   num_stages: int | None = None, longest_first: bool = True,
                   pack_rows: int | None = None, split: bool | None = None,
                   tma: bool | None = None, persistent: bool | None = None,
                   warp_specialize: bool | None = None, kv_major: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over the keys of `tiles` (M = ceil(N / tiles.block)).

    q `[B, Hq, N, D]`, k/v `[B, Hkv, N, D]`: last dim contiguous, fp16 / bf16 / fp32, D a power of two in 16..256;
    query head h reads KV head h // (Hq / Hkv). Returns (o `[B, Hq, N, D]` in q's dtype, lse Float32 `[B, Hq, N]`,
    natural log). The measurements behind each default are in kernels/NOTES.md.

    - `tiles`: per query head (`[B, Hq, M]`) or group-shared (`[B, Hkv, M]`: the G = Hq / Hkv heads of a KV head
      attend to the same keys, as InfLLM-V2 selects them). Group-shared tiles run GQA-packed, `pack_rows` rows a
      program (`pack_rows / G` of each head; default 128), so each K/V tile loads once for the G heads; per head
      (`expand_groups`) where G does not pack or the query tile would pass `PACKED_Q_BYTES` (fp32 at head_dim 256).
    - `sink`, `window`: optional per-head A-shape token mask, Int `[Hq]` in tokens (`NO_WINDOW` / 0: none).
    - `warp_specialize`: True runs the warp-specialised Gluon kernel (`prefill_ws.ws_prefill`: sm_90, bf16 / fp16,
      head_dim 64 / 128 / 256, 64 x 64 tiles without A-shape masks, columns only as `tiles.head_columns`;
      ValueError otherwise); False the Triton-language loop; None (default) `default_program`'s kernel: the Gluon
      kernel where it takes the tiles (head_dim 128; head_dim 64 per-head tiles without columns), row-block pairs
      (`prefill_pair.pair_prefill`) for per-head tiles at head_dim 256 (columns only as `head_columns`), else the
      loop. The loop reads `tiles.column_index`, never `head_columns`. The knobs below tune the loop only.
    - `split`: walk a tile's pieces as a masked prefix, an unmasked interior and a masked suffix; False: one loop
      that masks the pieces on an edge. `tma` (with `split`, Hopper or newer): K/V tiles, and a per-head program's
      Q and O rows, through tensor descriptors. None for either: `loop_variant`'s choice for this program shape.
    - `persistent`: one program per SM slot looping over the row blocks in `work_order` (None: `loop_variant`'s
      choice, and always past `GRID_Y` row-block programs per head, i.e. past 4M tokens at 64-row blocks);
      `kv_major`: every row block of one KV head's heads before the next KV head's (None: for Vertical-Slash column
      lists, whose near-dense tiles stream a KV head's whole K/V; on the Gluon route, for tiles with head columns).
    - `scale`: the softmax scale (None: D ** -0.5). `longest_first`: one program per row block, late row blocks
      (the most keys) launched first.
    - `num_warps`, `num_stages`: None for `default_config`'s (stages stepped down where shared memory runs out).
    """
    B, Hq, Hkv, N, D = check_prefill_args(q, k, v)
    if (sink is None) != (window is None):
        raise ValueError("give both sink and window (per-head A-shape mask) or neither")
    if warp_specialize is None:
        program = default_program(q, tiles, sink)
        if program == "pair":
            from .prefill_pair import pair_prefill  # lazy, as the Gluon kernel below

            return write_dense_rows(*pair_prefill(q, k, v, tiles, scale), q, k, v, tiles, scale)
        warp_specialize = program == "gluon"
    if warp_specialize:
        o, lse = _warp_specialized(q, k, v, tiles, scale, sink, window,
                                   tiles.head_columns is not None if kv_major is None else kv_major)
        return write_dense_rows(o, lse, q, k, v, tiles, scale)
    if D & (D - 1) or not 16 <= D <= 256:
        raise ValueError(f"head_dim must be a power of two in 16..256 for the Triton kernel, got {D}")
    if pack_rows is None:
        pack_rows = 128
    M = -(-N // tiles.block)
    if tiles.shape[1] == Hkv and Hq != Hkv:
        G = Hq // Hkv
        rows = pack_rows // G
        if G & (G - 1) or rows < 1 or tiles.block % rows or G * rows < 16 or (
                G * rows * D * q.element_size() > PACKED_Q_BYTES):
            tiles = expand_groups(tiles, G)  # G not packable: run per head
    if tuple(tiles.shape) not in ((B, Hq, M), (B, Hkv, M)):
        raise ValueError(f"tiles are for [B, H, M] = {tuple(tiles.shape)} but q needs ({B}, {Hq} or {Hkv}, {M}) "
                         f"(block {tiles.block}); rebuild the tiles for this input")
    pack = Hq // tiles.shape[1]
    rows = pack_rows // pack if pack > 1 else tiles.block
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v must be contiguous in the last (head_dim) dimension")
    hopper = q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] >= 9
    columns = tiles.column_index.shape[-1] > 1 and window is None  # Vertical-Slash column lists (a static width)
    kv_major = columns if kv_major is None else kv_major
    auto_split, auto_tma, auto_persistent = loop_variant(pack, columns, hopper, D)
    programs = M * (tiles.block // rows)  # per (batch, head): the grid's second axis unless persistent
    if persistent is False and programs > GRID_Y:
        raise ValueError(f"persistent=False launches {programs} programs per head along the grid's y axis, more than "
                         f"CUDA's {GRID_Y} (N = {N} tokens): use persistent=True or None")
    persistent = (auto_persistent or programs > GRID_Y) if persistent is None else persistent
    split = auto_split if split is None else split
    tma = (auto_tma and split) if tma is None else tma
    if tma and not (split and (q.device.type != "cuda" or hopper)):
        raise ValueError("tma=True needs split=True and a GPU of compute capability 9.0 or newer (Hopper)")
    strides16 = all(x.stride(2) * x.element_size() % 16 == 0 for x in (q, k, v))
    if tma and not strides16:
        raise ValueError("tma=True needs q, k and v rows 16-byte aligned (stride(2) * element size % 16 == 0)")
    if tma:
        triton.set_allocator(_descriptor_scratch)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    dev = q.device
    tiles = tiles.to(dev)
    has_window = window is not None
    if has_window:
        sink, window = (x.reshape(Hq) for x in band_on(sink, window, dev))
    else:
        sink = window = torch.zeros(1, dtype=torch.int32, device=dev)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=dev)
    bc, bo = tiles.block_count.contiguous(), tiles.block_offset.contiguous()
    cc, ci = tiles.column_count.contiguous(), tiles.column_index.contiguous()
    block = tiles.block
    auto_warps, auto_stages = default_config(D, rows, pack, tiles.piece, q.element_size(), _smem_per_block(dev))
    sub = block // rows
    n_work = B * tiles.shape[1] * M * sub
    if persistent:
        order = work_order(tiles, sub, tiles.shape[1] // Hkv if kv_major else 0)
        slots = sm_count(dev) * 2 if dev.type == "cuda" else 4
        grid = (min(n_work, slots),)
    else:
        order = bc  # unused
        grid = (B * tiles.shape[1], M * sub)

    def launch(stages: int):
        _sparse_prefill_kernel[grid](
            q, k, v, o, lse, bc, bo, cc, ci, sink, window, order,
            scale * LOG2E, N, tiles.shape[1], Hq // Hkv, M, bo.shape[-1], ci.shape[-1], n_work,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            D=D, BLOCK=block, BLOCK_N=tiles.piece, PACK=pack, ROWS=rows, HAS_WINDOW=has_window,
            LONGEST_FIRST=longest_first, SPLIT=split, CUT=not tiles.disjoint, TMA=tma,
            PERSISTENT=persistent, num_warps=num_warps or auto_warps, num_stages=stages)

    if num_stages is not None:
        launch(num_stages)
        return write_dense_rows(o, lse, q, k, v, tiles, scale)
    kind = (dev, q.dtype, D, block, tiles.piece, pack, rows, split, tma, persistent, has_window,
            num_warps or auto_warps)
    for stages in range(_FITTING_STAGES.get(kind, auto_stages), 0, -1):  # fewer stages until the tiles fit this
        try:  # GPU's shared memory, where `default_config`'s estimate was short;
            launch(stages)  # remembered, so that later calls do not fail first
            _FITTING_STAGES[kind] = stages
            break
        except OutOfResources:
            if stages == 1:
                raise
    return write_dense_rows(o, lse, q, k, v, tiles, scale)


def default_program(q: torch.Tensor, tiles: VSTiles, sink: torch.Tensor | None = None) -> str:
    """The kernel `sparse_prefill` runs at its default (`warp_specialize=None`): "gluon" (`prefill_ws`) at head_dim
    128, and at 64 for per-head tiles without columns, where `prefill_ws.ws_takes` takes them; "pair"
    (`prefill_pair`) where `pair_takes` takes them (head_dim 256 per-head tiles, columns only as `head_columns`); else
    "loop" (the Triton-language loop)."""
    D = q.shape[-1]
    if D == 256:
        from .prefill_pair import pair_takes  # lazy: the Gluon modules load only where they may run

        return "pair" if pair_takes(q, tiles, sink) else "loop"
    if not (D == 128 or D == 64 and not tiles.columns and tiles.shape[1] == q.shape[1]):
        return "loop"
    from .prefill_ws import ws_takes  # lazy, as in _warp_specialized

    return "gluon" if ws_takes(q, tiles, sink) else "loop"


def gluon_takes_kinds(q: torch.Tensor) -> bool:
    """Whether the Gluon kernels take per-head VS and block-sparse tiles and A-shape heads, each kind alone, for q
    `[B, Hq, N, D]` (sm_90, bf16 / fp16, head_dim 128: `prefill_ws`; 256: `prefill_pair`), where one launch over a
    layer that holds an A-shape head runs the loop (neither takes merged tiles under an A-shape mask). There
    `SparsePrefill` runs such a layer one launch per kind. H100, a third of the heads each VS, block-sparse, A-shape,
    against the merged launch at 64K / 128K: Llama 32/8/128 1.58x / 1.90x (kernels/NOTES.md, session 30); Gemma-3
    4/1/256, VS and block on the pairs and A-shape on the loop, 1.04x / 1.10x and 1.06x / 1.13x in two runs (sessions
    36, 37)."""
    from .prefill_ws import DTYPES, sm90  # lazy, as in default_program

    return q.shape[-1] in (128, 256) and q.dtype in DTYPES and sm90(q.device)


def write_dense_rows(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    tiles: VSTiles, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists' result (o `[B, Hq, N, D]`, lse `[B, Hq, N]`) with the rows `tiles.dense_from` marks replaced by
    exact causal attention over every key (`last_rows_attention` over the last `tiles.dense_rows` rows, in place)."""
    if tiles.dense_from is None:
        return o, lse
    N = q.shape[2]
    rows = min(tiles.dense_rows, N)
    dense_o, dense_lse = last_rows_attention(q, k, v, rows, scale)
    start = tiles.dense_from.to(q.device)
    if start.shape[1] != q.shape[1]:  # group-shared tiles: one start per KV head
        start = start.repeat_interleave(q.shape[1] // start.shape[1], 1)
    take = torch.arange(N - rows, N, device=q.device) >= start[..., None]  # [B, Hq, rows]
    o[:, :, N - rows:] = torch.where(take[..., None], dense_o, o[:, :, N - rows:])
    lse[:, :, N - rows:] = torch.where(take, dense_lse, lse[:, :, N - rows:])
    return o, lse


def _warp_specialized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: VSTiles, scale: float | None,
                      sink: torch.Tensor | None, window: torch.Tensor | None, kv_major: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_prefill` through the Gluon kernel at its launches (`prefill_ws.HEAD_LAUNCH`, `HEAD_LAUNCH_D64`;
    group-shared tiles: `SHARED_LAUNCH`, two query heads of a group on one ring), the fastest on the H200."""
    from .prefill_ws import (  # lazy: Gluon needs Triton's experimental module
        HEAD_LAUNCH,
        HEAD_LAUNCH_D64,
        HEAD_LAUNCH_D256,
        SHARED_LAUNCH,
        SHARED_LAUNCH_D256,
        ws_prefill,
    )

    if tiles.shape[1] != q.shape[1]:
        launch = SHARED_LAUNCH_D256 if q.shape[-1] == 256 else SHARED_LAUNCH
    else:
        launch = {64: HEAD_LAUNCH_D64, 128: HEAD_LAUNCH, 256: HEAD_LAUNCH_D256}[q.shape[-1]]
    return ws_prefill(q, k, v, tiles, scale, sink, window, kv_major=kv_major, **launch)


def vertical_slash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, columns: torch.Tensor,
                           offsets: torch.Tensor, scale: float | None = None, block: int = 64,
                           width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical-Slash prefill: columns Long `[B, Hq, Kv]`, offsets Long `[B, Hq, Ks]` -> (o, lse).
    `block` rows per tile, `width` keys per piece (0 = block)."""
    return sparse_prefill(q, k, v, vs_to_tiles(columns, offsets, q.shape[2], block, width=width), scale=scale)


def block_sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_index: torch.Tensor,
                         scale: float | None = None, block: int = 64,
                         width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse prefill: block_index Int `[B, Hq, M, K]` (64-token key blocks, -1 padded) -> (o, lse)."""
    return sparse_prefill(q, k, v, block_sparse_to_tiles(block_index, q.shape[2], block, width), scale=scale)


def ashape_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | list[int],
                   window: torch.Tensor | list[int], scale: float | None = None, block: int = 64,
                   width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A-shape prefill: per-head sink and window in tokens (`[Hq]`) -> (o, lse). No index tensor. On an sm_90
    GPU at head_dim 128 with 64-row tiles (block 64, width 0 or 64; `prefill_ws.ws_ashape_takes`) the Gluon kernel:
    where each KV group's heads pair up by band (`prefill_ws.head_pairs`), two heads of a band on one K/V ring, 128
    keys per step, a persistent grid (`prefill_ws.ASHAPE_LAUNCH`; H200, sink 128, window 4096, 64K / 128K: 0.82 /
    0.90 of dense SDPA's TFLOP/s in one probe against 0.69 / 0.75 for the loop below, kernels/NOTES.md), else per-head
    rings (`prefill_ws.ASHAPE_PER_HEAD_LAUNCH`; H100, windows 4096 / 2048 in turn: 1.09x / 1.14x the loop over
    per-head tiles); at head_dim 256 from 24K tokens two heads of one band on one ring where every KV group's heads
    pair up by band (`prefill_ws.ASHAPE_LAUNCH_D256`; H100, Gemma-3 4/1/256, 64K / 128K: 0.91-0.98 of dense per tile,
    1.2-1.5x the routes below), else, where the query heads of a KV group differ in band, row blocks 2j and 2j + 1 of
    a head on one K/V ring (`prefill_pair.pair_ashape`); else, when the heads of every KV group share
    sink and window (`groups_share_band`), group-shared tiles (GQA-packed kernel)."""
    hq, hkv = q.shape[1], k.shape[1]
    sink_t = torch.as_tensor(sink).reshape(-1).cpu()
    window_t = torch.as_tensor(window).reshape(-1).cpu()
    out = ashape_gluon(q, k, v, sink_t, window_t, scale, block, width)
    if out is not None:
        return out
    heads = slice(None, None, hq // hkv) if groups_share_band(sink_t, window_t, hq, hkv) else slice(None)
    tiles, _ = band_tiles(sink_t[heads], window_t[heads], q.shape[2], q.shape[0], block, q.device, width)  # cached
    return sparse_prefill(q, k, v, tiles, sink=sink_t, window=window_t, scale=scale)


def ashape_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, window: torch.Tensor,
                 scale: float | None = None, block: int = 64, width: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`ashape_prefill`'s Gluon route: (o, lse) where a Gluon kernel takes this A-shape (`ashape_program`; sink /
    window CPU Int `[Hq]`, so no host sync): the row-block pairs (`prefill_pair.pair_ashape`) or `prefill_ws.ws_ashape`
    at `prefill_ws.ashape_launch` (two heads on one K/V ring where they share a band, else per-head rings); None where
    neither runs."""
    program = ashape_program(q, k, sink, window, block, width)
    if program == "pair":
        from .prefill_pair import pair_ashape  # lazy, as in default_program

        return pair_ashape(q, k, v, sink, window, scale)
    if program == "gluon":
        from .prefill_ws import ashape_launch, ws_ashape  # lazy, as in sparse_prefill

        return ws_ashape(q, k, v, sink, window, scale, **ashape_launch(q.shape[1], k.shape[1], sink, window,
                                                                       q.shape[-1]))
    return None


def ashape_program(q: torch.Tensor, k: torch.Tensor, sink: torch.Tensor, window: torch.Tensor, block: int = 64,
                   width: int = 0) -> str:
    """The kernel `ashape_prefill` runs for this A-shape asked for in tiles of `block` rows x `width` keys (sink /
    window CPU Int `[Hq]`; no host sync): with 64-row tiles (width 0 or 64) "gluon" where `prefill_ws.ws_ashape_takes`
    (sm_90, one sink and window per query head; head_dim 128, or 256 from 24K tokens where each KV group's heads pair
    up by band), else "pair" at head_dim 256 where `prefill_pair.pair_runs` (sm_90, one sink and window per query
    head) and the heads of a KV group differ in band or each group is one head; else "loop" (the band's tiles,
    group-shared where `groups_share_band`)."""
    if q.shape[-1] not in (128, 256) or block != 64 or width not in (0, 64):
        return "loop"
    from .prefill_ws import ws_ashape_takes  # lazy, as in sparse_prefill

    if ws_ashape_takes(q, k, sink, window):
        return "gluon"
    if q.shape[-1] == 256:
        from .prefill_pair import pair_runs  # lazy, as in default_program

        hq, hkv = q.shape[1], k.shape[1]
        return "pair" if (pair_runs(q) and sink.numel() == window.numel() == hq
                          and not (hq > hkv and groups_share_band(sink, window, hq, hkv))) else "loop"
    return "loop"


def groups_share_band(sink: torch.Tensor, window: torch.Tensor, hq: int, hkv: int) -> bool:
    """Whether the query heads of every KV group share one sink and one window (CPU Int `[Hq]`), so that their A-shape
    runs as group-shared tiles on the GQA-packed loop (each K / V tile loaded once for the group's rows) where no
    Gluon kernel takes it (at head_dim 256: an odd group). At head_dim 256 that beat the pairs: H100, Gemma-3 4/1/256,
    sink 128, window 4096, 64K / 128K: 0.81 / 0.78 of dense per tile against 0.72 / 0.71 (kernels/NOTES.md, session
    37)."""
    return sink.numel() == window.numel() == hq and hq % hkv == 0 and bool(
        (sink.view(hkv, -1) == sink.view(hkv, -1)[:, :1]).all()
        & (window.view(hkv, -1) == window.view(hkv, -1)[:, :1]).all())
