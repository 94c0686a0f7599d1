"""Online proxy indexes: pick each head's VS or block-sparse index from cheap statistics of the prompt.

Both builders take all heads of a layer at once, on any device: q `[..., Hq, N, D]`, k `[..., Hkv, N, D]`
(query head h reads KV head h // (Hq // Hkv)); a leading batch dim is optional. Long prompts go through
the heads in groups (`head_groups`) so their `[heads, rows, N]` scores stay under a fixed size. They are
the reference the Triton index builder in `workbench_kernels` is tested against.
"""
from __future__ import annotations

import torch
from workbench_kernels.topk import budget as _budget
from workbench_kernels.topk import top_blocks, top_positions

from workbench.patterns.base import BLOCK

AGGREGATES = ("sum", "max", "logits")
DIAG_NORMS = ("sum", "mean", "prior")
GROUP_ELEMENTS = 1 << 24  # scores per head group (64 MB of fp32): `head_groups`' default budget


def head_groups(hq: int, hkv: int, per_head: int, budget: int | None = None) -> list[tuple[slice, slice]]:
    """Groups of query heads whose `per_head` elements each add up to at most `budget` (default
    `GROUP_ELEMENTS`; one head at least), with their KV heads: (query heads, KV heads) slices, every group
    GQA-aligned (whole KV groups while they fit, else equal parts of one). Small inputs are one group."""
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q has {hq} heads and k {hkv}: the query heads must be a multiple of the KV heads")
    budget = budget or GROUP_ELEMENTS
    g = hq // hkv
    if per_head * g <= budget:
        size = g * max(1, min(hkv, budget // (per_head * g)))
    else:
        size = max(d for d in range(1, g + 1) if g % d == 0 and (d == 1 or d * per_head <= budget))
    return [(slice(h0, min(h0 + size, hq)), slice(h0 // g, (min(h0 + size, hq) - 1) // g + 1))
            for h0 in range(0, hq, size)]


def _grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q `[..., Hq, R, D]` . k `[..., Hkv, N, D]` -> `[..., Hq, R, N]` without repeating k per query head."""
    hq, r, d = q.shape[-3:]
    hkv, n = k.shape[-3], k.shape[-2]
    if hq % hkv:
        raise ValueError(f"q has {hq} heads and k {hkv}: the query heads must be a multiple of the KV heads")
    qg = q.reshape(*q.shape[:-3], hkv, (hq // hkv) * r, d)
    return (qg @ k.transpose(-1, -2)).reshape(*q.shape[:-3], hq, r, n)


@torch.no_grad()
def vs_proxy(q: torch.Tensor, k: torch.Tensor, scale: float, vertical: int | torch.Tensor,
             slash: int | torch.Tensor, *, last_rows: int = 64, aggregate: str = "sum",
             diag_norm: str = "sum", sink: int = 30, local: int = 100,
             prior: float = 16.0, ranked: bool = False, group_shared: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical-slash index from the last `last_rows` query rows -> (columns, offsets).

    The last r rows score all keys (causal inside the r x r corner). `aggregate`: "sum" of softmax
    probabilities over rows, "max" probability, or "logits" (mean scaled logit). Columns rank by that
    score; offsets rank by the same values gathered along diagonals, normalised per `diag_norm`:
    "sum" (raw), "mean" (divided by the entries on that diagonal: min(r, n - d)) or "prior" (mean
    smoothed toward the strip's overall mean with `prior` pseudo-entries). The first `sink` columns
    and the `local` smallest offsets (offset 0 always) are forced in and count toward the budgets.
    `vertical`, `slash`: budgets (int, or Long `[Hq]` per head).
    Returns columns Long `[..., Hq, vertical]`, offsets Long `[..., Hq, slash]`, ascending, -1 padded
    (`ranked=True`: in preference order, so the first v columns are exactly the index of budget v).
    `group_shared`: one index per KV head (`[..., Hkv, ...]`) from the column and diagonal scores added over
    its query heads (as `workbench_kernels.index_build.vs_index(group_shared=True)`); per-head budgets are then
    one per KV head.
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r} is unknown: use one of {AGGREGATES}")
    if diag_norm not in DIAG_NORMS:
        raise ValueError(f"diag_norm={diag_norm!r} is unknown: use one of {DIAG_NORMS}")
    if last_rows < 1:
        raise ValueError(f"last_rows={last_rows}: use at least 1 query row")
    hq, n = q.shape[-3], q.shape[-2]
    heads = k.shape[-3] if group_shared else hq
    v_max, v_head = _budget(vertical, heads, "vertical")
    s_max, s_head = _budget(slash, heads, "slash")
    r = min(last_rows, n)
    batch = q[..., 0, 0, 0].numel()  # prompts in the leading dims
    parts = [_vs_scores(q[..., hs, n - r:, :], k[..., ks, :, :], scale, aggregate, diag_norm, prior)
             for hs, ks in head_groups(hq, k.shape[-3], batch * r * n)]
    col, diag = (torch.cat(x, -2) for x in zip(*parts))
    if group_shared:
        col, diag = (x.unflatten(-2, (k.shape[-3], -1)).sum(-2) for x in (col, diag))
    columns = top_positions(col, sink, v_max, v_head, ranked)
    offsets = top_positions(diag, max(local, 1), s_max, s_head, ranked)
    return columns, offsets


def _vs_scores(q: torch.Tensor, k: torch.Tensor, scale: float, aggregate: str, diag_norm: str,
               prior: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`vs_proxy`'s column and diagonal scores `[..., Hq, N]` from its last r query rows q `[..., Hq, r, D]`."""
    r, n = q.shape[-2], k.shape[-2]
    s = _grouped_scores(q.float(), k.float()) * scale  # [..., Hq, r, n]
    i = torch.arange(n - r, n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None, :]
    causal = j <= i  # [r, n]
    s = s.masked_fill(~causal, float("-inf"))
    if aggregate == "logits":
        value = s.masked_fill(~causal, 0.0)
        col = value.sum(-2) / causal.sum(0).clamp(min=1)
    else:
        value = torch.softmax(s, -1)
        col = value.sum(-2) if aggregate == "sum" else value.amax(-2)
    # gather the same values along diagonals: offset d = i - j; non-causal entries go to a spare slot n
    d = torch.where(causal, i - j, n).reshape(-1).expand(*value.shape[:-2], -1)
    flat = value.reshape(*value.shape[:-2], -1)
    diag = torch.zeros(*value.shape[:-2], n + 1, dtype=value.dtype, device=q.device)
    if aggregate == "max":
        diag = diag.scatter_reduce(-1, d, flat, "amax", include_self=False)[..., :n]
    else:
        diag = diag.scatter_add(-1, d, flat)[..., :n]
        count = torch.clamp(n - torch.arange(n, device=q.device), max=r).to(diag.dtype)
        if diag_norm == "mean":
            diag = diag / count
        elif diag_norm == "prior":
            mean = diag.sum(-1, keepdim=True) / count.sum()
            diag = (diag + prior * mean) / (count + prior)
    return col, diag


@torch.no_grad()
def block_proxy(q: torch.Tensor, k: torch.Tensor, topk: int | torch.Tensor, block: int = BLOCK,
                ranked: bool = False) -> torch.Tensor:
    """Block-sparse index from 64-token mean-pooled q and k -> Int `[..., Hq, M, topk]`.

    Pooled scores q~.k~ (no softmax), block-causal; the diagonal block is always kept; rows with fewer
    causal blocks than `topk` are -1 padded. Key-block ids ascending (`ranked=True`: in preference order,
    diagonal first, so the first t ids are the table of budget t). `topk`: int or Long `[Hq]`.
    """
    hq, n = q.shape[-3], q.shape[-2]
    k_max, k_head = _budget(topk, hq, "topk")
    full = n // block

    def pool(x: torch.Tensor) -> torch.Tensor:  # block means, summed in fp32 (no fp32 copy of x)
        parts = [x[..., :full * block, :].unflatten(-2, (full, block)).sum(-2, dtype=torch.float32) / block]
        if n % block:  # a last partial block averages its own tokens
            parts.append(x[..., full * block:, :].sum(-2, keepdim=True, dtype=torch.float32) / (n % block))
        return torch.cat(parts, -2)

    return top_blocks(_grouped_scores(pool(q), pool(k)), k_max, k_head, ranked)
