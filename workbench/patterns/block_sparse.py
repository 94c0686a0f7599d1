"""Block-sparse: each 64-row query block m reads a few 64-wide key blocks.

`block_index` Int `[H, M, K]` lists key-block ids per query block (ascending, -1 padded). The diagonal
block is always read (under the causal triangle); ids after m (future blocks), negative ids and
duplicates are ignored.
"""
from __future__ import annotations

import torch

from workbench.patterns.base import BLOCK, check_rows, to_mask
from workbench.patterns.vertical_slash import membership


class BlockSparse:
    """Block table for H heads; `block` is the tile size in tokens (64)."""

    def __init__(self, block_index: torch.Tensor, block: int = BLOCK):
        if block_index.dim() != 3:
            raise ValueError(f"BlockSparse wants block_index [H, M, K], got {tuple(block_index.shape)}: "
                             "index one layer's heads")
        self.block_index = block_index
        self.block = block
        self.n_heads = block_index.shape[0]

    def n_blocks(self, n: int) -> int:
        m = -(-n // self.block)
        if self.block_index.shape[1] != m:
            raise ValueError(f"block_index has {self.block_index.shape[1]} query blocks but n={n} needs {m} "
                             f"(block {self.block}): build the index for this prompt length")
        return m

    def block_set(self, n: int) -> torch.Tensor:
        """Bool `[H, M, M]`: key blocks read by each query block (causal blocks only, diagonal always)."""
        m = self.n_blocks(n)
        s = membership(self.block_index.long(), m)
        s |= torch.eye(m, dtype=torch.bool, device=s.device)
        return s & torch.ones(m, m, dtype=torch.bool, device=s.device).tril()

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        s = self.block_set(n)
        i = torch.arange(r0, r1, device=s.device)
        j = torch.arange(n, device=s.device)
        return s[:, i // self.block][:, :, j // self.block] & (j[None, :] <= i[:, None])

    def to_mask(self, n: int) -> torch.Tensor:
        return to_mask(self, n)

    def edges(self, n: int) -> torch.Tensor:
        s = self.block_set(n).long()
        m = s.shape[1]
        size = torch.clamp(n - torch.arange(m, device=s.device) * self.block, max=self.block)  # rows (= cols) per block
        area = size[:, None] * size[None, :]
        area.diagonal().copy_(size * (size + 1) // 2)  # the diagonal tile is a triangle
        return (s * area).sum((1, 2))

    def tiles(self, n: int) -> torch.Tensor:
        return self.block_set(n).sum((1, 2))

    def __repr__(self) -> str:
        return f"BlockSparse(block_index {tuple(self.block_index.shape)}, block={self.block})"
