"""workbench.views.viz: payload size, max-pooling, exact zoom, overlays that draw exactly the index, clear errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from workbench.analysis import stats
from workbench.analysis.stats import LayerStats, layer_stats
from workbench.patterns import AShape, BlockSparse, Dense, Stack, VerticalSlash, block_proxy, vs_proxy
from workbench.views import viz


def _stats(n: int, resolution: int = 1024, heads: int = 1, seed: int = 0) -> LayerStats:
    """LayerStats of an n-token capture as `layer_stats` lays them out, with random causal probabilities
    in the pooled map (the payload depends on the grid, not on the values)."""
    cell = math.ceil(n / resolution)
    r = math.ceil(n / cell)
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(heads, r, r, generator=g).pow(6) * torch.ones(r, r).tril()
    z = torch.zeros(heads, n)
    return LayerStats(n=n, cell=cell, block=64, max_map=p, mean_map=p, block_mass=torch.zeros(heads, 1, 1),
                      column_mass=z, diag_mass=z, row_entropy=z)


def test_heatmap_json_of_an_8k_capture_stays_under_3mb():
    st = _stats(8192)
    assert st.max_map.shape[-1] == 1024
    fig = viz.attention_map(st, 0)
    size = len(fig.to_json())
    print(f"8K heatmap JSON: {size / 1e6:.2f} MB")
    assert size < 3_000_000
    z = fig.data[0].z
    assert z.shape == (1024, 1024) and z.dtype == np.int8  # shipped as bytes, not text numbers
    # the overlay of a big VS index adds little
    cols = torch.randint(0, 8192, (1, 1000))
    offs = torch.randint(0, 8192, (1, 6096))
    fig = viz.attention_map(st, 0, pattern=VerticalSlash(cols, offs))
    assert len(fig.to_json()) < 3_000_000


def test_max_pooling_keeps_a_one_token_line():
    n = 2048
    p = torch.full((n, n), 1e-5).tril()
    p[:, 777] = 0.5  # one vertical key
    p = p.tril()
    st = LayerStats(n=n, cell=1, block=64, max_map=p[None], mean_map=p[None], block_mass=torch.zeros(1, 1, 1),
                    column_mass=torch.zeros(1, n), diag_mass=torch.zeros(1, n), row_entropy=torch.zeros(1, n))
    fig = viz.attention_map(st, 0, max_cells=256)
    z = fig.data[0].z
    assert z.shape == (256, 256)
    col = 777 // 8
    assert (z[col + 1:, col] == round(10 * math.log10(0.5))).all()  # every row below the diagonal shows it
    assert (z[col + 1:, col + 1] == -50).all()
    assert z[0, 255] == -128  # the non-causal corner stays blank
    assert fig.data[0].dx == 8 and fig.data[0].x0 == 3.5  # cells are in token units


def test_zoom_is_exact_when_it_fits_and_pooled_when_it_does_not():
    torch.manual_seed(0)
    q, k = torch.randn(4, 300, 16), torch.randn(2, 300, 16)
    scale = 0.25
    s = (q[3] @ k[1].T) * scale
    s = s.masked_fill(torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    fig = viz.attention_zoom(q, k, scale, 3, rows=(120, 180), cols=(40, 200))
    assert np.array_equal(fig.data[0].z, viz.to_db(p[120:180, 40:200]))
    assert fig.data[0].x0 == 40 and fig.data[0].y0 == 120 and fig.data[0].dx == 1 and "(exact)" in fig.layout.title.text
    # 250 x 200 tokens at 100 cells per side: cells of 3 tokens from (30, 100), a partial last row of cells
    tokens = [f"t{i}" for i in range(300)]
    fig = viz.attention_zoom(q, k, scale, 3, rows=(30, 280), cols=(100, 300), max_cells=100, pattern=AShape(4, 37, 4),
                             tokens=tokens, marks={"needle": [(150, 160)]})
    z, cell = fig.data[0], 3
    assert z.dx == z.dy == cell and z.x0 == 100 + 1 and z.y0 == 30 + 1 and np.asarray(z.z).shape == (84, 67)
    assert "max over 3x3-token cells" in fig.layout.title.text
    want = torch.nn.functional.max_pool2d(p[None, 30:280, 100:300], cell, ceil_mode=True)[0]
    assert np.array_equal(z.z, viz.to_db(want))
    assert np.array_equal(z.z, viz.to_db(stats.window_map(q, k, scale, 3, (30, 280), (100, 300), 100)[0]))
    assert fig.layout.xaxis.range == (99.5, 299.5) and fig.layout.yaxis.range == (279.5, 29.5)
    assert any(t.type == "scatter" for t in fig.data) and len(fig.layout.shapes) == 1  # the overlay and the needle
    assert fig.layout.xaxis.tickvals[0] == 100 and fig.layout.yaxis.tickvals[-1] == 279
    with pytest.raises(ValueError, match="head=4 is out of range"):
        viz.attention_zoom(q, k, scale, 4, rows=(0, 10))
    with pytest.raises(ValueError, match=r"rows=\(50, 50\) must satisfy"):
        viz.attention_zoom(q, k, scale, 0, rows=(50, 50))


def _inside(polys, n: int) -> np.ndarray:
    """Rasterise polygons at integer lattice points (x = key j, y = query i) by even-odd ray casting."""
    jj, ii = np.meshgrid(np.arange(n), np.arange(n))
    out = np.zeros((n, n), dtype=bool)
    for poly in polys:
        inside = np.zeros((n, n), dtype=bool)
        for (x0, y0), (x1, y1) in zip(poly, poly[1:] + poly[:1]):
            if y0 == y1:
                continue
            cross = ((y0 > ii) != (y1 > ii)) & (jj < x0 + (ii - y0) * (x1 - x0) / (y1 - y0))
            inside ^= cross
        out |= inside
    return out


@pytest.mark.parametrize("n", [200, 256])
def test_overlays_draw_exactly_the_index(n):
    torch.manual_seed(1)
    q, k = torch.randn(3, n, 16), torch.randn(1, n, 16)
    cols, offs = vs_proxy(q, k, 0.25, 12, 9, sink=3, local=4)
    table = block_proxy(q, k, 2)
    layer = Stack([AShape(5, 33, 1), VerticalSlash(cols[1:2], offs[1:2]), BlockSparse(table[2:3])])
    causal = np.tril(np.ones((n, n), dtype=bool))
    mask = layer.row_mask(0, n, n).numpy()
    for head in range(3):
        shapes = viz.pattern_shapes(layer, head, n)
        drawn = _inside([p for polys in shapes.values() for p in polys], n) & causal
        assert np.array_equal(drawn, mask[head]), f"head {head}: overlay differs from the index"
    assert np.array_equal(_inside(viz.pattern_shapes(Dense(1), 0, n)["dense"], n), causal)
    # and on a figure: one translucent trace per part
    fig = viz.attention_map(layer_stats(q, k, 0.25), 1, pattern=layer)
    assert {t.name.split(" ")[0] for t in fig.data[1:]} == {"columns", "slashes"}


def test_grids_and_thumbnails():
    names = [["vs", "ashape", "block"], ["dense", "vs", "vs"]]
    recall = torch.tensor([[0.9, 0.95, 0.99], [1.0, 0.5, 0.97]])
    fig = viz.pattern_grid(names, recall)
    assert {t.name for t in fig.data if t.type == "heatmap"} == {"Vertical-Slash", "A-shape", "Block-Sparse", "dense"}
    vs = next(t for t in fig.data if t.type == "heatmap" and t.name == "Vertical-Slash")
    assert np.isnan(vs.z[0][1]) and vs.z[1][1] == 0.5
    thumbs = torch.stack([torch.stack([viz.thumbnail(torch.rand(64, 64).tril(), 16) for _ in range(3)]) for _ in range(2)])
    assert thumbs.shape == (2, 3, 16, 16)
    fig = viz.head_thumbnails(thumbs, names, recall)
    assert len(fig.layout.shapes) == 6
    assert "0.50" in next(t for t in fig.data if t.name == "recall").text
    with pytest.raises(ValueError, match="unknown pattern"):
        viz.pattern_grid([["vs", "nope"]], [[1, 1]])
    with pytest.raises(ValueError, match="recall has shape"):
        viz.pattern_grid(names, torch.ones(3, 3))


def test_pattern_grid_from_a_head_config(embedded):
    from workbench.config import HeadConfig, HeadEntry

    _, _, shape = embedded
    heads = [HeadEntry(l, h, "ashape", {"sink": 64, "window": 256}, recall={"mean": 0.9 + h / 100, "worst": 0.8})
             for l in range(shape.n_layers) for h in range(shape.n_heads)]
    cfg = HeadConfig(model=shape.to_dict(), heads=heads)
    fig = viz.pattern_grid(cfg)
    assert fig.data[0].z.shape == (shape.n_layers, shape.n_heads)
    assert "ashape(sink=64, window=256)" in fig.data[0].text[0][0]


def test_curves_bars_and_matrices():
    fig = viz.mass_budget([64, 128, 256], {"vs": [0.5, 0.8, 0.95], "ashape": torch.tensor([0.4, 0.6, 0.9])}, target=0.95)
    assert len(fig.data) == 2
    fig = viz.oracle_vs_proxy(["a", "b", "c"], [0.9, 0.5, 0.7], [0.95, 0.9, 0.8])
    assert list(fig.data[0].x) == ["b", "c", "a"]  # worst proxy first
    fig = viz.segment_recall({"first": torch.tensor([0.9, 0.8]), "last": torch.tensor([0.99, 0.7])})
    assert [t.name for t in fig.data] == ["first", "last"]
    fig = viz.iou_heatmap(torch.eye(4))
    assert fig.data[0].z.shape == (4, 4)
    fig = viz.forecast_recall({"forecast": [0.5, None, 0.7], "proxy": [float("nan")] * 3})
    assert [t.name for t in fig.data] == ["forecast"]  # a selector with no value anywhere is left out
    fig = viz.latency_breakdown({"dense": {"T_proj": 1, "T_sparse": 8, "T_other": 2},
                                 "sparse": {"T_proj": 1, "T_index": 0.5, "T_sparse": 1, "T_other": 2}}, reference="dense")
    assert "2.44x" in fig.layout.annotations[1].text
    spans = [{"stream": "compute", "start": 0, "end": 2, "label": "L0"}, {"stream": "copy", "start": 0.5, "end": 1.5},
             {"stream": "compute", "start": 2, "end": 4, "label": "L1"}]
    fig = viz.decode_timeline(spans)
    assert [t.name for t in fig.data] == ["compute", "copy"] and list(fig.data[0].base) == [0, 2]
    json.loads(fig.to_json())


@pytest.mark.parametrize("call, match", [
    (lambda: viz.iou_heatmap(torch.ones(3, 4)), "square"),
    (lambda: viz.iou_heatmap(torch.ones(0, 0)), "empty"),
    (lambda: viz.mass_budget([1, 2], {"a": [0.1, 0.2, 0.3]}), "3 values for 2 budgets"),
    (lambda: viz.mass_budget([1, 2], {}), "curves is empty"),
    (lambda: viz.oracle_vs_proxy(["a"], [0.1, 0.2], [0.3, 0.4]), "same length"),
    (lambda: viz.segment_recall({"a": [1, 2], "b": [1]}), "same number"),
    (lambda: viz.latency_breakdown({"x": {"T_attn": 1.0}}), "unknown parts"),
    (lambda: viz.latency_breakdown({"x": {"T_proj": -1.0}}), "negative"),
    (lambda: viz.decode_timeline([]), "spans is empty"),
    (lambda: viz.decode_timeline([{"stream": "gpu", "start": 0, "end": 1}]), "stream"),
    (lambda: viz.decode_timeline([{"stream": "copy", "start": 2, "end": 1}]), "ends"),
    (lambda: viz.head_thumbnails(torch.rand(2, 3, 8)), "4-D"),
    (lambda: viz.head_thumbnails(torch.rand(0, 3, 8, 8)), "empty"),
    (lambda: viz.attention_map(_stats(256), 1), "out of range"),
    (lambda: viz.attention_map(torch.rand(1, 8, 8), 0), "LayerStats"),
    (lambda: viz.head_grid([]), "at least one"),
    (lambda: viz.add_pattern(viz.attention_map(_stats(128), 0), object(), 0, 128), "cannot draw"),
])
def test_bad_input_names_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bars_zoom_to_show_small_gaps_and_print_their_values():
    fig = viz.oracle_vs_proxy(["a", "b"], [0.93, 0.97], [0.99, 0.98])
    lo, hi = fig.layout.yaxis.range
    assert 0.85 <= lo <= 0.88 and hi > 1  # gaps of 0.01-0.06 fill the plot, not 2 % of a 0-1 axis
    assert list(fig.data[0].text) == ["0.930", "0.970"] and "axis from 0.85" in fig.layout.yaxis.title.text
    fig = viz.segment_recall({"first": [0.2], "last": [0.99]})
    assert fig.layout.yaxis.range[0] == 0  # a low value keeps the axis at 0
    assert viz.zoom_range([0.991, 0.999])[0] == pytest.approx(0.9)


def test_pattern_grid_counts_only_captured_heads_and_has_a_shade_scale():
    names = [["vs", "dense"], ["dense", "dense"], ["dense", "ashape"]]
    recall = [[0.9, 1.0], [float("nan")] * 2, [1.0, 0.95]]  # layer 1 was not captured
    fig = viz.pattern_grid(names, recall, title="a long title " * 12)
    legend = sorted(t.name for t in fig.data if t.type == "scatter" and t.showlegend)
    assert legend == ["A-shape (1)", "Vertical-Slash (1)", "dense (2)"]
    assert any(t.marker.showscale for t in fig.data if t.type == "scatter")  # the captured-mass colour scale
    title = fig.layout.title.text
    assert "<br>" in title and "2 heads blank" in title  # wrapped, not cut
    assert max(len(line) for line in title.split("<br>")) * 8 <= fig.layout.width


def test_latency_legend_lists_only_the_parts_drawn():
    fig = viz.latency_breakdown({"dense": {"T_dense": 4.0}, "sparse": {"T_index": 1.0, "T_sparse": 1.5}}, reference="dense")
    assert [t.name for t in fig.data] == ["T_index (online index)", "T_sparse (sparse attention)", "dense attention"]
    assert fig.data[2].marker.color != fig.data[1].marker.color  # dense is not drawn as T_sparse
    assert "1.60x" in fig.layout.annotations[1].text


def test_maps_carry_token_text_and_marks():
    st = _stats(300, resolution=300)
    tokens = [f"t{i}" for i in range(300)]
    fig = viz.attention_map(st, 0, tokens=tokens, marks={"needle": [(100, 120)]})
    assert fig.layout.xaxis.ticktext[0] == "0<br>t0" and fig.layout.yaxis.ticktext[-1] == "299 t299"
    assert fig.layout.shapes[-1].x0 == 99.5 and fig.layout.annotations[-1].text == "needle"
    assert viz.hovered_tokens(tokens, 41.5, 10.5, 4) == {"query": "9..12: 't9t10t11t12'", "key": "40..43: 't40t41t42t43'"}
    assert viz.hovered_tokens(tokens * 10, 41.5, 10.5, 4, whole=2048) == {"query": "10: 't10'", "key": "42: 't42'"}
    with pytest.raises(ValueError, match="outside the 10 tokens"):
        viz.attention_map(st, 0, tokens=tokens[:10])
