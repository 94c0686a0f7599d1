"""The work order of sparse prefill's row-block items, shared by the Triton-language loop (`prefill`) and the
Gluon kernel (`prefill_ws`): which (batch * head, row block, sub-block) a persistent program takes next."""
from __future__ import annotations

import torch

from .index_ref import VSTiles

LOG2E = 1.4426950408889634  # log2(e): both kernels' softmax scale in exp2 units (scale * LOG2E)


def work_order(tiles: VSTiles, sub: int) -> torch.Tensor:
    """Work items Int32 `[B * H * M * sub]` (item = bh * M * sub + m * sub + s for tiles `[B, H, M]`, `sub`
    programs per row block), most pieces and column strips first (longest-processing-time order: the long items
    start early, the short ones fill the tail). Measured against it on the H200 and slower (kernels/NOTES.md):
    the last row block first with every head of it before the next (for L2 reuse between query heads)."""
    cost = tiles.block_count + (tiles.column_count + tiles.piece - 1) // tiles.piece  # [B, H, M]
    cost = cost.reshape(-1, 1).expand(-1, sub).reshape(-1)
    return torch.argsort(cost, descending=True, stable=True).to(torch.int32)
