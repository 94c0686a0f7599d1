"""Latency of sparse attention: estimated from a committed GPU benchmark, or timed live on one layer.

`tile_rates(bench, shape)` turns a `workbench bench kernels` JSON (or a `kernels_prefill --minference` comparison's,
whose rows also time `vs_group`'s kernel) into {pattern: {"per_tile_ms", "index_ms"}}
per query head (median over the measured lengths), the table
`search.choose(latency=...)` takes; `estimate_ms` applies it to a head's 64x64 tile count. Given a model's
shape, `match_shape` picks the measured shape to read (the model's own, else the same head_dim, else the
nearest) and says which. The package ships the rows it reads, one table per GPU (workbench/data/latency: `rate_table`
of the committed runs assets/benchmarks/kernels_e1b5f27_h200.json (`BENCH`, the default) and kernels_a2c22cb_h100.json),
so the estimate works from any folder; `bench_path` picks the table of this machine's GPU where one is shipped.
`time_model_layer` times one of the model's own captured layers under its heads from a HeadConfig, as
the deployed prefill runs it (online index + Triton kernel on a GPU; on the CPU the PyTorch reference
path, dense math under a mask that does not get faster with sparsity, labelled as such) against dense
SDPA on the same q/k/v. Notebook 05 and the dashboard's Latency tab both call it.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch

from workbench.core.io import read_json
from workbench.core.timing import gpu_tag, time_ms
from workbench.data import LATENCY_BENCH, latency_gpus, shipped_latency
from workbench.patterns import PATTERNS, Stack, causal_tiles
from workbench.patterns.base import NO_WINDOW

BENCH = LATENCY_BENCH
_ROW_FIELDS = ("shape", "q_heads", "kv_heads", "head_dim", "n", "kernel", "block", "route", "time_ms", "index_ms",
               "physical_density")


def bench_path(choice: str | Path | None = None) -> Path:
    """The kernel benchmark an estimate reads. `choice`: a `workbench bench kernels` JSON (a path ending .json, or
    a file), the GPU of a shipped table ("h100", "h200"), or None: the table shipped for this machine's GPU where
    there is one, else `BENCH` (the H200's)."""
    if choice is None:
        return shipped_latency(gpu_tag()) or BENCH
    path = Path(choice)
    if path.suffix == ".json" or path.exists():
        return path
    shipped = shipped_latency(str(choice))
    if shipped is None:
        raise ValueError(f"latency benchmark {str(choice)!r} is neither a JSON file nor a GPU whose kernel table is "
                         f"shipped ({', '.join(latency_gpus())}): give a `workbench bench kernels` JSON or one of "
                         "those names")
    return shipped


def load_bench(path: str | Path = BENCH) -> dict[str, Any]:
    """A kernel benchmark JSON (`workbench bench kernels`, or the shipped `rate_table` of one)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"kernel benchmark {path} does not exist: run `workbench bench kernels --out {path}` "
                                "on a GPU, or leave the benchmark out to use the one the package ships")
    bench = read_json(path, "kernel benchmark")
    if not isinstance(bench, dict) or not isinstance(bench.get("rows"), list):
        raise ValueError(f"kernel benchmark {path} has no list of rows: give a `workbench bench kernels` JSON")
    return bench


def rate_table(bench: dict[str, Any], source: str) -> dict[str, Any]:
    """The part of a kernel benchmark that `tile_rates` and `match_shape` read: its environment and the
    pattern kernels' rows (their timing fields only), with `source` naming the full result. The package
    ships one as `BENCH`: `write_json(BENCH, rate_table(load_bench(FULL), FULL))`."""
    rows = [{k: row[k] for k in _ROW_FIELDS if k in row} for _, row in _usable_rows(bench, None)]
    return {"environment": bench.get("environment", {}), "source": source, "rows": rows}


def _kernel_rows(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark's rows as `workbench bench kernels` writes them (kernel, block, time_ms, ...). Rows of the
    MInference comparison (`kernels_prefill --minference`: "pattern", block "64x64", the dense time of the
    shape and length in each row) are turned into that form, with one dense_sdpa row per shape and length."""
    rows, dense = [], {}
    for row in bench.get("rows", []):
        if "kernel" in row or "pattern" not in row:
            rows.append(row)
            continue
        a, _, b = str(row.get("block", "64")).partition("x")
        rows.append({**row, "kernel": row["pattern"], "block": a if b in ("", a) else row["block"],
                     "index_ms": row.get("index_ms") or 0.0})
        if row.get("dense_ms") is not None:
            dense.setdefault((row["shape"], row["n"]), {k: row[k] for k in ("shape", "q_heads", "kv_heads", "head_dim", "n")}
                             | {"kernel": "dense_sdpa", "time_ms": row["dense_ms"]})
    return rows + list(dense.values())


def _usable_rows(bench: dict[str, Any], block: int | None):
    """(pattern, row) for every benchmark row of a kernel a pattern runs on, at `block` (None: any)."""
    kernels = {cls.bench_kernel: kind for kind, cls in PATTERNS.items() if cls.bench_kernel}
    for row in _kernel_rows(bench):
        pattern = kernels.get(str(row.get("kernel")).split("@")[0])  # "vertical_slash@512": a second budget
        if pattern is not None and (block is None or str(row.get("block", block)) == str(block)):
            yield pattern, row


def bench_shapes(bench: dict[str, Any], block: int = 64) -> dict[str, tuple[int, int, int]]:
    """{shape name: (query heads, KV heads, head_dim)} of every shape the benchmark timed at `block`."""
    return {row["shape"]: (row["q_heads"], row["kv_heads"], row["head_dim"]) for _, row in _usable_rows(bench, block)}


def match_shape(bench: dict[str, Any], model: Any, block: int = 64) -> tuple[str, str]:
    """The benchmark shape to estimate `model` (a `ModelShape`: n_heads, n_kv_heads, head_dim) from, and a
    sentence naming it: the model's own (heads, KV heads, head_dim) if measured, else the shape with the
    same head_dim and the nearest head counts, else the nearest head_dim (`tile_rates` then scales the
    per-tile times by head_dim)."""
    shapes = bench_shapes(bench, block)
    if not shapes:
        raise ValueError(f"the benchmark has no kernel rows at block {block}: run `workbench bench prefill` on a GPU")
    own = (model.n_heads, model.n_kv_heads, model.head_dim)

    def distance(name: str) -> tuple[float, ...]:
        hq, hkv, d = shapes[name]
        return (abs(math.log2(d / own[2])), abs(math.log2(hq / own[0])) + abs(math.log2(hkv / own[1])))

    name = min(sorted(shapes), key=distance)
    hq, hkv, d = shapes[name]
    what = f"shape {name!r} ({hq} q / {hkv} kv heads, head_dim {d})"
    if (hq, hkv, d) == own:
        return name, f"{what}: this model's attention shape"
    if d == own[2]:
        return name, f"{what}: nearest to this model's {own[0]} / {own[1]} heads, same head_dim (per-query-head rates)"
    return name, (f"{what}: nearest head_dim to this model's {own[2]} (none measured at {own[2]}); "
                  f"per-tile times scaled by {own[2]}/{d}")


def tile_rates(bench: dict[str, Any], shape: str | Any = "embedded", block: int = 64) -> dict[str, dict[str, float]]:
    """{pattern: {"per_tile_ms": ms per 64x64 tile of one query head, "index_ms": index build per query
    head}} from the benchmark rows of `shape` at `block` (median over lengths). `shape`: a shape name the
    benchmark measured, or a model's `ModelShape`, whose rows `match_shape` picks (per-tile times scaled
    by head_dim when the picked shape's differs: a tile's FLOPs and bytes grow with it)."""
    scale = 1.0
    if not isinstance(shape, str):
        model, (shape, _) = shape, match_shape(bench, shape, block)
        scale = model.head_dim / bench_shapes(bench, block)[shape][2]
    rates: dict[str, dict[str, list[float]]] = {}
    for pattern, row in _usable_rows(bench, block):
        if row.get("shape") != shape:
            continue
        heads = row["q_heads"]
        tiles = causal_tiles(row["n"], block) * heads * row.get("physical_density", 1.0)
        r = rates.setdefault(pattern, {"per_tile_ms": [], "index_ms": []})
        r["per_tile_ms"].append(row["time_ms"] / tiles * scale)
        r["index_ms"].append((row.get("index_ms") or 0.0) / heads)
    if not rates:
        raise ValueError(f"the benchmark has no rows for shape {shape!r} at block {block}: "
                         f"pick a shape it measured ({sorted(bench_shapes(bench, block))}) or pass the model's shape")
    return {p: {k: statistics.median(v) for k, v in r.items()} for p, r in rates.items()}


def estimate_ms(rates: dict[str, dict[str, float]], pattern: str, tiles: float) -> float:
    """Estimated time (ms) of one query head: tiles x per-tile time + its share of the index build."""
    if pattern not in rates:
        raise ValueError(f"no rate for pattern {pattern!r}: the benchmark measured {sorted(rates)}")
    r = rates[pattern]
    return tiles * r["per_tile_ms"] + r["index_ms"]


def _median_ms(fn, reps: int) -> float:
    return time_ms(fn, min_reps=reps, max_reps=reps)  # one warm-up call first (Triton compiles on it)


def layer_tiles(parts: list[Any], n: int, device: torch.device | str = "cpu"):
    """One layer's per-head patterns (a `Stack`'s parts) -> (VSTiles, sink `[H]`, window `[H]`) for
    `workbench_kernels.prefill.sparse_prefill`: the stack's `to_tiles` and `token_band` (window
    NO_WINDOW where a head has no band)."""
    stack = Stack(parts)
    h = stack.n_heads
    sink, window = stack.token_band() or (torch.zeros(h, dtype=torch.long), torch.full((h,), NO_WINDOW))
    return stack.to_tiles(n).to(device), sink, window


@torch.no_grad()
def time_model_layer(cap: Any, config: Any, layer: int, *, device: str | torch.device | None = None,
                     dtype: torch.dtype | None = None, reps: int = 5, backend: str = "auto",
                     graph_index: bool | None = None) -> dict[str, Any]:
    """Time one of the model's own layers the way the deployed prefill runs it: the captured q/k/v of
    `layer` (a `Capture`), that layer's heads from `config` (a HeadConfig), the online index (T_index:
    `SparsePrefill.layer_index`) and the sparse attention (T_sparse: `layer_kernel`), beside dense causal
    SDPA on the same q/k/v. device: where to time (default cuda when available: a CPU capture is copied
    there); dtype: default bf16 on a GPU, the capture's on the CPU. On a GPU the backend is the Triton
    path; on the CPU the PyTorch reference (dense math under a mask: not a speed-up), labelled as such.
    graph_index: `SparsePrefill`'s (None: the deployed default, the index replayed from a CUDA graph from its second
    call at this length where that measured faster, so the median of `reps` >= 3 times is the path kept; False:
    eager).
    Returns {"path", "device", "dtype", "layer", "n", "heads", "patterns", "index_ms", "sparse_ms",
    "dense_ms", "speedup"}; a layer whose heads are all dense runs dense SDPA as the prefill does."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from workbench.core.device import resolve_device
    from workbench.prefill.sparse import SparsePrefill

    dev = resolve_device(device)
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else cap.q.dtype)
    q, k, v = (t[None].to(dev, dt).contiguous() for t in cap.layer_qkv(layer))
    sp = SparsePrefill(None, cap.shape, config, min_length=0, backend=backend, graph_index=graph_index)
    be = sp.resolve_backend(q)
    plan = sp.plans[layer]
    patterns = {**dict.fromkeys(PATTERNS, 0), **{k: len(h) for k, h in plan.heads.items()}}
    dense_ms = _median_ms(lambda: sdpa(q, k, v, is_causal=True, scale=cap.scale, enable_gqa=True), reps)
    if plan.all_dense:
        index_ms, sparse_ms, path = 0.0, dense_ms, "all heads dense: dense SDPA, as the prefill runs it"
    else:
        index_ms = _median_ms(lambda: sp.layer_index(layer, q, k, cap.scale, be), reps)
        index = sp.layer_index(layer, q, k, cap.scale, be)
        sparse_ms = _median_ms(lambda: sp.layer_kernel(layer, index, q, k, v, cap.scale, be), reps)
        path = {"triton": "Triton index + Triton sparse kernel (the deployed path)",
                "torch": "PyTorch reference path (dense math under the tiles' mask: not the kernel, no speed-up)",
                }.get(be, be)
    return {"path": path, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": str(dt).removeprefix("torch."), "layer": layer, "n": cap.n, "heads": q.shape[1],
            "patterns": patterns, "index_ms": index_ms, "sparse_ms": sparse_ms, "dense_ms": dense_ms,
            "speedup": dense_ms / (index_ms + sparse_ms) if index_ms + sparse_ms > 0 else float("nan")}
