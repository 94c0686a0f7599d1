"""Exploratory (H200): the host's time per call of `sparse_prefill`'s routes beside the GPU's, at the bench's shapes,
and where the host time goes (cProfile of ten calls, top entries by cumulative time); `block_index` is the block
index alone (`block_tiles`).

    python3 scripts/host_overhead.py --shapes embedded,llama3-8b --lengths 8192,65536 --out host.json

Per (shape, length, route): `enqueue_ms` (calls issued back to back without a sync: the host's time per call while
the GPU runs behind), `synced_ms` (`time_ms`: the GPU idles at each call's start, so the host's time before the first
launch counts), `queued_ms` (`queued_ms`: the GPU's time per call).

`--layers`: also, per registered pattern kind, a layer whose heads all take it at `default_params(kind, n)`, as
`SparsePrefill` runs it (its index, then its kernel; 'index/KIND' the index alone, with `tile_density`, the share
of causal 64 x 64 tiles its kernel computes, and `gpu_kernels`, its top GPU kernels by time): where `enqueue_ms`
comes near `queued_ms` the layer makes the host wait for the GPU (a sync, or a copy from pageable memory), so the
GPU idles while the host prepares the next call (`drains`)."""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import time

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, one_kind_layer, planted_inputs
from workbench_kernels.index_build import block_tiles, vs_index, vs_tiles
from workbench_kernels.index_ref import ashape_to_tiles
from workbench_kernels.prefill import sparse_prefill

from workbench.core.io import write_json
from workbench.core.timing import environment, queued_ms, time_ms
from workbench.patterns.base import PATTERNS, default_params
from workbench.patterns.tile_select import tile_count
from workbench.prefill.sparse import SparsePrefill


def enqueue_ms(fn, reps: int = 20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    return host


def profile(fn, top: int = 24) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()][-top - 1:]


def layer_calls(shape: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict:
    """'layer/KIND' -> a call of a one-kind layer (every head KIND at its defaults) through `SparsePrefill`;
    'index/KIND' -> its index alone (`layer_index`)."""
    n, scale = q.shape[2], SHAPES[shape][2] ** -0.5
    calls = {}
    for kind in PATTERNS:
        model, config = one_kind_layer(shape, kind, default_params(kind, n))
        sp = SparsePrefill(None, model, config, min_length=0)
        calls[f"layer/{kind}"] = lambda sp=sp: sp.layer_kernel(0, sp.layer_index(0, q, k, scale, "triton"), q, k, v,
                                                                scale, "triton")
        calls[f"index/{kind}"] = lambda sp=sp: sp.layer_index(0, q, k, scale, "triton")
    return calls


def gpu_kernels(fn, top: int = 10) -> list[dict]:
    """The `top` GPU kernels of one call by their GPU time (torch.profiler over 5 calls): name, ms per call, launches."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:120], "ms": e.device_time_total / 5e3, "calls": e.count / 5} for e in rows[:top]]


def tile_density(index: tuple, n: int) -> float:
    """Share of the causal 64 x 64 tiles a layer's kernel computes (`layer_index`'s tiles, every head)."""
    tiles = index[0]
    m = -(-n // tiles.block)
    return float(tile_count(tiles).double().mean()) / (m * (m + 1) / 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="embedded,llama3-8b")
    p.add_argument("--lengths", default="8192,65536")
    p.add_argument("--out", default="host_overhead.json")
    p.add_argument("--layers", action="store_true", help="also a one-kind layer per pattern kind (SparsePrefill)")
    p.add_argument("--routes", default="", help="comma-separated: time only the routes that contain one of these")
    args = p.parse_args()
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    for shape in args.shapes.split(","):
        hq, hkv, d, theta = SHAPES[shape]
        for n in [int(x) for x in args.lengths.split(",")]:
            q, k, v = planted_inputs(hq, hkv, d, n, theta)
            scale = 1 / math.sqrt(d)
            cols, offs = vs_index(q, k, scale, 1000, min(6096, n))
            sink, window = [128] * hq, [4096] * hq
            routes = {"block": (block_tiles(q, k, 100), {}),
                      "vs_route": (vs_tiles(cols, offs, n, head_columns=True), {}),
                      "ashape_lists": (ashape_to_tiles(sink, window, n, 1, 64, "cuda"), {"sink": sink, "window": window}),
                      "ashape_device": (ashape_to_tiles(sink, window, n, 1, 64, "cuda"),
                                        {"sink": torch.tensor(sink, device="cuda"),
                                         "window": torch.tensor(window, device="cuda")})}
            calls = {route: (lambda tiles=tiles, kw=kw: sparse_prefill(q, k, v, tiles, scale=scale, **kw))
                     for route, (tiles, kw) in routes.items()}
            calls["block_index"] = lambda: block_tiles(q, k, 100)
            if args.layers:
                calls.update(layer_calls(shape, q, k, v))
            keep = [r for r in args.routes.split(",") if r]
            for route, fn in calls.items():
                if keep and not any(r in route for r in keep):
                    continue
                for _ in range(3):  # compiles; a layer's index graph is captured at its second call
                    fn()
                row = {"shape": shape, "n": n, "route": route, "enqueue_ms": enqueue_ms(fn), "synced_ms": time_ms(fn),
                       "queued_ms": queued_ms(fn), "profile": profile(fn)}
                row["drains"] = row["enqueue_ms"] > 0.8 * row["queued_ms"]
                if route.startswith("index/"):
                    row["tile_density"] = tile_density(fn(), n)
                    row["gpu_kernels"] = gpu_kernels(fn)
                result["rows"].append(row)
                print(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                                  if k_ != "profile"}), flush=True)
                print("\n".join(row["profile"]), flush=True)
            write_json(args.out, result)


if __name__ == "__main__":
    main()
