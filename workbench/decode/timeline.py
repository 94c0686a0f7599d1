"""Record one decode step of a `workbench.decode.engine.DecodeEngine` as spans on compute and copy streams.

The engine times its copies and waits only in aggregate; for a picture of one step this registers a
`StepHooks` object for the duration of that step (layer start/end, copy start/end) and stamps each
point on the stream it runs on: CUDA events on a GPU (in
`sparse-offload-forecast` the copy of layer l+1 runs on the side stream while layer l computes), wall
clock on the CPU, where there are no streams and copies run inline (compute spans are cut around them).
The spans feed `workbench.views.viz.decode_timeline`.
"""
from __future__ import annotations

from typing import Any

import torch

from workbench.core.timing import stamp
from workbench.decode.engine.hooks import StepHooks


def _cut(span: dict[str, Any], holes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`span` minus the intervals in `holes` (CPU: a copy inside a layer pauses its compute)."""
    out, start = [], span["start"]
    for h in sorted(holes, key=lambda s: s["start"]):
        if h["end"] <= start or h["start"] >= span["end"]:
            continue
        if h["start"] > start:
            out.append({**span, "start": start, "end": h["start"]})
        start = max(start, h["end"])
    if start < span["end"]:
        out.append({**span, "start": start})
    return out


class _Stamps(StepHooks):
    """Stamps every layer and copy boundary: CUDA events (on the current stream) or wall clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str, int, Any, Any]] = []
        self.opened: dict[tuple[str, int], Any] = {}

    def stamp(self) -> Any:
        return stamp(self.cuda)  # a CUDA event on the current stream: the side stream inside the engine's copy

    def _open(self, kind: str, layer: int) -> None:
        self.opened[(kind, layer)] = self.stamp()

    def _close(self, kind: str, layer: int) -> None:
        self.marks.append((kind, layer, self.opened.pop((kind, layer)), self.stamp()))

    def layer_start(self, layer: int) -> None:
        self._open("compute", layer)

    def layer_end(self, layer: int) -> None:
        self._close("compute", layer)

    def copy_start(self, layer: int) -> None:
        self._open("copy", layer)

    def copy_end(self, layer: int) -> None:
        self._close("copy", layer)


@torch.no_grad()
def trace_step(engine: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Run `engine.step(tokens)` once (eagerly) and return (logits `[B, V]`, spans).

    spans: [{"stream": "compute" | "copy", "start", "end" (ms from the step's start), "label", "layer"}].
    """
    cuda = bool(engine.cuda)
    stamps = _Stamps(cuda)
    engine.hooks.append(stamps)
    try:
        t0 = stamps.stamp()
        logits = engine.step(tokens)
        if cuda:
            torch.cuda.synchronize()
    finally:
        engine.hooks.remove(stamps)
    ms = (lambda e: t0.elapsed_time(e)) if cuda else (lambda t: (t - t0) * 1e3)
    spans = [{"stream": s, "layer": layer, "label": f"L{layer}", "start": ms(a), "end": ms(b)}
             for s, layer, a, b in stamps.marks]
    copies = [s for s in spans if s["stream"] == "copy"]
    if not cuda and copies:
        spans = [piece for s in spans if s["stream"] == "compute" for piece in _cut(s, copies)] + copies
    return logits, sorted(spans, key=lambda s: (s["start"], s["stream"]))
