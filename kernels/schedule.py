"""The work order of sparse prefill's row-block items, shared by the Triton-language loop (`prefill`) and the
Gluon kernel (`prefill_ws`): which (batch * head, row block, sub-block) a persistent program takes next."""
from __future__ import annotations

import torch

from .index_ref import VSTiles

LOG2E = 1.4426950408889634  # log2(e): both kernels' softmax scale in exp2 units (scale * LOG2E)


def work_order(tiles: VSTiles, sub: int, rows_first: bool = False) -> torch.Tensor:
    """Work items Int32 `[B * H * M * sub]` (item = bh * M * sub + m * sub + s for tiles `[B, H, M]`, `sub`
    programs per row block), most pieces and column strips first (longest-processing-time order: the long items
    start early, the short ones fill the tail).
    `rows_first`: the last row block first, every head of a row block before the next one (query heads of a KV
    head adjacent): the items running together read nearly the same keys of one KV head when a pattern is
    dense-ish, for L2 reuse; about longest-first too on causal patterns (later rows hold more keys)."""
    B, H, M = tiles.shape
    if rows_first:
        mid = torch.arange(M * sub - 1, -1, -1, device=tiles.block_count.device)
        bh = torch.arange(B * H, device=mid.device)
        return (bh[None, :] * (M * sub) + mid[:, None]).reshape(-1).to(torch.int32)
    cost = tiles.block_count + (tiles.column_count + tiles.piece - 1) // tiles.piece  # [B, H, M]
    cost = cost.reshape(-1, 1).expand(-1, sub).reshape(-1)
    return torch.argsort(cost, descending=True, stable=True).to(torch.int32)
