"""Quest's per-page key bounds as decode state: one buffer per layer that the engine fills at prefill,
updates with every appended key and selects pages from (`workbench.patterns.quest` has the math).

lo / hi `[B, Hkv, P, D]` float32: the elementwise min / max of the keys written so far to each 64-token
page (pages not yet reached hold zeros; selection never returns future pages). No host sync.
"""
from __future__ import annotations

import torch

from workbench.patterns.infllm import Budget, topk_blocks
from workbench.patterns.quest import page_bounds, page_scores


class QuestPages:
    """Page bounds of one layer for `batch` sequences of up to `n_pages` pages of `page` tokens."""

    def __init__(self, batch: int, kv_heads: int, head_dim: int, n_pages: int, device: torch.device | str,
                 page: int = 64) -> None:
        self.page = page
        self.lo = torch.zeros(batch, kv_heads, n_pages, head_dim, device=device)
        self.hi = torch.zeros_like(self.lo)

    @property
    def nbytes(self) -> int:
        return 2 * self.lo.numel() * 4

    def fill(self, b: int, k: torch.Tensor) -> None:
        """Prefill of sequence b: k `[Hkv, N, D]` (positions 0..N-1)."""
        lo, hi = page_bounds(k.to(self.lo.device), self.page)
        self.lo[b, :, :lo.shape[1]], self.hi[b, :, :hi.shape[1]] = lo, hi

    def append(self, k: torch.Tensor, positions: torch.Tensor) -> None:
        """Each sequence's new key k `[B, Hkv, D]` at `positions` `[B]`: a page's first key resets its bounds."""
        batch = torch.arange(k.shape[0], device=k.device)
        page = positions // self.page
        first = (positions % self.page == 0).view(-1, 1, 1)
        kf = k.float()
        lo, hi = self.lo[batch, :, page], self.hi[batch, :, page]  # [B, Hkv, D]
        self.lo[batch, :, page] = torch.where(first, kf, torch.minimum(lo, kf))
        self.hi[batch, :, page] = torch.where(first, kf, torch.maximum(hi, kf))

    def select(self, q_group: torch.Tensor, positions: torch.Tensor, n_blocks: int, budget: Budget) -> torch.Tensor:
        """One step's pages: q_group `[B, Hkv, G, D]`, positions `[B]` (the token just appended) ->
        ids `[B, Hkv, K]` (K = budget.total, ascending, -1 padded): init and local pages forced, then the
        top-k past pages by the largest bound of the group's heads."""
        bound = page_scores(q_group, self.lo[:, :, :n_blocks], self.hi[:, :, :n_blocks]).amax(2)  # [B, Hkv, P]
        return topk_blocks(bound[:, :, None], (positions // budget.block).view(-1, 1, 1), budget)[:, :, 0]
