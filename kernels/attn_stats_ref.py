"""Exact dense attention statistics in plain PyTorch, blockwise over query rows (the reference of
`attn_stats`, and the CPU path of `workbench.analysis`).

The softmax runs over the true causal row but only `chunk` query rows at a time, so memory holds
`[H, chunk, N]` probabilities, never an n x n matrix per head. Every statistic is a reduction of
those row chunks (`attention_rows`).

q `[Hq, N, D]`, k `[Hkv, N, D]`; query head h reads KV head h // (Hq // Hkv). Masses are in "rows"
(a row's probabilities add up to 1): divide by the number of rows for a fraction.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from .index_ref import VSTiles, tiles_to_mask
from .tiling import BLOCK

MASKED = -1e30  # finite "minus infinity": exp() underflows to exactly 0 and 0 * MASKED stays finite
MAPS = ("max_map", "mean_map", "block_mass", "column_mass", "diag_mass", "row_entropy")


class RowMasked(Protocol):
    """A sparse index that can say which keys each query row keeps."""

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        """Bool `[H, r1 - r0, n]`: True where query row r0 + t keeps key j."""
        ...


def check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    """Refuse q / k that are not `[Hq, N, D]` / `[Hkv, N, D]` with Hq a multiple of Hkv, empty, or not finite."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[1:] != k.shape[1:] or q.shape[0] % k.shape[0]:
        raise ValueError(f"expected q [Hq, N, D] and k [Hkv, N, D] with Hq a multiple of Hkv, "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[1] == 0:
        raise ValueError("the capture is empty (N = 0): capture at least one token")
    if not all(torch.isfinite(x).all() for x in (*torch.aminmax(q), *torch.aminmax(k))):  # NaN propagates
        raise ValueError("q or k contains NaN/inf: check the model dtype (fp16 overflow?) and the capture")


def check_rows(rows: tuple[int, int] | None, n: int) -> tuple[int, int]:
    """`rows` (None = all) as (start, stop) with 0 <= start < stop <= n, or a clear error."""
    start, stop = (0, n) if rows is None else rows
    if not 0 <= start < stop <= n:
        raise ValueError(f"rows={rows} must satisfy 0 <= start < stop <= N = {n}: pick query rows inside the capture")
    return start, stop


def attention_rows(q: torch.Tensor, k: torch.Tensor, scale: float, chunk: int = 256, entropy: bool = False,
                   rows: tuple[int, int] | None = None
                   ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """Yield (r0, r1, p, h) for query rows [r0, r1): p `[Hq, r1 - r0, r1]` fp32 causal softmax over
    keys 0..r1-1 (zeros where j > i), contiguous; h `[Hq, r1 - r0]` row entropy in nats when `entropy`.

    `rows=(start, stop)` walks only query rows [start, stop) (exact: each row still sees all its keys).
    p lives in a buffer that the next chunk overwrites (no allocation per chunk): use or copy it
    before advancing the iterator.
    """
    check_qk(q, k)
    Hq, n, d = q.shape
    Hkv = k.shape[0]
    g = Hq // Hkv
    start, stop = check_rows(rows, n)
    kt = k.float().transpose(1, 2)
    width = min(chunk, stop - start)
    scores = torch.empty(Hq * width * stop, device=q.device)
    probs = torch.empty_like(scores) if entropy else None  # the entropy reads scores and p together
    causal = torch.full((width, width), MASKED, device=q.device).triu_(1)  # added to the diagonal block
    for r0 in range(start, stop, chunk):
        r1 = min(stop, r0 + chunk)
        c = r1 - r0
        s = scores[:Hq * c * r1].view(Hkv, g * c, r1)
        torch.matmul((q[:, r0:r1].float() * scale).reshape(Hkv, g * c, d), kt[:, :, :r1], out=s)
        s = s.view(Hq, c, r1)
        s[:, :, r0:].add_(causal[:c, :c])  # |s| << 1e30: masked scores become exactly MASKED
        if not entropy:  # one fused pass per row, in place
            yield r0, r1, torch.softmax(s, -1, out=s), None
            continue
        s.sub_(s.amax(-1, keepdim=True))  # s - max s <= 0 keeps the entropy's dot product well conditioned
        p = torch.softmax(s, -1, out=probs[:Hq * c * r1].view(Hq, c, r1))
        # H = log z - sum_j p_j (s_j - max s), and the row maximum has p = 1 / z; masked keys add 0 * -1e30 = 0
        h = p.amax(-1).log_().neg_() - s.mul_(p).sum(-1)
        yield r0, r1, p, h


@dataclass
class LayerStats:
    """Statistics of all query heads of one layer (fp32); a map that was not requested is None.

    max_map / mean_map `[H, R, R]`: probability pooled over `cell` x `cell` squares (R = ceil(N / cell)).
    block_mass `[H, M, M]`: probability mass of each `block` x `block` tile (sums over its rows).
    column_mass `[H, N]`: mass each key receives, summed over rows. diag_mass `[H, N]`: mass at offset
    i - j = d, summed over rows. row_entropy `[H, N]` in nats. All masses are in "rows": divide by N
    for a fraction of the head's total attention.
    """

    n: int
    cell: int
    block: int
    max_map: torch.Tensor | None
    mean_map: torch.Tensor | None
    block_mass: torch.Tensor | None
    column_mass: torch.Tensor | None
    diag_mass: torch.Tensor | None
    row_entropy: torch.Tensor | None


def stats_layout(n: int, resolution: int, block: int, maps: Collection[str]) -> tuple[set[str], int]:
    """Check `layer_stats` arguments -> (the requested maps, the pooling cell ceil(n / resolution))."""
    if resolution < 1 or block < 1:
        raise ValueError(f"resolution and block must be >= 1, got resolution={resolution}, block={block}")
    want = set(maps)
    if not want or want - set(MAPS):
        raise ValueError(f"maps={sorted(want)} must be a non-empty subset of {MAPS}")
    return want, math.ceil(n / resolution)


def cell_sizes(n: int, cell: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`[R]`: how many positions each pooled cell holds (the last one may be smaller)."""
    R = math.ceil(n / cell)
    sizes = torch.full((R,), float(cell), device=device)
    sizes[-1] = n - (R - 1) * cell
    return sizes


def diagonal_sums(p: torch.Tensor) -> torch.Tensor:
    """The last C rows of a causal probability chunk `[H, C, W]` -> `[H, W]` sums by offset d = i - j.

    Row t is query i = W - C + t. Viewing p with row stride W + 1 shifts row t right by t, which puts
    offset d <= W - C of every row in column W - C - d; a product with ones sums those diagonals. The
    larger offsets lie in the first C keys: the same view of that corner, left-padded by C zeros.
    """
    H, c, w = p.shape
    p = p.contiguous()
    ones = p.new_ones(H, 1, c)
    near = p.as_strided((H, c, w - c + 1), (c * w, w + 1, 1), p.storage_offset())
    corner = torch.nn.functional.pad(p[:, :, :c - 1], (c, 0))  # [H, C, 2C - 1]: key j at column C + j
    far = corner.as_strided((H, c, c), (c * (2 * c - 1), 2 * c, 1))  # column x = C - (t - j)
    return torch.cat([torch.matmul(ones, near)[:, 0].flip(-1), torch.matmul(ones, far)[:, 0, 1:].flip(-1)], -1)


def _pool(x: torch.Tensor, rows: int, cols: int, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Reduce `[H, A, W]` over groups of `rows` rows, then of `cols` columns -> `[H, A / rows, W / cols]`.

    Rows first: that reduction runs along contiguous rows (vectorised) and shrinks the data for the next."""
    H, a, w = x.shape
    if rows > 1:
        x = reduce(x.view(H, a // rows, rows, w), dim=2)
    return x if cols == 1 else reduce(x.view(H, a // rows, w // cols, cols), dim=3)


def layer_stats(q: torch.Tensor, k: torch.Tensor, scale: float, resolution: int = 1024, block: int = BLOCK,
                chunk: int = 256, progress: Callable[[Iterable, int], Iterable] | None = None,
                maps: Collection[str] = MAPS) -> LayerStats:
    """The requested statistics (`maps`, a subset of `MAPS`) of one layer in one pass over row chunks.

    `resolution` caps the pooled maps at R x R cells. Every map costs passes over the `[Hq, chunk, N]`
    probabilities: request only those you read. `progress(chunks, total)` may wrap the walk over the
    row chunks (a progress bar).
    """
    check_qk(q, k)
    Hq, n, _ = q.shape
    want, cell = stats_layout(n, resolution, block, maps)
    unit = math.lcm(cell, block)
    chunk = max(unit, chunk // unit * unit)
    R, M = math.ceil(n / cell), math.ceil(n / block)
    padded = math.ceil(n / unit) * unit  # maps are filled at the padded size, then cropped
    Rp, Mp = padded // cell, padded // block
    dev = q.device
    shapes = {"max_map": (Rp, Rp), "mean_map": (Rp, Rp), "block_mass": (Mp, Mp), "column_mass": (n,),
              "diag_mass": (n,), "row_entropy": (n,)}
    out = LayerStats(n, cell, block, **{m: torch.zeros(Hq, *shapes[m], device=dev) if m in want else None for m in MAPS})
    pooled = bool(want & {"max_map", "mean_map", "block_mass"})
    nested = block % cell == 0  # block row sums are sums of cell row sums
    rows = attention_rows(q, k, scale, chunk=chunk, entropy="row_entropy" in want)
    for r0, r1, p, h in (rows if progress is None else progress(rows, math.ceil(n / chunk))):
        if h is not None:
            out.row_entropy[:, r0:r1] = h
        if out.diag_mass is not None:
            out.diag_mass[:, :r1] += diagonal_sums(p)
        if pooled and r1 % unit:  # only the last chunk is ragged: pad it to whole cells and blocks
            c, w = math.ceil((r1 - r0) / unit) * unit, math.ceil(r1 / unit) * unit
            p = torch.nn.functional.pad(p, (0, w - r1, 0, c - (r1 - r0)))
        c, w = p.shape[1:]
        a, b = r0 // cell, w // cell  # this chunk's cells: rows a.., columns ..b
        if out.max_map is not None:
            out.max_map[:, a:a + c // cell, :b] = _pool(p, cell, cell, torch.amax)
        sums = p  # the finest row sums computed so far: [Hq, c / rows, w]
        if out.mean_map is not None or (nested and out.block_mass is not None):
            sums = _pool(p, cell, 1, torch.sum)
            if out.mean_map is not None:
                out.mean_map[:, a:a + c // cell, :b] = _pool(sums, 1, cell, torch.sum)
        if out.block_mass is not None:
            sums = _pool(sums, block // cell, 1, torch.sum) if nested else _pool(p, block, 1, torch.sum)
            out.block_mass[:, r0 // block:(r0 + c) // block, :w // block] = _pool(sums, 1, block, torch.sum)
        if out.column_mass is not None:
            out.column_mass[:, :r1] += sums.sum(1)[:, :r1]
    if out.max_map is not None:
        out.max_map = out.max_map[:, :R, :R].contiguous()
    if out.mean_map is not None:  # mean over the in-range positions of each cell (the last cell may be smaller)
        sizes = cell_sizes(n, cell, dev)
        out.mean_map = out.mean_map[:, :R, :R] / (sizes[:, None] * sizes[None, :])
    if out.block_mass is not None:
        out.block_mass = out.block_mass[:, :M, :M].contiguous()
    return out


def captured_mass(q: torch.Tensor, k: torch.Tensor, scale: float, index: RowMasked,
                  chunk: int = 256) -> torch.Tensor:
    """Exact dense probability mass that `index` keeps, per query row: `[Hq, N]` in [0, 1]."""
    Hq, n, _ = q.shape
    out = torch.empty(Hq, n, device=q.device)
    for r0, r1, p, _ in attention_rows(q, k, scale, chunk=chunk):
        keep = index.row_mask(r0, r1, n)
        if keep.shape != (Hq, r1 - r0, n):
            raise ValueError(f"index.row_mask({r0}, {r1}, {n}) returned shape {tuple(keep.shape)}, "
                             f"expected {(Hq, r1 - r0, n)}: build the index for all {Hq} query heads")
        out[:, r0:r1] = (p * keep[:, :, :r1].to(p.device)).sum(-1)
    return out


@dataclass
class LayerSums:
    """Exact sums of one layer's dense attention over the query rows `rows` = [r0, r1) (units: rows of
    that segment; divide by r1 - r0 for fractions).

    column_mass `[H, N]`, diag_mass `[H, N]` (by offset i - j), block_mass `[H, m1 - m0, M]`: the
    `block` x `block` tile masses of the segment's row blocks `block_rows` = (m0, m1) only (all rows:
    `[H, M, M]`, M = ceil(N / block)), lse `[H, N]`: each row's log-normaliser, so p[i, j] =
    exp(scale q_i.k_j - lse[i]) for j <= i (rows outside the segment hold 0)."""

    column_mass: torch.Tensor
    diag_mass: torch.Tensor
    block_mass: torch.Tensor
    lse: torch.Tensor
    rows: tuple[int, int] = (0, 0)
    block: int = BLOCK

    @property
    def n_rows(self) -> int:
        """How many query rows the sums cover (the denominator of a mass fraction)."""
        return self.rows[1] - self.rows[0]

    @property
    def block_rows(self) -> tuple[int, int]:
        """(m0, m1): the row blocks `block_mass` holds, those that meet the segment's rows."""
        return self.rows[0] // self.block, -(-self.rows[1] // self.block)


@torch.no_grad()
def layer_sums(q: torch.Tensor, k: torch.Tensor, scale: float, block: int = BLOCK, chunk: int = 256,
               rows: tuple[int, int] | None = None) -> LayerSums:
    """One pass over the query rows `rows` (default all): the sums the search needs (a lean
    `layer_stats` plus lse). `rows=(n - 64, n)` gives the answer rows' sums (O(n) memory: the tile
    masses of their row blocks only)."""
    hq, n, d = q.shape
    r_start, r_stop = check_rows(rows, n)
    g = hq // k.shape[0]
    m = -(-n // block)
    m0 = r_start // block
    chunk = max(block, chunk // block * block)
    dev = q.device
    col, diag = torch.zeros(hq, n, device=dev), torch.zeros(hq, n, device=dev)
    tiles, lse = torch.zeros(hq, -(-r_stop // block) - m0, m, device=dev), torch.zeros(hq, n, device=dev)
    kq = k.float().repeat_interleave(g, 0)  # [Hq, N, D]
    for r0, r1, p, _ in attention_rows(q, k, scale, chunk=chunk, rows=(r_start, r_stop)):
        col[:, :r1] += p.sum(1)
        diag[:, :r1] += diagonal_sums(p)
        pad_top, pad_c = r0 % block, -r1 % block  # rows r0..r1-1 sit inside whole row blocks once padded
        pad_r = -(r1 - r0 + pad_top) % block
        b0, b1 = r0 // block - m0, -(-r1 // block) - m0
        tiles[:, b0:b1, :-(-r1 // block)] += torch.nn.functional.pad(p, (0, pad_c, pad_top, pad_r)).reshape(
            hq, (r1 - r0 + pad_top + pad_r) // block, block, (r1 + pad_c) // block, block).sum((2, 4))
        # the row maximum has p = 1 / z, so lse = s_max - log p_max (p_max >= 1/n: no underflow)
        p_max, j_max = p.max(-1)
        k_max = kq.gather(1, j_max[..., None].expand(-1, -1, d))
        lse[:, r0:r1] = (q[:, r0:r1].float() * k_max).sum(-1) * scale - p_max.log()
    return LayerSums(col, diag, tiles, lse, (r_start, r_stop), block)


def offset_rows(rows: int | tuple[int, int] | None, n: int) -> tuple[int, int]:
    """`column_offset_mass`'s `rows` (None: all; an int: rows < rows; a pair: [r0, r1)) as (r0, r1)."""
    return (0, n) if rows is None else (0, min(rows, n)) if isinstance(rows, int) else rows


def prefix_levels(prefixes: list[int], width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Long `[width]`: the index of the first prefix that holds rank r (ascending budgets `prefixes`)."""
    return torch.searchsorted(torch.tensor(prefixes, device=device), torch.arange(width, device=device), right=True)


@torch.no_grad()
def column_offset_mass(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor,
                       column_sets: list[torch.Tensor], prefixes: list[list[int]] | None = None,
                       rows: int | tuple[int, int] | None = None, chunk: int | None = None) -> list[torch.Tensor]:
    """Mass that sets of columns hold at each offset: for columns `[Hq, V]` (-1 padded, no duplicates)
    `[Hq, N]` = sum over j in the set of p[j + d, j] (units: rows), with p recomputed only at those
    columns from the row log-normalisers `lse` `[Hq, N]` (`layer_sums`). `rows` limits the sum to query rows
    < rows (an int) or to rows [r0, r1) (a pair; `lse` must hold those rows).

    With `prefixes[i]` (ascending budgets), set i is read in preference order and its result is
    `[P, Hq, N]`: the sums of its first prefixes[i][0], [1], ... columns (nested budgets at the cost of
    the largest)."""
    hq, n, _ = q.shape
    g = hq // k.shape[0]
    r_start, rows = offset_rows(rows, n)
    nested = prefixes is not None
    prefixes = prefixes or [[cols.shape[-1]] for cols in column_sets]
    out = []
    kf = k.float()
    dev = q.device
    for cols, pre in zip(column_sets, prefixes):
        cols = cols[:, :max(pre)].long().to(dev)
        levels = len(pre)
        level = prefix_levels(pre, cols.shape[-1], dev)  # [V]
        valid = cols >= 0
        all_valid = bool(valid.all())
        safe = torch.where(valid, cols, 0)
        level_offset = (level * (n + 1))[None, None, :]
        keys = kf.repeat_interleave(g, 0).gather(1, safe[..., None].expand(-1, -1, kf.shape[-1]))  # [Hq, V, D]
        acc = torch.zeros(hq, levels * (n + 1), device=dev)
        step = chunk or max(64, (1 << 22) // max(1, hq * cols.shape[-1]))  # ~4M probabilities at a time
        for r0 in range(r_start, rows, step):
            r1 = min(rows, r0 + step)
            i = torch.arange(r0, r1, device=dev)[None, :, None]
            s = (q[:, r0:r1].float() @ keys.transpose(1, 2)).mul_(scale).sub_(lse[:, r0:r1, None])  # [Hq, C, V]
            d = i - safe[:, None, :]
            dead = d < 0
            if not all_valid:
                dead |= ~valid[:, None, :]
            vals = s.masked_fill_(dead, float("-inf")).exp_()
            slot = d.clamp_(min=0).add_(level_offset)  # dead entries add 0 wherever they land
            acc.scatter_add_(1, slot.reshape(hq, -1), vals.reshape(hq, -1))
        out.append(acc.view(hq, levels, n + 1)[:, :, :n].cumsum(1).transpose(0, 1))
    return out if nested else [t[0] for t in out]


@dataclass
class TokenRule:
    """A sparse index as a kernel reads it: the tiles it visits and which tokens of them it keeps.

    Query row i keeps key j <= i when (i, j) lies in `tiles` (`[1, H, M]`, piece / column semantics of
    `index_ref`) and (key j is in `keys[h]`, or offset i - j is in `offsets[h]`), or when row i is one of the
    tiles' dense rows (every causal key). keys / offsets Bool `[H, N]`; both None: every token of the tiles."""

    tiles: VSTiles
    keys: torch.Tensor | None = None
    offsets: torch.Tensor | None = None

    @classmethod
    def banded(cls, tiles: VSTiles, sink: torch.Tensor, window: torch.Tensor, n: int) -> TokenRule:
        """Tiles plus the A-shape token band (j < sink or i - j < window, `[H]` tokens)."""
        j = torch.arange(n, device=tiles.block_count.device)
        sink, window = (torch.as_tensor(x, device=j.device).reshape(-1, 1) for x in (sink, window))
        return cls(tiles, j < sink, j < window)

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        """Bool `[H, r1 - r0, n]` of the kept keys of query rows r0..r1-1 (small n: it builds the tiles' n x n)."""
        mask = tiles_to_mask(self.tiles, n)[0, :, r0:r1]
        i = torch.arange(r0, r1, device=mask.device)[:, None]
        j = torch.arange(n, device=mask.device)[None, :]
        if self.keys is None and self.offsets is None:
            keep = torch.ones_like(mask)
        else:
            keep = torch.zeros_like(mask)
            if self.keys is not None:
                keep |= self.keys[:, None, :].to(mask.device)
            if self.offsets is not None:
                keep |= self.offsets.to(mask.device)[:, (i - j).clamp(min=0)]
        dense = self.tiles.dense_mask(i, j)
        if dense is not None:
            keep |= dense[0].to(mask.device)
        return mask & keep
