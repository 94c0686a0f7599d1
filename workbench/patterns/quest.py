"""Quest: decode-time KV page selection from per-page key bounds.

Each `page`-token page of keys keeps the elementwise min and max of its keys (`page_bounds`). For a
query q, the page's score is the upper bound  sum_i max(q_i min_i, q_i max_i)  >=  q . k for every key
k of the page (`page_scores`), so a page holding a large score can never rank low. With GQA the G query
heads of a group share pages: a group scores a page by the largest bound of its heads. The top-k
pages are selected per step beside the forced init and local pages, with the same `Budget` as the
InfLLM-V2 selector (`workbench.patterns.infllm`), so both pick the same number of 64-token blocks.
"""
from __future__ import annotations

import torch

from workbench.patterns.infllm import Budget, topk_blocks


def page_bounds(k: torch.Tensor, page: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """k `[..., N, D]` -> (min, max) `[..., P, D]`, P = ceil(N / page); a last partial page uses only
    its real keys."""
    n = k.shape[-2]
    p = -(-n // page)
    pad = p * page - n
    kp = torch.nn.functional.pad(k.float(), (0, 0, 0, pad), value=float("inf")).reshape(*k.shape[:-2], p, page, k.shape[-1])
    lo = kp.amin(-2)
    hi = torch.nn.functional.pad(k.float(), (0, 0, 0, pad), value=float("-inf")).reshape(kp.shape).amax(-2)
    return lo, hi


def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Upper bounds of q . k per page: q `[..., R, D]`, lo/hi `[..., P, D]` -> `[..., R, P]`.
    sum_i max(q_i lo_i, q_i hi_i) = sum_i (relu(q_i) hi_i - relu(-q_i) lo_i): two matrix products."""
    qf = q.float()
    return qf.clamp(min=0) @ hi.transpose(-1, -2) + qf.clamp(max=0) @ lo.transpose(-1, -2)


def group_page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """q `[Hkv, G, R, D]`, lo/hi `[Hkv, P, D]` -> `[Hkv, R, P]`: the largest bound of the group's heads."""
    return page_scores(q, lo[:, None], hi[:, None]).amax(1)


def quest_select(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, positions: torch.Tensor,
                 budget: Budget = Budget()) -> torch.Tensor:
    """Pages of one decode step per KV head: q `[Hkv, G, R, D]` (R query rows at `positions` `[R]`),
    bounds `[Hkv, P, D]` -> ids Long `[Hkv, R, K]` (K = budget.total, ascending, -1 padded): init and
    local pages forced, then the top-k past pages by bound; future pages never."""
    s = group_page_scores(q, lo, hi)
    return topk_blocks(s, positions // budget.block, budget)
