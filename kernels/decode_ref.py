"""PyTorch reference for sparse decode attention over gathered KV blocks (no Triton).

One new query token per sequence attends to the 64-token KV blocks its KV head selected. The blocks
live in a *pool* `[S, 64, D]` (a layer's full KV viewed as blocks, or a GPU block cache); `slots`
says where each selected block sits in the pool and `blocks` says which 64-token block of the
sequence it is, so that keys past the sequence length can be masked.
"""
from __future__ import annotations

import torch

from . import BLOCK


def check_decode_args(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                      slots: torch.Tensor, lengths: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate shapes; returns (B, Hq, Hkv, K, D)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_pool.dim() != 3 or k_pool.shape[1:] != (BLOCK, D) or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [S, {BLOCK}, {D}], got {tuple(k_pool.shape)} "
                         f"and {tuple(v_pool.shape)}")
    if blocks.dim() != 3 or blocks.shape[0] != B or slots.shape != blocks.shape:
        raise ValueError(f"blocks and slots must both be [B={B}, Hkv, K], got {tuple(blocks.shape)} "
                         f"and {tuple(slots.shape)}")
    Hkv, K = blocks.shape[1], blocks.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B={B}], got {tuple(lengths.shape)}")
    return B, Hq, Hkv, K, D


def sparse_decode_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor,
                      slots: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query per sequence over its selected blocks.

    q `[B, Hq, D]`; k_pool, v_pool `[S, 64, D]`; blocks, slots `[B, Hkv, K]` (block ids ascending,
    -1 = unused entry; slots index the pool); lengths `[B]` = valid tokens per sequence including
    the current one. Query head h reads KV head h // (Hq // Hkv). Returns `[B, Hq, D]` in q's dtype,
    computed in fp32. Every sequence must select at least one valid key.
    """
    B, Hq, Hkv, K, D = check_decode_args(q, k_pool, v_pool, blocks, slots, lengths)
    G = Hq // Hkv
    valid = blocks >= 0
    idx = torch.where(valid, slots, 0).long()
    k = k_pool[idx].float()  # [B, Hkv, K, 64, D]
    pos = blocks.long().unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=q.device)  # [B, Hkv, K, 64]
    keep = valid.unsqueeze(-1) & (pos < lengths.view(B, 1, 1, 1).to(q.device))
    # slots past the length may hold uninitialised memory: zero them, since 0 * NaN = NaN
    v = v_pool[idx].float().masked_fill(~keep.unsqueeze(-1), 0.0)
    qg = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bhktd->bhgkt", qg, k) * scale  # [B, Hkv, G, K, 64]
    s = s.masked_fill(~keep.unsqueeze(2), float("-inf")).flatten(3)
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", p, v.flatten(2, 3))
    return out.reshape(B, Hq, D).to(q.dtype)
