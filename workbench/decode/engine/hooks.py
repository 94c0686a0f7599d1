"""Hook points of `DecodeEngine.step`, for timing without touching the engine's internals.

The engine calls every registered `StepHooks` object at these points of an eager step (a CUDA-graph
replay runs no Python, so hooks need `run(graph=False)`):

- `layer_start(layer)` / `layer_end(layer)`: around one layer's whole compute (norm to FFN).
- `copy_start(layer)` / `copy_end(layer)`: around the block copy that fills `layer`'s GPU cache, on the
  stream that runs it (the side stream in `sparse-offload-forecast`, so an event recorded there times
  the copy itself).
- `wait_start(layer)` / `wait_end(layer)`: around the time the main stream spends getting `layer`'s
  blocks in place: waiting for the prefetch, or running the copy inline (sync and no-prefetch modes).

`CopyTimer` is the engine's own aggregate copy/stall timer (CUDA events); `workbench.decode.timeline`
stamps every point for a picture of one step.
"""
from __future__ import annotations

import torch


class StepHooks:
    """Base class: every hook is a no-op; override the ones you need."""

    def layer_start(self, layer: int) -> None: ...

    def layer_end(self, layer: int) -> None: ...

    def copy_start(self, layer: int) -> None: ...

    def copy_end(self, layer: int) -> None: ...

    def wait_start(self, layer: int) -> None: ...

    def wait_end(self, layer: int) -> None: ...


class CopyTimer(StepHooks):
    """CUDA events around every copy and every wait -> total copy and stall seconds (read after a sync)."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"copy": [], "stall": []}
        self._open: dict[tuple[str, int], torch.cuda.Event] = {}

    def _stamp(self, kind: str, layer: int, start: bool) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        if start:
            self._open[(kind, layer)] = e
        else:
            self.spans[kind].append((self._open.pop((kind, layer)), e))

    def copy_start(self, layer: int) -> None:
        self._stamp("copy", layer, True)

    def copy_end(self, layer: int) -> None:
        self._stamp("copy", layer, False)

    def wait_start(self, layer: int) -> None:
        self._stamp("stall", layer, True)

    def wait_end(self, layer: int) -> None:
        self._stamp("stall", layer, False)

    def seconds(self, kind: str) -> float:
        """Summed span time of `kind` ("copy" or "stall") in seconds."""
        return sum(a.elapsed_time(b) for a, b in self.spans[kind]) / 1e3
