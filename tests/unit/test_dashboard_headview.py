"""The Head tab's fast path (`workbench.views.headview`) against the row-chunked metrics, and the time model."""
from __future__ import annotations

import pytest
import torch

from workbench.analysis.metrics import captured_mass, density, output_error, segment_mass
from workbench.patterns import AShape, BlockSparse, Dense, VerticalSlash, block_proxy, vs_proxy
from workbench.views.headview import HeadView, full_mask


def _qkv(n=300, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, d, generator=g) for _ in range(3))
    k[5] += 3 * q.mean(0)  # a vertical key so the proxies have something to find
    return q, k, v


def _indexes(q, k, n):
    return [VerticalSlash(*vs_proxy(q[None], k[None], 0.25, 7, 9, last_rows=32, sink=2, local=3)),
            VerticalSlash(torch.tensor([[3, 5, 290]]), torch.tensor([[1, 64, 299, -1]])),
            AShape(4, 37), AShape(0, 1), BlockSparse(block_proxy(q[None], k[None], 2)), Dense(1)]


@pytest.mark.parametrize("i", range(6))
def test_full_mask_matches_row_mask(i):
    q, k, _ = _qkv()
    index = _indexes(q, k, 300)[i]
    assert torch.equal(full_mask(index, 300), index.row_mask(0, 300, 300)[0])


@pytest.mark.parametrize("i", range(6))
def test_evaluate_matches_chunked_metrics(i):
    q, k, v = _qkv()
    index = _indexes(q, k, 300)[i]
    view = HeadView(q, k, v, 0.25)
    got = view.evaluate(index)
    rows = captured_mass(q[None], k[None], 0.25, index)[0]
    assert torch.allclose(got["rows"], rows, atol=1e-5)
    for name, value in segment_mass(rows[None]).items():
        assert got["segments"][name] == pytest.approx(float(value[0]), abs=1e-5)
    err = output_error(q[None], k[None], v[None], 0.25, index)
    assert got["rel_l2"] == pytest.approx(float(err["rel_l2"][0]), abs=1e-4)
    assert got["cosine"] == pytest.approx(float(err["cosine"][0]), abs=1e-5)
    dens = density(index, 300)
    assert got["physical"] == pytest.approx(float(dens["physical"][0]))
    assert got["logical"] == pytest.approx(float(dens["logical"][0]))


def test_evaluate_sees_a_smaller_index():
    q, k, v = _qkv()
    view = HeadView(q, k, v, 0.25)
    wide, narrow = view.evaluate(AShape(4, 200)), view.evaluate(AShape(1, 2))
    assert narrow["segments"]["all"] < wide["segments"]["all"] <= 1.0
    assert narrow["rel_l2"] > wide["rel_l2"]
    assert view.evaluate(Dense(1))["rel_l2"] == pytest.approx(0.0, abs=1e-6)


def test_full_mask_refuses_many_heads():
    with pytest.raises(ValueError, match="one-head"):
        full_mask(AShape(1, 2, n_heads=2), 10)


def test_tile_rates_from_the_committed_benchmark():
    from workbench.prefill.latency import BENCH, estimate_ms, load_bench, tile_rates

    rates = tile_rates(load_bench(BENCH))
    assert set(rates) == {"vs", "vs_group", "block", "ashape", "dense"}  # every kind the benchmark times
    assert all(r["per_tile_ms"] > 0 for r in rates.values())
    assert rates["dense"]["index_ms"] == 0
    assert estimate_ms(rates, "block", 200) > estimate_ms(rates, "block", 100)
    with pytest.raises(ValueError, match="no rows for shape"):
        tile_rates(load_bench(BENCH), shape="nope")


def test_layer_tiles_cover_exactly_the_stack():
    """The kernel computes every pair the patterns keep; exactly those for A-shape, block and dense heads,
    VS slashes expanded to whole 64-wide pieces (the physical tiles)."""
    from workbench_kernels.index_ref import tiles_to_mask

    from workbench.patterns import Stack
    from workbench.prefill.latency import layer_tiles

    q, k, _ = _qkv(n=200)
    parts = [VerticalSlash(torch.tensor([[3, 5, 150]]), torch.tensor([[1, 64, -1]])), AShape(4, 37),
             BlockSparse(block_proxy(q[None], k[None], 1)), Dense(1)]
    tiles, sink, window = layer_tiles(parts, 200)
    got = tiles_to_mask(tiles, 200, sink, window)[0]
    want = Stack(parts).row_mask(0, 200, 200)
    assert torch.equal(got[1:], want[1:])
    assert bool((got[0] >= want[0]).all()) and got[0].sum() > want[0].sum()


def test_head_index_is_the_configs_index_for_that_head():
    from workbench.config import PROXY_DEFAULTS, HeadConfig, HeadEntry
    from workbench.views.headview import head_index

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(4, 256, 16, generator=g), torch.randn(2, 256, 16, generator=g)
    model = {"n_layers": 1, "n_heads": 4}
    heads = [HeadEntry(0, 0, "vs", {"vertical": 40, "slash": 60}), HeadEntry(0, 1, "block", {"topk": 2}),
             HeadEntry(0, 2, "ashape", {"sink": 3, "window": 17}), HeadEntry(0, 3, "vs", {"vertical": 31, "slash": 101})]
    stack = HeadConfig(model=model, heads=heads).layer_index(0, q, k, 0.25)
    for h, e in enumerate(heads):
        one = head_index(e, q[h], k[h // 2], 0.25, PROXY_DEFAULTS)
        assert torch.equal(one.row_mask(0, 256, 256), stack.parts[h].row_mask(0, 256, 256))


def test_head_map_box_zoom_redraws_the_window_and_a_reset_restores_the_whole_head():
    """The Head tab's map on the server (no browser): a box zoom (`relayout_data` ranges) redraws the window
    re-reduced at up to 256 cells per side, a small window exactly, a reset (autorange) the whole head; the
    ranges a new figure reports back redraw nothing (no loop)."""
    from types import SimpleNamespace

    import numpy as np

    from workbench.analysis.stats import layer_stats, window_map
    from workbench.config import HeadEntry
    from workbench.core.capture import Capture
    from workbench.core.model import ModelShape
    from workbench.views import viz
    from workbench.views.dashboard.app import HeadTab
    from workbench.views.dashboard.state import Session, Settings

    n = 600
    shape = ModelShape(name="tiny", architecture="llama", n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                       hidden_size=32, rope_type="default", rope_theta=10000.0, max_positions=1024, fingerprint="abc")
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 1, n, 16, generator=g), torch.zeros(1, 1, n, 16)
    tab = HeadTab(session=Session(Settings()))
    s, h = tab.session, tab.job
    s.capture = Capture(q, k, v, (0,), shape, torch.zeros(n, dtype=torch.long), 0.25)
    s.sample, s.tokens = SimpleNamespace(needles=[(100, 110)]), [f"t{i}" for i in range(n)]
    h.layer, h.head = 0, 1
    h.stats = layer_stats(q[0, 1:], k[0], 0.25, resolution=256)
    h.result = {"entry": HeadEntry(0, 1, "ashape", {"sink": 4, "window": 37}), "index": AShape(4, 37)}
    tab._draw_map()

    def heatmap():
        return tab.map.object.data[0]

    assert tab._cell == heatmap().dx == 3 and np.asarray(heatmap().z).shape == (200, 200)  # the pooled stats
    box = {"xaxis.range[0]": 49.7, "xaxis.range[1]": 449.2, "yaxis.range[0]": 499.4, "yaxis.range[1]": 99.6}
    tab.map.relayout_data = box  # keys 50..449, queries 100..499: 400 tokens, cells of 2
    z = heatmap()
    assert tab._cell == z.dx == 2 and (z.x0, z.y0) == (50.5, 100.5) and np.asarray(z.z).shape == (200, 200)
    want, cell = window_map(q[0], k[0], 0.25, 1, (100, 500), (50, 450), max_cells=256)
    assert cell == 2 and np.array_equal(z.z, viz.to_db(want))
    title = tab.map.object.layout.title.text
    assert "layer 0 head 1" in title and "queries 100..499, keys 50..449, max over 2x2-token cells" in title
    assert any(t.type == "scatter" for t in tab.map.object.data)  # the pattern overlay
    assert tab.map.object.layout.xaxis.tickvals[0] == 50 and len(tab.map.object.layout.shapes) == 1  # tokens, needle
    zoomed = tab.map.object
    # the new figure reports its own ranges back: the same window, nothing redrawn
    tab.map.relayout_data = {"xaxis.range[0]": 49.5, "xaxis.range[1]": 449.5, "yaxis.range[0]": 499.5,
                             "yaxis.range[1]": 99.5}
    tab.map.relayout_data = {"autosize": True}
    assert tab.map.object is zoomed
    tab.map.relayout_data = {"xaxis.range[0]": 300.2, "xaxis.range[1]": 340.4, "yaxis.range[0]": 420.9, "yaxis.range[1]": 380}
    assert tab._cell == heatmap().dx == 1 and (heatmap().x0, heatmap().y0) == (300, 380)  # exact: 41 x 41 tokens
    assert "exact" in tab.map.object.layout.title.text
    tab.map.relayout_data = {"xaxis.autorange": True, "yaxis.autorange": True}
    assert tab._cell == heatmap().dx == 3 and np.asarray(heatmap().z).shape == (200, 200)
    tab.map.relayout_data = {"xaxis.range[0]": -0.5, "xaxis.range[1]": 599.5, "yaxis.range[0]": 599.5, "yaxis.range[1]": -0.5}
    assert tab._cell == 3  # the whole head's own ranges: still the pooled stats
    tab._hovered(SimpleNamespace(new={"points": [{"x": 301, "y": 1}]}))
    assert "300..302" in tab.hover.object
