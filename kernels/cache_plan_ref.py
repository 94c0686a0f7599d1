"""PyTorch reference for the decode engine's per-layer bookkeeping (no Triton).

`plan_blocks_ref`: admit one selection into a GPU block cache. Per (sequence, KV head) row, blocks
still cached stay where they are (hits); each missing block takes the lowest-numbered slot not held
by a hit, in selection order, evicting whatever that slot held. Returns the pool slot of every selected
block and a copy list (store block -> cache slot, -1 = nothing to copy) with no host synchronisation.

`append_token_ref`: write each sequence's new key/value row into the pinned host store (quantised for an
FP8 / INT8 / INT4 store, with the values the decoder must attend to), and/or roll the compressed keys
(`roll_compressed_ref`). The token enters the pool the decoder attends to in the decode kernel itself.
"""
from __future__ import annotations

import torch

from .gather_ref import QMAX, dequantize_rows, kv_quant, quantize_rows


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


def append_token_ref(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
                     host_k: torch.Tensor | None = None, host_v: torch.Tensor | None = None,
                     host_scale_k: torch.Tensor | None = None, host_scale_v: torch.Tensor | None = None,
                     quant: torch.dtype | tuple | None = None, k_out: torch.Tensor | None = None,
                     v_out: torch.Tensor | None = None, tail: torch.Tensor | None = None,
                     ckeys: torch.Tensor | None = None, stride: int = 16) -> None:
    """k, v `[B, H, D]` (the new token, after RoPE) at `positions` `[B]`. Writes, each where given:

    - host_k/v `[B, H, NBh * 64, D]` (the pinned host store's rows; codes when `quant` is float8_e4m3fn or int8,
      with their scales in host_scale_k/v `[B, H, NBh * 64]` float32; `quant` INT4 (uint8): `[B, H, NBh * 64, D / 2]`
      packed codes and `[B, H, NBh * 64, D / 32]` float16 scales, `gather_ref.quantize_rows`; a (K, V) pair
      `gather_ref.kv_quant` rounds each part its own way: (int8, INT4) for "int8k-int4v");
    - k_out/v_out `[B, H, D]`: what the decoder must attend to for this token, `dequantize_rows(quantize_rows(k))`
      in k_out's dtype (a quantised store: the same values a later gather of the block gives back);
    - tail `[B, H, W, D]` float32 and ckeys `[B, H, Nc + 1, D]`: the compressed keys (from the exact k).
    The token reaches the attended pool through the decode kernel (`k_new` / `v_new`).
    """
    B = k.shape[0]
    qk, qv = kv_quant(quant)
    for x, q, out, host, host_scale in ((k, qk, k_out, host_k, host_scale_k), (v, qv, v_out, host_v, host_scale_v)):
        codes = x
        if q is not None:
            codes, scale = quantize_rows(x, q)
            if out is not None:
                out.copy_(dequantize_rows(codes, scale, out.dtype))
        if host is not None:
            if (host.dtype in QMAX) != (q is not None) or (q is not None and host_scale is None):
                raise ValueError(f"a {host.dtype} host store needs quant={host.dtype} and its scales")
            b, p = torch.arange(B, device=host.device), positions.to(host.device)
            host[b, :, p] = codes.to(host.device, host.dtype)
            if q is not None:
                host_scale[b, :, p] = scale.to(host_scale.device)
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
