"""Physical tiles of sparse-attention indexes, in plain PyTorch (no Triton; runs on CPU or GPU).

A sparse prefill kernel walks, for every (batch, head, query row block m of `block` rows), a list of
key *pieces* (`block`-wide key ranges, start positions in `block_offset`) and a list of single key
*columns* (`column_index`, gathered `block` at a time). `VSTiles` holds both for every pattern:

- Vertical-Slash: slash offset s covers, for row block m, the key range [m*b - s, (m+1)*b - s). In
  d-space (d = m*b - key) these ranges are the same for every row block; their union is covered by
  the fewest `block`-wide pieces (greedy from the diagonal down the keys: each piece starts at the
  highest key not yet covered), so a piece may stick out below a range, across a gap into the next
  range, and below key 0 (starts lie in (-block, n)). Pieces never overlap. Placing them in d-space
  makes every piece's distance from the row block independent of m, which is what lets `vs_to_tiles`
  run vectorised with no host sync.
  Columns inside any piece of a row block, or >= m*b, are dropped from its column list, so every
  remaining column is < m*b (strictly causal). Offset 0 is always present.
- Block-sparse: the pieces are the selected key blocks (`block_sparse_to_tiles`).
- A-shape: the pieces cover the window band, the sink tokens are columns (`ashape_to_tiles`); the
  kernel additionally applies the exact per-token sink/window mask.

Piece semantics (what kernels and `tiles_to_mask` compute): pieces of a row block are ascending; piece
t covers keys [p_t, min(p_t + w, p_{t+1})) intersected with [0, n) and j <= i (w = piece width, by
default the row block size; `width=64` with `block=128` gives 128-row tiles over 64-wide pieces). The
cut at the next piece's start means overlapping pieces never count a key twice. Padding (past the
counts) is -1 (`index_build.vs_tiles` leaves it unwritten).

Shapes: columns Long `[B, H, Kv]` (absolute key positions), offsets Long `[B, H, Ks]` (i - j),
block_index Int `[B, H, M, K]` (key-block ids, -1 padded). -1 entries are ignored everywhere,
duplicates count once, offsets >= n and columns >= n are ignored.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import masks
from .tiling import BLOCK, NO_WINDOW, band_on, ints_on


@dataclass
class VSTiles:
    """Per (batch, head, row block) key pieces and columns; M = ceil(n / block). Pieces are `piece`
    (= width or block) keys wide; width 64 with block 128 gives 128-row tiles over 64-wide pieces.

    block_count Int32 `[B, H, M]`, block_offset Int32 `[B, H, M, NS]` (piece starts, ascending),
    column_count Int32 `[B, H, M]`, column_index Int32 `[B, H, M, NC]` (ascending, all < m*block).
    The same columns per head, for a kernel that gathers each head's columns once (`prefill_ws`), optionally:
    head_columns Int32 `[B, H, KV]` (the head's unique columns ascending, then n), covered Int8
    `[B, H, n + block - 1]` (index d + block - 1 is 1 iff d = m*block - key lies under a piece, the same for
    every row block m): row block m reads column c iff c < m*block and covered[m*block - c + block - 1] == 0,
    which is its `column_index` list (`index_build.vs_tiles(head_columns=True)`).
    Rows outside the lists, optionally (Tri-shape's question): dense_from Int32 `[B, H]`, the first query row of each
    head that attends to every causal key (`NO_WINDOW`: none), and `dense_rows` > 0, the static count of last rows a
    launch computes densely after the lists (>= n - min(dense_from); `prefill_ref.last_rows_attention`); both unset
    (None, 0) without dense rows. The lists need not cover those rows, so a long question adds no list width.
    """

    block_count: torch.Tensor
    block_offset: torch.Tensor
    column_count: torch.Tensor
    column_index: torch.Tensor
    block: int = BLOCK
    width: int = 0  # piece width (and column strip width) in keys; 0 = `block`
    disjoint: bool = False  # pieces never overlap (p_t + piece <= p_{t+1}): the kernel skips the cut check
    columns: bool = True  # False: no column lists at all (block-sparse tiles; column_count all 0), known statically
    head_columns: torch.Tensor | None = None
    covered: torch.Tensor | None = None
    dense_from: torch.Tensor | None = None
    dense_rows: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.block_count.shape)

    @property
    def piece(self) -> int:
        return self.width or self.block

    def to(self, device: torch.device | str) -> VSTiles:
        return self.map(lambda t: t.to(device))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> VSTiles:
        """These tiles with `fn` applied to every tensor (head dimension 1 throughout)."""
        opt = [None if t is None else fn(t) for t in (self.head_columns, self.covered, self.dense_from)]
        return VSTiles(*(fn(t) for t in (self.block_count, self.block_offset, self.column_count, self.column_index)),
                       self.block, self.width, self.disjoint, self.columns, *opt, self.dense_rows)

    def with_dense_rows(self, parts: Sequence[VSTiles]) -> VSTiles:
        """These full-width tiles with room for the dense rows of `parts` (to be written by `write_heads`):
        dense_from all `NO_WINDOW`, dense_rows the widest part's; unchanged where no part has dense rows."""
        rows = max(t.dense_rows for t in parts)
        if not rows:
            return self
        B, H, _ = self.shape
        start = torch.full((B, H), NO_WINDOW, dtype=torch.int32, device=self.block_count.device)
        return dataclasses.replace(self, dense_from=start, dense_rows=rows)

    def dense_blocks(self) -> torch.Tensor | None:
        """Bool `[B, H, M]`: the row blocks that hold a dense row (counted as every causal key block: `tile_area`,
        `tile_count`); None without dense rows."""
        if self.dense_from is None:
            return None
        m = torch.arange(self.shape[-1], device=self.dense_from.device)
        return m >= (self.dense_from.long() // self.block)[..., None]

    def dense_mask(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor | None:
        """Bool, broadcast of `[B, H, 1, 1]` with query rows i and keys j: (i, j) lies in a dense row (causal);
        None without dense rows."""
        if self.dense_from is None:
            return None
        return masks.dense_rows(i, j, self.dense_from.to(i.device)[..., None, None])


def _check_bh(name: str, t: torch.Tensor, ndim: int = 3) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims ([B, H, ...]); got shape {tuple(t.shape)}")


def _compact(values: torch.Tensor, keep: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Move kept entries (last dim) to the front in order, pad with -1. Returns (Int32 packed, Int32 counts)."""
    count = keep.sum(-1)
    if width is None:
        width = max(int(count.max()) if count.numel() else 0, 1)
    pos = torch.where(keep, keep.cumsum(-1) - 1, width)
    pos = pos.clamp_max(width)  # entries beyond a too-small static width fall into the dump slot
    out = torch.full((*values.shape[:-1], width + 1), -1, dtype=torch.int32, device=values.device)
    out.scatter_(-1, pos, values.to(torch.int32))
    return out[..., :width], count.clamp_max(width).to(torch.int32)


def vs_to_tiles(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int = BLOCK,
                max_pieces: int | None = None, max_columns: int | None = None, width: int = 0) -> VSTiles:
    """Vertical-Slash index -> physical tiles (see module docstring).

    columns Long `[B, H, Kv]`, offsets Long `[B, H, Ks]`; n = sequence length. With `max_pieces` and
    `max_columns` given (static bounds, e.g. `vs_tile_bounds`) nothing syncs with the host; without
    them the widths are the exact maxima (one sync). `width`: piece width (0 = block).
    """
    _check_bh("columns", columns)
    _check_bh("offsets", offsets)
    if columns.shape[:2] != offsets.shape[:2]:
        raise ValueError(f"columns {tuple(columns.shape)} and offsets {tuple(offsets.shape)} must share [B, H]")
    B, H, _ = offsets.shape
    dev = offsets.device
    M = -(-n // block)
    w = width or block
    ends, covered = vs_pieces(offsets, n, block, static=max_pieces is not None, width=w)
    # Row block m uses every piece whose lowest key m*b - end is > -w (ends ascending, padding INT_MAX).
    hi, block_count = piece_ranges(ends, n, block, w)
    m_top = torch.arange(M, device=dev, dtype=torch.int32) * block + (w - 1)
    ns = max_pieces if max_pieces is not None else max(int(block_count.max()), 1)
    t = torch.arange(ns, device=dev)
    src = (hi.unsqueeze(-1).long() - 1 - t).clamp(min=0, max=ends.shape[-1] - 1)  # ascending keys
    starts = (m_top - (w - 1)).view(1, 1, M, 1) - torch.gather(ends.unsqueeze(2).expand(B, H, M, -1), 3, src)
    block_offset = torch.where(t < block_count.unsqueeze(-1), starts, -1).to(torch.int32)
    block_count = block_count.clamp(max=ns)
    # Columns: per row block keep those < m*b and not under any piece.
    c = unique_columns(columns, n).unsqueeze(2)  # [B, H, 1, Kv]
    m0 = (torch.arange(M, device=dev) * block).view(1, 1, M, 1)
    dc = (m0 - c).clamp(min=1, max=n - 1) + block - 1
    keep = (c < m0) & ~torch.gather(covered.unsqueeze(2).expand(B, H, M, -1), 3, dc.expand(B, H, M, -1))
    column_index, column_count = _compact(c.expand(B, H, M, -1), keep, max_columns)
    return VSTiles(block_count, block_offset, column_count, column_index, block, width, disjoint=True)


def vs_tile_count(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int = BLOCK,
                  budget: int = 1 << 25) -> torch.Tensor:
    """Long `[B, H]`: the 64x64 tiles `vs_to_tiles(columns, offsets, n, block)` holds, counted without
    building them: per row block its pieces plus its remaining columns packed `block` at a time.

    Memory O(n) per head plus `budget` elements: the pieces come from `vs_pieces` / `piece_ranges`;
    column c stays in row block m iff d = m*block - c > 0 is not covered, and the covered flags of
    every row block are one strided view of a padded copy (row block m reads it from m*block on), so a
    chunk of row blocks is a single gather of the columns (no `[M, Kv]` index tensor)."""
    _check_bh("columns", columns)
    _check_bh("offsets", offsets)
    B, H, kv = columns.shape
    M = -(-n // block)
    ends, covered = vs_pieces(offsets, n, block)
    pieces = piece_ranges(ends, n, block, block)[1].long().sum(-1)
    # flags[x] = covered at d = x - n - block (d <= 0: True), so row block m and column c read
    # flags[m*block + n + block - c]; invalid columns (= n) read d = m*block - n < 0
    flags = torch.cat([covered.new_ones(B, H, n + 1), covered], -1)
    at = (n + block - unique_columns(columns, n)).unsqueeze(2)  # [B, H, 1, Kv]
    strips = torch.zeros(B, H, dtype=torch.long, device=columns.device)
    step = max(1, budget // max(1, B * H * kv))
    for m0 in range(0, M, step):
        mc = min(M, m0 + step) - m0
        view = flags.as_strided((B, H, mc, n + block + 1), (*flags.stride()[:2], block, 1), flags.storage_offset() + m0 * block)
        kept = (~view.gather(-1, at.expand(B, H, mc, kv))).sum(-1)
        strips += (-(-kept // block)).sum(-1)
    return pieces + strips


def piece_ranges(ends: torch.Tensor, n: int, block: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a head's pieces each row block uses: (hi, count) Int32 `[B, H, M]`; row block m uses
    ends[hi - count : hi] (start m*block - end > -width, and < n)."""
    B, H, _ = ends.shape
    m0 = torch.arange(-(-n // block), device=ends.device, dtype=torch.int32) * block
    hi = torch.searchsorted(ends, (m0 + width - 1).expand(B, H, -1).contiguous(), right=True)
    lo = torch.searchsorted(ends, (m0 - n).expand(B, H, -1).contiguous(), right=True)
    return hi.to(torch.int32), (hi - lo).to(torch.int32)


def unique_columns(columns: torch.Tensor, n: int) -> torch.Tensor:
    """Columns `[..., Kv]` sorted ascending with -1, out-of-range and repeated entries replaced by n."""
    cols = torch.where((columns >= 0) & (columns < n), columns.long(), n).sort(-1).values
    dup = torch.nn.functional.pad(cols[..., 1:] == cols[..., :-1], (1, 0), value=False)
    return torch.where(dup, n, cols)


def vs_pieces(offsets: torch.Tensor, n: int, block: int = BLOCK, static: bool = False,
              width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-block-independent part of the VS tiles of each head.

    In d-space (key j of row block m sits at d = m*block - j) the merged slash ranges and their pieces
    are the same for every row block. Returns (ends Int32 `[B, H, P]`: each piece's d of its lowest key,
    ascending, padded with INT32_MAX; row block m uses the pieces with end <= m*block + width - 1 and
    piece start m*block - end), covered Bool `[B, H, n + block - 1]` (index d + block - 1: d lies under
    some piece). `static`: P = `max_pieces_total` (no host sync) instead of the exact maximum.
    `width`: piece width (0 = block).
    """
    w = width or block
    B, H, _ = offsets.shape
    dev = offsets.device
    off = offsets.long()
    valid = (off >= 0) & (off < n)
    bitmap = torch.zeros(B, H, n + 1, dtype=torch.int32, device=dev)
    bitmap.scatter_(-1, torch.where(valid, off, n), 1)
    bitmap[..., 0] = 1  # offset 0 always in
    # Key j is in some slash range of block m iff an offset lies in [d, d + block - 1], d in [-(block-1), n-1].
    cnt = torch.nn.functional.pad(bitmap[..., :n].cumsum(-1), (1, 0))  # cnt[x] = #offsets < x
    d = torch.arange(-(block - 1), n, device=dev)
    hit = (cnt[..., (d + block).clamp(max=n)] - cnt[..., d.clamp(min=0)]) > 0  # [B, H, n + block - 1]
    idx = torch.arange(hit.shape[-1], device=dev)
    piece = greedy_cover(hit, w)
    size = max_pieces_total(n, offsets.shape[-1], block, w) if static else None
    ends, count = _compact((d + w - 1).expand(B, H, -1), piece, size)  # ends may be < 0 when w < block
    live = torch.arange(ends.shape[-1], device=dev) < count.unsqueeze(-1)
    ends = torch.where(live, ends, torch.iinfo(torch.int32).max)
    pc = torch.nn.functional.pad(piece.int().cumsum(-1), (1, 0))
    covered = (pc[..., (idx + 1)] - pc[..., (idx + 1 - w).clamp(min=0)]) > 0
    return ends.contiguous(), covered


def greedy_cover(hit: torch.Tensor, width: int) -> torch.Tensor:
    """Fewest `width`-wide intervals covering every True of `hit` Bool `[..., L]`: their starts, Bool
    `[..., L]`. The greedy cover (each interval starts at the first hit not yet covered) is optimal for
    fixed widths; its starts are the orbit of the first hit under next(i) = first hit >= i + width,
    computed by pointer doubling (log2(L / width) gather/scatter passes, no host sync)."""
    L = hit.shape[-1]
    idx = torch.arange(L + 1, device=hit.device)
    first_hit = torch.where(torch.nn.functional.pad(hit, (0, 1)), idx, L)  # [..., L + 1], L = none
    first_hit = first_hit.flip(-1).cummin(-1).values.flip(-1)  # first hit >= i
    jump = first_hit.gather(-1, (idx + width).clamp(max=L).expand_as(first_hit))
    start = torch.zeros_like(first_hit).scatter_(-1, first_hit[..., :1], 1)
    for _ in range(max(L // width + 1, 1).bit_length()):  # the orbit has at most L / width + 1 members
        start = start.scatter_add(-1, jump, start).clamp_(max=1)
        jump = jump.gather(-1, jump)
    return start[..., :L].bool()


def max_pieces_total(n: int, n_offsets: int, block: int = BLOCK, width: int = 0) -> int:
    """Upper bound on the number of distinct pieces of one head (over all row blocks)."""
    w = width or block
    return min(n + block, n_offsets + 1 + -(-(n + block) // w))


def vs_tile_bounds(n: int, n_columns: int, n_offsets: int, block: int = BLOCK, width: int = 0) -> tuple[int, int]:
    """Static (max_pieces, max_columns) for `vs_to_tiles` without a host sync."""
    w = width or block
    return min(2 * (-(-n // w)) + 4, max_pieces_total(n, n_offsets, block, w)), max(n_columns, 1)


def ashape_to_tiles(sink: torch.Tensor | list[int], window: torch.Tensor | list[int], n: int, batch: int = 1,
                    block: int = BLOCK, device: torch.device | str | None = None, width: int = 0) -> VSTiles:
    """A-shape heads (sink tokens `[H]`, window `[H]`, both in tokens) -> tiles: window band as pieces,
    sinks as columns. The kernel applies the exact per-token mask (j < sink or i - j < window) on top.

    Closed form of `vs_to_tiles` on the offsets [0, window) and the columns [0, sink): the band of row
    block m (rows [m*b, m*b + b)) is one merged range, chopped from its end into pieces starting at
    m*b + b - w - k*w (k = 0, 1, ...) down to the first start <= m*b - window + 1; pieces with start
    <= -w or >= n are dropped; sinks below the lowest piece (and below m*b) are the columns. Only
    arange arithmetic on `device`: no host sync, nothing of size n."""
    sink = torch.as_tensor(sink, dtype=torch.long).reshape(-1).cpu()
    window = torch.as_tensor(window, dtype=torch.long).reshape(-1).cpu()
    if sink.shape != window.shape:
        raise ValueError(f"sink {tuple(sink.shape)} and window {tuple(window.shape)} must both be [H]")
    if bool((window < 1).any()) or bool((sink < 0).any()):
        raise ValueError("window must be >= 1 and sink >= 0 tokens per head")
    w = width or block
    M = -(-n // block)
    device = torch.get_default_device() if device is None else torch.device(device)  # e.g. a search's capture device
    win, sk = window.clamp(max=n), sink.clamp(max=n)
    pieces = (win + block - 2) // w + 1  # pieces per row block before the cuts at 0 and n, [H]
    ns, nc = int(pieces.max()), max(int(sk.max()), 1)
    sinks = bool(sk.max() > 0)  # (no sink anywhere: no column lists, e.g. dense heads)
    # cached device copies (`tiling.ints_on`): a copy from pageable host memory would wait for the GPU's queue to drain
    win, sk, pieces = (ints_on(t, device).long().view(-1, 1) for t in (win, sk, pieces))
    base = (torch.arange(M, device=device) * block + block - w).view(1, M)  # highest piece start, [1, M]
    k_hi = torch.minimum(pieces - 1, torch.div(base + w - 1, w, rounding_mode="floor"))  # start > -w
    k_lo = torch.div(base - n, w, rounding_mode="floor").add(1).clamp(min=0)  # start < n
    count = (k_hi - k_lo + 1).clamp(min=0)  # [H, M]
    t = torch.arange(ns, device=device)
    starts = base.unsqueeze(-1) - (k_hi.unsqueeze(-1) - t) * w
    block_offset = torch.where(t < count.unsqueeze(-1), starts, -1)
    low = (base - k_hi * w).clamp(min=0)  # lowest piece start: sinks from there on are under a piece
    ccount = torch.minimum(torch.minimum(sk, low), base - (block - w))  # sink columns below m*b
    c = torch.arange(nc, device=device)
    column_index = torch.where(c < ccount.unsqueeze(-1), c, -1)
    expand = lambda x: x.to(torch.int32).expand(batch, *x.shape).contiguous()  # noqa: E731
    return VSTiles(expand(count), expand(block_offset), expand(ccount), expand(column_index), block, width, True,
                   sinks)


def band_tiles(sink: torch.Tensor | Sequence[int], window: torch.Tensor | Sequence[int], n: int, batch: int,
               block: int, device: torch.device | str, width: int = 0
               ) -> tuple[VSTiles, tuple[torch.Tensor, torch.Tensor]]:
    """(`ashape_to_tiles` of the band, `tiling.band_on` (sink, window) Int32 `[H]`) on `device`, built once per
    (band, n, batch, block, device, width) and cached: A-shape and dense tiles depend on the config and the prompt
    length only, so a prefill rebuilds none of them. Read them, never write into them. (A sink / window on the GPU
    costs one host sync to key the cache.)"""
    key = [tuple(int(x) for x in torch.as_tensor(t).reshape(-1).tolist()) for t in (sink, window)]
    return _band_tiles(*key, n, batch, block, torch.device(device), width)


@functools.lru_cache(maxsize=256)
def _band_tiles(sink: tuple[int, ...], window: tuple[int, ...], n: int, batch: int, block: int,
                device: torch.device, width: int) -> tuple[VSTiles, tuple[torch.Tensor, torch.Tensor]]:
    tiles = ashape_to_tiles(list(sink), list(window), n, batch, block, device=device, width=width)
    return tiles, band_on(sink, window, device)


def block_sparse_to_tiles(block_index: torch.Tensor, n: int, block: int = BLOCK, width: int = 0) -> VSTiles:
    """Block-sparse index Int `[B, H, M, K]` (key-block ids of 64 tokens, -1 padded) -> tiles.

    Blocks above the diagonal are dropped, the diagonal is added, duplicates count once. With
    `block` = 128 the key blocks of each pair of row blocks are merged: into 128-wide pieces, or with
    `width` = 64 into the union of their 64-wide blocks."""
    if block_index.dim() != 4:
        raise ValueError(f"block_index must be [B, H, M, K]; got {tuple(block_index.shape)}")
    B, H, M64, K = block_index.shape
    if M64 != -(-n // BLOCK):
        raise ValueError(f"block_index has M={M64} row blocks but n={n} needs {-(-n // BLOCK)}")
    r = block // BLOCK
    w = width or block
    M = -(-n // block)
    dev = block_index.device
    bi = block_index.long()
    m64 = torch.arange(M64, device=dev).view(1, 1, M64, 1)
    bi = torch.where((bi >= 0) & (bi <= m64), bi // (w // BLOCK), -1)
    bi = torch.cat([bi, (m64 // (w // BLOCK)).expand(B, H, M64, 1)], -1)  # diagonal always in
    if M * r != M64:
        bi = torch.nn.functional.pad(bi, (0, 0, 0, M * r - M64), value=-1)
    bi = bi.view(B, H, M, r * (K + 1))
    big = M * r
    srt = torch.where(bi >= 0, bi, big).sort(-1).values
    keep = (srt < big) & torch.nn.functional.pad(srt[..., 1:] != srt[..., :-1], (1, 0), value=True)
    block_offset, block_count = _compact(srt * w, keep, None)
    empty = torch.full((B, H, M, 1), -1, dtype=torch.int32, device=dev)
    return VSTiles(block_count, block_offset, torch.zeros_like(block_count), empty, block, width, True, False)


def expand_groups(tiles: VSTiles, group: int) -> VSTiles:
    """Group-shared tiles (one list per KV head) -> the per-query-head tiles they stand for (H x group)."""
    return tiles.map(lambda t: t.repeat_interleave(group, 1))


def narrow_pieces(tiles: VSTiles, width: int, n: int) -> VSTiles:
    """The same keys as `tiles` in pieces of `width` keys (a divisor of `tiles.piece`): each piece [p, min(p + piece,
    next start)) becomes the sub-pieces p, p + width, ... below the next start, less those wholly before key 0 or
    after the row block's last row; columns stay (strips of `width`). A narrower piece holds fewer K/V bytes per
    stage (head_dim 256, 32 keys, 2 stages: 98 KB, two programs per SM; on the H100 no faster than 64 keys at 3
    stages: kernels/NOTES.md, session 27). `[B, H, M, NS]` -> `[B, H, M, NS * piece / width]`; no host sync."""
    if width < 16 or tiles.piece % width:
        raise ValueError(f"width must divide the tiles' piece width {tiles.piece} and be at least 16, got {width}")
    r = tiles.piece // width
    if r == 1:
        return tiles
    B, H, M, NS = tiles.block_offset.shape
    dev = tiles.block_offset.device
    starts = tiles.block_offset.long()
    slot = torch.arange(NS, device=dev)
    real = slot < tiles.block_count.unsqueeze(-1).long()
    nxt = torch.where(torch.nn.functional.pad(real[..., 1:], (0, 1)), starts.roll(-1, -1), 1 << 40)
    sub = starts.unsqueeze(-1) + torch.arange(0, tiles.piece, width, device=dev)  # [B, H, M, NS, r]
    last_row = (torch.arange(M, device=dev) * tiles.block + tiles.block - 1).clamp_max(n - 1).view(1, 1, M, 1, 1)
    keep = real.unsqueeze(-1) & (sub < nxt.unsqueeze(-1)) & (sub + width > 0) & (sub <= last_row)
    offset, count = _compact(sub.flatten(-2), keep.flatten(-2), NS * r)
    return dataclasses.replace(tiles, block_count=count, block_offset=offset, width=width)


def selected_block_tiles(block_index: torch.Tensor) -> VSTiles:
    """64-row tiles of an index that is already ascending, causal, duplicate-free, -1 padded and holds
    each row's diagonal block (what `index_build.block_index` and `block_proxy` return): the same tiles
    as `block_sparse_to_tiles(block_index, n)` by two elementwise ops (no sort, no host sync)."""
    if block_index.dim() != 4:
        raise ValueError(f"block_index must be [B, H, M, K]; got {tuple(block_index.shape)}")
    live = block_index >= 0
    offsets = torch.where(live, block_index * BLOCK, -1).to(torch.int32)
    count = live.sum(-1, dtype=torch.int32)
    empty = torch.full((*count.shape, 1), -1, dtype=torch.int32, device=block_index.device)
    return VSTiles(count, offsets, torch.zeros_like(count), empty, BLOCK, 0, True, False)


def write_heads(out: VSTiles, heads: slice | torch.Tensor, tiles: VSTiles) -> None:
    """Write one group's tiles (`[B, h, M]`) into the full-width `out` at `heads` (a slice or Long `[h]`)."""
    out.block_count[:, heads] = tiles.block_count
    out.block_offset[:, heads, :, : tiles.block_offset.shape[-1]] = tiles.block_offset
    out.column_count[:, heads] = tiles.column_count
    out.column_index[:, heads, :, : tiles.column_index.shape[-1]] = tiles.column_index
    if out.head_columns is not None and tiles.head_columns is not None:
        out.head_columns[:, heads, : tiles.head_columns.shape[-1]] = tiles.head_columns
        out.covered[:, heads] = tiles.covered
    if tiles.dense_from is not None:
        if out.dense_from is None or out.dense_rows < tiles.dense_rows:
            raise ValueError("the full-width tiles have no room for these dense rows: make them with `with_dense_rows`")
        out.dense_from[:, heads] = tiles.dense_from


def with_head_columns(tiles: VSTiles, parts: list[VSTiles]) -> VSTiles:
    """Full-width `tiles` (every head) given head_columns / covered wide enough for those of `parts` (no column
    per head: n padding, covered 0), to be filled by `write_heads`; unchanged unless some part has head columns
    and every part with column lists has them (else a kernel needs the per-row-block lists)."""
    with_cols = [t for t in parts if t.head_columns is not None]
    if not with_cols or any(t.columns and t.head_columns is None for t in parts):
        return tiles
    B, H, _ = tiles.shape
    L = with_cols[0].covered.shape[-1]
    n = L - tiles.block + 1
    kv = max(t.head_columns.shape[-1] for t in with_cols)
    dev = tiles.block_count.device
    return dataclasses.replace(tiles, head_columns=torch.full((B, H, kv), n, dtype=torch.int32, device=dev),
                               covered=torch.zeros(B, H, L, dtype=torch.int8, device=dev))


def widened(base: VSTiles, parts: list[VSTiles]) -> VSTiles:
    """A copy of full-width `base` with room for `parts` (written into it by `write_heads`): piece and column lists
    padded with -1 to the widest, `disjoint` / `columns` over all of them, head columns where `with_head_columns`
    keeps them."""
    def pad(x: torch.Tensor, width: int) -> torch.Tensor:
        return x.clone() if width == x.shape[-1] else torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-1)

    ns = max(t.block_offset.shape[-1] for t in (base, *parts))
    nc = max(t.column_index.shape[-1] for t in (base, *parts))
    out = VSTiles(base.block_count.clone(), pad(base.block_offset, ns), base.column_count.clone(),
                  pad(base.column_index, nc), base.block, base.width, all(t.disjoint for t in (base, *parts)),
                  any(t.columns for t in (base, *parts)))
    out = with_head_columns(out, [base, *parts]).with_dense_rows([base, *parts])
    if base.dense_from is not None:
        out.dense_from.copy_(base.dense_from)
    return out


def merge_tiles(parts: list[tuple[list[int] | torch.Tensor, VSTiles]], num_heads: int, cover: bool = True,
                head_index: Callable[[list[int]], slice | torch.Tensor] | None = None) -> VSTiles:
    """Tiles of head groups -> one `VSTiles` over all `num_heads` heads, for one launch over a layer
    whose heads use different patterns. parts: (head ids `[h]`, tiles with H = h) per group; every
    head must appear exactly once (`cover=False`: at most once, the others keep count 0 and -1 padding,
    to be filled in later by `write_heads`). Piece/column widths are padded to the widest group.
    `head_index(ids)`: the device index of a group's heads (e.g. cached, or a slice for a contiguous run);
    default a Long tensor made per group."""
    if len({(t.block, t.piece) for _, t in parts}) != 1:
        raise ValueError("all tiles must use the same block size and piece width")
    ids = sorted(torch.cat([torch.as_tensor(h, dtype=torch.long).reshape(-1) for h, _ in parts]).tolist())
    if (ids != list(range(num_heads))) if cover else (len(set(ids)) != len(ids) or not set(ids) <= set(range(num_heads))):
        raise ValueError(f"head ids must cover 0..{num_heads - 1} exactly once; got {ids}")
    t0 = parts[0][1]
    B, _, M = t0.shape
    ns = max(t.block_offset.shape[-1] for _, t in parts)
    nc = max(t.column_index.shape[-1] for _, t in parts)
    dev = t0.block_count.device
    out = VSTiles(torch.zeros(B, num_heads, M, dtype=torch.int32, device=dev),
                  torch.full((B, num_heads, M, ns), -1, dtype=torch.int32, device=dev),
                  torch.zeros(B, num_heads, M, dtype=torch.int32, device=dev),
                  torch.full((B, num_heads, M, nc), -1, dtype=torch.int32, device=dev), t0.block, t0.width,
                  all(t.disjoint for _, t in parts), any(t.columns for _, t in parts))
    out = with_head_columns(out, [t for _, t in parts]).with_dense_rows([t for _, t in parts])
    for h, t in parts:
        ids_h = torch.as_tensor(h, dtype=torch.long).reshape(-1).tolist()
        if t.shape != (B, len(ids_h), M):
            raise ValueError(f"tiles for heads {ids_h} have shape {t.shape}, expected {(B, len(ids_h), M)}")
        write_heads(out, head_index(ids_h) if head_index else torch.tensor(ids_h, device=dev), t)
    return out


@dataclass(frozen=True)
class PairItems:
    """The work of `prefill_pair.pair_prefill`: per item (b, head, row-block pair j) the ascending union of the two row blocks'
    piece starts and, per union piece, which of them holds it (bit 0: row block 2j, bit 1: 2j + 1).
    union / bits Int32 `[items, U]` (U = 2 x the tiles' list width, a static bound; entries past count: unused),
    count Int32 `[items]`, order Int32 `[items]` (the launch order, `ordered`); items = B * H * ceil(M / 2)."""

    union: torch.Tensor
    bits: torch.Tensor
    count: torch.Tensor
    order: torch.Tensor

    @classmethod
    def ordered(cls, union: torch.Tensor, bits: torch.Tensor, count: torch.Tensor, heads: int) -> PairItems:
        """The items of `heads` (b, head) runs with their launch order: one head after another, each head's pairs
        last first (the programs running together read one region of one head's keys, held in L2). H100, Gemma-3
        4/1/256, block top-100, 64K / 128K: 1.09x / 1.24x faster than longest union first, which interleaved the
        heads (`pair_order_probe_0f9a382_h100.json`, kernels/NOTES.md session 37). Cached per shape: read it."""
        return cls(union, bits, count, _head_runs(heads, count.numel() // heads, count.device))


@functools.lru_cache(maxsize=64)
def _head_runs(heads: int, pairs: int, device: torch.device) -> torch.Tensor:
    """Int32 `[heads * pairs]`: item (head, j) = head * pairs + j, head-major, j descending."""
    return torch.arange(heads * pairs, dtype=torch.int32, device=device).view(heads, pairs).flip(1).reshape(-1)


def member_union(lists: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per item, the ascending union of its P members' lists and, per union entry, the bits of the members that hold
    it (bit j: member j), by one sort of the item's P x K entries. lists Int `[items, P, K]` (each member's live
    entries ascending, distinct, >= 0), live Bool alike. Returns (union Int32 `[items, P * K]`, entries past count
    past every value; bits Int32 alike, 0 past count; count Int32 `[items]`)."""
    items, P, K = lists.shape
    big = torch.iinfo(torch.int32).max // 4  # past every value: dead entries sort last
    start = torch.where(live, lists, big).reshape(items, P * K).long()
    member = torch.arange(P * K, device=lists.device) // K
    code, _ = torch.sort(start * P + member, dim=-1)  # ascending values, lower members first on a tie
    key, who = code // P, code % P
    first = torch.ones_like(key, dtype=torch.bool)
    first[:, 1:] = key[:, 1:] != key[:, :-1]
    slot = first.long().cumsum(-1) - 1  # the union position of each sorted entry
    union = torch.full_like(key, big).scatter_(1, slot, key)
    bits = torch.zeros_like(key).scatter_add_(1, slot, (1 << who) * (key < big))
    count = (first & (key < big)).sum(-1).to(torch.int32)
    return union.to(torch.int32), bits.to(torch.int32), count


def pair_items_ref(tiles: VSTiles) -> PairItems:
    """`PairItems` of per-head tiles `[B, H, M]` (piece starts in tokens, ascending, `block_count` valid per row
    block) by `member_union` over row blocks 2j and 2j + 1: the reference of `prefill_pair.pair_items`, which merges
    them in one launch."""
    B, H, M, NS = tiles.block_offset.shape
    live = torch.arange(NS, device=tiles.block_offset.device) < tiles.block_count[..., None]
    pad = (0, 0, 0, M % 2)  # an odd M's last pair: row block 2j alone
    union, bits, count = member_union(torch.nn.functional.pad(tiles.block_offset, pad).view(-1, 2, NS),
                                      torch.nn.functional.pad(live, pad).view(-1, 2, NS))
    return PairItems.ordered(union, bits, count, B * H)


def tiles_to_mask(tiles: VSTiles, n: int, sink: torch.Tensor | None = None,
                  window: torch.Tensor | None = None) -> torch.Tensor:
    """Bool `[B, H, n, n]` of the keys a kernel computes (small n only). Optional per-head `sink` and
    `window` (tokens, `[H]`) add the A-shape token mask."""
    H = tiles.shape[1]
    dev = tiles.block_count.device
    i, j = torch.arange(n, device=dev).view(-1, 1), torch.arange(n, device=dev).view(1, -1)
    mask = masks.tile(tile_keys(tiles, n), i, j, tiles.block, key_block=1) & masks.causal(i, j)  # [B, H, n, n]
    if window is not None:
        sink = torch.as_tensor(sink, device=dev).view(1, H, 1, 1)
        window = torch.as_tensor(window, device=dev).view(1, H, 1, 1)
        mask &= masks.band(i, j, sink, window)
    dense = tiles.dense_mask(i, j)
    return mask if dense is None else mask | dense


def tile_keys(tiles: VSTiles, n: int) -> torch.Tensor:
    """Bool `[B, H, M, n]`: the keys each row block's tiles cover, pieces (each cut at the next one's start, as the
    kernel cuts it) and column strips, before the causal and A-shape masks."""
    count = tiles.block_count.unsqueeze(-1).long()
    t = torch.arange(tiles.block_offset.shape[-1], device=count.device)
    start = tiles.block_offset.long()
    nxt = torch.cat([start[..., 1:], torch.full_like(start[..., :1], 1 << 40)], -1)
    end = torch.minimum(start + tiles.piece, torch.where(t + 1 < count, nxt, 1 << 40))
    start, end = start.clamp(0, n), end.clamp(0, n)
    live = (t < count) & (end > start)
    edges = torch.zeros(*tiles.shape, n + 1, dtype=torch.int32, device=count.device)  # +1 at a start, -1 past an end
    edges.scatter_add_(-1, torch.where(live, start, n), live.int())
    edges.scatter_add_(-1, torch.where(live, end, n), -live.int())
    keys = edges.cumsum(-1)[..., :n] > 0
    cols = torch.arange(tiles.column_index.shape[-1], device=count.device)
    hit = torch.zeros(*tiles.shape, n + 1, dtype=torch.bool, device=count.device)
    hit.scatter_(-1, torch.where(cols < tiles.column_count.unsqueeze(-1).long(), tiles.column_index.long(), n), True)
    return keys | hit[..., :n]


def tile_area(tiles: VSTiles, n: int) -> torch.Tensor:
    """Physical (query, key) pairs computed per head, Long `[B, H]` (piece rows x piece width + column
    strips, before causal masking; what the loop's tensor cores do). The Gluon kernel walks head columns as whole
    64-key strips (a row block's columns rounded up, the covered ones masked, `prefill_ws`) and pairs items in
    128-key steps (an odd last item adds a masked half): a little more than this. A row block that holds dense rows
    counts as every causal key block (its band pieces and dense rows cost about that)."""
    M = tiles.shape[-1]
    rows = torch.full((M,), tiles.block, device=tiles.block_count.device)
    rows[-1] = n - (M - 1) * tiles.block
    per_block = tiles.block_count.long() * tiles.piece + tiles.column_count.long()
    dense = tiles.dense_blocks()
    if dense is not None:  # a row block that holds dense rows: every causal key block
        per_block = torch.where(dense, (torch.arange(M, device=dense.device) + 1) * tiles.block, per_block)
    return (per_block * rows).sum(-1)
