"""Per-layer GPU block cache with a block map.

Each (sequence, KV head) owns `capacity` slots of one 64-token block (K and V). `slot_of[b, h, block]`
says where a block sits (-1: not cached) and `block_in[b, h, slot]` which block a slot holds. When a new
selection arrives (`plan`), blocks still selected stay where they are, and each missing block takes a slot
whose block is no longer selected; the copy list (host block -> cache slot) is built on the device, with
no synchronisation, so it can be handed straight to the gather kernel. Slots that no miss needs keep
their old block, which can be hit again later.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.decode.engine.store import BLOCK


@dataclass
class CopyPlan:
    """What `plan` decided. slots `[B, Hkv, K]`: flat pool slot of each selected block (-1 for padding);
    src/dst `[B*Hkv*K]`: flat store block -> flat cache slot, the first `count` entries valid."""

    slots: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor


class BlockCache:
    """GPU block cache of one layer for `batch` sequences.

    k, v `[batch * Hkv * capacity, 64, D]` (a pool for the decode kernel); `store_blocks` = blocks per
    sequence in the host store layout (for flat source indices). `hits` and `misses` are running device
    counters (selected blocks found / not found in the cache).
    """

    def __init__(self, batch: int, kv_heads: int, capacity: int, store_blocks: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.batch, self.heads, self.capacity, self.store_blocks = batch, kv_heads, capacity, store_blocks
        n = batch * kv_heads * capacity
        self.k = torch.zeros(n, BLOCK, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # One spare column each: entries that must not write anywhere write there.
        self.slot_of = torch.full((batch, kv_heads, store_blocks + 1), -1, dtype=torch.long, device=device)
        self.block_in = torch.full((batch, kv_heads, capacity + 1), -1, dtype=torch.long, device=device)
        self.hits = torch.zeros((), dtype=torch.long, device=device)
        self.misses = torch.zeros((), dtype=torch.long, device=device)
        row = torch.arange(batch * kv_heads, device=device).view(batch, kv_heads, 1)
        self._row_store = row * store_blocks
        self._row_cache = row * capacity

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def plan(self, blocks: torch.Tensor) -> CopyPlan:
        """Admit the selection `blocks` `[B, Hkv, K]` (ascending, -1 padded; K <= capacity): update the
        block map and return where every block will sit and which blocks must be copied in."""
        B, H, C, NB = self.batch, self.heads, self.capacity, self.store_blocks
        if blocks.shape[:2] != (B, H) or blocks.shape[2] > C:
            raise ValueError(f"selection {tuple(blocks.shape)} does not fit a cache of batch {B}, {H} heads, "
                             f"{C} slots: raise the cache capacity to at least K")
        valid = blocks >= 0
        cur = self.slot_of.gather(2, blocks.clamp(min=0))
        hit = valid & (cur >= 0)
        miss = valid & ~hit
        keep = torch.zeros(B, H, C + 1, dtype=torch.int8, device=blocks.device)
        keep.scatter_(2, torch.where(hit, cur, C), 1)
        free_first = torch.sort(keep[:, :, :C], dim=2, stable=True).indices  # free slots, ascending, first
        rank = (miss.cumsum(2) - 1).clamp(min=0)
        new = free_first.gather(2, rank)
        old = self.block_in.gather(2, new)
        self.slot_of.scatter_(2, torch.where(miss & (old >= 0), old, NB), -1)  # evict what the misses replace
        self.slot_of.scatter_(2, torch.where(miss, blocks, NB), new)
        self.block_in.scatter_(2, torch.where(miss, new, C), blocks)
        slots = torch.where(hit, cur, torch.where(miss, new, -1))
        flat_slots = torch.where(valid, slots + self._row_cache, -1)
        order = torch.sort((~miss).flatten().to(torch.int8), stable=True).indices  # misses first
        src = (blocks.clamp(min=0) + self._row_store).flatten()[order]
        dst = flat_slots.flatten()[order]
        count = miss.sum().to(torch.int32).reshape(1)
        self.hits += hit.sum()
        self.misses += miss.sum()
        return CopyPlan(slots=flat_slots, src=src, dst=dst, count=count)

    def token_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat row `[B, Hkv]` of token `positions[b]` in the pool viewed as `[-1, D]` (its block must be cached)."""
        blk = (positions // BLOCK).view(-1, 1, 1).expand(self.batch, self.heads, 1)
        slot = self.slot_of.gather(2, blk)[:, :, 0] + self._row_cache[:, :, 0]
        return slot * BLOCK + (positions % BLOCK).view(-1, 1)
