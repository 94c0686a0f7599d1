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
    runs the real selector (its cost stays in the timing); only its output is replaced. At a layer's first
    call each row draws a random order of the blocks that are past and not forced at its position; the
    dynamic blocks are then a window of `topk` consecutive entries of that order which moves on by
    `round((1 - rate) * topk)` entries per step (the oldest leave, fresh random ones enter, none repeats for
    `blocks / replaced` steps). About ten launches a call, all state updated in place, so it can be captured in
    a CUDA graph. Needs contexts of more than init + local + 2 * topk blocks at the first call.
    """

    def __init__(self, budget: Budget, rate: float, n_blocks: int) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"reuse rate must be in [0, 1], got {rate}")
        self.budget, self.rate, self.n_blocks = budget, rate, n_blocks
        self.replace = round((1.0 - rate) * budget.topk)
        self.order: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (order, candidates per row)
        self.start: dict[int, torch.Tensor] = {}  # layer -> the window's first entry (device int)

    def _first_call(self, layer: int, B: int, H: int, positions: torch.Tensor) -> None:
        b, dev = self.budget, positions.device
        n = (positions // BLOCK - b.local - b.init + 1).view(B, 1, 1)  # candidates init .. block - local
        if int(n.min()) < 2 * b.topk:
            raise ValueError(f"ImposedReuse needs more than {b.init + b.local + 2 * b.topk} blocks per sequence")
        ids = torch.arange(self.n_blocks, device=dev).view(1, 1, -1)
        keys = torch.rand(B, H, self.n_blocks, device=dev).masked_fill(ids >= n, 2.0)
        self.order[layer] = (keys.argsort(-1) + b.init, n)  # the first n entries: a random order of candidates
        self.start[layer] = torch.zeros((), dtype=torch.long, device=dev)
        self._window = torch.arange(b.topk, device=dev).view(1, 1, -1)
        self._init = torch.arange(b.init, device=dev).view(1, 1, -1).expand(B, 1, -1)
        self._local = (torch.arange(b.local, device=dev) - b.local + 1).view(1, 1, -1)

    def __call__(self, layer: int, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, H, K = blocks.shape
        if layer not in self.order or self.order[layer][0].shape[:2] != (B, H):
            self._first_call(layer, B, H, positions)
        order, n = self.order[layer]
        dynamic = order.gather(2, ((self.start[layer] + self._window) % n).expand(B, H, -1))
        forced = torch.cat([self._init, (positions // BLOCK).view(B, 1, 1) + self._local], -1)  # init, local
        sel = torch.cat([forced.expand(B, H, -1), dynamic], -1).sort(-1).values
        self.start[layer] += self.replace
        return sel[..., :K]
