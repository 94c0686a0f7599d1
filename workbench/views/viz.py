"""Plotly figures shared by the CLI reports, the notebooks and the dashboard.

Every function takes library objects (`LayerStats`, patterns, `HeadConfig`, ...) or plain arrays and
returns a `plotly.graph_objects.Figure`; nothing here analyses anything beyond layout (pooling a map
to the screen, rounding). Bad input raises ValueError naming the argument and the fix.

Attention maps are drawn in decibels, 10*log10(p), rounded to int8 (1 dB steps, floor -60 dB = 1e-6),
which plotly ships as base64 bytes: a 1024 x 1024 map is ~1.8 MB of figure JSON. Cells with p = 0
(the non-causal triangle) are left white. Axes are token positions (x = key j, y = query i).
Plotly is imported inside the functions: the GPU image has no plotly.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from workbench.analysis.head_kinds import HeadProfile
from workbench.analysis.stats import LayerStats, window_map
from workbench.patterns import PATTERNS

KIND_COLORS = {"sink+local": "#4c78a8", "vertical": "#f58518", "slash": "#54a24b", "block": "#b279a2", "diffuse": "#9d9d9d"}
PALETTE = ["#4c78a8", "#f58518", "#b279a2", "#7f7f7f", "#e45756", "#72b7b2", "#eeca3b", "#ff9da6", "#9d755d", "#54a24b"]
PATTERN_COLORS = {kind: PALETTE[i % len(PALETTE)] for i, kind in enumerate(PATTERNS)}  # in the registry's order
PATTERN_NAMES = {kind: cls.title for kind, cls in PATTERNS.items()}
TIME_PARTS = ("T_proj", "T_index", "T_sparse", "T_dense", "T_other")  # T_dense: dense attention (the reference)
TIME_COLORS = {"T_proj": "#4c78a8", "T_index": "#f58518", "T_sparse": "#54a24b", "T_dense": "#e45756",
               "T_other": "#9d9d9d"}
TIME_NAMES = {"T_proj": "T_proj (projections)", "T_index": "T_index (online index)",
              "T_sparse": "T_sparse (sparse attention)", "T_dense": "dense attention", "T_other": "T_other (MLP, norms)"}
STREAM_COLORS = {"compute": "#4c78a8", "copy": "#f58518", "stall": "#e45756"}
FLOOR_DB = -60
MAX_CELLS = 1024
_BLANK = -128  # int8 code of p = 0: below zmin, drawn white
_MAGMA = ["#000004", "#3b0f70", "#8c2981", "#de4968", "#fe9f6d", "#fcfdbf"]


def _go():
    import plotly.graph_objects as go

    return go


def as_array(x: Any, name: str, ndim: int | None = None) -> np.ndarray:
    """A float64 numpy copy of a tensor / array / nested list; checks `ndim` and that it is not empty."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be numeric (a tensor, array or list of numbers): {e}") from None
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{name} is empty (shape {a.shape}): capture or measure something first")
    return a


def zoom_range(values: Any, top: float = 1.0) -> tuple[float, float]:
    """A y range from just below the smallest value to `top`, so that gaps of 0.01-0.09 between values
    near 1 are visible: the floor is a multiple of 0.05 at least 0.05 below the minimum (0 for low values)."""
    v = as_array(values, "values")
    lo = float(np.nanmin(v)) if np.isfinite(v).any() else 0.0
    floor = max(0.0, math.floor((lo - 0.05) * 20) / 20)
    floor = floor if floor >= 0.3 else 0.0
    return floor, top + 0.08 * (top - floor)


def to_db(p: Any, floor_db: int = FLOOR_DB) -> np.ndarray:
    """Probabilities -> int8 decibels 10*log10(p), clamped to [floor_db, 0]; p <= 0 -> -128 (blank)."""
    a = as_array(p, "p")
    with np.errstate(divide="ignore"):
        db = np.clip(np.rint(10 * np.log10(np.maximum(a, 1e-30))), floor_db, 0)
    return np.where(a > 0, db, _BLANK).astype(np.int8)


def pool_max(z: Any, max_cells: int = MAX_CELLS) -> tuple[torch.Tensor, int]:
    """Max-pool a 2-D map so that each side has at most `max_cells` cells -> (map, factor).

    Max (not mean) keeps one-token-wide vertical and slash lines visible."""
    t = torch.as_tensor(z, dtype=torch.float32)
    if t.dim() != 2 or t.numel() == 0:
        raise ValueError(f"a map must be 2-D and non-empty, got shape {tuple(t.shape)}")
    if max_cells < 1:
        raise ValueError(f"max_cells={max_cells} must be >= 1")
    f = -(-max(t.shape) // max_cells)
    if f > 1:
        t = torch.nn.functional.max_pool2d(t[None], f, ceil_mode=True)[0]
    return t, f


def _db_colorscale(floor_db: int) -> list:
    """White below floor_db (blank cells), magma from floor_db to 0 dB."""
    lo, span = _BLANK, -_BLANK
    edge = (floor_db - 0.5 - lo) / span
    scale = [[0.0, "#ffffff"], [edge, "#ffffff"]]
    for i, c in enumerate(_MAGMA):
        scale.append([edge + (1 - edge) * i / (len(_MAGMA) - 1), c])
    scale[2][0] = edge + 1e-9
    return scale


def cell_text(cell: int) -> str:
    """How a map's cells read: "exact" (one token per side) or "max over 8x8-token cells"."""
    return "exact" if cell == 1 else f"max over {cell}x{cell}-token cells"


def _map_figure(p: torch.Tensor, row0: int, col0: int, cell: int, n_rows: int, n_cols: int, title: str,
                floor_db: int):
    """Heatmap of probabilities `[R, C]` whose cell (r, c) covers `cell` x `cell` tokens starting at
    query row0 + r*cell, key col0 + c*cell; the axes span n_rows x n_cols tokens."""
    go = _go()
    z = to_db(p, floor_db)
    ticks = [v for v in range(floor_db, 1, 10)]
    trace = go.Heatmap(
        z=z, x0=col0 + (cell - 1) / 2, dx=cell, y0=row0 + (cell - 1) / 2, dy=cell, zmin=_BLANK, zmax=0,
        colorscale=_db_colorscale(floor_db), name="attention",
        colorbar=dict(title="10·log10 p", tickvals=ticks, ticktext=[str(t) for t in ticks]),
        hovertemplate="query %{y}<br>key %{x}<br>%{z} dB<extra></extra>" if cell == 1 else
        f"queries %{{y}}±{cell // 2}<br>keys %{{x}}±{cell // 2}<br>max %{{z}} dB<extra></extra>")
    fig = go.Figure(trace)
    fig.update_layout(title=title, width=560, height=520, margin=dict(l=60, r=20, t=50, b=50),
                      legend=dict(orientation="h", y=-0.12), plot_bgcolor="white")
    fig.update_xaxes(title="key position", range=[col0 - 0.5, col0 + n_cols - 0.5], constrain="domain")
    fig.update_yaxes(title="query position", range=[row0 + n_rows - 0.5, row0 - 0.5], scaleanchor="x",
                     constrain="domain")
    return fig


# ----------------------------------------------------------------------------- heads at a glance

def head_grid(profiles: Sequence[HeadProfile], metric: str = "local", title: str | None = None):
    """Layers x heads grid: colour = `metric` of each head, hover = its profile and kind."""
    go = _go()
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
        z[i][j] = round(getattr(p, metric), 4)
        text[i][j] = (f"L{p.layer} H{p.head}: {p.kind}<br>sink {p.sink:.2f} local {p.local:.2f} vertical {p.vertical:.2f}"
                      f"<br>slash {p.slash:.2f} block {p.block:.2f} entropy {p.entropy:.2f}")
    fig = go.Figure(go.Heatmap(z=z, x=heads, y=layers, text=text, hoverinfo="text", colorscale="Viridis",
                               zmin=0, zmax=1, colorbar=dict(title=metric)))
    fig.update_layout(title=title or f"{metric} mass per head", xaxis_title="query head", yaxis_title="layer",
                      yaxis_autorange="reversed", height=max(300, 18 * len(layers) + 120), width=max(360, 40 * len(heads) + 200))
    return fig


def _patterns_and_recall(patterns: Any, recall: Any) -> tuple[list[list[str]], np.ndarray, list[list[str]]]:
    """(pattern names `[L][H]`, recall `[L, H]`, hover labels) from a HeadConfig or plain arrays."""
    if hasattr(patterns, "heads") and hasattr(patterns, "model"):  # a HeadConfig
        cfg = patterns
        L, H = cfg.model["n_layers"], cfg.model["n_heads"]
        names = [[cfg.entry(l, h).pattern for h in range(H)] for l in range(L)]
        labels = [[cfg.entry(l, h).label() for h in range(H)] for l in range(L)]
        if recall is None:
            missing = [(e.layer, e.head) for e in cfg.heads if not e.recall]
            if missing:
                raise ValueError(f"the config has no recall for heads {missing[:3]}: pass recall=[L, H] "
                                 "(e.g. search.evaluate_config(...)['mass'])")
            recall = [[cfg.entry(l, h).recall["mean"] for h in range(H)] for l in range(L)]
    else:
        names = [list(row) for row in patterns]
        labels = names
        if recall is None:
            raise ValueError("recall is required with plain pattern names: give an [L, H] array")
    r = as_array(recall, "recall", 2)
    if r.shape != (len(names), len(names[0]) if names else 0) or any(len(row) != r.shape[1] for row in names):
        raise ValueError(f"recall has shape {r.shape} but patterns is {len(names)} x {len(names[0]) if names else 0}: "
                         "give one value per (layer, head)")
    unknown = {p for row in names for p in row} - set(PATTERNS)
    if unknown:
        raise ValueError(f"unknown pattern names {sorted(unknown)}: use {sorted(PATTERNS)}")
    return names, r, labels


def _tint(color: str, white: float) -> str:
    """`color` (#rrggbb) mixed with a share `white` of white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * white):02x}" for c in rgb)


def _wrap(title: str, width: int) -> str:
    """`title` broken into lines (plotly `<br>`) of about as many characters as `width` pixels hold at 14 px."""
    import textwrap

    return "<br>".join(textwrap.wrap(title, max(20, width // 8)))


def pattern_grid(patterns: Any, recall: Any = None, title: str | None = None, floor: float | None = None):
    """Layers x heads grid: hue = the head's pattern, shade = its recall (captured mass; lightest = the
    lowest recall in the grid or `floor`, full colour = 1), with a grey colour scale of the shade.

    `patterns`: a HeadConfig (recall defaults to each head's calibration mean) or names `[L][H]` from
    the registered kinds (`workbench.patterns.PATTERNS`) with `recall` `[L, H]`. Heads whose recall is
    NaN (layers not captured) are left blank and not counted in the legend. Click data: x = head, y = layer."""
    go = _go()
    names, r, labels = _patterns_and_recall(patterns, recall)
    L, H = r.shape
    seen = np.isfinite(r)
    lo = (float(np.nanmin(r)) if seen.any() else 0.0) if floor is None else floor
    lo = min(lo, 0.99)
    width = max(520, 36 * H + 330)
    fig = go.Figure()
    for pat, color in PATTERN_COLORS.items():
        mask = np.array([[p == pat for p in row] for row in names]) & seen
        if not mask.any():
            continue
        z = np.where(mask, np.round(r, 4), np.nan)
        text = [[f"L{l} H{h}: {labels[l][h]}<br>recall {r[l, h]:.3f}" if mask[l, h] else "" for h in range(H)]
                for l in range(L)]
        fig.add_trace(go.Heatmap(z=z, x=list(range(H)), y=list(range(L)), zmin=lo, zmax=1, showscale=False,
                                 colorscale=[[0, _tint(color, 0.75)], [1, color]], text=text, hoverinfo="text",
                                 xgap=1, ygap=1, name=PATTERN_NAMES.get(pat, pat)))
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=dict(size=10, color=color, symbol="square"),
                                 name=f"{PATTERN_NAMES.get(pat, pat)} ({int(mask.sum())})", showlegend=True))
    gray = "#555555"  # the shade's scale: every hue goes from its 75 % tint (lowest recall) to full colour (1)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", hoverinfo="skip", showlegend=False, name="shade",
                             marker=dict(color=[lo], cmin=lo, cmax=1, showscale=True,
                                         colorscale=[[0, _tint(gray, 0.75)], [1, gray]],
                                         colorbar=dict(title=dict(text="captured<br>mass", side="top"), x=1.02,
                                                       len=0.5, y=0, yanchor="bottom", thickness=14))))
    blank = int((~seen).sum())
    full = title or f"pattern per head (shade: recall {lo:.2f} .. 1)"
    if blank:
        full += f"; {blank} heads blank (layers not captured)"
    fig.update_layout(title=dict(text=_wrap(full, width - 120), font=dict(size=14)), plot_bgcolor="white",
                      xaxis_title="query head", yaxis_title="layer", yaxis_autorange="reversed",
                      height=max(360, 16 * L + 170), width=width, margin=dict(t=90),
                      legend=dict(x=1.02, y=1, yanchor="top"))
    return fig


def thumbnail(max_map: Any, size: int = 24) -> torch.Tensor:
    """A `[R, R]` max-pooled map pooled further (max) to at most `size` x `size` cells (for head grids)."""
    return pool_max(max_map, size)[0]


def head_thumbnails(thumbs: Any, patterns: Any = None, recall: Any = None, title: str | None = None,
                    floor_db: int = FLOOR_DB, layers: Sequence[int] | None = None):
    """A mosaic of every head's attention map: thumbs `[L, H, t, t]` probabilities (e.g. `thumbnail` of
    each `LayerStats.max_map[h]`); `layers` labels the rows (default 0..L-1). With `patterns`
    (HeadConfig or names `[L][H]`, same rows) and `recall`, each thumbnail gets a frame in its
    pattern's colour and its recall printed in its empty upper-right corner."""
    go = _go()
    t = as_array(thumbs, "thumbs", 4)
    L, H, s, s2 = t.shape
    if s != s2:
        raise ValueError(f"thumbs must be square per head [L, H, t, t], got {t.shape}")
    layers = list(range(L)) if layers is None else list(layers)
    if len(layers) != L:
        raise ValueError(f"layers has {len(layers)} labels for {L} rows of thumbnails")
    pitch = s + 2
    mosaic = np.zeros((L * pitch, H * pitch))
    for l in range(L):
        for h in range(H):
            mosaic[l * pitch + 1:l * pitch + 1 + s, h * pitch + 1:h * pitch + 1 + s] = t[l, h]
    z = to_db(mosaic, floor_db)
    ticks = list(range(floor_db, 1, 20))
    fig = go.Figure(go.Heatmap(z=z, zmin=_BLANK, zmax=0, colorscale=_db_colorscale(floor_db), hoverinfo="skip",
                               colorbar=dict(title="10·log10 p", tickvals=ticks, ticktext=[str(t) for t in ticks])))
    centers_x = [h * pitch + pitch / 2 - 0.5 for l in range(L) for h in range(H)]
    centers_y = [l * pitch + pitch / 2 - 0.5 for l in range(L) for h in range(H)]
    hover = [f"L{layers[l]} H{h}" for l in range(L) for h in range(H)]
    if patterns is not None:
        names, r, labels = _patterns_and_recall(patterns, recall)
        if r.shape != (L, H):
            raise ValueError(f"patterns/recall are {r.shape} but thumbs has {L} layers x {H} heads")
        colors = PATTERN_COLORS
        for l in range(L):
            for h in range(H):
                fig.add_shape(type="rect", x0=h * pitch - 0.5, x1=(h + 1) * pitch - 1.5, y0=l * pitch - 0.5,
                              y1=(l + 1) * pitch - 1.5, line=dict(color=colors[names[l][h]], width=2))
        hover = [f"L{layers[l]} H{h}: {labels[l][h]}<br>recall {r[l, h]:.3f}" for l in range(L) for h in range(H)]
        # recall printed in each map's empty (non-causal) upper-right corner
        fig.add_trace(go.Scatter(x=[h * pitch + 0.72 * pitch for l in range(L) for h in range(H)],
                                 y=[l * pitch + 0.22 * pitch for l in range(L) for h in range(H)], mode="text",
                                 text=[f"{r[l, h]:.2f}" for l in range(L) for h in range(H)], hoverinfo="skip",
                                 textfont=dict(size=9, color="#333"), showlegend=False, name="recall"))
        for pat, color in colors.items():
            if any(p == pat for row in names for p in row):
                fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=PATTERN_NAMES.get(pat, pat),
                                         marker=dict(size=10, color=color, symbol="square-open")))
    fig.add_trace(go.Scatter(x=centers_x, y=centers_y, mode="markers", marker=dict(size=max(4, s), opacity=0),
                             text=hover, hoverinfo="text", showlegend=False, name="heads"))
    fig.update_xaxes(tickvals=[h * pitch + pitch / 2 - 0.5 for h in range(H)], ticktext=[str(h) for h in range(H)],
                     title="query head", showgrid=False)
    fig.update_yaxes(tickvals=[l * pitch + pitch / 2 - 0.5 for l in range(L)], ticktext=[str(x) for x in layers],
                     title="layer", autorange="reversed", scaleanchor="x", showgrid=False)
    fig.update_layout(title=title or "every head's attention map", plot_bgcolor="white",
                      width=max(420, 2 * H * pitch + 200), height=max(360, 2 * L * pitch + 140),
                      legend=dict(orientation="h", y=-0.05))
    return fig


# ----------------------------------------------------------------------------- one head

def token_texts(tokenizer: Any, ids: Any) -> list[str]:
    """Each token id `[N]` as its own text (what the maps' axes and hover show)."""
    return [tokenizer.decode([int(i)]) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


def _short(text: str, width: int = 10) -> str:
    t = repr(text)[1:-1]
    return t if len(t) <= width else t[:width - 1] + "…"


def add_tokens(fig: Any, tokens: Sequence[str], rows: tuple[int, int], cols: tuple[int, int],
               marks: Mapping[str, Sequence[tuple[int, int]]] | None = None, ticks: int = 8) -> Any:
    """Label a map's axes with token text: `ticks` positions per axis show "position·token" (queries
    rows = (r0, r1), keys cols = (c0, c1)); `marks` {name: [(start, end)]} outlines token spans (e.g. a
    needle) as dotted key bands. Returns `fig`."""
    for axis, (a, b) in (("x", cols), ("y", rows)):
        if not 0 <= a < b <= len(tokens):
            raise ValueError(f"{axis} range ({a}, {b}) is outside the {len(tokens)} tokens given")
        pos = sorted({a + round(i * (b - 1 - a) / max(ticks - 1, 1)) for i in range(ticks)})
        sep = "<br>" if axis == "x" else " "
        getattr(fig, f"update_{axis}axes")(tickvals=pos, ticktext=[f"{p}{sep}{_short(tokens[p])}" for p in pos])
    for name, spans in (marks or {}).items():
        for start, end in spans:
            if end > cols[0] and start < cols[1]:
                fig.add_vrect(x0=max(start, cols[0]) - 0.5, x1=min(end, cols[1]) - 0.5, fillcolor="rgba(0,0,0,0)",
                              line=dict(color="#00e5ff", dash="dot", width=1.5), annotation_text=name,
                              annotation_position="bottom left", annotation_font=dict(color="#00b8d4", size=11))
    return fig


def attention_map(stats: LayerStats, head: int, title: str | None = None, max_cells: int = MAX_CELLS,
                  pattern: Any = None, floor_db: int = FLOOR_DB, tokens: Sequence[str] | None = None,
                  marks: Mapping[str, Sequence[tuple[int, int]]] | None = None):
    """Max-pooled attention map of one head from `LayerStats.max_map` (max keeps thin vertical and slash
    lines visible), pooled further to at most `max_cells` x `max_cells`; `pattern` is overlaid
    (`add_pattern`); `tokens` (`[N]` texts, `token_texts`) label the axes and `marks` outline token
    spans such as a needle (`add_tokens`). `attention_zoom` recomputes a region: exact per token, or
    re-reduced at the finest cell that fits when the region is larger than `max_cells`."""
    if not isinstance(stats, LayerStats):
        raise ValueError(f"stats must be a LayerStats (workbench.analysis.stats.layer_stats), got {type(stats).__name__}")
    if not 0 <= head < stats.max_map.shape[0]:
        raise ValueError(f"head {head} is out of range: these stats have heads 0..{stats.max_map.shape[0] - 1}")
    z, f = pool_max(stats.max_map[head], max_cells)
    cell = stats.cell * f
    fig = _map_figure(z, 0, 0, cell, stats.n, stats.n,
                      title or f"head {head}: max over {cell}x{cell}-token cells (n = {stats.n})", floor_db)
    if pattern is not None:
        add_pattern(fig, pattern, head, stats.n)
    if tokens is not None:
        add_tokens(fig, tokens, (0, stats.n), (0, stats.n), marks)
    return fig


def attention_zoom(q: torch.Tensor, k: torch.Tensor, scale: float, head: int, rows: tuple[int, int],
                   cols: tuple[int, int] | None = None, max_cells: int = MAX_CELLS, pattern: Any = None,
                   title: str | None = None, floor_db: int = FLOOR_DB, tokens: Sequence[str] | None = None,
                   marks: Mapping[str, Sequence[tuple[int, int]]] | None = None):
    """Attention of one head in a region, recomputed (`stats.window_map`): exact, one cell per (query, key),
    when each side fits `max_cells` tokens; a larger region max-pooled at the finest cell that fits (the
    title says the cell). Either way each row keeps its full causal softmax. `pattern`, `tokens` and
    `marks` are drawn as in `attention_map`.

    q `[Hq, N, D]`, k `[Hkv, N, D]` (one layer); rows = (r0, r1) query rows, cols = (c0, c1) keys
    (default (0, r1)). The cost is the rows' normalisers plus rows x (c1 - c0), not the whole head."""
    r0, r1 = rows
    c0, c1 = cols if cols is not None else (0, r1)
    p, cell = window_map(q, k, scale, head, (r0, r1), (c0, c1), max_cells)
    fig = _map_figure(p, r0, c0, cell, r1 - r0, c1 - c0,
                      title or f"head {head}: queries {r0}..{r1 - 1}, keys {c0}..{c1 - 1} ({cell_text(cell)})", floor_db)
    if pattern is not None:
        add_pattern(fig, pattern, head, q.shape[1])
    if tokens is not None:
        add_tokens(fig, tokens, (r0, r1), (c0, c1), marks)
    return fig


def hovered_tokens(tokens: Sequence[str], x: float, y: float, cell: int, whole: int = 2048) -> dict[str, str]:
    """What a map's hovered cell at (key x, query y) covers, as text: {"query", "key"}. A map of at most
    `whole` tokens shows every token of the cell's rows and columns, a longer one the token at the cell's
    centre (positions are the cell centres the heatmap reports)."""
    def span(centre: float) -> str:
        if len(tokens) <= whole:
            a = max(0, int(round(centre - (cell - 1) / 2)))
            b = min(len(tokens), a + cell)
            return f"{a}..{b - 1}: " + repr("".join(tokens[a:b])) if b - a > 1 else f"{a}: {tokens[a]!r}"
        p = min(len(tokens) - 1, max(0, int(round(centre))))
        return f"{p}: {tokens[p]!r}"

    return {"query": span(y), "key": span(x)}


# ----------------------------------------------------------------------------- pattern overlays

def _polys(polys: list[list[tuple[float, float]]]) -> tuple[list, list]:
    xs: list = []
    ys: list = []
    for poly in polys:
        for x, y in poly + poly[:1]:
            xs.append(x)
            ys.append(y)
        xs.append(None)
        ys.append(None)
    return xs, ys


def pattern_shapes(pattern: Any, head: int, n: int) -> dict[str, list[list[tuple[float, float]]]]:
    """Polygons of one head's index in token coordinates (x = key j, y = query i; the lattice point
    (j, i) is inside exactly when the index keeps that causal pair): the pattern's own `shapes`, e.g.
    {"sink", "window"} for A-shape, {"columns", "slashes"} for VS, {"blocks"} for block-sparse."""
    if not callable(getattr(pattern, "shapes", None)):
        raise ValueError(f"cannot draw a {type(pattern).__name__}: use a pattern of workbench.patterns "
                         "(AShape, VerticalSlash, BlockSparse, Dense, Stack, ...)")
    return pattern.shapes(head, n)


_OVERLAY_COLORS = {"sink": "#00c2ff", "window": "#00c2ff", "columns": "#00e676", "slashes": "#2979ff",
                   "blocks": "#00e676", "dense": "#bbbbbb"}
_OVERLAY_DEFAULT = "#ffd600"  # parts of patterns added later


def add_pattern(fig: Any, pattern: Any, head: int, n: int, opacity: float = 0.18) -> Any:
    """Overlay one head's index on an attention map (from `attention_map` / `attention_zoom`): the
    A-shape sink and window band, VS columns and slash bands, or block-sparse tiles, as outlined
    translucent polygons. Returns `fig`."""
    go = _go()
    for name, polys in pattern_shapes(pattern, head, n).items():
        if not polys:
            continue
        xs, ys = _polys(polys)
        c = _OVERLAY_COLORS.get(name, _OVERLAY_DEFAULT)
        rgb = tuple(int(c[i:i + 2], 16) for i in (1, 3, 5))
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", fill="toself", name=f"{name} ({len(polys)})",
                                 line=dict(color=c, width=1), fillcolor=f"rgba{(*rgb, opacity)}", hoverinfo="skip"))
    return fig


# ----------------------------------------------------------------------------- recall and budgets

def mass_budget(budgets: Any, curves: Mapping[str, Any], target: float | None = None, x_title: str = "budget",
                title: str | None = None, log_x: bool = False):
    """Captured mass vs budget: one line per name in `curves`, each `[B]` aligned with `budgets` `[B]`, or,
    with `budgets=None`, each its own pair (x `[B]`, y `[B]`); `target` draws the quality bar."""
    go = _go()
    if not curves:
        raise ValueError("curves is empty: give {name: captured mass per budget}")
    shared = None if budgets is None else as_array(budgets, "budgets", 1)
    fig = go.Figure()
    for name, ys in curves.items():
        if shared is None:
            if not (isinstance(ys, (tuple, list)) and len(ys) == 2):
                raise ValueError(f"curves[{name!r}] must be a pair (x, y) when budgets is None")
            x, y = as_array(ys[0], f"curves[{name!r}] x", 1), as_array(ys[1], f"curves[{name!r}] y", 1)
        else:
            x, y = shared, as_array(ys, f"curves[{name!r}]", 1)
        if y.shape != x.shape:
            raise ValueError(f"curves[{name!r}] has {y.size} values for {x.size} budgets: give one per budget")
        order = np.argsort(x, kind="stable")
        fig.add_trace(go.Scatter(x=x[order].round(6), y=y[order].round(4), mode="lines+markers", name=str(name)))
    if target is not None:
        fig.add_hline(y=target, line=dict(dash="dash", color="#e45756"), annotation_text=f"target {target}")
    fig.update_layout(title=title or "captured attention mass vs budget", xaxis_title=x_title,
                      yaxis_title="captured mass", yaxis_range=[0, 1.02], width=620, height=420)
    if log_x:
        fig.update_xaxes(type="log")
    return fig


def head_tradeoff(evidence: Any, layer: int, head: int, target: float | None = None, title: str | None = None):
    """One head's search evidence (`search.Evidence`): worst-sample captured mass vs physical density
    (64x64 tiles / causal tiles) of every candidate, one line per pattern family."""
    L, H = evidence.mass.shape[1:3]
    if not (0 <= layer < L and 0 <= head < H):
        raise ValueError(f"(layer {layer}, head {head}) is outside the evidence's {L} layers x {H} heads")
    physical = evidence.density()[1][:, layer, head].mean(0)
    worst = evidence.mass[:, layer, head].amin(0)
    curves = {}
    for pat in PATTERN_COLORS:
        idx = [c for c, cand in enumerate(evidence.candidates) if cand.pattern == pat]
        if idx:
            curves[PATTERN_NAMES.get(pat, pat)] = (physical[idx], worst[idx])
    return mass_budget(None, curves, target=target, x_title="physical density (tiles / causal tiles)",
                       title=title or f"L{layer} H{head}: captured mass (worst sample) vs cost")


def oracle_vs_proxy(labels: Sequence[str], proxy: Any, oracle: Any, title: str | None = None, sort: bool = True,
                    limit: int | None = None):
    """Bars of the online proxy's captured mass (value printed) with the same-budget oracle's as a tick above
    each, per item (head, sample, ...), worst proxy first when `sort`; the axis is zoomed (`zoom_range`). The gap
    is the error of sampling the index online."""
    go = _go()
    pr, orc = as_array(proxy, "proxy", 1), as_array(oracle, "oracle", 1)
    if not (len(labels) == pr.size == orc.size):
        raise ValueError(f"labels ({len(labels)}), proxy ({pr.size}) and oracle ({orc.size}) must have the same length")
    order = np.argsort(pr, kind="stable") if sort else np.arange(pr.size)
    if limit is not None:
        order = order[:limit]
    xs = [str(labels[i]) for i in order]
    lo, hi = zoom_range(np.concatenate([pr[order], orc[order]]))
    fig = go.Figure([
        go.Bar(x=xs, y=pr[order].round(4), name="proxy (online)", marker_color="#f58518",
               text=[f"{x:.3f}" for x in pr[order]], textposition="inside", insidetextanchor="end", textangle=-90,
               textfont=dict(size=10), hovertemplate="%{x}: proxy %{y:.4f}<extra></extra>"),
        go.Scatter(x=xs, y=orc[order].round(4), name="oracle (same budget)", mode="markers",
                   marker=dict(symbol="line-ew-open", size=16, color="#1f3b73", line=dict(width=3, color="#1f3b73")),
                   hovertemplate="%{x}: oracle %{y:.4f}<extra></extra>")])
    fig.update_layout(title=title or "proxy vs oracle captured mass" + (" (worst first)" if sort else ""),
                      yaxis_title="captured mass" + (f" (axis from {lo:.2f})" if lo > 0 else ""), yaxis_range=[lo, hi],
                      width=max(520, 22 * len(xs) + 200), height=440, margin=dict(t=70), bargap=0.15,
                      legend=dict(orientation="h", y=1.0, yanchor="bottom", x=1, xanchor="right"))
    return fig


def segment_recall(segments: Mapping[str, Any], labels: Sequence[str] | None = None, title: str | None = None):
    """Recall per query segment: `segments` {segment name: `[H]` or a number} (e.g.
    `metrics.segment_mass`), grouped bars per item (head) with one bar per segment."""
    go = _go()
    if not segments:
        raise ValueError("segments is empty: give {segment: recall per head} (metrics.segment_mass)")
    vals = {name: np.atleast_1d(as_array(v, f"segments[{name!r}]")) for name, v in segments.items()}
    sizes = {v.size for v in vals.values()}
    if len(sizes) != 1:
        raise ValueError(f"every segment needs the same number of values, got sizes {sorted(sizes)}")
    size = sizes.pop()
    labels = [str(x) for x in (labels if labels is not None else range(size))]
    if len(labels) != size:
        raise ValueError(f"{len(labels)} labels for {size} values per segment")
    lo, hi = zoom_range(np.concatenate(list(vals.values())))
    fig = go.Figure([go.Bar(x=labels, y=v.round(4), name=name, text=[f"{x:.3f}" for x in v], textposition="outside",
                            cliponaxis=False, textfont=dict(size=10)) for name, v in vals.items()])
    fig.update_layout(barmode="group", title=title or "captured mass per query segment",
                      yaxis_title="captured mass" + (f" (axis from {lo:.2f})" if lo > 0 else ""), yaxis_range=[lo, hi],
                      xaxis_title="head" if size > 1 else "", width=max(420, 22 * size * len(vals) + 200), height=400,
                      legend=dict(orientation="h", y=-0.15 if size > 1 else -0.08, yanchor="top"))
    return fig


def mass_and_time(x: Any, mass: Any, ms: Any, x_title: str, title: str | None = None, time_label: str = "index time"):
    """A trade-off: captured mass (left axis) and a time in ms (right axis) against one knob `x` `[K]`
    (e.g. the proxy's sampled query rows)."""
    go = _go()
    xs, m, t = as_array(x, "x", 1), as_array(mass, "mass", 1), as_array(ms, "ms", 1)
    if not xs.size == m.size == t.size:
        raise ValueError(f"x ({xs.size}), mass ({m.size}) and ms ({t.size}) must have the same length")
    fig = go.Figure([go.Scatter(x=xs, y=m.round(4), name="captured mass", mode="lines+markers"),
                     go.Scatter(x=xs, y=t.round(4), name=f"{time_label} (ms)", mode="lines+markers", yaxis="y2",
                                line=dict(dash="dot"))])
    fig.update_layout(title=title or f"captured mass and {time_label} vs {x_title}", xaxis_title=x_title,
                      yaxis=dict(title="captured mass"), yaxis2=dict(title=f"{time_label} (ms)", overlaying="y", side="right",
                                                                     rangemode="tozero"),
                      width=640, height=420, legend=dict(orientation="h", y=-0.2))
    return fig


def grouped_bars(groups: Mapping[str, Mapping[str, float]], y_title: str, title: str | None = None):
    """Grouped bars: {series: {label: value}} (e.g. churn with and without EMA per selector, or
    tokens/s per decode mode)."""
    go = _go()
    if not groups:
        raise ValueError("groups is empty: give {series: {label: value}}")
    fig = go.Figure()
    for name, values in groups.items():
        if not values:
            raise ValueError(f"groups[{name!r}] is empty")
        ys = [None if v is None else round(float(v), 4) for v in values.values()]
        fig.add_trace(go.Bar(x=[str(k) for k in values], y=ys, name=str(name)))
    fig.update_layout(barmode="group", title=title, yaxis_title=y_title, width=640, height=400)
    return fig


def loss_curve(losses: Sequence[float], evals: Sequence[Mapping[str, float]] = (), title: str | None = None):
    """Training loss per step, with optional held-out points [{"step", "held_out_kl"}]
    (`forecast_train.train` history)."""
    go = _go()
    y = as_array(losses, "losses", 1)
    fig = go.Figure(go.Scatter(x=np.arange(1, y.size + 1), y=y.round(5), mode="lines", name="train (per step)"))
    if evals:
        fig.add_trace(go.Scatter(x=[e["step"] for e in evals], y=[round(e["held_out_kl"], 5) for e in evals],
                                 mode="markers+lines", name="held out"))
    fig.update_layout(title=title or "training loss", xaxis_title="step", yaxis_title="partition KL", width=620, height=380)
    return fig


# ----------------------------------------------------------------------------- forecast

def iou_heatmap(matrix: Any, title: str | None = None, labels: Sequence[Any] | None = None):
    """Layer x layer IoU `[L, L]` of per-layer top-k block sets (e.g. `forecast_report` 'iou_matrix')."""
    go = _go()
    m = as_array(matrix, "matrix", 2)
    if m.shape[0] != m.shape[1]:
        raise ValueError(f"matrix must be square [L, L], got {m.shape}")
    ticks = list(labels) if labels is not None else list(range(m.shape[0]))
    fig = go.Figure(go.Heatmap(z=m.round(3), x=ticks, y=ticks, zmin=0, zmax=1, colorscale="Blues",
                               colorbar=dict(title="IoU"), hovertemplate="layer %{y} vs %{x}: IoU %{z}<extra></extra>"))
    fig.update_layout(title=title or "IoU of top-k block sets between layers", xaxis_title="layer", yaxis_title="layer",
                      yaxis_autorange="reversed", width=520, height=480)
    return fig


def forecast_recall(recall: Mapping[str, Any], title: str | None = None, key: str = "recall"):
    """Recall per target layer for each selector: {selector: `[L]`} (NaN/None where it does not apply),
    or a `forecast_report.build_report` dict (its per-layer `key`: "recall" or "iou_teacher")."""
    go = _go()
    if isinstance(recall, Mapping) and isinstance(recall.get("layers"), list):
        rows = recall["layers"]
        if not rows or key not in rows[0]:
            raise ValueError(f"the report has no per-layer {key!r}: give build_report's output")
        recall = {name: [row[key][name] for row in rows] for name in rows[0][key]}
    if not recall:
        raise ValueError("recall is empty: give {selector: recall per layer}")
    fig = go.Figure()
    sizes = set()
    for name, ys in recall.items():
        y = as_array([np.nan if v is None else v for v in (ys.tolist() if hasattr(ys, "tolist") else ys)],
                     f"recall[{name!r}]", 1)
        sizes.add(y.size)
        if np.isnan(y).all():
            continue
        fig.add_trace(go.Scatter(x=list(range(y.size)), y=[None if np.isnan(v) else round(float(v), 4) for v in y],
                                 mode="lines+markers", name=str(name)))
    if len(sizes) != 1:
        raise ValueError(f"every selector needs one value per layer, got lengths {sorted(sizes)}")
    fig.update_layout(title=title or "recall of the target layer's attention per selector", xaxis_title="target layer",
                      yaxis_title="recall (share of mass on the chosen blocks)", yaxis_range=[0, 1.02], width=680, height=420)
    return fig


# ----------------------------------------------------------------------------- time

def latency_breakdown(rows: Mapping[str, Mapping[str, float]], title: str | None = None, unit: str = "ms",
                      reference: str | None = None):
    """Stacked bars of T_proj / T_index / T_sparse / T_dense / T_other per configuration: {label: {part: time}}
    (a missing part counts 0; T_dense is dense attention, the reference's attention part). The legend lists
    only the parts drawn. With `reference` (a label), each bar is annotated with its speed-up."""
    go = _go()
    if not rows:
        raise ValueError("rows is empty: give {label: {T_proj, T_index, T_sparse, T_other}}")
    for label, parts in rows.items():
        bad = set(parts) - set(TIME_PARTS)
        if bad:
            raise ValueError(f"rows[{label!r}] has unknown parts {sorted(bad)}: use {list(TIME_PARTS)}")
        neg = [p for p, v in parts.items() if not (v >= 0 and math.isfinite(v))]
        if neg:
            raise ValueError(f"rows[{label!r}] has negative or non-finite times for {neg}")
    labels = list(rows)
    totals = {lab: sum(rows[lab].values()) for lab in labels}
    if reference is not None and reference not in rows:
        raise ValueError(f"reference {reference!r} is not one of the labels {labels}")
    drawn = [part for part in TIME_PARTS if any(rows[lab].get(part, 0.0) > 0 for lab in labels)]
    fig = go.Figure([go.Bar(x=labels, y=[round(rows[lab].get(part, 0.0), 4) for lab in labels], name=TIME_NAMES[part],
                            marker_color=TIME_COLORS[part]) for part in drawn])
    for lab in labels:
        text = f"{totals[lab]:.3g} {unit}"
        if reference is not None and totals[lab] > 0:
            text += f"<br>{totals[reference] / totals[lab]:.2f}x"
        fig.add_annotation(x=lab, y=totals[lab], text=text, showarrow=False, yshift=14)
    width = max(520, 110 * len(labels) + 260)
    fig.update_layout(barmode="stack", title=_wrap(title or "time per layer: T = T_proj + T_index + T_sparse + T_other",
                                                   width - 100), showlegend=True,
                      yaxis_title=f"time ({unit})", width=width, height=460, margin=dict(t=90))
    return fig


def decode_timeline(spans: Sequence[Mapping[str, Any]], title: str | None = None, unit: str = "ms"):
    """Gantt chart of a decode step: spans {"stream": "compute" | "copy" | "stall", "start", "end", "label"}
    (times in `unit` from the step's start). Copies hidden under compute overlap a compute span."""
    go = _go()
    if not spans:
        raise ValueError("spans is empty: record a decode step first")
    for i, s in enumerate(spans):
        missing = {"stream", "start", "end"} - set(s)
        if missing:
            raise ValueError(f"spans[{i}] lacks {sorted(missing)}: each span needs stream, start and end")
        if s["stream"] not in STREAM_COLORS:
            raise ValueError(f"spans[{i}].stream = {s['stream']!r}: use one of {list(STREAM_COLORS)}")
        if not s["end"] >= s["start"]:
            raise ValueError(f"spans[{i}] ends ({s['end']}) before it starts ({s['start']})")
    streams = [k for k in STREAM_COLORS if any(s["stream"] == k for s in spans)]
    fig = go.Figure()
    for stream in streams:
        mine = [s for s in spans if s["stream"] == stream]
        fig.add_trace(go.Bar(
            y=[stream] * len(mine), x=[round(s["end"] - s["start"], 4) for s in mine],
            base=[round(s["start"], 4) for s in mine], orientation="h", name=stream, marker_color=STREAM_COLORS[stream],
            marker_line=dict(width=0.5, color="white"), text=[s.get("label", "") for s in mine], textposition="inside",
            insidetextanchor="middle", hovertemplate="%{text}<br>%{base:.3f} + %{x:.3f} " + unit + "<extra></extra>"))
    fig.update_layout(barmode="overlay", title=title or "decode step: compute and copy streams", xaxis_title=f"time ({unit})",
                      yaxis=dict(categoryorder="array", categoryarray=streams[::-1]), width=840,
                      height=160 + 60 * len(streams), bargap=0.3)
    return fig
