"""Block-set comparisons: dynamic top-k sets, teacher-mass recall, IoU, early-layer reuse, decode churn.

All sets here are the *dynamic* part of a selection (init and local blocks are forced for every
method, so they are left out of every comparison): Bool `[..., R, nb]` over the key blocks of R query
rows. The early-layer-reuse baseline follows the practitioner's blog: record every layer's top-k set on
calibration prompts, pick the shallow layer whose set overlaps the deeper layers' sets best (IoU), and
reuse that layer's set for all deeper layers.
"""
from __future__ import annotations

import torch

from workbench.patterns.infllm import NEG, Budget, forced_and_future


def candidates(positions: torch.Tensor, n_blocks: int, budget: Budget) -> torch.Tensor:
    """Bool `[R, nb]`: past blocks that are not forced (the blocks that compete for top-k)."""
    forced, future = forced_and_future(positions // budget.block, n_blocks, budget.init, budget.local)
    return ~forced & ~future


def dynamic_set(scores: torch.Tensor, positions: torch.Tensor, budget: Budget) -> torch.Tensor:
    """The `budget.topk` best candidate blocks: scores `[..., R, nb]` -> Bool `[..., R, nb]`."""
    cand = candidates(positions, scores.shape[-1], budget)
    s = scores.float().masked_fill(~cand, NEG)
    k = min(budget.topk, s.shape[-1])
    val, idx = s.topk(k, -1)
    return torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, val > NEG)


def block_mass(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scale: float, block: int = 64,
               chunk: int = 128) -> torch.Tensor:
    """Exact attention mass per key block, averaged over each GQA group.

    q `[Hq, R, D]` at rows `positions` `[R]`, k `[Hkv, N, D]` -> `[Hkv, R, nb]` (each row sums to 1).
    """
    hq, r, d = q.shape
    hkv, n, _ = k.shape
    nb = -(-n // block)
    out = []
    for r0 in range(0, r, chunk):
        pos = positions[r0:r0 + chunk]
        logits = torch.einsum("hgrd,hnd->hgrn", q[:, r0:r0 + chunk].float().reshape(hkv, hq // hkv, -1, d),
                              k.float()) * scale
        logits = logits.masked_fill(torch.arange(n)[None, :] > pos[:, None], NEG)
        p = torch.softmax(logits, -1).mean(1)
        p = torch.nn.functional.pad(p, (0, nb * block - n))
        out.append(p.reshape(hkv, len(pos), nb, block).sum(-1))
    return torch.cat(out, 1)


def recall(mass: torch.Tensor, chosen: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Share of the candidate blocks' mass that the chosen blocks hold, per row: `[..., R, nb]` -> `[..., R]`.
    Rows whose candidates hold no mass count as 1."""
    total = (mass * cand).sum(-1)
    got = (mass * (chosen & cand)).sum(-1)
    return torch.where(total > 0, got / total.clamp_min(1e-30), torch.ones_like(total))


def iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a & b| / |a | b| per row (1 where both are empty): Bool `[..., nb]` -> `[...]`."""
    inter = (a & b).sum(-1).float()
    union = (a | b).sum(-1).float()
    return torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union))


def iou_matrix(sets: torch.Tensor) -> torch.Tensor:
    """Layer x layer mean IoU of per-layer sets `[L, R, nb]` -> `[L, L]`."""
    a = sets.float()
    inter = torch.einsum("arb,crb->acr", a, a)
    size = a.sum(-1)  # [L, R]
    union = size[:, None, :] + size[None, :, :] - inter
    return torch.where(union > 0, inter / union.clamp_min(1), torch.ones_like(union)).mean(-1)


def pick_shallow_layer(matrix: torch.Tensor, shallow: range) -> tuple[int, list[float]]:
    """The blog's calibration: the shallow layer whose set has the best mean IoU with all deeper layers.
    matrix `[L, L]` (calibration prompts) -> (layer, mean IoU of each candidate in `shallow`)."""
    L = matrix.shape[0]
    scores = [matrix[s, s + 1:L].mean().item() for s in shallow]
    return shallow[max(range(len(scores)), key=scores.__getitem__)], scores


def ema_sets(scores: torch.Tensor, positions: torch.Tensor, budget: Budget, keep: float = 0.3) -> torch.Tensor:
    """Dynamic sets of consecutive decode steps with EMA-smoothed block scores.

    scores `[..., T, nb]` at consecutive positions; step t ranks (1 - keep) * s_t + keep * e_{t-1}
    (a block with no earlier score takes its current score) -> Bool `[..., T, nb]`.
    """
    smoothed = torch.empty_like(scores, dtype=torch.float32)
    prev = None
    for t in range(scores.shape[-2]):
        cur = scores[..., t, :].float()
        if prev is not None:
            cur = torch.where(torch.isfinite(prev) & torch.isfinite(cur), (1 - keep) * cur + keep * prev, cur)
        smoothed[..., t, :] = cur
        prev = cur
    return dynamic_set(smoothed, positions, budget)


def churn(sets: torch.Tensor) -> torch.Tensor:
    """Share of step t's dynamic blocks that step t-1 did not have: Bool `[..., T, nb]` -> mean over steps `[...]`."""
    now, before = sets[..., 1:, :], sets[..., :-1, :]
    new = (now & ~before).sum(-1).float()
    return (new / now.sum(-1).clamp_min(1).float()).mean(-1)
