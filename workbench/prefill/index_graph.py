"""A layer's online index replayed from a CUDA graph.

At a few heads the index is launch-bound: Gemma-3-270M's searched 32K config spent 3.04 ms building one layer's
index (VS scores, top-k, tiles, the block index, the merge into one launch) against ~0.6 ms of GPU work, which
made that layer slower than dense (kernels/NOTES.md, session 13). The index has static shapes and no host sync,
so one capture per (layer, input shapes) turns its ~40 launches into one graph launch. A replay copies q and k
into the graph's input buffers (B (Hq + Hkv) N D elements: ~25 us for Gemma-3 at 32K, ~0.4 ms for Llama-3-8B at
128K, where the index is GPU-bound and the graph gains little).

All graphs share one memory pool: a layer's outputs are valid until the next replay of any graph, which is how
the prefill uses them (index, then that layer's kernel, then the next layer).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch


class IndexGraphs:
    """`graphs(key, build, q, k)`: `build(q, k)` (the layer's index from q `[B, Hq, N, D]`, k `[B, Hkv, N, D]` on
    a GPU; static shapes, no host sync, every host-side cache filled by its first call) replayed from a CUDA graph
    per (key, shapes, strides, dtype, device).

    after: eager calls per (key, layout) before the capture, which costs about two more builds (a warm-up run on a
    side stream, then the capture) and a replay. 1 (the prefill's default) captures on the second call, so a length
    seen once costs nothing extra. layouts: input layouts (lengths) kept; the least recently used one is dropped
    with its graphs and its q / k buffers (B (Hq + Hkv) N D elements each). `failures` keeps why a capture failed;
    that key then runs `build` eagerly."""

    def __init__(self, after: int = 0, layouts: int = 2) -> None:
        if after < 0 or layouts < 1:
            raise ValueError(f"after (eager calls before a capture) must be >= 0 and layouts (kept) >= 1; got "
                             f"after={after}, layouts={layouts}")
        self.after, self.layouts = after, layouts
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor], Any]] = {}
        self._inputs: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()  # shared per layout
        self._eager: Counter[tuple] = Counter()
        self._pool: Any = None
        self.failures: dict[tuple, str] = {}

    def __len__(self) -> int:
        """Graphs kept."""
        return len(self._graphs)

    def __call__(self, key: Hashable, build: Callable[[torch.Tensor, torch.Tensor], Any], q: torch.Tensor,
                 k: torch.Tensor) -> Any:
        layout = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), q.dtype, q.device)
        full = (key, layout)
        if full in self.failures:
            return build(q, k)
        if full not in self._graphs:
            if self._eager[full] < self.after:
                self._eager[full] += 1
                return build(q, k)
            try:
                self._graphs[full] = self._capture(build, q, k, layout)
            except RuntimeError as e:  # e.g. an op that syncs with the host: record it, run eagerly
                self.failures[full] = f"{type(e).__name__}: {e}"[:500]
                torch.cuda.synchronize(q.device)
                return build(q, k)
        self._inputs.move_to_end(layout)
        graph, (sq, sk), out = self._graphs[full]
        sq.copy_(q)
        sk.copy_(k)
        graph.replay()
        return out

    def _capture(self, build: Callable, q: torch.Tensor, k: torch.Tensor, layout: tuple) -> tuple:
        if layout not in self._inputs:
            if len(self._inputs) == self.layouts:
                self._drop(next(iter(self._inputs)))
            self._inputs[layout] = (torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device),
                                    torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=k.device))
        sq, sk = self._inputs[layout]
        sq.copy_(q)
        sk.copy_(k)
        side = torch.cuda.Stream(q.device)
        side.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(side):  # compiles the kernels and fills the caches outside the capture
            build(sq, sk)
        torch.cuda.current_stream(q.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = build(sq, sk)
        return graph, (sq, sk), out

    def _drop(self, layout: tuple) -> None:
        """Forget one input layout: its graphs, buffers and eager counts."""
        for full in [f for f in self._graphs if f[1] == layout]:
            del self._graphs[full]
        for full in [f for f in self._eager if f[1] == layout]:
            del self._eager[full]
        del self._inputs[layout]
