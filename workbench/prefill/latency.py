"""Latency of sparse attention: estimated from a committed GPU benchmark, or timed live on one layer.

`tile_rates(bench)` turns a `workbench bench prefill` JSON (assets/benchmarks/prefill_h200.json) into
{pattern: {"per_tile_ms", "index_ms"}} per query head (median over the measured lengths), the table
`search.choose(latency=...)` takes; `estimate_ms` applies it to a head's 64x64 tile count.
`time_layer` times one layer under a per-head index: the Triton kernel against dense SDPA on a GPU,
or on the CPU the PyTorch reference path (`metrics.sparse_attention`, dense math under a mask: it
does not get faster with sparsity) against dense SDPA, labelled as such.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from workbench.patterns import AShape, BlockSparse, Dense, VerticalSlash, causal_tiles

BENCH = Path(__file__).resolve().parents[2] / "assets" / "benchmarks" / "prefill_h200.json"
KERNELS = {"vertical_slash": "vs", "block_sparse": "block", "a_shape": "ashape", "dense_sdpa": "dense"}


def load_bench(path: str | Path = BENCH) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"benchmark {path} does not exist: run `workbench bench prefill --out {path}` on a GPU")
    return json.loads(path.read_text())


def tile_rates(bench: dict[str, Any], shape: str = "embedded", block: int = 64) -> dict[str, dict[str, float]]:
    """{pattern: {"per_tile_ms": ms per 64x64 tile of one query head, "index_ms": index build per query
    head}} from the benchmark rows of `shape` at `block` (median over lengths)."""
    rates: dict[str, dict[str, list[float]]] = {}
    for row in bench.get("rows", []):
        pattern = KERNELS.get(str(row.get("kernel")).split("@")[0])  # "vertical_slash@512": a second budget
        if pattern is None or row.get("shape") != shape or str(row.get("block", block)) != str(block):
            continue
        heads = row["q_heads"]
        tiles = causal_tiles(row["n"], block) * heads * row.get("physical_density", 1.0)
        r = rates.setdefault(pattern, {"per_tile_ms": [], "index_ms": []})
        r["per_tile_ms"].append(row["time_ms"] / tiles)
        r["index_ms"].append(row.get("index_ms", 0.0) / heads)
    if not rates:
        raise ValueError(f"the benchmark has no rows for shape {shape!r} at block {block}: "
                         "pick a shape it measured (see its 'rows')")
    return {p: {k: statistics.median(v) for k, v in r.items()} for p, r in rates.items()}


def estimate_ms(rates: dict[str, dict[str, float]], pattern: str, tiles: float) -> float:
    """Estimated time (ms) of one query head: tiles x per-tile time + its share of the index build."""
    if pattern not in rates:
        raise ValueError(f"no rate for pattern {pattern!r}: the benchmark measured {sorted(rates)}")
    r = rates[pattern]
    return tiles * r["per_tile_ms"] + r["index_ms"]


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up (Triton compiles on the first call)
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def layer_tiles(parts: list[Any], n: int, device: torch.device | str = "cpu"):
    """One layer's per-head patterns (a `Stack`'s parts, one head each) -> (VSTiles, sink `[H]`,
    window `[H]`) for `workbench_kernels.prefill.sparse_prefill` (window NO_WINDOW where not A-shape)."""
    from workbench_kernels.index_ref import ashape_to_tiles, block_sparse_to_tiles, merge_tiles, vs_to_tiles
    from workbench_kernels.prefill import NO_WINDOW

    groups, sink, window = [], [], []
    for h, p in enumerate(parts):
        if isinstance(p, VerticalSlash):
            t = vs_to_tiles(p.columns[None].to(device), p.offsets[None].to(device), n)
            s, w = 0, NO_WINDOW
        elif isinstance(p, BlockSparse):
            t = block_sparse_to_tiles(p.block_index[None].to(device), n)
            s, w = 0, NO_WINDOW
        elif isinstance(p, (AShape, Dense)):
            s, w = (int(p.sink[0]), int(p.window[0])) if isinstance(p, AShape) else (0, n)
            t = ashape_to_tiles([s], [w], n, device=device)
        else:
            raise ValueError(f"head {h}: cannot run a {type(p).__name__} in the kernel")
        groups.append(([h], t))
        sink.append(s)
        window.append(w)
    return merge_tiles(groups, len(parts)), torch.tensor(sink), torch.tensor(window)


@torch.no_grad()
def time_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, index: Any,
               reps: int = 5) -> dict[str, Any]:
    """Time one layer (q `[Hq, N, D]`, k/v `[Hkv, N, D]`) under `index` (a `Stack` of one-head patterns).

    On a GPU: the Triton sparse kernel (bf16) vs dense causal SDPA, index -> tiles conversion timed
    apart. On the CPU: `metrics.sparse_attention` (the reference path) vs dense SDPA (fp32).
    Returns {"path", "device", "dense_ms", "sparse_ms", "tiles_ms", "speedup"}."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from workbench.analysis.metrics import sparse_attention

    hq, n, _ = q.shape
    gpu = torch.cuda.is_available()
    parts = getattr(index, "parts", [index])
    if gpu:
        from workbench_kernels.prefill import sparse_prefill

        dev, dt = "cuda", torch.bfloat16
        qd, kd, vd = (t[None].to(dev, dt).contiguous() for t in (q, k, v))
        tiles_ms = _median_ms(lambda: layer_tiles(parts, n, dev), reps)
        tiles, sink, window = layer_tiles(parts, n, dev)
        sparse_ms = _median_ms(lambda: sparse_prefill(qd, kd, vd, tiles, sink=sink, window=window, scale=scale), reps)
        path, device = "Triton sparse kernel (bf16)", torch.cuda.get_device_name()
    else:
        qd, kd, vd = (t[None].float() for t in (q, k, v))
        tiles_ms = 0.0
        sparse_ms = _median_ms(lambda: sparse_attention(q, k, v, scale, index), reps)
        path, device = "CPU reference path (metrics.sparse_attention: dense math under a mask, not a sparse kernel)", "cpu"
    dense_ms = _median_ms(lambda: sdpa(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=True), reps)
    return {"path": path, "device": device, "n": n, "heads": hq, "dense_ms": dense_ms, "sparse_ms": sparse_ms,
            "tiles_ms": tiles_ms, "speedup": dense_ms / sparse_ms if sparse_ms > 0 else float("nan")}
