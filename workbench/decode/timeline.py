"""Record one decode step of a `workbench.decode.engine.DecodeEngine` as spans on compute and copy streams.

The engine times its copies and waits only in aggregate; for a picture of one step this wraps three of
its calls for the duration of that step (`lm.norm_in` opens a layer, `lm.finish` closes it, the engine's
block copy) and stamps each on the stream it runs on: CUDA events on a GPU (in
`sparse-offload-forecast` the copy of layer l+1 runs on the side stream while layer l computes), wall
clock on the CPU, where there are no streams and copies run inline (compute spans are cut around them).
The spans feed `workbench.views.viz.decode_timeline`.
"""
from __future__ import annotations

import time
from typing import Any

import torch


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


@torch.no_grad()
def trace_step(engine: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Run `engine.step(tokens)` once and return (logits `[B, V]`, spans).

    spans: [{"stream": "compute" | "copy", "start", "end" (ms from the step's start), "label", "layer"}].
    """
    cuda = bool(engine.cuda)
    lm = engine.lm

    def stamp() -> Any:
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()  # on the current stream: the side stream inside the engine's copy
            return e
        return time.perf_counter()

    marks: list[tuple[str, int, Any, Any]] = []
    opened: dict[int, Any] = {}
    norm_in, finish, copy = lm.norm_in, lm.finish, engine._copy

    def traced_norm_in(layer: int, x: torch.Tensor) -> torch.Tensor:
        opened[layer] = stamp()
        return norm_in(layer, x)

    def traced_finish(layer: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        out = finish(layer, x, attn_out)
        marks.append(("compute", layer, opened.pop(layer), stamp()))
        return out

    def traced_copy(layer: int, plan: Any, stream_events: Any) -> None:
        a = stamp()
        copy(layer, plan, stream_events)
        marks.append(("copy", layer, a, stamp()))

    lm.norm_in, lm.finish, engine._copy = traced_norm_in, traced_finish, traced_copy
    try:
        t0 = stamp()
        logits = engine.step(tokens)
        if cuda:
            torch.cuda.synchronize()
    finally:
        del lm.norm_in, lm.finish, engine._copy  # back to the class methods
    ms = (lambda e: t0.elapsed_time(e)) if cuda else (lambda t: (t - t0) * 1e3)
    spans = [{"stream": s, "layer": layer, "label": f"L{layer}", "start": ms(a), "end": ms(b)}
             for s, layer, a, b in marks]
    copies = [s for s in spans if s["stream"] == "copy"]
    if not cuda and copies:
        spans = [piece for s in spans if s["stream"] == "compute" for piece in _cut(s, copies)] + copies
    return logits, sorted(spans, key=lambda s: (s["start"], s["stream"]))
