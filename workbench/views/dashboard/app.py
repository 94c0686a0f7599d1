"""The Panel dashboard: browse heads, edit patterns live, export configs, see forecast and latency.

Serve it with `workbench dashboard` or `panel serve workbench/views/dashboard/app.py` (options through
WORKBENCH_DASHBOARD_* variables, see `state.Settings`). Each browser tab gets its own `Session`;
the model and captures are shared read-only. Views only lay out what `Session` computes.
"""
from __future__ import annotations

import html
import io
import logging
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pandas as pd
import panel as pn
import param

from workbench.config import MINFERENCE_DEFAULT, PARAMS
from workbench.views import viz  # absolute imports: `panel serve` runs this file as a script
from workbench.views.dashboard.decode_tab import DecodeView
from workbench.views.dashboard.state import Session, Settings

pn.extension("plotly", "tabulator")


def on_page_loop(fn: Callable) -> Callable:
    """`fn`, made safe to fire from a background job's thread: there it is queued onto this page's own
    event loop (`Document.add_next_tick_callback`, Bokeh's thread-safe way in); on the loop, or outside a
    server, it runs at once. Call while the page is being built (on the loop). Session jobs finish on the
    shared executor, often within milliseconds when another session has filled the shared memo: changing
    widgets from that thread while the loop was still handling the click left the page 'busy' for good."""
    doc, loop = pn.state.curdoc, threading.get_ident()
    if doc is None or doc.session_context is None:
        return fn

    def call(*args: Any) -> None:
        if threading.get_ident() == loop:
            fn(*args)
        else:
            doc.add_next_tick_callback(partial(fn, *args))

    return call


_SIZES = list(dict.fromkeys(name for names in PARAMS.values() for name in names))  # every kind's size fields


def _table(rows: list[tuple[str, str]], css: str) -> str:
    body = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
                   f"<td class='{css}-{k.split()[0].lower()}'>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='{css}'>{body}</table>"


def _fmt(x: Any, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


class _View(pn.viewable.Viewer):
    """A tab. `shown` is True while its tab is open; changes that arrive while hidden redraw on opening."""

    session = param.ClassSelector(class_=Session)
    shown = param.Boolean(default=True)

    def __init__(self, **params):
        super().__init__(**params)
        self._stale = False
        self.param.watch(lambda e: e.new and self._stale and self.refresh(), "shown")

    def changed(self, _event=None) -> None:
        if self.shown:
            self.refresh()
        else:
            self._stale = True

    def refresh(self) -> None:
        self._stale = False
        self._safely(self._draw)

    def _safely(self, draw: Callable[[], None]) -> None:
        """Run `draw`; an error shows in the sidebar's Alert (raised on the page loop it reached only the log)."""
        try:
            draw()
        except Exception as e:
            logging.getLogger(__name__).exception("drawing %s failed", type(self).__name__)
            self.session.error = f"{type(self).__name__} could not draw: {e or type(e).__name__}"

    def run(self, start, then=None) -> None:
        """Start a session job from a button; `then` redraws when it is done. Refusals show in the sidebar."""
        try:
            job = start()
        except Exception as e:  # busy, or a bad request: say why
            self.session.error = str(e)
            return
        if then is not None:
            job.add_done_callback(on_page_loop(lambda _: self._safely(then)))

    def _draw(self) -> None:
        raise NotImplementedError


class HeadsView(_View):
    """All heads at a glance: hue = pattern, shade = recall on the loaded sample; a click opens a head."""

    def __init__(self, **params):
        super().__init__(**params)
        self.plot = pn.pane.Plotly(None, css_classes=["wb-grid"], config={"displayModeBar": False})
        self.plot.param.watch(self._clicked, "click_data")
        self.session.param.watch(on_page_loop(self.changed), "grid_version")

    def _draw(self) -> None:
        s = self.session
        self.plot.object = viz.pattern_grid(s.config, recall=s.mass.numpy(), title=(
            f"pattern per head, shade = captured mass on {s.task}/{s.length} (blank: layer not captured)"))

    def _clicked(self, event) -> None:
        point = (event.new or {}).get("points", [{}])[0]
        if "x" in point and "y" in point:
            self.run(lambda: self.session.select(int(point["y"]), int(point["x"])))

    def __panel__(self):
        return pn.Column("Click a head to open it in the Head tab.", self.plot)


class HeadView(_View):
    """The selected head: attention map with its index, the pattern editor and the live numbers."""

    def __init__(self, **params):
        super().__init__(**params)
        self.pattern = pn.widgets.Select(name="pattern", options=list(PARAMS), css_classes=["wb-pattern"], width=160)
        self.sizes = {k: pn.widgets.IntInput(name=k, value=0, start=0, css_classes=[f"wb-{k}"], width=110)
                      for k in _SIZES}
        self.proxy = pn.pane.HTML("", css_classes=["wb-proxy-settings"])
        self.numbers = pn.pane.HTML("", css_classes=["wb-numbers"], width=560)
        self.segments = pn.pane.Plotly(None, config={"displayModeBar": False})
        self.map = pn.pane.Plotly(None, config={"displayModeBar": False})
        self._syncing = False
        self.pattern.param.watch(lambda _: self._show_sizes(), "value")
        for w in (self.pattern, *self.sizes.values()):
            w.param.watch(self._edited, "value")
        self.session.param.watch(on_page_loop(self.changed), "head_version")

    def _draw(self) -> None:
        s, r = self.session, self.session.head_result
        e = r["entry"]
        self._syncing = True
        try:
            self.pattern.value = e.pattern
            for k, v in e.params.items():
                self.sizes[k].value = v
        finally:
            self._syncing = False
        self._show_sizes()
        seg = r["segments"]
        est = r["estimate_ms"]
        estimate = r["estimate_source"] if est is None else (
            f"{est * 1e3:.2f} us (of which index share {r['estimate_index_ms'] * 1e3:.2f} us) vs dense "
            f"{r['dense_estimate_ms'] * 1e3:.2f} us: {r['estimate_source']}")
        self.numbers.object = _table([
            ("head", f"layer {s.layer}, head {s.head}: {e.label()}"),
            ("captured mass", _fmt(r["mass"])),
            ("oracle (same budget)", _fmt(r["oracle"])),
            ("first third", _fmt(seg["first"])), ("middle third", _fmt(seg["middle"])),
            ("last third", _fmt(seg["last"])), ("last 64 rows", _fmt(seg["last64"])),
            ("output error (rel. L2)", _fmt(r["rel_l2"])), ("output cosine", _fmt(r["cosine"], 5)),
            ("logical density", _fmt(r["logical"])), ("physical density", _fmt(r["physical"])),
            ("64x64 tiles", str(r["tiles"])),
            ("estimated latency", estimate),
            ("edit time", f"{s.last_edit_ms:.0f} ms to compute (server)" if s.last_edit_ms == s.last_edit_ms else "-"),
        ], "wb-head")
        self.proxy.object = "VS proxy: " + ", ".join(f"{k}={v}" for k, v in s.config.proxy.items())
        self.segments.object = viz.segment_recall({k: [v] for k, v in seg.items() if k != "all"},
                                                  labels=[f"L{s.layer} H{s.head}"], title="captured mass per query segment")
        self.map.object = viz.attention_map(s.head_stats, 0, max_cells=256, pattern=r["index"],
                                            title=f"layer {s.layer} head {s.head}: {e.label()}")

    def _show_sizes(self) -> None:
        for k, w in self.sizes.items():
            w.visible = k in PARAMS[self.pattern.value]

    def _edited(self, event) -> None:
        if self._syncing or self.session.head_view is None:
            return
        pattern = self.pattern.value
        try:  # a new kind starts from its default sizes at this length (`default_params`), a size edit from the boxes
            self.session.edit(pattern, None if event.obj is self.pattern else
                              {k: self.sizes[k].value for k in PARAMS[pattern]})
        except Exception as e:
            self.session.error = f"edit refused: {e}"

    def __panel__(self):
        editor = pn.Row(self.pattern, *self.sizes.values())
        return pn.Column(editor, self.proxy, pn.Row(self.numbers, self.segments), self.map)


class ProxyView(_View):
    """Online proxy vs the same-budget oracle for every head, worst gap first (sortable table)."""

    def __init__(self, **params):
        super().__init__(**params)
        self.table = pn.widgets.Tabulator(pd.DataFrame(), pagination="remote", page_size=20, disabled=True,
                                          show_index=False, css_classes=["wb-proxy"], sizing_mode="stretch_width")
        self.bars = pn.pane.Plotly(None, config={"displayModeBar": False})
        self.session.param.watch(on_page_loop(self.changed), "grid_version")

    def _draw(self) -> None:
        rows = self.session.proxy_rows()
        self.table.value = pd.DataFrame(rows)
        worst = rows[:30]
        self.bars.object = viz.oracle_vs_proxy([f"L{r['layer']}H{r['head']}" for r in worst], [r["proxy"] for r in worst],
                                               [r["oracle"] for r in worst], sort=False,
                                               title="30 largest proxy-oracle gaps (captured mass)")

    def __panel__(self):
        return pn.Column("Captured mass of each head's online index (proxy) and of the best index of the same "
                         "budget chosen from full attention (oracle); click a column to sort.", self.table, self.bars)


class ForecastView(_View):
    """Layer x layer IoU of top-k block sets and per-layer recall of each block selector."""

    def __init__(self, **params):
        super().__init__(**params)
        self.load = pn.widgets.Button(name="Load report", button_type="primary")
        self.compute = pn.widgets.Button(name="Compute on this sample")
        self.source = pn.pane.Markdown("")
        self.iou = pn.pane.Plotly(None, config={"displayModeBar": False})
        self.recall = pn.pane.Plotly(None, config={"displayModeBar": False})
        self.load.on_click(self._load)
        self.compute.on_click(lambda _: self.run(self.session.compute_forecast, self._draw))

    def _load(self, _event) -> None:
        try:
            self.session.load_forecast()
            self._draw()
        except FileNotFoundError as e:
            self.session.error = str(e)

    def _draw(self) -> None:
        rep = self.session.forecast
        if not rep:
            return
        self.source.object = f"Source: `{rep['source']}`"
        self.iou.object = viz.iou_heatmap(rep["iou_matrix"])
        if rep.get("layers"):
            names = [n for n in rep["layers"][0]["recall"] if any(r["recall"][n] is not None for r in rep["layers"])]
            self.recall.object = viz.forecast_recall({n: [r["recall"][n] for r in rep["layers"]] for n in names})
        else:
            self.recall.object = None

    def __panel__(self):
        return pn.Column(pn.Row(self.load, self.compute), self.source, pn.Row(self.iou, self.recall))


class LatencyView(_View):
    """Time the selected layer under the session's config: GPU kernel vs dense, or the labelled CPU reference."""

    def __init__(self, **params):
        super().__init__(**params)
        self.button = pn.widgets.Button(name="Time the selected layer", button_type="primary")
        self.text = pn.pane.HTML("", css_classes=["wb-latency"])
        self.plot = pn.pane.Plotly(None, config={"displayModeBar": False})
        self.button.on_click(lambda _: self.run(self.session.time_latency, self._draw))

    def _draw(self) -> None:
        r = self.session.latency
        if not r:
            return
        rows = [("path", r["path"]), ("device", f"{r['device']} ({r['dtype']})"),
                ("layer", f"{r['layer']} ({r['heads']} heads {r['patterns']}, {r['n']} tokens, the model's own q/k/v)"),
                ("dense SDPA", f"{r['dense_ms']:.2f} ms"), ("sparse", f"{r['sparse_ms']:.2f} ms"),
                ("online index", f"{r['index_ms']:.2f} ms"), ("speed-up", f"{r['speedup']:.2f}x")]
        bars = {"dense SDPA": {"T_sparse": r["dense_ms"]}, "sparse": {"T_index": r["index_ms"], "T_sparse": r["sparse_ms"]}}
        est = r["estimate"]
        rows.append(("estimate", r["estimate_source"] if est is None else
                     f"dense {est['dense_ms'] * 1e3:.1f} us, sparse {est['sparse_ms'] * 1e3:.1f} us ({r['estimate_source']})"))
        self.text.object = _table(rows, "wb-lat")
        self.plot.object = viz.latency_breakdown(bars, title=f"layer {r['layer']}: {r['path'][:60]}", reference="dense SDPA")

    def __panel__(self):
        return pn.Column(self.button, self.text, self.plot)


class ExportView(_View):
    """Download the edited HeadConfig, save it into the configs folder, import one (errors shown here)."""

    def __init__(self, **params):
        super().__init__(**params)
        self.download = pn.widgets.FileDownload(callback=lambda: io.StringIO(self.session.export_text()),
                                                filename="head_config.json", label="Download edited config (JSON)",
                                                button_type="primary", css_classes=["wb-download"])
        self.config_name = pn.widgets.TextInput(name="config name", placeholder="my-edit", css_classes=["wb-name"])
        self.save = pn.widgets.Button(name=f"Save into {self.session.settings.configs_dir}/", css_classes=["wb-save"])
        self.upload = pn.widgets.FileInput(accept=".json", css_classes=["wb-upload"])
        self.fill_missing = pn.widgets.Checkbox(
            name=f"fill missing heads (MInference files: its default vertical_and_slash {MINFERENCE_DEFAULT})",
            css_classes=["wb-fill-missing"])
        self.message = pn.pane.Alert("", alert_type="light", css_classes=["wb-message"], visible=False)
        self.save.on_click(self._save)
        self.upload.param.watch(self._import, "value")

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
        self._say(f"checking and evaluating {self.upload.filename} ...{notes}", "info")

        def done(_job) -> None:
            if self.session.error:
                self._say(self.session.error, "danger")
            else:
                self._say(f"imported {self.upload.filename}: {self.session.config.summary()} heads{notes}",
                          "warning" if notes else "success")
        job.add_done_callback(on_page_loop(done))

    def __panel__(self):
        return pn.Column(self.download, pn.Row(self.config_name, self.save), "Import a HeadConfig or MInference JSON:",
                         self.fill_missing, self.upload, self.message)


class Dashboard(pn.viewable.Viewer):
    """One session's page: sidebar (model, sample, head) and the seven tabs."""

    def __init__(self, settings: Settings | None = None, **params):
        super().__init__(**params)
        s = self.session = Session(settings or Settings.from_env(dict(os.environ)))
        self.model = pn.widgets.TextInput(name="model", value=s.model_name, disabled=True)
        self.task = pn.widgets.Select.from_param(s.param.task, name="task")
        self.length = pn.widgets.IntInput.from_param(s.param.length, name="length (tokens)", step=256,
                                                    css_classes=["wb-length"])
        self.seed = pn.widgets.IntInput.from_param(s.param.seed, name="seed")
        self.target = pn.widgets.FloatInput.from_param(s.param.target, name="search target (captured mass)", step=0.01,
                                                       css_classes=["wb-target"])
        self.reload = pn.widgets.Button(name="Load sample", button_type="primary", css_classes=["wb-load"])
        self.layer = pn.widgets.IntInput(name="layer", value=0, start=0, css_classes=["wb-layer"])
        self.head = pn.widgets.IntInput(name="head", value=0, start=0, css_classes=["wb-head-index"])
        self.open = pn.widgets.Button(name="Open head", css_classes=["wb-open"])
        self.progress = pn.indicators.Progress(value=0, max=100, active=False, sizing_mode="stretch_width",
                                               css_classes=["wb-progress"])
        self.status = pn.pane.HTML("", css_classes=["wb-status"])
        self.error = pn.pane.Alert("", alert_type="danger", visible=False, css_classes=["wb-error"])
        self.reload.on_click(lambda _: self._start(s.load))
        self.open.on_click(lambda _: self._start(lambda: s.select(self.layer.value, self.head.value)))
        s.param.watch(on_page_loop(self._progress), ["progress", "status", "busy", "error", "head_version"])
        self.views = {"Heads": HeadsView(session=s), "Head": HeadView(session=s), "Proxy": ProxyView(session=s),
                      "Forecast": ForecastView(session=s), "Latency": LatencyView(session=s),
                      "Export/Import": ExportView(session=s), "Decode": DecodeView(session=s, on_loop=on_page_loop)}
        self.tabs = pn.Tabs(*self.views.items(), dynamic=False, css_classes=["wb-tabs"])
        self.tabs.param.watch(lambda e: self._shown(e.new), "active")
        self._shown(0)
        self.template = pn.template.FastListTemplate(
            title="Sparse Attention Workbench", sidebar=[
                self.model, self.task, self.length, self.seed, self.target, self.reload, pn.layout.Divider(),
                self.layer, self.head, self.open, pn.layout.Divider(), self.progress, self.status, self.error],
            main=[self.tabs])
        self._start(s.load)

    def _shown(self, active: int) -> None:
        for i, view in enumerate(self.views.values()):
            view.shown = i == active

    def _start(self, job) -> None:
        try:
            job()
        except Exception as e:
            self.session.error = str(e)

    def _progress(self, _event) -> None:
        s = self.session
        self.progress.param.update(**s.progress_bar())
        state = "busy" if s.busy else s.status
        self.status.object = f"<span class='wb-state' data-state='{html.escape(state)}'>{html.escape(s.status)}</span>"
        self.error.param.update(object=s.error, visible=bool(s.error))
        for w in (self.reload, self.open):
            w.disabled = s.busy
        if not s.busy and s.ready:
            self.layer.value, self.head.value = s.layer, s.head

    def __panel__(self):
        return self.template


def create_app(settings: Settings | None = None):
    """A new session's page (what `panel serve` and `workbench dashboard` serve)."""
    return Dashboard(settings).template


if __name__.startswith("bokeh"):
    create_app().servable()
