"""The keys the sparse prefill kernel computes, row by row: a `VSTiles` index (pieces cut at the next
piece's start, plus columns and dense rows) as per-row key masks, for the PyTorch reference path and the Flex export."""
from __future__ import annotations

from typing import Any

import torch
from workbench_kernels import masks


def band_mask(sink: torch.Tensor, window: torch.Tensor, keys: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Bool `[H, r1 - r0, K]`: the A-shape token mask (j < sink or i - j < window) of rows r0..r1-1 over
    the key positions `keys` `[K]` (not causal by itself), on keys' device."""
    rows = torch.arange(r0, r1, device=keys.device)[:, None]
    return masks.band(rows, keys[None, :], sink.to(keys.device).view(-1, 1, 1), window.to(keys.device).view(-1, 1, 1))


def tile_rows(tiles: Any, r0: int, r1: int, band: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys the sparse kernel computes for query rows r0..r1-1 (r0 a multiple of tiles.block), from
    its pieces (each cut at the next piece's start) and columns, under the token `band` (sink, window `[H]`)
    where given, and its dense rows (every key), causal: (keys Long `[K]`: the key positions any head reads,
    mask Bool `[B, H, r1 - r0, K]` over those keys)."""
    b = tiles.block
    m0, m1 = r0 // b, -(-r1 // b)
    start = tiles.block_offset[:, :, m0:m1].long()
    count = tiles.block_count[:, :, m0:m1].long().unsqueeze(-1)
    t = torch.arange(start.shape[-1], device=start.device)
    nxt = torch.cat([start[..., 1:], torch.full_like(start[..., :1], r1)], -1)
    end = torch.minimum(start + tiles.piece, torch.where(t + 1 < count, nxt, r1))
    live = (t < count).int()
    edges = torch.zeros(*start.shape[:-1], r1 + 1, dtype=torch.int32, device=start.device)
    edges.scatter_add_(-1, start.clamp(0, r1), live)
    edges.scatter_add_(-1, end.clamp(0, r1), -live)
    keys = edges.cumsum(-1)[..., :r1] > 0  # [B, H, m1 - m0, r1]
    cols = tiles.column_index[:, :, m0:m1].long()
    c_live = torch.arange(cols.shape[-1], device=cols.device) < tiles.column_count[:, :, m0:m1].long().unsqueeze(-1)
    hit = torch.zeros(*cols.shape[:-1], r1 + 1, dtype=torch.bool, device=cols.device)
    hit.scatter_(-1, torch.where(c_live, cols, r1).clamp(0, r1), True)
    blk = keys | hit[..., :r1]
    i = torch.arange(r0, r1, device=blk.device)
    dense = None if tiles.dense_from is None else i >= tiles.dense_from.to(blk.device).long()[..., None]  # [B, H, R]
    if dense is not None and bool(dense.any()):
        used = torch.arange(r1, device=blk.device)  # a dense row reads every key up to its own
    else:
        used = blk.flatten(0, -2).any(0).nonzero().squeeze(1)  # keys any head of these rows reads
    blk = blk[..., used]
    B, H, mc, k = blk.shape
    rows = blk.unsqueeze(3).expand(B, H, mc, b, k).reshape(B, H, mc * b, k)[:, :, : r1 - r0]
    if band is not None:
        rows = rows & band_mask(*band, used, r0, r1)
    if dense is not None:
        rows = rows | dense[..., None]
    return used, rows & (used[None, :] <= i[:, None])
