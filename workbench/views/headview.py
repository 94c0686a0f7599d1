"""One head under an edited index, fast enough to follow live edits (the dashboard's Head tab).

`HeadView(q, k, v, scale)` runs one head's exact causal softmax once and keeps the probabilities
`[N, N]` fp32 (64 MB at 4K tokens, 256 MB at 8K) and the dense output. `evaluate(index)` then needs
no new softmax: per-row captured mass, its mean per query segment (`metrics.segment_mass`), the
output error against dense (the same quantities as `metrics.output_error`) and the logical and
physical density (`metrics.density`). Oracle mass and tiles come from `search.rescore_head`.
"""
from __future__ import annotations

from typing import Any

import torch

from workbench.analysis.metrics import density, segment_mass
from workbench.analysis.stats import attention_rows
from workbench.patterns import BLOCK, pattern_class

MAX_N = 8192


def full_mask(index: Any, n: int) -> torch.Tensor:
    """Bool `[n, n]` of a one-head index: its `row_mask(0, n, n)[0]`."""
    if index.n_heads != 1:
        raise ValueError(f"full_mask takes a one-head index, got {index.n_heads} heads: pick the head first")
    return index.row_mask(0, n, n)[0]


@torch.no_grad()
def head_index(entry: Any, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
               block: int = BLOCK, group: tuple[torch.Tensor, int] | None = None):
    """The one-head index a `HeadEntry` prescribes for this prompt (q, k `[N, D]`): what
    `HeadConfig.layer_index` builds for that head, without running the proxies of the other heads. `group`: (q
    `[G, N, D]` of the head's KV group, the head's row in it), which a kind that shares one index per KV group
    reads (the whole group taking the entry, as the config's rule has it)."""
    cls = pattern_class(entry.pattern)
    if cls.kv_shared and group is not None:
        return cls.build([entry.params] * group[0].shape[0], group[0], k[None], scale, proxy, block)[group[1]]
    return cls.build([entry.params], q[None], k[None], scale, proxy, block)[0]


class HeadView:
    """One head's dense attention held in memory. q `[N, D]`, k and v `[N, D]` (its KV head)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        n = q.shape[0]
        if n > MAX_N:
            raise ValueError(f"HeadView keeps an N x N matrix: N = {n} is above {MAX_N}; use metrics.captured_mass "
                             "and metrics.output_error (row-chunked) for longer prompts")
        self.n = n
        self.v = v.float()
        self.p = torch.zeros(n, n)
        for r0, r1, p, _ in attention_rows(q[None], k[None], scale, chunk=512):
            self.p[r0:r1, :r1] = p[0]
        self.dense = self.p @ self.v

    @torch.no_grad()
    def evaluate(self, index: Any) -> dict[str, Any]:
        """Numbers of a one-head index (a pattern with n_heads = 1).

        Returns {"rows": `[N]` captured mass per query row, "segments": {name: float} (all, first, middle,
        last third, last64), "rel_l2": float, "cosine": float, "logical": float, "physical": float}."""
        kept = self.p * full_mask(index, self.n)
        rows = kept.sum(-1)
        sparse = (kept @ self.v) / rows[:, None]
        err2 = (sparse - self.dense).square().sum().double()
        ref2 = self.dense.square().sum().double().clamp(min=1e-30)
        cos = torch.nn.functional.cosine_similarity(sparse, self.dense, dim=-1).mean()
        dens = density(index, self.n)
        return {"rows": rows, "segments": {k: float(v[0]) for k, v in segment_mass(rows[None]).items()},
                "rel_l2": float((err2 / ref2).sqrt()), "cosine": float(cos),
                "logical": float(dens["logical"][0]), "physical": float(dens["physical"][0])}
