"""Exact dense attention statistics, computed blockwise.

The softmax runs over the true causal row but only `chunk` query rows at a time, so memory holds
`[H, chunk, N]` probabilities, never an n x n matrix per head. Every statistic is a reduction of
those row chunks (`attention_rows`), which the pattern metrics reuse.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm.auto import tqdm

_MASKED = -1e30  # finite "minus infinity": exp() underflows to exactly 0 and 0 * _MASKED stays finite


class RowMasked(Protocol):
    """A sparse index that can say which keys each query row keeps."""

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        """Bool `[H, r1 - r0, n]`: True where query row r0 + t keeps key j."""
        ...


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[1:] != k.shape[1:] or q.shape[0] % k.shape[0]:
        raise ValueError(f"expected q [Hq, N, D] and k [Hkv, N, D] with Hq a multiple of Hkv, "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[1] == 0:
        raise ValueError("the capture is empty (N = 0): capture at least one token")
    if not (torch.isfinite(q).all() and torch.isfinite(k).all()):
        raise ValueError("q or k contains NaN/inf: check the model dtype (fp16 overflow?) and the capture")


def attention_rows(q: torch.Tensor, k: torch.Tensor, scale: float, chunk: int = 256, entropy: bool = False,
                   left_pad: bool = False, rows: tuple[int, int] | None = None
                   ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """Yield (r0, r1, p, h) for query rows [r0, r1): p `[Hq, r1 - r0, r1]` fp32 causal softmax over
    keys 0..r1-1 (zeros where j > i); h `[Hq, r1 - r0]` row entropy in nats when `entropy`.

    q `[Hq, N, D]`, k `[Hkv, N, D]`; query head h reads KV head h // (Hq // Hkv).
    `rows=(start, stop)` walks only query rows [start, stop) (exact: each row still sees all its keys).
    `left_pad=True` makes p a view into a buffer with r1 - r0 zero columns before key 0 (see
    `diagonal_sums`); the values are the same.
    """
    _check_qk(q, k)
    Hq, n, d = q.shape
    Hkv = k.shape[0]
    g = Hq // Hkv
    start, stop = (0, n) if rows is None else rows
    if not 0 <= start < stop <= n:
        raise ValueError(f"rows={rows} must satisfy 0 <= start < stop <= N = {n}: pick query rows inside the capture")
    kt = k.float().transpose(1, 2)
    for r0 in range(start, stop, chunk):
        r1 = min(stop, r0 + chunk)
        c = r1 - r0
        qc = (q[:, r0:r1].float() * scale).reshape(Hkv, g * c, d)
        s = torch.matmul(qc, kt[:, :, :r1]).view(Hq, c, r1)
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).triu_(1)
        s[:, :, r0:].masked_fill_(causal, _MASKED)
        s.sub_(s.amax(-1, keepdim=True))
        buf = s.new_zeros(Hq, c, c + r1) if left_pad else s.new_empty(Hq, c, r1)
        p = torch.exp(s, out=buf[:, :, buf.shape[2] - r1:])
        z = p.sum(-1, keepdim=True)
        h = (z.log() - torch.linalg.vecdot(p, s).unsqueeze(-1) / z).squeeze(-1) if entropy else None
        yield r0, r1, p.div_(z), h


@dataclass
class LayerStats:
    """Statistics of all query heads of one layer (fp32).

    max_map / mean_map `[H, R, R]`: probability pooled over `cell` x `cell` squares (R = ceil(N / cell)).
    block_mass `[H, M, M]`: probability mass of each `block` x `block` tile (sums over its rows).
    column_mass `[H, N]`: mass each key receives, summed over rows. diag_mass `[H, N]`: mass at offset
    i - j = d, summed over rows. row_entropy `[H, N]` in nats. All masses are in "rows": divide by N
    for a fraction of the head's total attention.
    """

    n: int
    cell: int
    block: int
    max_map: torch.Tensor
    mean_map: torch.Tensor
    block_mass: torch.Tensor
    column_mass: torch.Tensor
    diag_mass: torch.Tensor
    row_entropy: torch.Tensor


def _pool(p: torch.Tensor, size: int, op: str) -> torch.Tensor:
    """Pool `[H, C, W]` (C, W multiples of size) over size x size squares -> `[H, C/size, W/size]`."""
    if size == 1:
        return p
    H, c, w = p.shape
    reduce = torch.amax if op == "max" else torch.sum
    rows = reduce(p.reshape(H, c // size, size, w), dim=2)
    return reduce(rows.view(H, c // size, w // size, size), dim=3)


def diagonal_sums(p: torch.Tensor) -> torch.Tensor:
    """The last C rows of a causal probability chunk `[H, C, W]` -> `[H, W]` sums by offset d = i - j.

    `p` must come from `attention_rows(..., left_pad=True)`: C zero columns precede each row in
    memory. Viewing that buffer with row stride + 1 shifts row t left by t, which puts offset d of
    every row in column W - d; one sum over rows then gives every diagonal.
    """
    H, c, w = p.shape
    skew = p.as_strided((H, c, w + 1), (p.stride(0), p.stride(1) + 1, 1), p.storage_offset() - c)
    return skew.sum(1)[:, 1:].flip(-1)


def layer_stats(q: torch.Tensor, k: torch.Tensor, scale: float, resolution: int = 1024, block: int = 64,
                chunk: int = 256, progress: bool = False) -> LayerStats:
    """All statistics of one layer in one pass over row chunks.

    q `[Hq, N, D]`, k `[Hkv, N, D]`. `resolution` caps the pooled maps at R x R cells.
    """
    _check_qk(q, k)
    if resolution < 1 or block < 1:
        raise ValueError(f"resolution and block must be >= 1, got resolution={resolution}, block={block}")
    Hq, n, _ = q.shape
    cell = math.ceil(n / resolution)
    unit = math.lcm(cell, block)
    chunk = max(unit, chunk // unit * unit)
    R, M = math.ceil(n / cell), math.ceil(n / block)
    padded = math.ceil(n / unit) * unit  # maps are filled at the padded size, then cropped
    Rp, Mp = padded // cell, padded // block
    dev = q.device
    max_map, mean_map = torch.zeros(Hq, Rp, Rp, device=dev), torch.zeros(Hq, Rp, Rp, device=dev)
    block_mass = torch.zeros(Hq, Mp, Mp, device=dev)
    out = LayerStats(n=n, cell=cell, block=block, max_map=max_map, mean_map=mean_map, block_mass=block_mass,
                     column_mass=torch.zeros(Hq, n, device=dev), diag_mass=torch.zeros(Hq, n, device=dev),
                     row_entropy=torch.zeros(Hq, n, device=dev))
    rows = attention_rows(q, k, scale, chunk=chunk, entropy=True, left_pad=True)
    for r0, r1, p, h in tqdm(rows, total=math.ceil(n / chunk), desc="stats", leave=False, disable=not progress):
        out.row_entropy[:, r0:r1] = h
        out.column_mass[:, :r1] += p.sum(1)
        out.diag_mass[:, :r1] += diagonal_sums(p)
        if r1 % unit:  # only the last chunk is ragged: pad it to whole cells and blocks
            c, w = math.ceil((r1 - r0) / unit) * unit, math.ceil(r1 / unit) * unit
            p = torch.nn.functional.pad(p, (0, w - r1, 0, c - (r1 - r0)))
        c, w = p.shape[1:]
        cell_sum = _pool(p, cell, "sum")
        max_map[:, r0 // cell:(r0 + c) // cell, : w // cell] = _pool(p, cell, "max")
        mean_map[:, r0 // cell:(r0 + c) // cell, : w // cell] = cell_sum
        tiles = _pool(cell_sum, block // cell, "sum") if block % cell == 0 else _pool(p, block, "sum")
        block_mass[:, r0 // block:(r0 + c) // block, : w // block] = tiles
    # mean over the in-range positions of each cell (the last cell may be smaller)
    sizes = torch.full((R,), float(cell), device=dev)
    sizes[-1] = n - (R - 1) * cell
    out.max_map = max_map[:, :R, :R].contiguous()
    out.mean_map = mean_map[:, :R, :R] / (sizes[:, None] * sizes[None, :])
    out.block_mass = block_mass[:, :M, :M].contiguous()
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
        out[:, r0:r1] = (p * keep[:, :, :r1]).sum(-1)
    return out
