"""The dashboard's `Tab` protocol: one class per tab, each owning its state and background job.

A tab reads the session's sample, config and selection; a tab that computes owns a `Job` (`tab_state.py`)
whose progress, status and error it shows above its body. The dashboard keeps its tabs in one list
(`app.TABS`); `shown` is True while a tab is open, and changes that arrive while it is hidden redraw it
when it opens.
"""
from __future__ import annotations

import html
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import panel as pn
import param

from workbench.views.dashboard.state import Job, Session


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


def html_table(rows: list[tuple[str, str]], css: str, width: int | None = None) -> str:
    """A two-column HTML table; each value cell has the class `<css>-<first word of its key>`."""
    style = f" style='width:{width}px;table-layout:fixed'" if width else ""
    body = "".join(f"<tr><th style='text-align:left;padding-right:1em;vertical-align:top;width:11em'>{html.escape(k)}</th>"
                   f"<td class='{css}-{k.split()[0].lower()}' style='white-space:normal;overflow-wrap:anywhere'>"
                   f"{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table class='{css}'{style}>{body}</table>"


class JobStatus(pn.viewable.Viewer):
    """A job's progress bar, status line (`.<css>-state[data-state]`) and error Alert (`.wb-error`)."""

    def __init__(self, job: Job, css: str, **params):
        super().__init__(**params)
        self.job, self.css = job, css
        self.progress = pn.indicators.Progress(value=0, max=100, active=False, sizing_mode="stretch_width",
                                               css_classes=[f"{css}-progress"])
        self.status = pn.pane.HTML("", css_classes=[f"{css}-status"])
        self.error = pn.pane.Alert("", alert_type="danger", visible=False, css_classes=["wb-error", f"{css}-error"])
        job.param.watch(on_page_loop(self.update), ["progress", "status", "busy", "error"])
        self.update()

    def update(self, *_events: Any) -> None:
        j = self.job
        self.progress.param.update(**j.progress_bar(), visible=j.busy)
        state = "busy" if j.busy else j.status
        self.status.object = (f"<span class='{self.css}-state' data-state='{html.escape(state)}' "
                              f"style='color:#555;font-size:90%'>{html.escape(j.status)}</span>")
        self.error.param.update(object=j.error, visible=bool(j.error))

    def __panel__(self):
        return pn.Column(self.progress, self.status, self.error, sizing_mode="stretch_width")


class Tab(pn.viewable.Viewer):
    """One dashboard tab. Subclasses set `title`, make `job` (their state, a `Job`) if they compute, build
    widgets in `__init__`, draw in `_draw` and lay out in `body`. `open_tab(title)` switches tabs."""

    title: ClassVar[str] = ""
    session = param.ClassSelector(class_=Session)
    shown = param.Boolean(default=False)
    open_tab = param.Callable(default=lambda title: None)

    def __init__(self, **params):
        super().__init__(**params)
        self.job: Job | None = self.make_job()
        self._stale = False
        self._layout = None
        self.param.watch(lambda e: e.new and self._stale and self.refresh(), "shown")

    def make_job(self) -> Job | None:
        """The tab's own state and job (None: the tab only reads the session)."""
        return None

    @property
    def slug(self) -> str:
        return "wb-" + self.title.lower().split("/")[0]

    def changed(self, *_events: Any) -> None:
        if self.shown:
            self.refresh()
        else:
            self._stale = True

    def refresh(self) -> None:
        self._stale = False
        self._safely(self._draw)

    def say(self, message: str) -> None:
        """Show a refusal or a failure in this tab's Alert (the sidebar's for tabs without a job)."""
        (self.job or self.session).error = message

    def _safely(self, draw: Callable[[], None]) -> None:
        """Run `draw`; an error shows in the Alert (raised on the page loop it reached only the log)."""
        try:
            draw()
        except Exception as e:
            logging.getLogger(__name__).exception("drawing %s failed", type(self).__name__)
            self.say(f"the {self.title} tab could not draw: {e or type(e).__name__}")

    def run(self, start: Callable[[], Any], then: Callable[[], None] | None = None) -> None:
        """Start a job from a button; `then` redraws when it is done. Refusals show in the Alert."""
        try:
            job = start()
        except Exception as e:  # busy, or a bad request: say why
            self.say(str(e))
            return
        if then is not None:
            job.add_done_callback(on_page_loop(lambda _: self._safely(then)))

    def _draw(self) -> None:
        raise NotImplementedError

    def body(self) -> pn.viewable.Viewable:
        raise NotImplementedError

    def __panel__(self):
        if self._layout is None:
            parts = [self.body()] if self.job is None else [JobStatus(self.job, f"{self.slug}-job"), self.body()]
            self._layout = pn.Column(*parts, sizing_mode="stretch_width")
        return self._layout
