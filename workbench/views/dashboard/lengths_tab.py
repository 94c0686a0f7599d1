"""The Lengths tab: does the session's config hold at other prompt lengths, or must some heads be searched again?

One library call does the work (`prefill.generalize.generalization_report`, the one `workbench generalize` and
notebook 08 make, through `tab_state.LengthsState`); this module lays out its controls, the report's takeaway
and summary (`views.lengths`), the heads that lose mass, and every chosen head's captured mass against prompt
length (solid: the budgets as searched; dotted: every budget x n / L).
"""
from __future__ import annotations

import html
from typing import Any

import panel as pn

from workbench.core.corpus import TASKS
from workbench.core.report import table_html
from workbench.views import lengths
from workbench.views.dashboard.tab import Tab, on_page_loop
from workbench.views.dashboard.tab_state import MAX_PROMPTS, LengthsState

SHOW = {"heads that lose mass": "dropping", "heads below target": "below", "every head": "all",
        "the selected head": "selected"}
MAX_ROWS = 30  # rows of the table of heads that lose mass
STYLE = ("<style>table{border-collapse:collapse;margin:4px 0 8px}td,th{border-bottom:1px solid #ddd;padding:1px 10px;"
         "text-align:right}</style>")


class LengthsTab(Tab):
    """Controls (lengths, held-out task and prompts), Evaluate / Stop, the takeaway, the summary per length
    and variant, the heads that lose mass, and the mass-vs-length figure of the heads chosen under 'show'."""

    title = "Lengths"

    def make_job(self) -> LengthsState:
        return LengthsState(self.session)

    def __init__(self, **params):
        super().__init__(**params)
        self.lengths = pn.widgets.TextInput(label="lengths (tokens, comma-separated)", value="", width=260,
                                            css_classes=["wb-lengths-lengths"])
        self.task = pn.widgets.Select(label="held-out task", options=list(TASKS), value="multikey", width=150,
                                      css_classes=["wb-lengths-task"])
        self.prompts = pn.widgets.IntInput(label=f"prompts per length (1-{MAX_PROMPTS})", value=1, width=150,
                                           css_classes=["wb-lengths-prompts"])
        self.button = pn.widgets.Button(label="Evaluate", color="primary", css_classes=["wb-lengths-run"])
        self.stop = pn.widgets.Button(label="Stop", css_classes=["wb-lengths-stop"], disabled=True)
        self.show = pn.widgets.RadioButtonGroup(options=list(SHOW), value="heads that lose mass",
                                                css_classes=["wb-lengths-show"])
        self.note = pn.pane.HTML("", css_classes=["wb-lengths-note"], sizing_mode="stretch_width")
        self.summary = pn.pane.HTML("", css_classes=["wb-lengths-summary"], sizing_mode="stretch_width")
        self.empty = pn.pane.HTML("", css_classes=["wb-lengths-empty"], visible=False)
        self.plot = pn.pane.Plotly(None, config={"displayModeBar": False}, css_classes=["wb-lengths-plot"],
                                   visible=False, sizing_mode="stretch_width")
        self._default = ""
        self._new_report = False
        self.button.on_click(lambda _: self.run(self._start, self._evaluated))
        self.stop.on_click(lambda _: self.job.stop())
        self.show.param.watch(lambda _: self._safely(self._draw_figure), "value")
        self.job.param.watch(on_page_loop(self._follow), ["busy"])
        self.session.param.watch(on_page_loop(self.changed), ["config_version", "grid_version", "layer", "head"])

    def _start(self):
        return self.job.evaluate(self.lengths.value, self.prompts.value, self.task.value)

    def _evaluated(self) -> None:
        self._new_report = True
        self._draw()

    def _follow(self, *_events: Any) -> None:
        self.button.disabled, self.stop.disabled = self.job.busy, not self.job.busy

    def _draw(self) -> None:
        with pn.io.hold():  # the inputs, the note and the results reach the page in one message
            self._draw_all()

    def _draw_all(self) -> None:
        s = self.session
        if s.config is None:
            return
        L, why = self.job.searched_at()
        default = ", ".join(str(n) for n in self.job.default_lengths())
        if self.lengths.value in ("", self._default):  # follow the config until the user types lengths
            self.lengths.value = default
        self._default = default
        self.note.object = (
            f"<p>The config ({html.escape(s.config_source)}, edits included) at L = {L} tokens ({html.escape(why)}) "
            "and at other lengths, on held-out prompts (seeds the search never saw). Mass = the exact share of "
            "each head's attention its online index keeps, over all rows and over the answer rows; a head is below "
            "target when its worst prompt is. Two variants: the budgets in tokens as searched, and every budget x "
            "n / L. Press Evaluate; `workbench generalize` adds retrieval and next-token KL at the longest length."
            "</p>")
        rep = self.job.report
        if rep is None:
            return
        drops = rep["dropping"]["as_is"]
        rows = [{"layer": r["layer"], "head": r["head"], "config": rep["labels"][r["layer"]][r["head"]],
                 f"mass at {rep['config']['searched_at']}": r["mass_at_L"],
                 f"mass at {rep['settings']['drop_to']}": r["mass_at_drop_to"], "drop": r["drop"]}
                for r in drops[:MAX_ROWS]]
        more = f" (the {MAX_ROWS} largest shown)" if len(drops) > MAX_ROWS else ""
        if self._new_report:  # show the first non-empty set: heads that lose mass, below target, or all
            self._new_report = False
            self.show.value = next((label for label in SHOW if SHOW[label] in ("dropping", "below", "all")
                                    and self._heads(SHOW[label])), "every head")
        stale = ("<p class='wb-lengths-stale'><b>The config changed after this evaluation</b> (a head edited or "
                 "another config loaded): what follows is the config as it was. Press Evaluate for the current one."
                 "</p>") if self.job.stale() else ""
        self.summary.object = (
            STYLE + stale + f"<p class='wb-lengths-takeaway'><b>{html.escape(lengths.takeaway(rep))}</b></p>"
            + table_html(lengths.summary_rows(rep), 4, "wb-lengths-table")
            + (f"<p>Heads that lose more than {rep['settings']['drop']} of their mass, budgets as searched: "
               f"{len(drops)}{more}</p>" + table_html(rows, 4, "wb-lengths-drops") if drops else ""))
        self._draw_figure()

    def _heads(self, which: str | None = None) -> list[tuple[int, int]]:
        rep, which = self.job.report, which or SHOW[self.show.value]
        if which == "dropping":
            return [(r["layer"], r["head"]) for r in rep["dropping"]["as_is"]]
        if which == "below":
            return lengths.below_target_heads(rep)
        if which == "selected":
            pick = (self.session.layer, self.session.head)
            return [pick] if pick in lengths.evaluated_heads(rep) else []
        return lengths.evaluated_heads(rep)

    def _draw_figure(self) -> None:
        rep = self.job.report
        if rep is None:
            return
        heads = self._heads()
        self.empty.param.update(object=f"<p>No {html.escape(self.show.value)} to draw: choose another.</p>",
                                visible=not heads)
        if heads:
            self.plot.object = lengths.report_figure(rep, heads=heads)
        self.plot.visible = bool(heads)

    def body(self):
        controls = pn.Row(self.lengths, self.task, self.prompts)
        return pn.Column(self.note, controls, pn.Row(self.button, self.stop), self.summary, self.show, self.empty,
                         self.plot, sizing_mode="stretch_width")
