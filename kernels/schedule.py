"""The work order of sparse prefill's row-block items, shared by the Triton-language loop (`prefill`) and the
Gluon kernel (`prefill_ws`): which (batch * head, row block, sub-block) a persistent program takes next, and how
many SMs a persistent grid fills."""
from __future__ import annotations

import functools

import torch

from .index_ref import VSTiles


def work_order(tiles: VSTiles, sub: int, group: int = 0) -> torch.Tensor:
    """Work items Int32 `[B * H * M * sub]` (item = bh * M * sub + m * sub + s for tiles `[B, H, M]`, `sub`
    programs per row block), most pieces and column strips first (longest-processing-time order: the long items
    start early, the short ones fill the tail). `group` > 0: every item of a run of `group` heads (the query heads
    of one KV head; 1 for GQA-packed tiles) before the next run's, most pieces first within, so the programs
    running together read one KV head's keys (L2 reuse; H % group == 0). Measured against it on the H200 and
    slower (kernels/NOTES.md): the last row block first with every head of it before the next."""
    cost = tiles.block_count  # [B, H, M]; as few torch ops as the tiles need (each costs the host ~10 us a call)
    if tiles.columns:
        cost = cost + (tiles.column_count + tiles.piece - 1) // tiles.piece
    cost = cost.reshape(-1) if sub == 1 else cost.reshape(-1).repeat_interleave(sub)
    if group:
        run = torch.arange(cost.numel(), device=cost.device) // (group * tiles.shape[2] * sub)
        cost = cost.long() - run * (cost.max() + 1)  # run 0's items above run 1's, ... (on the device: no sync)
    return torch.argsort(cost, descending=True, stable=True).to(torch.int32)


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA `device` (a persistent grid's unit)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
