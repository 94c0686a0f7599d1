"""PyTorch reference for sparse decode attention over 64-token KV blocks (no Triton).

One new query token per sequence attends to the 64-token KV blocks its KV head selected. The blocks
live in a *pool* `[S, 64, D]` (a layer's resident KV viewed as blocks, a ring of its last blocks, or a
GPU block cache). Which blocks, and where they sit, is given one of two ways:

- a selection: `blocks` `[B, Hkv, K]` (block ids ascending, -1 = unused entry) with `slots` `[B, Hkv, K]`
  (their pool slots), or with `slots=None` the slot `row * row_blocks + block % row_blocks` (row = b * Hkv + h);
- no selection (`blocks=None`): every block from the one holding position `length - window` (0 without a
  window) to the current one, at that same computed slot (a resident layer, or a ring of `row_blocks` slots).

`window` > 0 also masks keys at positions <= length - 1 - window (a sliding-window layer). With `k_new` /
`v_new` `[B, Hkv, D]` the current token (position length - 1) is first written into its block's slot
(that block must be in the selection), which is how the decoder appends a token to the KV it attends to.
"""
from __future__ import annotations

import torch

from .tiling import BLOCK


def check_decode_args(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor | None,
                      slots: torch.Tensor | None, lengths: torch.Tensor, row_blocks: int | None = None,
                      kv_heads: int | None = None) -> tuple[int, int, int, int, int]:
    """Validate shapes; returns (B, Hq, Hkv, K, D) (K = entries per row: the selection's, or the blocks a row can
    address without one)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if k_pool.dim() != 3 or k_pool.shape[1:] != (BLOCK, D) or v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool and v_pool must both be [S, {BLOCK}, {D}], got {tuple(k_pool.shape)} "
                         f"and {tuple(v_pool.shape)}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B={B}], got {tuple(lengths.shape)}")
    if blocks is None:
        if slots is not None or not row_blocks or not kv_heads:
            raise ValueError("without blocks give row_blocks and kv_heads (and no slots)")
        Hkv, K = kv_heads, row_blocks
    else:
        if blocks.dim() != 3 or blocks.shape[0] != B or (slots is not None and slots.shape != blocks.shape):
            raise ValueError(f"blocks (and slots) must be [B={B}, Hkv, K], got {tuple(blocks.shape)} and "
                             f"{None if slots is None else tuple(slots.shape)}")
        if slots is None and not row_blocks:
            raise ValueError("blocks without slots need row_blocks (the pool's blocks per row)")
        Hkv, K = blocks.shape[1], blocks.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if row_blocks and k_pool.shape[0] < B * Hkv * row_blocks:
        raise ValueError(f"the pool has {k_pool.shape[0]} blocks, fewer than B * Hkv * row_blocks = {B * Hkv * row_blocks}")
    return B, Hq, Hkv, K, D


def decode_entries(lengths: torch.Tensor, kv_heads: int, row_blocks: int, window: int = 0,
                   blocks: torch.Tensor | None = None, slots: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (blocks, slots) `[B, Hkv, K]` a decode call reads, as `sparse_decode_ref` documents them."""
    B = lengths.shape[0]
    rows = torch.arange(B * kv_heads, device=lengths.device).view(B, kv_heads, 1)
    if blocks is None:
        last = (lengths - 1) // BLOCK
        first = (lengths - window).clamp(min=0) // BLOCK if window else torch.zeros_like(last)
        ids = first.view(B, 1, 1) + torch.arange(row_blocks, device=lengths.device).view(1, 1, -1)
        blocks = torch.where(ids <= last.view(B, 1, 1), ids, -1).expand(B, kv_heads, -1)
    if slots is None:
        slots = torch.where(blocks >= 0, rows * row_blocks + blocks.clamp(min=0) % row_blocks, -1)
    return blocks, slots


def sparse_decode_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, lengths: torch.Tensor,
                      scale: float, *, blocks: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                      kv_heads: int | None = None, row_blocks: int | None = None, window: int = 0,
                      k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per sequence over its blocks (see the module docstring for blocks/slots/window).

    q `[B, Hq, D]`; k_pool, v_pool `[S, 64, D]`; lengths `[B]` = valid tokens per sequence including the current
    one; kv_heads (needed without blocks) = Hkv. Query head h reads KV head h // (Hq // Hkv). Returns
    `[B, Hq, D]` in q's dtype, computed in fp32. Every sequence must see at least one valid key.
    """
    B, Hq, Hkv, K, D = check_decode_args(q, k_pool, v_pool, blocks, slots, lengths, row_blocks, kv_heads)
    blocks, slots = decode_entries(lengths, Hkv, row_blocks or 0, window, blocks, slots)
    if k_new is not None:
        cur = ((lengths - 1) // BLOCK).view(B, 1, 1)
        slot = torch.where(blocks == cur, slots, -1).amax(-1)  # [B, Hkv]: the current block's slot
        if (slot < 0).any():
            raise ValueError("k_new given but a row's selection does not hold its current block")
        flat = (slot * BLOCK + ((lengths - 1) % BLOCK).view(B, 1)).flatten()
        k_pool.view(-1, D)[flat] = k_new.reshape(-1, D).to(k_pool.dtype)
        v_pool.view(-1, D)[flat] = v_new.reshape(-1, D).to(v_pool.dtype)
    G = Hq // Hkv
    valid = blocks >= 0
    idx = torch.where(valid, slots, 0).long()
    k = k_pool[idx].float()  # [B, Hkv, K, 64, D]
    pos = blocks.long().unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=q.device)  # [B, Hkv, K, 64]
    n = lengths.view(B, 1, 1, 1).to(q.device)
    keep = valid.unsqueeze(-1) & (pos < n)
    if window:
        keep &= pos >= n - window
    # slots past the length may hold uninitialised memory: zero them, since 0 * NaN = NaN
    v = v_pool[idx].float().masked_fill(~keep.unsqueeze(-1), 0.0)
    qg = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bhktd->bhgkt", qg, k) * scale  # [B, Hkv, G, K, 64]
    s = s.masked_fill(~keep.unsqueeze(2), float("-inf")).flatten(3)
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", p, v.flatten(2, 3))
    return out.reshape(B, Hq, D).to(q.dtype)
