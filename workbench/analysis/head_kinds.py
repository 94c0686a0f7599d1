"""Summarise each head's dense attention from its `LayerStats`: where does its mass go?"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from workbench.analysis.stats import LayerStats

SINK_TOKENS = 4
LOCAL_WINDOW = 64


@dataclass
class HeadProfile:
    """Fractions of a head's total attention mass (all in [0, 1]; they overlap).

    sink: first 4 keys. local: offsets i - j < 64. vertical: the top 1% of the other columns.
    slash: the top 1% of offsets >= 64. block: the top 10% of 64x64 tiles of each row block.
    entropy: mean row entropy over log(i + 1) (1 = uniform over the causal prefix).
    """

    layer: int
    head: int
    sink: float
    local: float
    vertical: float
    slash: float
    block: float
    entropy: float
    kind: str

    def to_dict(self) -> dict:
        return asdict(self)


def _kind(sink: float, local: float, vertical: float, slash: float, block: float) -> str:
    """A coarse label for the head grid; the pattern search gives the real per-head choice."""
    if sink + local >= 0.9:
        return "sink+local"
    scores = {"vertical": vertical, "slash": slash, "block": block}
    best = max(scores, key=scores.get)
    return best if scores[best] >= 0.3 else "diffuse"


def profile_layer(stats: LayerStats, layer: int) -> list[HeadProfile]:
    """One `HeadProfile` per query head of a layer."""
    n = stats.n
    col = stats.column_mass.clone()
    col[:, :SINK_TOKENS] = 0
    sink = stats.column_mass[:, :SINK_TOKENS].sum(-1) / n
    local = stats.diag_mass[:, :LOCAL_WINDOW].sum(-1) / n
    top_cols = max(1, n // 100)
    vertical = col.topk(min(top_cols, n), dim=-1).values.sum(-1) / n
    far = stats.diag_mass[:, LOCAL_WINDOW:]
    slash = far.topk(min(top_cols, far.shape[1]), dim=-1).values.sum(-1) / n if far.shape[1] else torch.zeros_like(sink)
    M = stats.block_mass.shape[-1]
    top_tiles = max(1, M // 10)
    block = stats.block_mass.topk(min(top_tiles, M), dim=-1).values.sum((-1, -2)) / n
    norm = torch.log(torch.arange(1, n + 1, dtype=torch.float32, device=stats.row_entropy.device)).clamp_min(1e-6)
    entropy = (stats.row_entropy[:, 1:] / norm[1:]).mean(-1) if n > 1 else torch.zeros_like(sink)
    out = []
    for h in range(stats.column_mass.shape[0]):
        vals = [float(x[h]) for x in (sink, local, vertical, slash, block)]
        out.append(HeadProfile(layer, h, *vals, float(entropy[h]), _kind(*vals)))
    return out
