"""The Decode tab: decode the loaded sample with the loaded model in several engine modes side by side,
the KV of every mode but dense-resident in the model's dtype or as FP8 / INT8 / INT4 codes, or INT8 keys with INT4
values (the host store's dtype).

One library call does the work (`workbench.decode.compare.compare_modes`, the same one notebook 06 makes,
through `tab_state.DecodeState`); this module lays out its controls, a table of the modes' speed and bytes,
a table of what each mode generated (text, the sample's answer found or not, tokens equal to dense's and to
its lossless reference's) and one step's compute/copy timeline. On a GPU the engine runs its Triton kernels
with CUDA graphs; on the CPU the PyTorch reference path, which the device line says.
"""
from __future__ import annotations

import html
from typing import Any

import panel as pn

from workbench.decode.compare import ALL_MODES, DEFAULT_MODES, Comparison
from workbench.views import viz
from workbench.views.dashboard.tab import Tab, on_page_loop
from workbench.views.dashboard.tab_state import DecodeState

COLUMNS = (("mode", "mode"), ("tokens/s", "tps"), ("MB moved / step", "mb"), ("cache hit rate", "hit"),
           ("copy hidden", "hidden"), ("copy GB/s", "gbps"), ("CUDA graph", "graph"))
TEXT_COLUMNS = (("mode", "mode"), ("generated text", "text"), ("answer found", "found"),
                ("same tokens as dense", "dense"), ("same tokens as its reference", "same"))
DENSE = "dense-resident"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _table(css: str, columns: tuple, rows: list[tuple[str, dict[str, str]]]) -> str:
    head = "".join(f"<th style='text-align:left;padding-right:1em'>{html.escape(t)}</th>" for t, _ in columns)
    body = "".join(f"<tr data-mode='{html.escape(mode)}'>" + "".join(
        f"<td class='wb-decode-{k}' style='padding-right:1em;vertical-align:top'>{html.escape(cells[k])}</td>"
        for _, k in columns) + "</tr>" for mode, cells in rows)
    return f"<table class='{css}' style='width:100%;table-layout:auto'><tr>{head}</tr>{body}</table>"


def budget_text(budget: Any) -> str:
    """"1 sink + 2 local + 8 top-k blocks of 64 tokens"."""
    return f"{budget.init} sink + {budget.local} local + {budget.topk} top-k blocks of {budget.block} tokens"


def decode_tables(result: Comparison, texts: dict[str, str], answer: str) -> str:
    """The device line, the modes' numbers (`table.wb-decode`, `tr[data-mode]`, cells `td.wb-decode-<key>`)
    and what each mode generated (`table.wb-decode-text`)."""
    numbers, generated = [], []
    dense = result.runs.get(DENSE)
    for r in result.rows():
        spec = r["mode"]
        tokens = result.runs[spec].tokens[0]
        numbers.append((spec, {
            "mode": spec, "tps": _num(r["tokens_per_s"], 2), "mb": _num(r["bytes_moved_per_step"] / 1e6, 3),
            "hit": _num(r["hit_rate"], 3), "hidden": _num(r["hidden_fraction"], 2), "gbps": _num(r["copy_gbps"], 1),
            "graph": ("yes" if r["cuda_graph"] else "no") + (f" ({r['note']})" if r["note"] else "")}))
        same_dense = "-" if dense is None else f"{int((tokens == dense.tokens[0]).sum())} of {len(tokens)}"
        same = "-" if r["reference"] is None else f"{r['reference']}: " + (
            "not run" if r["equals_reference"] is None else "yes" if r["equals_reference"] else "NO")
        found = "-" if not answer else (f"yes ({answer})" if answer in texts[spec] else f"no ({answer})")
        generated.append((spec, {"mode": spec, "text": texts[spec], "found": found, "dense": same_dense, "same": same}))
    hidden = "" if result.device.startswith("cuda") else (
        " No streams on the CPU: copies run inline, so no share of the copy is hidden.")
    stores = sorted({r["store_dtype"] for r in result.rows()} - {"model"})
    if stores:
        names = {"int8k-int4v": "INT8-key / INT4-value"}
        hidden += (f" KV kept as {' / '.join(names.get(s, s.upper()) for s in stores)} codes with a scale per token row"
                   + (" (INT4: per 32 elements)" if any("int4" in s for s in stores) else "")
                   + " (modes marked @): their distance from dense-resident includes the rounding.")
    return (f"<p class='wb-decode-device'>{html.escape(result.device)}: prompt {result.prompt_tokens[0]} tokens, "
            f"{result.new_tokens} new tokens, budget {html.escape(budget_text(result.budget))}.{hidden}</p>"
            + _table("wb-decode", COLUMNS, numbers) + "<p></p>" + _table("wb-decode-text", TEXT_COLUMNS, generated))


class DecodeTab(Tab):
    """Controls (modes, new tokens, budget), Decode / Stop, the tables of modes and a timeline of one step."""

    title = "Decode"

    def make_job(self) -> DecodeState:
        return DecodeState(self.session)

    def __init__(self, **params):
        super().__init__(**params)
        self.modes = pn.widgets.MultiChoice(label="modes", value=list(DEFAULT_MODES), options=list(ALL_MODES), width=420,
                                            css_classes=["wb-decode-modes"])
        self.new_tokens = pn.widgets.IntInput(label="new tokens", value=16, width=110, css_classes=["wb-decode-tokens"])
        self.store = pn.widgets.Select(label="host KV store", value="model", width=190, css_classes=["wb-decode-store"],
                                       options={"model dtype": "model", "FP8 (e4m3)": "fp8", "INT8": "int8",
                                                "INT4 (4-bit, groups of 32)": "int4",
                                                "INT8 keys, INT4 values": "int8k-int4v"})
        self._fitted = self.job.fitted_budget(self.new_tokens.value)  # the budget the inputs show unless edited
        self.budget = {k: pn.widgets.IntInput(label=f"{k} blocks", value=v, width=100, css_classes=[f"wb-decode-{k}"])
                       for k, v in self._fitted.items()}
        self.button = pn.widgets.Button(label="Decode", color="primary", css_classes=["wb-decode-run"])
        self.stop = pn.widgets.Button(label="Stop", css_classes=["wb-decode-stop"], disabled=True)
        self.table = pn.pane.HTML("Press Decode: the loaded sample is the prompt; every mode generates the new tokens "
                                  "greedily and the tables compare them.", css_classes=["wb-decode-table"],
                                  sizing_mode="stretch_width")
        self.which = pn.widgets.Select(label="timeline of", options=[], width=260, css_classes=["wb-decode-which"],
                                       visible=False)
        self.plot = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-decode-timeline"],
                                   visible=False)
        self.button.on_click(lambda _: self.run(self._start, self._draw))
        self.stop.on_click(lambda _: self.job.stop())
        self.which.param.watch(lambda _: self._draw_timeline(), "value")
        self.job.param.watch(on_page_loop(self._follow), ["busy"])
        self.new_tokens.param.watch(lambda _: self._fit_budget(), "value")
        self.session.param.watch(on_page_loop(lambda *_: self._fit_budget()), ["sample_version"])

    def _fit_budget(self) -> None:
        """Show the default budget cut to the sample (a 600-token prompt has 10 blocks, not the default's 11),
        unless the user typed another budget."""
        shown = {k: w.value for k, w in self.budget.items()}
        if shown == self._fitted:
            self._fitted = self.job.fitted_budget(self.new_tokens.value)
            for k, w in self.budget.items():
                w.value = self._fitted[k]

    def _start(self):
        return self.job.decode(self.modes.value, self.new_tokens.value, {k: w.value for k, w in self.budget.items()},
                               self.store.value)

    def _follow(self, *_events: Any) -> None:
        self.button.disabled, self.stop.disabled = self.job.busy, not self.job.busy

    def _draw(self) -> None:
        r = self.job.result
        if r is None:
            return
        self.table.object = decode_tables(r, self.job.texts, self.job.answer)
        specs = list(r.runs)
        self.which.options = specs
        self.which.value = "sparse-offload-forecast" if "sparse-offload-forecast" in specs else specs[-1]
        self.which.visible = True
        self._draw_timeline()

    def _draw_timeline(self) -> None:
        r, spec = self.job.result, self.which.value
        if r is None or spec not in r.runs or not r.runs[spec].timeline:
            return
        clock = "CUDA events" if r.device.startswith("cuda") else "CPU wall clock, no streams"
        self.plot.object = viz.decode_timeline(r.runs[spec].timeline, title=f"{spec}: one decode step ({clock})")
        self.plot.visible = True

    def body(self):
        controls = pn.FlexBox(self.modes, self.new_tokens, self.store, *self.budget.values(), flex_wrap="wrap",
                              sizing_mode="stretch_width")  # wraps where the inputs do not fit one row
        return pn.Column(controls, pn.Row(self.button, self.stop), self.table, self.which, self.plot,
                         sizing_mode="stretch_width")
