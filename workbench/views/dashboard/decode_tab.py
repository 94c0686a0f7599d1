"""The Decode tab: decode the loaded sample with the loaded model in several engine modes side by side.

One library call does the work (`workbench.decode.compare.compare_modes`, the same one notebook 06 makes); this
module lays out its controls, table and one step's compute/copy timeline. On a GPU the engine runs its Triton
kernels with CUDA graphs; on the CPU the PyTorch reference path, which the device line says.
"""
from __future__ import annotations

import html
import threading
from typing import Any

import panel as pn
import param

from workbench.decode.compare import ALL_MODES, DEFAULT_MODES, Comparison, compare_modes
from workbench.patterns.infllm import Budget
from workbench.views import viz
from workbench.views.dashboard.state import SHARED, Session

COLUMNS = (("mode", "mode"), ("tokens/s", "tps"), ("MB moved / step", "mb"), ("cache hit rate", "hit"),
           ("copy hidden", "hidden"), ("copy GB/s", "gbps"), ("CUDA graph", "graph"), ("greedy tokens", "tokens"),
           ("same tokens as", "same"))
ONE_AT_A_TIME = threading.Lock()  # sessions decode in turn: a CUDA-graph capture must not meet another thread's work


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def decode_table(result: Comparison) -> str:
    """HTML table, one row per mode (`tr[data-mode]`, cells `td.wb-decode-<key>`), then the device line."""
    head = "".join(f"<th style='text-align:left;padding-right:1em'>{html.escape(t)}</th>" for t, _ in COLUMNS)
    body = []
    for r in result.rows():
        same = "-" if r["reference"] is None else f"{r['reference']}: {'yes' if r['equals_reference'] else 'NO'}"
        cells = {"mode": r["mode"], "tps": _num(r["tokens_per_s"], 2), "mb": _num(r["bytes_moved_per_step"] / 1e6, 3),
                 "hit": _num(r["hit_rate"], 3), "hidden": _num(r["hidden_fraction"], 2), "gbps": _num(r["copy_gbps"], 1),
                 "graph": ("yes" if r["cuda_graph"] else "no") + (f" ({r['note']})" if r["note"] else ""),
                 "tokens": " ".join(map(str, r["greedy_tokens"])), "same": same}
        body.append(f"<tr data-mode='{html.escape(r['mode'])}'>" + "".join(
            f"<td class='wb-decode-{k}' style='padding-right:1em'>{html.escape(cells[k])}</td>" for _, k in COLUMNS)
            + "</tr>")
    hidden = "" if result.device.startswith("cuda") else (
        " No streams on the CPU: copies run inline, so no share of the copy is hidden.")
    return (f"<p class='wb-decode-device'>{html.escape(result.device)}: prompt {result.prompt_tokens[0]} tokens, "
            f"{result.new_tokens} new tokens, budget {html.escape(str(result.budget.to_dict()))}.{hidden}</p>"
            f"<table class='wb-decode'><tr>{head}</tr>{''.join(body)}</table>")


class DecodeView(pn.viewable.Viewer):
    """Controls (modes, new tokens, budget), a progress bar, the table of modes and a timeline of one step.

    `on_loop` wraps callbacks that may fire on a job's thread so that they run on the page's event loop
    (the dashboard passes its `on_page_loop`)."""

    session = param.ClassSelector(class_=Session)
    shown = param.Boolean(default=True)
    on_loop = param.Callable(default=lambda fn: fn)
    modes = param.ListSelector(default=list(DEFAULT_MODES), objects=list(ALL_MODES))
    new_tokens = param.Integer(default=16, bounds=(2, 512), doc="tokens generated per mode (the prefill's first)")
    init = param.Integer(default=1, bounds=(0, None), doc="sink blocks of 64 tokens")
    local = param.Integer(default=2, bounds=(1, None), doc="local blocks of 64 tokens")
    topk = param.Integer(default=8, bounds=(0, None), doc="top-k dynamic blocks of 64 tokens")

    def __init__(self, **params):
        super().__init__(**params)
        self.result: Comparison | None = None
        self.button = pn.widgets.Button(name="Decode", button_type="primary", css_classes=["wb-decode-run"])
        self.progress = pn.indicators.Progress(value=0, max=100, active=False, sizing_mode="stretch_width",
                                               css_classes=["wb-decode-progress"])
        self.table = pn.pane.HTML("Press Decode: the loaded sample is the prompt.", css_classes=["wb-decode-table"])
        self.which = pn.widgets.Select(name="timeline of", options=[], width=260, css_classes=["wb-decode-which"])
        self.plot = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-decode-timeline"])
        self.button.on_click(lambda _: self._start())
        self.which.param.watch(lambda _: self._draw_timeline(), "value")
        self.session.param.watch(self.on_loop(self._follow), ["progress", "busy"])

    def _start(self) -> None:
        s = self.session
        try:
            if s.sample is None:
                raise RuntimeError("no sample loaded yet: wait for 'ready' or press Load sample")
            job = s.run_job("decoding", self._decode)
        except Exception as e:  # busy, or nothing loaded: say why in the sidebar
            s.error = str(e)
            return
        job.add_done_callback(self.on_loop(lambda _: self._draw()))

    def _decode(self) -> None:
        s = self.session
        model, _, _ = SHARED.model(s.settings.model, s.settings.device, s.settings.dtype)
        budget = Budget(init=self.init, local=self.local, topk=self.topk)
        s.status = "decoding: waiting for another session's decode"
        with ONE_AT_A_TIME:
            self.result = compare_modes(
                model, s.sample.input_ids, modes=self.modes, new_tokens=self.new_tokens, budget=budget,
                progress=lambda what, done, total: s.param.update(status=f"decoding: {what}",
                                                                  progress=int(100 * done / total)))

    def _follow(self, _event: Any = None) -> None:
        s = self.session
        self.progress.param.update(**s.progress_bar())
        self.button.disabled = s.busy

    def _draw(self) -> None:
        r = self.result
        if r is None:
            return
        self.table.object = decode_table(r)
        specs = list(r.runs)
        self.which.options = specs
        self.which.value = "sparse-offload-forecast" if "sparse-offload-forecast" in specs else specs[-1]
        self._draw_timeline()

    def _draw_timeline(self) -> None:
        r, spec = self.result, self.which.value
        if r is None or spec not in r.runs or not r.runs[spec].timeline:
            return
        clock = "CUDA events" if r.device.startswith("cuda") else "CPU wall clock, no streams"
        self.plot.object = viz.decode_timeline(r.runs[spec].timeline, title=f"{spec}: one decode step ({clock})")

    def __panel__(self):
        controls = pn.Row(
            pn.widgets.MultiChoice.from_param(self.param.modes, name="modes", width=420, css_classes=["wb-decode-modes"]),
            pn.widgets.IntInput.from_param(self.param.new_tokens, name="new tokens", width=110,
                                           css_classes=["wb-decode-tokens"]),
            *(pn.widgets.IntInput.from_param(self.param[k], name=f"{k} blocks", width=100, css_classes=[f"wb-decode-{k}"])
              for k in ("init", "local", "topk")))
        return pn.Column(controls, pn.Row(self.button, self.progress), self.table, self.which, self.plot)

