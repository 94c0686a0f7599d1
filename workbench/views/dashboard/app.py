"""The Panel dashboard: browse heads, edit patterns live, check a config at longer lengths, export configs,
see forecast, latency and decode.

Serve it with `workbench dashboard` or `panel serve workbench/views/dashboard/app.py` (options through
WORKBENCH_DASHBOARD_* variables, see `state.Settings`). Each browser tab gets its own `Session` (sample,
config, selection) and one instance of every class in `TABS`; the model and captures are shared read-only.
Every resource the page loads comes from this server (no fonts or scripts from the internet).
"""
from __future__ import annotations

import asyncio
import html
import io
import math
import os
from typing import Any

import pandas as pd
import panel as pn

from workbench.config import MINFERENCE_DEFAULT, PARAMS
from workbench.patterns import default_params, pattern_class
from workbench.views import viz  # absolute imports: `panel serve` runs this file as a script
from workbench.views.dashboard.decode_tab import DecodeTab
from workbench.views.dashboard.lengths_tab import LengthsTab
from workbench.views.dashboard.state import SEARCH, Session, Settings
from workbench.views.dashboard.tab import JobStatus, Tab, html_table, on_page_loop
from workbench.views.dashboard.tab_state import ForecastState, HeadState, LatencyState

pn.extension("plotly", "tabulator")

_SIZES = list(dict.fromkeys(name for names in PARAMS.values() for name in names))  # every kind's size fields


def _default_sizes(kind: str, n: int) -> dict[str, int]:
    """The sizes a head gets when it is switched to `kind` at a prompt of n tokens (the kind's own defaults)."""
    return default_params(kind, n)


def _fmt(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _us(ms: float) -> str:
    return f"{ms * 1e3:.2f} us" if ms < 1 else f"{ms:.2f} ms"


def _zoom_span(relayout: dict[str, Any], axis: str, n: int) -> tuple[int, int] | None:
    """The tokens [a, b) that a Plotly box zoom shows along `axis` ("x": keys, "y": queries), clipped to
    0..n; None when the event has no range for that axis or the range misses every token. Token t spans
    t - 0.5 .. t + 0.5, so a partly shown token counts."""
    lo, hi = relayout.get(f"{axis}axis.range[0]"), relayout.get(f"{axis}axis.range[1]")
    if lo is None or hi is None:
        return None
    lo, hi = sorted((float(lo), float(hi)))  # the query axis runs downwards
    a, b = max(0, math.floor(lo + 0.5)), min(n, math.ceil(hi + 0.5))
    return (a, b) if a < b else None


def _counts(patterns: dict[str, int]) -> str:
    """{"vs": 3, "dense": 6} -> "3 Vertical-Slash, 6 dense" (kinds with no head left out)."""
    return ", ".join(f"{n} {viz.PATTERN_NAMES.get(k, k)}" for k, n in patterns.items() if n) or "no heads"


class HeadsTab(Tab):
    """All heads at a glance: hue = pattern, shade = captured mass on the loaded sample; a click opens a head."""

    title = "Heads"

    def __init__(self, **params):
        super().__init__(**params)
        self.plot = pn.pane.Plotly(None, css_classes=["wb-grid"], config={"displayModeBar": False})
        self.plot.param.watch(self._clicked, "click_data")
        self.session.param.watch(on_page_loop(self.changed), "grid_version")

    def _draw(self) -> None:
        s = self.session
        if s.config is None:
            return
        self.plot.object = viz.pattern_grid(s.config, recall=s.mass.numpy(), title=(
            f"pattern per head, shade = captured mass on {s.task}/{s.length}"))

    def _clicked(self, event) -> None:
        point = (event.new or {}).get("points", [{}])[0]
        if "x" in point and "y" in point:
            try:
                self.session.select(int(point["y"]), int(point["x"]))
            except Exception as e:
                self.say(str(e))
                return
            self.open_tab("Head")

    def body(self):
        return pn.Column("Click a head to open it in the Head tab.", self.plot)


class HeadTab(Tab):
    """The selected head: attention map with its index and tokens, the pattern editor and the live numbers."""

    title = "Head"

    def make_job(self) -> HeadState:
        return HeadState(self.session)

    def __init__(self, **params):
        super().__init__(**params)
        self.pattern = pn.widgets.Select(label="pattern", options=list(PARAMS), css_classes=["wb-pattern"], width=160)
        # no `start`: the browser would silently keep the old value of a size typed below it; the config's check
        # refuses it instead, with the reason in the tab's Alert
        self.sizes = {k: pn.widgets.IntInput(label=k, value=0, css_classes=[f"wb-{k}"], width=110)
                      for k in _SIZES}
        # one knob for the kinds with a key budget: it sets their sizes (`at_budget`); empty when it does not
        # describe the head's sizes
        self.budget = pn.widgets.IntInput(label="budget (keys / query)", value=None, placeholder="sets the sizes",
                                          css_classes=["wb-budget"], width=150)
        self.proxy = pn.pane.HTML("", css_classes=["wb-proxy-settings"])
        self.numbers = pn.pane.HTML("", css_classes=["wb-numbers"], width=560)
        self.segments = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-segments"])
        self.map = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-map"])
        self.hover = pn.pane.HTML("Hover the map: the tokens of the hovered row (query) and column (key) show here.",
                                  css_classes=["wb-hover"], sizing_mode="stretch_width")
        self._cell = 1  # tokens per map cell (the hover text)
        self._zoom: tuple[tuple[int, int], tuple[int, int]] | None = None  # (query rows, keys) of a box zoom
        self._zoom_of = None  # the head's stats the zoom was made on: another head starts whole
        self._syncing = False
        self.pattern.param.watch(self._pattern_changed, "value")
        for w in self.sizes.values():
            w.param.watch(self._edited, "value")
        self.budget.param.watch(self._budget_set, "value")
        self.map.param.watch(self._hovered, "hover_data")
        self.map.param.watch(self._zoomed, "relayout_data")
        self.job.param.watch(on_page_loop(self.changed), "version")

    def _draw(self) -> None:
        s, h = self.session, self.job
        r = h.result
        if not r:
            return
        e = r["entry"]
        self._show_entry(e.pattern, e.params)
        seg, est = r["segments"], r["estimate"]
        estimate = "-" if est is None else (f"{_us(est['kernel_ms'] + est['index_ms'])} ({_us(est['kernel_ms'])} kernel + "
                                            f"{_us(est['index_ms'])} index) vs dense {_us(est['dense_ms'])}")
        self.numbers.object = html_table([
            ("head", f"layer {h.layer}, head {h.head}: {e.label()}"),
            ("prompt", f"{s.task}, {s.capture.n} tokens"),
            ("captured mass", _fmt(r["mass"])),
            ("oracle (same budget)", _fmt(r["oracle"])),
            ("first third", _fmt(seg["first"])), ("middle third", _fmt(seg["middle"])),
            ("last third", _fmt(seg["last"])), ("last 64 rows", _fmt(seg["last64"])),
            ("output error (rel. L2)", _fmt(r["rel_l2"])), ("output cosine", _fmt(r["cosine"], 5)),
            ("logical density", _fmt(r["logical"])), ("physical density", _fmt(r["physical"])),
            ("64x64 tiles", str(r["tiles"])),
            ("estimated latency", estimate),
            ("source of the estimate", r["estimate_note"]),
            ("edit time", f"{h.last_edit_ms:.0f} ms to compute (server)" if h.last_edit_ms == h.last_edit_ms else "-"),
        ], "wb-head", width=560)
        self.proxy.object = "VS proxy: " + ", ".join(f"{k} = {v}" for k, v in s.config.proxy.items())
        self.segments.object = viz.segment_recall({k: [v] for k, v in seg.items() if k != "all"},
                                                  labels=[f"L{h.layer} H{h.head}"], title="captured mass per query segment")
        self._draw_map()

    def _draw_map(self) -> None:
        """The head's map: the whole head from its pooled stats, or, after a box zoom on this head, the
        zoomed window recomputed at up to 256 cells per side (`viz.attention_zoom`: exact per token when
        it fits, else re-reduced at the finest cell that fits)."""
        s, h = self.session, self.job
        label = f"layer {h.layer} head {h.head}: {h.result['entry'].label()}"
        marks = {"needle": s.sample.needles} if s.sample.needles else None
        overlays = dict(max_cells=256, pattern=h.result["index"], tokens=s.tokens, marks=marks)
        if self._zoom is None or self._zoom_of is not h.stats:
            fig = viz.attention_map(h.stats, 0, title=label, **overlays)
        else:
            rows, cols = self._zoom
            q, k, _ = s.capture.head_qkv(h.layer, h.head)
            fig = viz.attention_zoom(q[None], k[None], s.capture.scale, 0, rows, cols, **overlays)
            fig.update_layout(title=f"{label}<br><sup>zoom: queries {rows[0]}..{rows[1] - 1}, keys {cols[0]}..{cols[1] - 1}, "
                                    f"{viz.cell_text(int(fig.data[0].dx))} (double-click: whole head)</sup>")
        self._cell = int(fig.data[0].dx)
        self.map.object = fig

    def _n(self) -> int:
        """The prompt's length (before a capture, any length: it only tells which kinds have a budget)."""
        return self.session.capture.n if self.session.capture is not None else 4096

    def _show_sizes(self) -> None:
        for k, w in self.sizes.items():
            w.visible = k in PARAMS[self.pattern.value]
        self.budget.visible = pattern_class(self.pattern.value).at_budget(64, self._n()) is not None

    def _show_entry(self, pattern: str, sizes: dict[str, int]) -> None:
        """Put `pattern` and `sizes` into the editor (not an edit). The sizes are in their inputs before the
        pattern's inputs show, and the browser gets it all in one message: a size typed into an input as soon
        as it appears is not overwritten by a value the server sent after showing it."""
        # the knob shows a budget only where `at_budget` gives exactly these sizes
        budget = pattern_class(pattern).budget_of(sizes, self._n(), hint=self.budget.value)
        self._syncing = True
        try:
            with pn.io.hold():
                for k, v in sizes.items():
                    self.sizes[k].value = v
                self.budget.value = budget
                self.pattern.value = pattern
                self._show_sizes()
        finally:
            self._syncing = False

    def _pattern_changed(self, _event) -> None:
        """A new pattern starts from its default sizes at this prompt's length."""
        if self._syncing:  # _show_entry shows the sizes once they are set
            return
        if self.job.view is None:
            self._show_sizes()
            return
        self._show_entry(self.pattern.value, _default_sizes(self.pattern.value, self.session.capture.n))
        self._edited(None)

    def _budget_set(self, _event) -> None:
        """A budget of keys per query row sets the kind's sizes (`PatternBase.at_budget`), then edits the head."""
        b = self.budget.value
        if self._syncing or self.job.view is None or b is None:
            return
        if b < 1:
            self.say(f"budget {b}: give a whole number of keys per query row, at least 1")
            return
        self._show_entry(self.pattern.value, pattern_class(self.pattern.value).at_budget(b, self._n()))
        self._edited(None)

    def _edited(self, _event) -> None:
        if self._syncing or self.job.view is None:
            return
        pattern = self.pattern.value
        try:
            self.job.edit(pattern, {k: self.sizes[k].value for k in PARAMS[pattern]})
        except Exception as e:
            self.say(f"edit refused: {e}")
            self._safely(self._draw)  # the inputs go back to the head's entry
        else:
            self.job.error = ""

    def _hovered(self, event) -> None:
        point = (event.new or {}).get("points", [{}])[0]
        if "x" not in point or "y" not in point or not self.session.tokens:
            return
        t = viz.hovered_tokens(self.session.tokens, float(point["x"]), float(point["y"]), self._cell)
        self.hover.object = (f"<div class='wb-hover-text'><b>query</b> {html.escape(t['query'])}<br>"
                             f"<b>key</b> {html.escape(t['key'])}</div>")

    def _zoomed(self, event) -> None:
        """A box zoom (drag on the map) redraws the zoomed window; a reset (double-click: autorange) draws the
        whole head again. A new figure makes the browser report its ranges again: the same window, no redraw
        (no loop); other layout events (autosize) are ignored."""
        h, d = self.job, event.new or {}
        if h.stats is None or not h.result:
            return
        if d.get("xaxis.autorange") or d.get("yaxis.autorange"):
            zoom = None
        else:
            rows, cols = _zoom_span(d, "y", h.stats.n), _zoom_span(d, "x", h.stats.n)
            if rows is None or cols is None:
                return
            zoom = None if rows == cols == (0, h.stats.n) else (rows, cols)
        if zoom == (self._zoom if self._zoom_of is h.stats else None):
            return
        self._zoom, self._zoom_of = zoom, h.stats
        self._safely(self._draw_map)

    def body(self):
        editor = pn.Row(self.pattern, self.budget, *self.sizes.values())
        return pn.Column(editor, self.proxy, pn.Row(self.numbers, self.segments), self.hover, self.map)


class ProxyTab(Tab):
    """Online proxy vs the same-budget oracle for every captured head, worst gap first (sortable table)."""

    title = "Proxy"

    def __init__(self, **params):
        super().__init__(**params)
        self.table = pn.widgets.Tabulator(pd.DataFrame(), pagination="remote", page_size=20, disabled=True,
                                          show_index=False, css_classes=["wb-proxy"], sizing_mode="stretch_width")
        self.bars = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-proxy-bars"])
        self.session.param.watch(on_page_loop(self.changed), "grid_version")

    def _draw(self) -> None:
        if self.session.config is None:
            return
        rows = self.session.proxy_rows()
        self.table.value = pd.DataFrame(rows)
        worst = rows[:30]
        self.bars.object = viz.oracle_vs_proxy([f"L{r['layer']}H{r['head']}" for r in worst], [r["proxy"] for r in worst],
                                               [r["oracle"] for r in worst], sort=False,
                                               title="30 largest proxy-oracle gaps (captured mass)")

    def body(self):
        return pn.Column("Captured mass of each head's online index (proxy) and of the best index of the same "
                         "budget chosen from full attention (oracle); click a column to sort.", self.table, self.bars)


class ForecastTab(Tab):
    """Layer x layer IoU of top-k block sets and per-layer recall of each block selector."""

    title = "Forecast"

    def make_job(self) -> ForecastState:
        return ForecastState(self.session)

    def __init__(self, **params):
        super().__init__(**params)
        self.load = pn.widgets.Button(label="Load report", color="primary", css_classes=["wb-forecast-load"])
        self.compute = pn.widgets.Button(label="Compute on this sample", css_classes=["wb-forecast-compute"])
        self.source = pn.pane.Markdown("", css_classes=["wb-forecast-source"])
        self.iou = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-forecast-iou"])
        self.recall = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-forecast-recall"],
                                     visible=False)
        self.load.on_click(self._load)
        self.compute.on_click(lambda _: self.run(self.job.compute, self._draw))
        self.job.param.watch(on_page_loop(lambda *_: setattr(self.compute, "disabled", self.job.busy)), "busy")

    def _load(self, _event) -> None:
        try:
            self.job.load()
            self.job.error = ""
            self._draw()
        except (FileNotFoundError, ValueError) as e:
            self.say(str(e))

    def _draw(self) -> None:
        rep = self.job.report
        if not rep:
            return
        self.source.object = f"Source: `{rep['source']}`"
        self.iou.object = viz.iou_heatmap(rep["iou_matrix"])
        if rep.get("layers"):
            names = [n for n in rep["layers"][0]["recall"] if any(r["recall"][n] is not None for r in rep["layers"])]
            self.recall.object = viz.forecast_recall({n: [r["recall"][n] for r in rep["layers"]] for n in names})
        self.recall.visible = bool(rep.get("layers"))

    def body(self):
        return pn.Column(pn.Row(self.load, self.compute), self.source, self.iou, self.recall)


class LatencyTab(Tab):
    """The selected layer timed on this machine (GPU: Triton kernel vs dense; CPU: the labelled reference
    path), beside the GPU benchmark's estimate, each named as what it is."""

    title = "Latency"

    def make_job(self) -> LatencyState:
        return LatencyState(self.session)

    def __init__(self, **params):
        super().__init__(**params)
        self.button = pn.widgets.Button(label="Time the selected layer", color="primary", css_classes=["wb-lat-run"])
        self.text = pn.pane.HTML("", css_classes=["wb-latency"], width=760)
        self.plot = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-lat-plot"], visible=False)
        self.button.on_click(lambda _: self.run(self.job.time, self._draw))

    def _draw(self) -> None:
        r = self.job.result
        if not r:
            return
        cpu = r["device"] == "cpu"
        here = ("this machine runs the PyTorch reference path: dense math under the tiles' mask, which cannot be "
                f"faster than dense ({r['speedup']:.2f}x); it checks the bookkeeping, not the kernels' speed" if cpu else
                f"on {r['device']} the deployed path is {r['speedup']:.2f}x dense SDPA for this layer "
                "(index + sparse kernel vs dense)")
        if r["path"].startswith("all heads dense"):
            here = "every head of this layer is dense: the prefill runs dense SDPA, so there is nothing to gain here"
        rows = [("measured on", f"{r['device']} ({r['dtype']}): this machine"), ("path", r["path"]),
                ("layer", f"{r['layer']}: {r['heads']} heads ({_counts(r['patterns'])}), {r['n']} tokens, "
                          "the model's own q/k/v"),
                ("dense SDPA", f"{r['dense_ms']:.2f} ms"), ("online index", f"{r['index_ms']:.2f} ms"),
                ("sparse attention", f"{r['sparse_ms']:.2f} ms"), ("takeaway here", here)]
        est = r["estimate"]
        rows.append(("estimate", "-" if est is None else
                     f"{_us(est['kernel_ms'] + est['index_ms'])} ({_us(est['kernel_ms'])} kernels + {_us(est['index_ms'])} "
                     f"index) vs dense {_us(est['dense_ms'])}"))
        rows.append(("source of the estimate", r["estimate_note"]))
        self.text.object = html_table(rows, "wb-lat", width=760)
        bars = {"dense SDPA": {"T_dense": r["dense_ms"]}, "this layer's config": (
            {"T_dense": r["sparse_ms"]} if r["path"].startswith("all heads dense") else
            {"T_index": r["index_ms"], "T_sparse": r["sparse_ms"]})}
        self.plot.object = viz.latency_breakdown(
            bars, reference="dense SDPA", title=f"measured on this machine ({r['device']}, {r['dtype']}): layer {r['layer']}, "
                                                f"{r['n']} tokens, attention only")
        self.plot.visible = True

    def body(self):
        return pn.Column(self.button, self.text, self.plot)


class ExportTab(Tab):
    """Download the edited HeadConfig (workbench or MInference format), save it into the configs folder,
    import one (errors shown here; the import's progress in the sidebar)."""

    title = "Export/Import"

    def __init__(self, **params):
        super().__init__(**params)
        self.download = pn.widgets.FileDownload(callback=lambda: io.StringIO(self.session.export_text()),
                                                filename="head_config.json", label="Download edited config (workbench JSON)",
                                                color="primary", css_classes=["wb-download"])
        self.download_minference = pn.widgets.FileDownload(
            callback=lambda: io.StringIO(self.session.export_minference_text()), filename="minference_config.json",
            label="Download in MInference's format (one dict per layer)", css_classes=["wb-download-minference"])
        self.config_name = pn.widgets.TextInput(label="config name", placeholder="my-edit", css_classes=["wb-name"])
        self.save = pn.widgets.Button(label=f"Save into {self.session.settings.configs_dir}/", css_classes=["wb-save"])
        self.upload = pn.widgets.FileInput(accept=".json", css_classes=["wb-upload"])
        self.fill_missing = pn.widgets.Checkbox(
            label=f"fill missing heads (MInference files: its default vertical_and_slash {MINFERENCE_DEFAULT})",
            css_classes=["wb-fill-missing"])
        self.message = pn.pane.Alert("", alert_type="light", css_classes=["wb-message"], visible=False)
        self.save.on_click(self._save)
        self.upload.param.watch(self._import, "value")

    def _draw(self) -> None:
        pass

    def _say(self, text: str, kind: str) -> None:
        self.message.param.update(object=text, alert_type=kind, visible=True)

    def _save(self, _event) -> None:
        try:
            path = self.session.save(self.config_name.value)
            self._say(f"saved {path}", "success")
        except Exception as e:
            self._say(f"not saved: {e}", "danger")

    def _import(self, event) -> None:
        """Import the uploaded file; with "fill missing heads" ticked, the library's warning naming each
        filled head (and any non-canonical key it read) is shown with the result."""
        import warnings

        if not event.new:
            return
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                job = self.session.import_text(event.new, source=self.upload.filename or "uploaded config",
                                               fill_missing=self.fill_missing.value)
        except Exception as e:
            self._say(f"import refused: {e}".replace("pass --fill-missing (fill_missing=True)",
                                                     "tick 'fill missing heads' and upload again"), "danger")
            return
        notes = "".join(f"\n\nwarning: {w.message}" for w in caught)
        self._say(f"checking and evaluating {self.upload.filename} (progress in the sidebar) ...{notes}", "info")

        def done(_job) -> None:
            if self.session.error:
                self._say(self.session.error, "danger")
            else:
                counts = _counts(self.session.config.summary())
                self._say(f"imported {self.upload.filename}: {counts}{notes}", "warning" if notes else "success")
        job.add_done_callback(on_page_loop(done))

    def body(self):
        return pn.Column(pn.Row(self.download, self.download_minference), pn.Row(self.config_name, self.save),
                         "Import a HeadConfig or MInference JSON:", self.fill_missing, self.upload, self.message)


TABS: list[type[Tab]] = [HeadsTab, HeadTab, ProxyTab, LengthsTab, ForecastTab, LatencyTab, ExportTab, DecodeTab]


class Dashboard(pn.viewable.Viewer):
    """One session's page: the sidebar (model, sample, config, head) and one instance of every tab in TABS."""

    def __init__(self, settings: Settings | None = None, **params):
        super().__init__(**params)
        s = self.session = Session(settings or Settings.from_env(dict(os.environ)))
        self.model = pn.widgets.TextInput(label="model", value=s.model_name, disabled=True)
        self.task = pn.widgets.Select(label="task", options=list(s.param.task.objects), value=s.task, css_classes=["wb-task"])
        self.length = pn.widgets.IntInput(label="length (tokens)", value=s.length, step=256, css_classes=["wb-length"])
        self.seed = pn.widgets.IntInput(label="seed", value=s.seed, css_classes=["wb-seed"])
        self.config = pn.widgets.Select(label="config", options=self._choices(), css_classes=["wb-config"])
        self.config_note = pn.pane.HTML("", css_classes=["wb-config-note"], sizing_mode="stretch_width")
        self.target = pn.widgets.FloatInput(label="search target (captured mass)", value=s.target, step=0.01,
                                            css_classes=["wb-target"])
        self.reload = pn.widgets.Button(label="Load sample", color="primary", css_classes=["wb-load"])
        self.layer = pn.widgets.IntInput(label="layer", value=0, css_classes=["wb-layer"])
        self.head = pn.widgets.IntInput(label="head", value=0, css_classes=["wb-head-index"])
        self.open = pn.widgets.Button(label="Open head", css_classes=["wb-open"])
        self.job = JobStatus(s, "wb")
        self.reload.on_click(lambda _: self._load())
        self.open.on_click(lambda _: self._open())
        for w in (self.task, self.length, self.seed, self.config, self.target):
            w.param.watch(lambda _: self._inputs(), "value")
        s.param.watch(on_page_loop(self._follow), ["busy", "layer", "head"])
        s.param.watch(on_page_loop(lambda *_: self.config.param.update(options=self._choices())), ["saved_version"])
        self.tabs_list = [cls(session=s, open_tab=self.open_tab) for cls in TABS]
        self.tabs = pn.Tabs(*((t.title, t) for t in self.tabs_list), dynamic=False, css_classes=["wb-tabs"],
                            sizing_mode="stretch_width")
        self.tabs.param.watch(lambda e: self._shown(e.new), "active")
        self._shown(0)
        self.template = pn.template.BootstrapTemplate(
            title="Sparse Attention Workbench", sidebar_width=330, sidebar=[
                self.model, self.task, self.length, self.seed, self.config, self.config_note, self.target, self.reload,
                pn.layout.Divider(), self.layer, self.head, self.open, pn.layout.Divider(), self.job],
            main=[self.tabs])
        self._start(s.load)

    def open_tab(self, title: str) -> None:
        self.tabs.active = [t.title for t in self.tabs_list].index(title)

    def _shown(self, active: int) -> None:
        for i, tab in enumerate(self.tabs_list):
            tab.shown = i == active

    def _start(self, job) -> None:
        try:
            job()
        except Exception as e:
            self.session.error = str(e)

    def _inputs(self) -> bool:
        """Apply the sidebar's sample inputs, or show why not; True when they were applied."""
        try:
            self.session.configure(task=self.task.value, length=self.length.value, seed=self.seed.value,
                                   target=self.target.value, config_choice=self.config.value)
        except ValueError as e:
            self.session.error = str(e)
            return False
        if not self.session.busy:
            self.session.error = ""
        return True

    def _load(self) -> None:
        if self._inputs():
            self._start(self.session.load)

    def _open(self) -> None:
        try:
            self.session.select(self.layer.value, self.head.value)
        except Exception as e:
            self.session.error = f"cannot open layer {self.layer.value} head {self.head.value}: {e}"
            return
        self.open_tab("Head")

    def _choices(self) -> dict[str, str]:
        return {c or "the default (decided when the model is loaded)": c for c in self.session.config_choices()}

    def _follow(self, *_events: Any) -> None:
        s = self.session
        for w in (self.reload, self.open):
            w.disabled = s.busy
        if not s.busy and s.ready:
            self.layer.value, self.head.value = s.layer, s.head
            self.config.param.update(options=self._choices(), value=s.config_choice)
            note = s.config_source + (f" ({s.config_note})" if s.config_note else "")
            search = "" if s.config_choice == SEARCH else " The search target applies when 'config' is the search."
            self.config_note.object = f"<small class='wb-config-text'>{html.escape(note)}.{search}</small>"

    def __panel__(self):
        return self.template


def create_app(settings: Settings | None = None):
    """A new session's page (what `panel serve` and `workbench dashboard` serve)."""
    quiet_server_loop()
    return Dashboard(settings).template


def quiet_server_loop() -> None:
    """In a server's session (`panel serve`, `workbench dashboard`), make `quiet_closed_tabs` the server loop's
    exception handler; elsewhere (a notebook) nothing."""
    if pn.state.curdoc is not None and pn.state.curdoc.session_context is not None:
        asyncio.get_running_loop().set_exception_handler(quiet_closed_tabs)


def quiet_closed_tabs(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """asyncio's report of a task's unretrieved exception, except Tornado's WebSocketClosedError: Panel sent an update
    to a browser tab that had just closed, whose session ends with it (nothing lost; the traceback only alarmed)."""
    from tornado.websocket import WebSocketClosedError

    if not isinstance(context.get("exception"), WebSocketClosedError):
        loop.default_exception_handler(context)


if __name__.startswith("bokeh"):
    create_app().servable()
