"""Per-layer GPU block cache with a block map.

Each (sequence, KV head) owns `capacity` slots of one 64-token block (K and V). `slot_of[b, h, block]`
says where a block sits (-1: not cached) and `block_in[b, h, slot]` which block a slot holds. When a new
selection arrives (`plan`), blocks still selected stay where they are, and each missing block takes a slot
whose block is no longer selected; the copy list (host block -> cache slot) is built on the device, with
no synchronisation (dst -1 for hits), so it can be handed straight to the gather kernel. Slots that no
miss needs keep their old block, which can be hit again later. Planning is one Triton launch
(`workbench_kernels.cache_plan.plan_blocks`) or its PyTorch reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.decode.engine.store import BLOCK


@dataclass
class CopyPlan:
    """What `plan` decided. slots `[B, Hkv, K]`: flat pool slot of each selected block (-1 for padding);
    src/dst `[B*Hkv*K]`: flat store block -> flat cache slot (dst -1: nothing to copy); count = entries."""

    slots: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor


class BlockCache:
    """GPU block cache of one layer for `batch` sequences.

    k, v `[batch * Hkv * capacity, 64, D]` (a pool for the decode kernel); `store_blocks` = blocks per
    sequence in the host store layout (for flat source indices). `hits` and `misses` are running device
    counters (selected blocks found / not found in the cache). `fused` plans with the Triton kernel.
    """

    def __init__(self, batch: int, kv_heads: int, capacity: int, store_blocks: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, fused: bool = False) -> None:
        self.batch, self.heads, self.capacity, self.store_blocks = batch, kv_heads, capacity, store_blocks
        n = batch * kv_heads * capacity
        self.k = torch.zeros(n, BLOCK, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # One spare column each: entries that must not write anywhere write there.
        self.slot_of = torch.full((batch, kv_heads, store_blocks + 1), -1, dtype=torch.long, device=device)
        self.block_in = torch.full((batch, kv_heads, capacity + 1), -1, dtype=torch.long, device=device)
        self.hits = torch.zeros((), dtype=torch.long, device=device)
        self.misses = torch.zeros((), dtype=torch.long, device=device)
        if fused:
            from workbench_kernels.cache_plan import plan_blocks
        else:
            from workbench_kernels.cache_plan_ref import plan_blocks_ref as plan_blocks
        self._plan = plan_blocks
        self._counts: dict[int, torch.Tensor] = {}  # copy-list length -> device int (made at the first, eager step)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def plan(self, blocks: torch.Tensor) -> CopyPlan:
        """Admit the selection `blocks` `[B, Hkv, K]` (ascending, -1 padded; K <= capacity): update the
        block map and return where every block will sit and which blocks must be copied in."""
        B, H, C = self.batch, self.heads, self.capacity
        if blocks.shape[:2] != (B, H) or blocks.shape[2] > C:
            raise ValueError(f"selection {tuple(blocks.shape)} does not fit a cache of batch {B}, {H} heads, "
                             f"{C} slots: raise the cache capacity to at least K")
        slots, src, dst = self._plan(blocks.contiguous(), self.slot_of, self.block_in, self.hits, self.misses)
        return self.admitted(slots, src, dst)

    def admitted(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> CopyPlan:
        """The CopyPlan of a selection already admitted into this cache's maps (by `plan`, or by the fused
        selection kernel)."""
        n = src.numel()
        if n not in self._counts:
            self._counts[n] = torch.tensor([n], dtype=torch.int32, device=src.device)
        return CopyPlan(slots=slots, src=src, dst=dst, count=self._counts[n])
