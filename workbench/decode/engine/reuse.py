"""Block reuse between decode steps: measure it on a real model, or impose it on a benchmark.

Reuse counts only the *dynamic* (top-k) blocks: init and local blocks are forced and always reused, so
the dynamic rate carries over between budgets of different sizes. Both classes are `select_hook`s of
`DecodeEngine` (called once per layer per step with the selection `[B, Hkv, K]` and positions `[B]`).
"""
from __future__ import annotations

import torch

from workbench.decode.engine.store import BLOCK
from workbench.patterns.infllm import Budget, forced_and_future


def forced_mask(positions: torch.Tensor, n_blocks: int, budget: Budget) -> torch.Tensor:
    """Bool `[B, 1, n_blocks]`: init blocks and the `local` blocks ending at each position's block."""
    return forced_and_future(positions // BLOCK, n_blocks, budget.init, budget.local)[0].unsqueeze(1)


class ReuseMeter:
    """Records, per layer, how many dynamic blocks of each step were also selected at the previous step."""

    def __init__(self, budget: Budget, n_blocks: int) -> None:
        self.budget, self.n_blocks = budget, n_blocks
        self.previous: dict[int, torch.Tensor] = {}
        self.reused = 0
        self.total = 0

    def __call__(self, layer: int, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, H, _ = blocks.shape
        chosen = torch.zeros(B, H, self.n_blocks + 1, dtype=torch.bool, device=blocks.device)
        chosen.scatter_(2, torch.where(blocks >= 0, blocks, self.n_blocks), True)
        dynamic = chosen[:, :, :-1] & ~forced_mask(positions, self.n_blocks, self.budget)
        if layer in self.previous:
            self.reused += int((dynamic & self.previous[layer]).sum())
            self.total += int(dynamic.sum())
        self.previous[layer] = dynamic
        return blocks

    @property
    def rate(self) -> float | None:
        """Fraction of dynamic blocks that were already selected at the previous step."""
        return self.reused / self.total if self.total else None


class ImposedReuse:
    """Replaces each selection by forced blocks + `budget.topk` dynamic blocks of which a fraction `rate`
    stays from the previous step (per layer, sequence, KV head); the rest are random past blocks.

    For benchmarks on random weights, where the real selector's reuse is not realistic. The engine still
    runs the real selector (its cost stays in the timing); only its output is replaced. Needs contexts
    of more than init + local + 2 * topk blocks. Draws from the default generator and updates its state
    in place, so it can be captured in a CUDA graph.
    """

    def __init__(self, budget: Budget, rate: float, n_blocks: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"reuse rate must be in [0, 1], got {rate}")
        self.budget, self.rate, self.n_blocks = budget, rate, n_blocks
        self.replace = round((1.0 - rate) * budget.topk)
        self.dynamic: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, H, K = blocks.shape
        dev = blocks.device
        ids = torch.arange(self.n_blocks, device=dev).view(1, 1, -1)
        forced = forced_mask(positions, self.n_blocks, self.budget)
        invalid = forced | (ids > (positions // BLOCK).view(-1, 1, 1))
        scores = torch.rand(B, H, self.n_blocks, device=dev)
        dyn = self.dynamic.get(layer)
        if dyn is None or dyn.shape[:2] != (B, H):
            dyn = scores.masked_fill(invalid, -1.0).topk(self.budget.topk, -1).indices
        elif self.replace:
            taken = torch.zeros(B, H, self.n_blocks, dtype=torch.bool, device=dev).scatter_(2, dyn, True)
            fresh = scores.masked_fill(invalid | taken, -1.0).topk(self.replace, -1).indices
            where = torch.rand(B, H, self.budget.topk, device=dev).argsort(-1)[..., :self.replace]
            dyn = dyn.scatter(2, where, fresh)
        if layer in self.dynamic and self.dynamic[layer].shape == dyn.shape:
            self.dynamic[layer].copy_(dyn)
        else:
            self.dynamic[layer] = dyn
        mask = forced.expand(B, H, -1).clone().scatter_(2, dyn, True)
        sel = torch.where(mask, ids, self.n_blocks).sort(-1).values[..., :K]
        return sel.masked_fill(sel == self.n_blocks, -1)
