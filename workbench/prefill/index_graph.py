"""A layer's online index replayed from a CUDA graph.

At a few heads the index is launch-bound: Gemma-3-270M's searched 32K config spent 3.04 ms building one layer's
index (VS scores, top-k, tiles, the block index, the merge into one launch) against ~0.6 ms of GPU work, which
made that layer slower than dense (kernels/NOTES.md, session 13). The index has static shapes and no host sync,
so one capture per (layer, input shapes) turns its ~40 launches into one graph launch. A replay copies q and k
into the graph's input buffers (B (Hq + Hkv) N D elements: ~25 us for Gemma-3 at 32K). Where the index is
GPU-bound the copy costs more than the launches it saves: the block index of Llama-3-8B's shape (32 / 8 heads)
took 0.49 / 1.41 ms eagerly and 0.76 / 2.00 ms replayed at 64K / 128K (H200, session 17), so the prefill keeps a
graph only where its replay measured faster.

All graphs share one memory pool: a layer's outputs are valid until the next replay of any graph, which is how
the prefill uses them (index, then that layer's kernel, then the next layer).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch


class IndexGraphs:
    """`graphs(key, build, q, k)`: `build(q, k)` (the layer's index from q `[B, Hq, N, D]`, k `[B, Hkv, N, D]` on
    a GPU; static shapes, no host sync, every host-side cache filled by its first call) replayed from a CUDA graph
    per (key, shapes, strides, dtype, device).

    after: eager calls per (key, layout) before the capture. The capture call builds twice more (a warm-up on a side
    stream, timed: the eager build's wall time, host launches included; then the capture) and replays twice (the
    second timed, q / k copy included); `timings` keeps the two times. keep_slower: keep a graph whose replay is not
    faster than the eager build (else that key runs eagerly from then on: at many heads the index is GPU-bound and
    the copy costs more than the launches it saves). layouts: input layouts (lengths) kept, least recently used
    dropped first with their graphs, q / k buffers (B (Hq + Hkv) N D elements each) and counts. `failures` keeps why
    a capture failed; that key then runs eagerly."""

    def __init__(self, after: int = 0, layouts: int = 2, keep_slower: bool = True) -> None:
        if after < 0 or layouts < 1:
            raise ValueError(f"after (eager calls before a capture) must be >= 0 and layouts (kept) >= 1; got "
                             f"after={after}, layouts={layouts}")
        self.after, self.layouts, self.keep_slower = after, layouts, keep_slower
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}  # (key, layout) -> (graph, its outputs)
        self._inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # layout -> q / k buffers of its graphs
        self._calls: Counter[tuple] = Counter()  # (key, layout) -> eager calls
        self._recent: OrderedDict[tuple, None] = OrderedDict()  # layouts, least recently used first
        self._pool: Any = None
        self.failures: dict[tuple, str] = {}
        self.timings: dict[tuple, tuple[float, float]] = {}  # (key, layout) -> (eager build, replay) ms

    def __len__(self) -> int:
        """Graphs kept."""
        return len(self._graphs)

    def __call__(self, key: Hashable, build: Callable[[torch.Tensor, torch.Tensor], Any], q: torch.Tensor,
                 k: torch.Tensor) -> Any:
        layout = (tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), q.dtype, q.device)
        full = (key, layout)
        self._touch(layout)
        if full in self._graphs:
            graph, out = self._graphs[full]
            self._replay(graph, layout, q, k)
            return out
        if full in self.failures or full in self.timings:  # (timings and no graph: its replay was not faster)
            return build(q, k)
        if self._calls[full] < self.after:
            self._calls[full] += 1
            return build(q, k)
        try:
            return self._capture(full, build, q, k)
        except RuntimeError as e:  # e.g. an op that syncs with the host: record it, run eagerly
            self.failures[full] = f"{type(e).__name__}: {e}"[:500]
            torch.cuda.synchronize(q.device)
            self._release(layout)
            return build(q, k)

    def _capture(self, full: tuple, build: Callable, q: torch.Tensor, k: torch.Tensor) -> Any:
        layout, dev = full[1], q.device
        if layout not in self._inputs:
            self._inputs[layout] = (torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=dev),
                                    torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=dev))
        sq, sk = self._inputs[layout]
        sq.copy_(q)
        sk.copy_(k)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        with torch.cuda.stream(side):  # compiles the kernels and fills the caches outside the capture
            build(sq, sk)
        torch.cuda.synchronize(dev)
        eager_ms = (time.perf_counter() - start) * 1e3
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = build(sq, sk)
        self._replay(graph, layout, q, k)  # (the first replay uploads the graph)
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        self._replay(graph, layout, q, k)
        torch.cuda.synchronize(dev)
        self.timings[full] = (eager_ms, (time.perf_counter() - start) * 1e3)
        if self.keep_slower or self.timings[full][1] < eager_ms:
            self._graphs[full] = (graph, out)
        else:
            self._release(layout)  # (out stays valid: its memory is held while the caller holds it)
        return out

    def _replay(self, graph: torch.cuda.CUDAGraph, layout: tuple, q: torch.Tensor, k: torch.Tensor) -> None:
        sq, sk = self._inputs[layout]
        sq.copy_(q)
        sk.copy_(k)
        graph.replay()

    def _touch(self, layout: tuple) -> None:
        self._recent[layout] = None
        self._recent.move_to_end(layout)
        while len(self._recent) > self.layouts:
            self._drop(self._recent.popitem(last=False)[0])

    def _release(self, layout: tuple) -> None:
        """Free a layout's q / k buffers once none of its graphs is kept."""
        if not any(f[1] == layout for f in self._graphs):
            self._inputs.pop(layout, None)

    def _drop(self, layout: tuple) -> None:
        """Forget one input layout: its graphs, buffers, counts, failures and timings."""
        for table in (self._graphs, self._calls, self.failures, self.timings):
            for full in [f for f in table if f[1] == layout]:
                del table[full]
        self._inputs.pop(layout, None)
