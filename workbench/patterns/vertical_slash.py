"""Vertical-Slash: columns C (absolute key positions) and slash offsets D (i - j = offset).

N(i) = {j in C : j <= i} U {i - d : d in D, i - d >= 0}. Padding -1 and other negative positions are
ignored, positions >= n are ignored, duplicates count once and offset 0 is always included (it keeps
the diagonal block, so every remaining column is strictly causal for its whole 64-row block).
The physical tiling (slash ranges merged per 64-row block, columns inside them dropped, the rest
packed 64 at a time) is `workbench_kernels.index_ref.vs_to_tiles`, the same one the kernels run on.
"""
from __future__ import annotations

import torch

from workbench.patterns.base import BLOCK, check_rows, to_mask


def membership(positions: torch.Tensor, n: int) -> torch.Tensor:
    """Bool `[..., n]` from Long `[..., K]` positions: True at each valid position (0 <= p < n)."""
    valid = (positions >= 0) & (positions < n)
    out = torch.zeros(*positions.shape[:-1], n + 1, dtype=torch.bool, device=positions.device)
    out.scatter_(-1, torch.where(valid, positions, n).long(), True)  # invalid ones land in the spare slot
    return out[..., :n]


class VerticalSlash:
    """VS index for H heads: `columns` Long `[H, Kv]`, `offsets` Long `[H, Ks]` (-1 = padding)."""

    def __init__(self, columns: torch.Tensor, offsets: torch.Tensor):
        if columns.dim() != 2 or offsets.dim() != 2 or columns.shape[0] != offsets.shape[0]:
            raise ValueError(f"VerticalSlash wants columns [H, Kv] and offsets [H, Ks] with the same H, got "
                             f"{tuple(columns.shape)} and {tuple(offsets.shape)}: index one layer's heads")
        self.columns = columns.long()
        self.offsets = offsets.long()
        self.n_heads = columns.shape[0]

    def column_set(self, n: int) -> torch.Tensor:
        """Bool `[H, n]`: which keys are columns."""
        return membership(self.columns, n)

    def offset_set(self, n: int) -> torch.Tensor:
        """Bool `[H, n]`: which offsets are slashes (offset 0 always)."""
        d = membership(self.offsets, n)
        d[:, 0] = True
        return d

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        i = torch.arange(r0, r1, device=self.columns.device)[:, None]
        j = torch.arange(n, device=self.columns.device)[None, :]
        d = i - j  # [R, n]
        causal = d >= 0
        slash = self.offset_set(n)[:, d.clamp(min=0)]  # [H, R, n]
        return causal & (slash | self.column_set(n)[:, None, :])

    def to_mask(self, n: int) -> torch.Tensor:
        return to_mask(self, n)

    def edges(self, n: int) -> torch.Tensor:
        c, d = self.column_set(n).long(), self.offset_set(n).long()
        rows_left = n - torch.arange(n, device=c.device)  # key j is read by n - j rows; offset d by n - d
        # a column j and an offset d meet at row j + d when j + d < n: count those pairs once
        offsets_below = d.cumsum(1).flip(1)  # [h, j] = #offsets <= n - 1 - j
        overlap = (c * offsets_below).sum(1)
        return (c * rows_left).sum(1) + (d * rows_left).sum(1) - overlap

    def tiles(self, n: int, block: int = BLOCK) -> torch.Tensor:
        return vs_tile_count(self.columns[None], self.offsets[None], n, block)[0]

    def __repr__(self) -> str:
        return f"VerticalSlash(columns {tuple(self.columns.shape)}, offsets {tuple(self.offsets.shape)})"


def vs_tile_count(columns: torch.Tensor, offsets: torch.Tensor, n: int, block: int = BLOCK) -> torch.Tensor:
    """Long `[B, H]`: 64x64 tiles the VS kernel computes: per row block, its 64-wide slash pieces plus
    its remaining columns packed 64 at a time. columns `[B, H, Kv]`, offsets `[B, H, Ks]`."""
    from workbench_kernels.index_ref import vs_to_tiles

    t = vs_to_tiles(columns, offsets, n, block=block)
    return t.block_count.long().sum(-1) + (-(-t.column_count.long() // block)).sum(-1)
