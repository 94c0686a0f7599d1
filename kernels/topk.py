"""Top-k selection helpers shared by the index builders and the pattern proxies (torch only).

`workbench.patterns.proxy` and `workbench_kernels.index_build` both select with these, so the Triton
index builders and the torch proxies pick the same positions and blocks.
"""
from __future__ import annotations

import torch


def budget(size: int | torch.Tensor, hq: int, name: str) -> tuple[int, torch.Tensor | None]:
    """(the largest budget, per-head budgets Long `[Hq]` or None when all heads share one)."""
    if isinstance(size, int) and size >= 0:  # (no tensor op: the index of a few heads is launch- and host-bound)
        return size, None
    t = torch.as_tensor(size, dtype=torch.long).reshape(-1)
    if t.numel() not in (1, hq) or (t < 0).any():
        raise ValueError(f"{name} must be an int >= 0 or one per query head ({hq}), got {t.tolist()}")
    return int(t.max()), (t if t.numel() == hq and t.numel() > 1 else None)


def ascending(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Sort ascending with the -1 padding moved to the end (entries >= n count as padding)."""
    s = torch.where(idx < 0, n, idx).sort(-1).values
    return torch.where(s >= n, -1, s)


def top_positions(score: torch.Tensor, forced: int, size: int, per_head: torch.Tensor | None = None,
                  ranked: bool = False) -> torch.Tensor:
    """Positions 0..forced-1, then the best-scoring others: Long `[..., H, size]` ascending, -1 padded.

    score `[..., H, n]`; `per_head` Long `[H]` keeps only each head's first choices. `ranked=True`
    keeps preference order instead of ascending: the first v entries are then the choice of budget v.
    """
    n = score.shape[-1]
    forced = min(forced, size, n)
    free = min(size - forced, n - forced)
    best = score[..., forced:].topk(free, dim=-1).indices + forced
    head = torch.arange(forced, device=score.device).expand(*score.shape[:-1], forced)
    pad = torch.full((*score.shape[:-1], size - forced - free), -1, dtype=torch.long, device=score.device)
    idx = torch.cat([head, best, pad], -1)  # in order of preference
    if per_head is not None:
        keep = torch.arange(size, device=score.device) < per_head.to(score.device)[:, None]
        idx = torch.where(keep, idx, -1)
    return idx if ranked else ascending(idx, n)


def top_blocks(score: torch.Tensor, topk: int, per_head: torch.Tensor | None = None,
               ranked: bool = False) -> torch.Tensor:
    """Block table from block scores `[..., H, M, M]`: per query block the diagonal plus the best
    causal key blocks, `topk` in all (`per_head` Long `[H]`: each head's own, at least 1)
    -> Int `[..., H, M, topk]` ascending, -1 padded. `ranked=True` keeps preference order instead
    (diagonal first, -1 last): the first t entries are then the table of budget t."""
    m = score.shape[-1]
    causal = torch.ones(m, m, dtype=torch.bool, device=score.device).tril()
    score = score.float().masked_fill(~causal, float("-inf"))
    score.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    kk = min(topk, m)
    top = score.topk(kk, dim=-1)
    idx = torch.where(top.values > float("-inf"), top.indices, -1)
    if per_head is not None:
        keep = torch.arange(kk, device=score.device) < per_head.to(score.device)[:, None, None].clamp(min=1)
        idx = torch.where(keep, idx, -1)
    idx = idx if ranked else ascending(idx, m)
    if kk < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - kk), value=-1)
    return idx.to(torch.int32)
