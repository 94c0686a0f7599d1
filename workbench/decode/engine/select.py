"""Batched decode-time block selection for the engine, built on `workbench.patterns.infllm`.

The selector itself (group softmax, max-pool to blocks, forced init/local blocks, top-k) is InfLLM-V2's
from `patterns.infllm`; this module adds what a batched decoder needs around it: a fixed-capacity
compressed-key buffer per layer that grows token by token with a different length per sequence (no
reallocation, no host synchronisation), and per-sequence positions.
"""
from __future__ import annotations

from typing import Any

import torch
from workbench_kernels.cache_plan_ref import roll_compressed_ref

from workbench.patterns.infllm import Budget, compress_keys, group_scores, pool_to_blocks, topk_blocks


class CompressedKeyBuffer:
    """Compressed keys (mean of `window` keys every `stride` tokens) of one layer, batch-first.

    keys `[B, Hkv, capacity + 1, D]` in `dtype` (means are taken in float32; the last column is a sink for
    sequences that complete no window at a step); tail `[B, Hkv, window, D]` float32 holds the last
    `window` raw keys, token t at t % window. Entry j is valid once token j*stride + window - 1 is appended.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, max_tokens: int, budget: Budget,
                 device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        self.budget = budget
        self.capacity = max(0, (max_tokens - budget.window) // budget.stride + 1)
        self.keys = torch.zeros(batch, kv_heads, self.capacity + 1, head_dim, device=device, dtype=dtype)
        self.tail = torch.zeros(batch, kv_heads, budget.window, head_dim, device=device)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.tail.numel() * 4

    def fill(self, b: int, k: torch.Tensor) -> None:
        """Prefill of sequence b: k `[Hkv, N, D]` (positions 0..N-1)."""
        w, n = self.budget.window, k.shape[1]
        ck = compress_keys(k.float(), w, self.budget.stride)
        self.keys[b, :, :ck.shape[1]] = ck.to(self.keys.dtype)
        last = torch.arange(max(0, n - w), n, device=k.device)
        self.tail[b, :, last % w] = k[:, last].float()

    def append(self, k: torch.Tensor, positions: torch.Tensor) -> None:
        """Add each sequence's new key: k `[B, Hkv, D]` at `positions` `[B]`; completes a window where
        (position + 1) is a multiple of the stride and position >= window - 1. (The engine's Triton path
        does this in `workbench_kernels.cache_plan.append_token`.)"""
        roll_compressed_ref(k, positions, self.tail, self.keys, self.budget.stride)


def select_decode(q_group: torch.Tensor, ck: CompressedKeyBuffer, positions: torch.Tensor,
                  visible_upto: torch.Tensor, n_blocks: int, budget: Budget, scale: float | None = None,
                  fused: bool = False, cache: Any = None):
    """InfLLM-V2 selection for one new token per sequence.

    q_group `[B, Hkv, G, D]` (the G query heads of each group, or G = 1 for a Forecast head);
    positions `[B]`: the token being decoded (its block and the `local` blocks before it are forced);
    visible_upto `[B]`: the last token whose key is in `ck` (= positions for the same-layer selector;
    positions - 1 for a forecast made before the target layer has seen the new token); n_blocks: blocks
    per sequence the caller can address (> every position // block). -> block ids
    `[B, Hkv, K]`, ascending, -1 padded, K = budget.total. `fused` runs the same selection as two Triton
    launches (`workbench_kernels.block_select`; ties between equal scores go to the lower block id); with a
    `BlockCache` as `cache` (fused only) the second launch also admits the blocks into it and the call returns
    (ids, slots, src, dst) as `BlockCache.plan` computes them.
    """
    if fused:
        from workbench_kernels.block_select import select_blocks

        b = budget
        maps = (cache.slot_of, cache.block_in, cache.hits, cache.misses) if cache is not None else None
        return select_blocks(q_group, ck.keys, positions, visible_upto, n_blocks, init=b.init, local=b.local,
                             topk=b.topk, block=b.block, window=b.window, stride=b.stride, scale=scale, cache=maps)
    if cache is not None:
        raise ValueError("cache needs fused=True: plan the reference selection with BlockCache.plan")
    B = q_group.shape[0]
    s = group_scores(q_group[:, :, :, None, :], ck.keys[:, :, :-1], visible_upto.view(B, 1, 1, 1),
                     window=budget.window, stride=budget.stride, scale=scale)  # [B, Hkv, 1, Nc]
    blocks = pool_to_blocks(s, n_blocks, block=budget.block, window=budget.window, stride=budget.stride)
    return topk_blocks(blocks, (positions // budget.block).view(B, 1, 1), budget)[:, :, 0]

