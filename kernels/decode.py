"""Triton sparse decode attention over gathered 64-token KV blocks (GQA-native, split-K).

Same contract as `decode_ref.sparse_decode_ref`. One program handles one (sequence, KV head, split):
the G query heads of the group are the rows of one tile, so each K/V block is read once for the whole
group. Splits cut the selected-block list into `splits` parts (flash-decoding), each writes a partial
(max, sum, unnormalised output), and a small combine step merges them with the online-softmax rule.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_ref import BLOCK, check_decode_args


@triton.jit
def _sparse_decode_kernel(Q, Kp, Vp, Blocks, Slots, Lengths, Opart, Mpart, Lpart, qk_scale,
                          Hkv, K, per_split, G,
                          D: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)  # b * Hkv + kv head
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    b = bh // Hkv
    rows = tl.arange(0, GP)
    cols = tl.arange(0, D)
    toks = tl.arange(0, BLOCK_N)
    row_ok = rows < G
    q_ok = row_ok[:, None] & (cols[None, :] < D)
    q = tl.load(Q + (bh * G + rows)[:, None] * D + cols[None, :], mask=q_ok, other=0.0)
    length = tl.load(Lengths + b)
    m_i = tl.full([GP], -1.0e30, tl.float32)  # finite: a fully masked block leaves m, l, acc unchanged
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    start = split * per_split
    end = tl.minimum(start + per_split, K)
    for i in range(start, end):
        blk = tl.load(Blocks + bh * K + i)
        slot = tl.load(Slots + bh * K + i)
        slot = tl.where(blk >= 0, slot, 0).to(tl.int64)
        pos = blk * BLOCK_N + toks
        key_ok = (pos >= 0) & (pos < length)  # an unused entry (blk = -1) gives negative positions
        off = slot * (BLOCK_N * D) + toks[:, None] * D + cols[None, :]
        tile_ok = key_ok[:, None] & (cols[None, :] < D)
        k = tl.load(Kp + off, mask=tile_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [GP, BLOCK_N], log2 units
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(Vp + off, mask=tile_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    part = (bh * nsplit + split) * G + rows
    tl.store(Opart + part[:, None] * D + cols[None, :], acc, mask=q_ok)
    tl.store(Mpart + part, m_i, mask=row_ok)
    tl.store(Lpart + part, l_i, mask=row_ok)


def default_splits(B: int, Hkv: int, K: int, target_programs: int = 264) -> int:
    """Enough splits to give ~2 programs per SM of an H100/H200, at least 4 blocks per split."""
    want = max(1, -(-target_programs // (B * Hkv)))
    return max(1, min(want, K // 4 or 1))


def sparse_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                  slots: torch.Tensor, lengths: torch.Tensor, scale: float, splits: int | None = None) -> torch.Tensor:
    """Triton version of `sparse_decode_ref` (same arguments; `splits` parts of the block list run in
    parallel, default from `default_splits`). Returns `[B, Hq, D]` in q's dtype."""
    B, Hq, Hkv, K, D = check_decode_args(q, k_pool, v_pool, blocks, slots, lengths)
    if D & (D - 1) or D < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernel, got {D}")
    G = Hq // Hkv
    splits = splits or default_splits(B, Hkv, K)
    per_split = -(-K // splits)
    splits = -(-K // per_split)
    q = q.contiguous()
    blocks = blocks.to(torch.int32).contiguous()
    slots = slots.to(torch.int32).contiguous()
    lengths = lengths.to(device=q.device, dtype=torch.int32).contiguous()
    opart = torch.empty(B * Hkv, splits, G, D, device=q.device, dtype=torch.float32)
    mpart = torch.empty(B * Hkv, splits, G, device=q.device, dtype=torch.float32)
    lpart = torch.empty_like(mpart)
    LOG2E = 1.4426950408889634
    _sparse_decode_kernel[(B * Hkv, splits)](
        q, k_pool, v_pool, blocks, slots, lengths, opart, mpart, lpart, scale * LOG2E,
        Hkv, K, per_split, G, D=D, GP=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK, num_warps=4)
    if splits == 1:
        out = opart[:, 0] / lpart[:, 0, :, None]
    else:
        m = mpart.amax(dim=1, keepdim=True)
        w = torch.exp2(mpart - m)  # [B*Hkv, splits, G]
        out = (opart * w[..., None]).sum(1) / (lpart * w).sum(1)[..., None]
    return out.reshape(B, Hq, D).to(q.dtype)
