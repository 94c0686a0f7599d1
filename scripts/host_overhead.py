"""Exploratory (H200): the host's time per call of `sparse_prefill`'s routes beside the GPU's, at the bench's shapes,
and where the host time goes (cProfile of ten calls, top entries by cumulative time); `block_index` is the block
index alone (`block_tiles`).

    python3 scripts/host_overhead.py --shapes embedded,llama3-8b --lengths 8192,65536 --out host.json

Per (shape, length, route): `enqueue_ms` (calls issued back to back without a sync: the host's time per call while
the GPU runs behind), `synced_ms` (`time_ms`: the GPU idles at each call's start, so the host's time before the first
launch counts), `queued_ms` (`queued_ms`: the GPU's time per call)."""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import time

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import block_tiles, vs_index, vs_tiles
from workbench_kernels.index_ref import ashape_to_tiles
from workbench_kernels.prefill import sparse_prefill

from workbench.core.io import write_json
from workbench.core.timing import environment, queued_ms, time_ms


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="embedded,llama3-8b")
    p.add_argument("--lengths", default="8192,65536")
    p.add_argument("--out", default="host_overhead.json")
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
            for route, fn in calls.items():
                fn()
                row = {"shape": shape, "n": n, "route": route, "enqueue_ms": enqueue_ms(fn), "synced_ms": time_ms(fn),
                       "queued_ms": queued_ms(fn), "profile": profile(fn)}
                result["rows"].append(row)
                print(json.dumps({k_: (round(v_, 4) if isinstance(v_, float) else v_) for k_, v_ in row.items()
                                  if k_ != "profile"}), flush=True)
                print("\n".join(row["profile"]), flush=True)
            write_json(args.out, result)


if __name__ == "__main__":
    main()
