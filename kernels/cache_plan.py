"""Triton versions of the decode engine's per-layer bookkeeping: one launch for the cache plan, one
for writing the new token (pool, host store and/or compressed keys). Same contracts as `cache_plan_ref`.

`plan_blocks`: one program per (sequence, KV head) row holds the row's selection `[K]` and slot map
`[C]` in registers: hits are found by a gather from the block map, the free slots are ranked with a
prefix sum and matched to the misses' ranks (the reference's assignment exactly), the maps are updated
in place and the copy list is written into the row's own segment (no compaction; atomics only for the
two counters).
`append_token`: one program per row writes K and V where the decoder reads them (through the block
map for a cache), into pinned host memory through UVA, and rolls the compressed-key window.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_plan_ref import BLOCK


@triton.jit
def _plan_kernel(Blocks, SlotOf, BlockIn, Slots, Src, Dst, Hits, Misses, K, C, NB,
                 KP: tl.constexpr, CP: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, KP)
    cc = tl.arange(0, CP)
    kin = kk < K
    blk = tl.load(Blocks + bh * K + kk, mask=kin, other=-1).to(tl.int64)
    valid = blk >= 0
    cur = tl.load(SlotOf + bh * (NB + 1) + tl.where(valid, blk, 0), mask=valid, other=-1).to(tl.int64)
    hit = valid & (cur >= 0)
    miss = valid & (cur < 0)
    held = tl.max(tl.where(hit[:, None] & (cur[:, None] == cc[None, :]), 1, 0), 0)  # [CP]
    free = (held == 0) & (cc < C)
    free_rank = tl.cumsum(free.to(tl.int32), 0) - 1
    miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    match = miss[:, None] & free[None, :] & (miss_rank[:, None] == free_rank[None, :])
    new = tl.sum(tl.where(match, cc[None, :], 0), 1).to(tl.int64)  # [KP]
    old = tl.load(BlockIn + bh * (C + 1) + new, mask=miss, other=-1).to(tl.int64)
    # evicted blocks, missed blocks and new slots are disjoint address sets: no ordering needed
    tl.store(SlotOf + bh * (NB + 1) + tl.where(old >= 0, old, NB), -1, mask=miss & (old >= 0))
    tl.store(SlotOf + bh * (NB + 1) + tl.where(valid, blk, NB), new, mask=miss)
    tl.store(BlockIn + bh * (C + 1) + new, blk, mask=miss)
    slot = tl.where(hit, cur, new) + bh * C
    tl.store(Slots + bh * K + kk, tl.where(valid, slot, -1), mask=kin)
    tl.store(Src + bh * K + kk, tl.where(valid, blk, 0) + bh * NB, mask=kin)
    tl.store(Dst + bh * K + kk, tl.where(miss, slot, -1), mask=kin)
    tl.atomic_add(Hits, tl.sum(hit.to(tl.int64), 0))
    tl.atomic_add(Misses, tl.sum(miss.to(tl.int64), 0))


def plan_blocks(blocks: torch.Tensor, slot_of: torch.Tensor, block_in: torch.Tensor, hits: torch.Tensor,
                misses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `plan_blocks_ref` (same arguments and results; maps and counters int64, contiguous)."""
    B, H, K = blocks.shape
    NB, C = slot_of.shape[2] - 1, block_in.shape[2] - 1
    if K > C:
        raise ValueError(f"a selection of {K} blocks does not fit a cache of {C} slots: raise the capacity")
    for name, t in (("blocks", blocks), ("slot_of", slot_of), ("block_in", block_in), ("hits", hits), ("misses", misses)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor, got {t.dtype}")
    slots = torch.empty_like(blocks)
    src = torch.empty(B * H * K, dtype=torch.int64, device=blocks.device)
    dst = torch.empty_like(src)
    _plan_kernel[(B * H,)](blocks, slot_of, block_in, slots, src, dst, hits, misses, K, C, NB,
                           KP=triton.next_power_of_2(K), CP=triton.next_power_of_2(C), num_warps=4)
    return slots, src, dst


@triton.jit
def _append_token_kernel(K, V, Pos, PoolK, PoolV, SlotOf, HostK, HostV, Tail, CKeys,
                         H, ROW_SLOTS, NB1, HOST_TOKENS, NC1, STRIDE,
                         D: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr,
                         POOL: tl.constexpr, MAPPED: tl.constexpr, HOST: tl.constexpr, COMPRESS: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    d = tl.arange(0, D)
    pos = tl.load(Pos + b).to(tl.int64)
    k = tl.load(K + bh * D + d)
    v = tl.load(V + bh * D + d)
    if POOL:
        blk = pos // BLOCK_N
        if MAPPED:
            slot = tl.load(SlotOf + bh * NB1 + blk).to(tl.int64) + bh * ROW_SLOTS
        else:
            slot = bh * ROW_SLOTS + blk
        row = (slot * BLOCK_N + pos % BLOCK_N) * D
        tl.store(PoolK + row + d, k.to(PoolK.dtype.element_ty))
        tl.store(PoolV + row + d, v.to(PoolV.dtype.element_ty))
    if HOST:
        hrow = (bh * HOST_TOKENS + pos) * D
        tl.store(HostK + hrow + d, k.to(HostK.dtype.element_ty))
        tl.store(HostV + hrow + d, v.to(HostV.dtype.element_ty))
    if COMPRESS:
        kf = k.to(tl.float32)
        tl.store(Tail + (bh * W + pos % W) * D + d, kf)
        if ((pos + 1) % STRIDE == 0) & (pos >= W - 1):
            tok = pos - (W - 1) + tl.arange(0, W)  # the window's tokens; the newest comes from registers
            others = tl.load(Tail + (bh * W + tok % W)[:, None] * D + d[None, :], mask=(tok != pos)[:, None], other=0.0)
            mean = (tl.sum(others, 0) + kf) / W
            j = (pos - (W - 1)) // STRIDE
            tl.store(CKeys + (bh * NC1 + j) * D + d, mean.to(CKeys.dtype.element_ty))


def append_token(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, pool_k: torch.Tensor | None,
                 pool_v: torch.Tensor | None, *, slot_of: torch.Tensor | None = None, n_blocks: int | None = None,
                 host_k: torch.Tensor | None = None, host_v: torch.Tensor | None = None,
                 tail: torch.Tensor | None = None, ckeys: torch.Tensor | None = None, stride: int = 16) -> None:
    """Triton `append_token_ref` (same arguments). Tensors contiguous; host_k/v may be pinned host memory
    (written through UVA); D and the window W must be powers of two."""
    B, H, D = k.shape
    if D & (D - 1) or (tail is not None and tail.shape[2] & (tail.shape[2] - 1)):
        raise ValueError(f"head_dim ({D}) and the compression window must be powers of two for the Triton kernel")
    if pool_k is not None and (slot_of is None) == (n_blocks is None):
        raise ValueError("give exactly one of slot_of (a block cache) or n_blocks (a resident pool)")
    row_slots = (pool_k.shape[0] // (B * H) if slot_of is not None else n_blocks) if pool_k is not None else 0
    W = tail.shape[2] if tail is not None else 1
    k = k.contiguous()
    pool = pool_k is not None
    _append_token_kernel[(B * H,)](
        k, v.contiguous(), positions, pool_k if pool else k, pool_v if pool else k,
        slot_of if slot_of is not None else positions, host_k if host_k is not None else k,
        host_v if host_v is not None else k, tail if tail is not None else k, ckeys if ckeys is not None else k,
        H, row_slots, slot_of.shape[2] if slot_of is not None else 0, host_k.shape[2] if host_k is not None else 0,
        ckeys.shape[2] if ckeys is not None else 0, stride,
        D=D, W=W, BLOCK_N=BLOCK, POOL=pool, MAPPED=slot_of is not None, HOST=host_k is not None,
        COMPRESS=tail is not None, num_warps=1)
