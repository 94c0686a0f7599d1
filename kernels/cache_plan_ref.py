"""PyTorch reference for the decode engine's per-layer bookkeeping (no Triton).

`plan_blocks_ref`: admit one selection into a GPU block cache. Per (sequence, KV head) row, blocks
still cached stay where they are (hits); each missing block takes the lowest-numbered slot not held
by a hit, in selection order, evicting whatever that slot held. Returns the pool slot of every selected
block and a copy list (store block -> cache slot, -1 = nothing to copy) with no host synchronisation.

`append_token_ref`: write each sequence's new key/value row where the decoder reads it (a resident
pool or a block cache through its block map, and optionally the pinned host store) and/or roll the
compressed keys (`roll_compressed_ref`).
"""
from __future__ import annotations

import torch

from . import BLOCK


def plan_blocks_ref(blocks: torch.Tensor, slot_of: torch.Tensor, block_in: torch.Tensor, hits: torch.Tensor,
                    misses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks `[B, H, K]` (ids, -1 = unused, no repeats per row); slot_of `[B, H, NB + 1]` (slot of each
    block, -1 = not cached; the last column is a sink); block_in `[B, H, C + 1]` (block in each slot, same
    sink); both updated in place, as are the 0-d counters hits/misses. Returns slots `[B, H, K]` (flat pool
    slot row * C + slot, -1 for unused entries), src and dst `[B * H * K]` (flat store block, flat cache slot;
    dst -1 where nothing is copied)."""
    B, H, K = blocks.shape
    NB, C = slot_of.shape[2] - 1, block_in.shape[2] - 1
    if K > C:
        raise ValueError(f"a selection of {K} blocks does not fit a cache of {C} slots: raise the capacity")
    valid = blocks >= 0
    cur = slot_of.gather(2, blocks.clamp(min=0))
    hit = valid & (cur >= 0)
    miss = valid & ~hit
    keep = torch.zeros(B, H, C + 1, dtype=torch.int8, device=blocks.device)
    keep.scatter_(2, torch.where(hit, cur, C), 1)
    free_first = torch.sort(keep[:, :, :C], dim=2, stable=True).indices  # free slots ascending, then held ones
    rank = (miss.cumsum(2) - 1).clamp(min=0)
    new = free_first.gather(2, rank)
    old = block_in.gather(2, new)
    slot_of.scatter_(2, torch.where(miss & (old >= 0), old, NB), -1)  # evict what the misses replace
    slot_of.scatter_(2, torch.where(miss, blocks, NB), new)
    block_in.scatter_(2, torch.where(miss, new, C), blocks)
    row = torch.arange(B * H, device=blocks.device).view(B, H, 1)
    slot = torch.where(hit, cur, new) + row * C
    slots = torch.where(valid, slot, -1)
    src = (blocks.clamp(min=0) + row * NB).flatten()
    dst = torch.where(miss, slot, -1).flatten()
    hits += hit.sum()
    misses += miss.sum()
    return slots, src, dst


def append_token_ref(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, pool_k: torch.Tensor | None,
                     pool_v: torch.Tensor | None, *, slot_of: torch.Tensor | None = None, n_blocks: int | None = None,
                     host_k: torch.Tensor | None = None, host_v: torch.Tensor | None = None,
                     tail: torch.Tensor | None = None, ckeys: torch.Tensor | None = None, stride: int = 16) -> None:
    """k, v `[B, H, D]` at `positions` `[B]`.

    Pool `[S, 64, D]` (None: no pool write): with `slot_of` `[B, H, NB + 1]` (a block cache of C = S / (B * H)
    slots per row) the token's block must be cached and the row goes to its slot; without it the pool is
    resident, `n_blocks` blocks per row. host_k/v `[B, H, NBh * 64, D]` (optional): the host store rows.
    tail `[B, H, W, D]` float32 and ckeys `[B, H, Nc + 1, D]` (optional): the compressed keys.
    """
    B, H, D = k.shape
    if pool_k is not None:
        row = torch.arange(B * H, device=k.device).view(B, H)
        blk, off = (positions // BLOCK).view(B, 1), (positions % BLOCK).view(B, 1)
        if slot_of is not None:
            slot = slot_of.gather(2, blk.view(B, 1, 1).expand(B, H, 1))[:, :, 0] + row * (pool_k.shape[0] // (B * H))
        else:
            slot = row * n_blocks + blk
        flat = (slot * BLOCK + off).flatten()
        pool_k.view(-1, D)[flat] = k.reshape(-1, D).to(pool_k.dtype)
        pool_v.view(-1, D)[flat] = v.reshape(-1, D).to(pool_v.dtype)
    if host_k is not None:
        b = torch.arange(B, device=host_k.device)
        p = positions.to(host_k.device)
        host_k[b, :, p] = k.to(host_k.device, host_k.dtype)
        host_v[b, :, p] = v.to(host_v.device, host_v.dtype)
    if tail is not None:
        roll_compressed_ref(k, positions, tail, ckeys, stride)


def roll_compressed_ref(k: torch.Tensor, positions: torch.Tensor, tail: torch.Tensor, ckeys: torch.Tensor,
                        stride: int) -> None:
    """The new key enters a `W`-row ring buffer (tail `[B, H, W, D]` float32, token t at t % W); when it
    completes a window ((pos + 1) % stride == 0 and pos >= W - 1) the window's mean becomes compressed key
    (pos - W + 1) // stride of ckeys `[B, H, Nc + 1, D]` (the last column is a sink for the others)."""
    B, H, D = k.shape
    W = tail.shape[2]
    b = torch.arange(B, device=k.device)
    tail[b, :, positions % W] = k.float()
    done = ((positions + 1) % stride == 0) & (positions >= W - 1)
    j = torch.where(done, (positions - (W - 1)) // stride, ckeys.shape[2] - 1)
    order = (positions[:, None] - (W - 1) + torch.arange(W, device=k.device)) % W  # token order
    window = tail.gather(2, order[:, None, :, None].expand(-1, H, -1, D))
    ckeys[b, :, j] = window.mean(2).to(ckeys.dtype)
