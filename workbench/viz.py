"""Plotly figures shared by the CLI reports, the notebooks and the dashboard."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .profile import HeadProfile
from .stats import LayerStats

KIND_COLORS = {"sink+local": "#4c78a8", "vertical": "#f58518", "slash": "#54a24b", "block": "#b279a2", "diffuse": "#9d9d9d"}


def head_grid(profiles: Sequence[HeadProfile], metric: str = "local", title: str | None = None):
    """Layers x heads grid: colour = `metric` of each head, hover = its profile and kind."""
    import plotly.graph_objects as go

    if not profiles:
        raise ValueError("head_grid needs at least one HeadProfile: profile a capture first")
    if metric not in HeadProfile.__dataclass_fields__ or metric in ("layer", "head", "kind"):
        raise ValueError(f"unknown metric {metric!r}: use sink, local, vertical, slash, block or entropy")
    layers = sorted({p.layer for p in profiles})
    heads = sorted({p.head for p in profiles})
    z = [[None] * len(heads) for _ in layers]
    text = [[""] * len(heads) for _ in layers]
    for p in profiles:
        i, j = layers.index(p.layer), heads.index(p.head)
        z[i][j] = getattr(p, metric)
        text[i][j] = (f"L{p.layer} H{p.head}: {p.kind}<br>sink {p.sink:.2f} local {p.local:.2f} vertical {p.vertical:.2f}"
                      f"<br>slash {p.slash:.2f} block {p.block:.2f} entropy {p.entropy:.2f}")
    fig = go.Figure(go.Heatmap(z=z, x=heads, y=layers, text=text, hoverinfo="text", colorscale="Viridis",
                               zmin=0, zmax=1, colorbar=dict(title=metric)))
    fig.update_layout(title=title or f"{metric} mass per head", xaxis_title="query head", yaxis_title="layer",
                      yaxis_autorange="reversed", height=max(300, 18 * len(layers) + 120), width=max(360, 40 * len(heads) + 200))
    return fig


def attention_map(stats: LayerStats, head: int, title: str | None = None, log: bool = True, max_cells: int = 1024):
    """Max-pooled attention map of one head (max keeps thin vertical and slash lines visible),
    pooled further to at most `max_cells` x `max_cells`."""
    import plotly.graph_objects as go

    if not 0 <= head < stats.max_map.shape[0]:
        raise ValueError(f"head {head} is out of range: these stats have heads 0..{stats.max_map.shape[0] - 1}")
    z = stats.max_map[head].float()
    f = -(-z.shape[0] // max_cells)
    if f > 1:
        z = torch.nn.functional.max_pool2d(z[None], f, ceil_mode=True)[0]
    z = torch.log10(z.clamp_min(1e-6)) if log else z
    ticks = torch.arange(z.shape[0]) * stats.cell * f
    fig = go.Figure(go.Heatmap(z=z.numpy().round(3), x=ticks.tolist(), y=ticks.tolist(), colorscale="Magma",
                               colorbar=dict(title="log10 p" if log else "p")))
    fig.update_layout(title=title or f"head {head}: max-pooled ({stats.cell}x{stats.cell} cells)", xaxis_title="key",
                      yaxis_title="query", yaxis_autorange="reversed", width=520, height=480)
    return fig
