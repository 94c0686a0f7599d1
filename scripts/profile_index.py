"""Exploratory: per-kernel device time of the VS index (its scores, then the top-k of columns and offsets), the VS
index -> tiles conversion and the block index (`block_tiles` beside the table then `selected_block_tiles`; the pooling
alone) at the bench's planted inputs, H200.

    python3 scripts/profile_index.py SHAPES OUT.json [LENGTHS]     (LENGTHS default 65536,131072)"""
import json
import math
import sys
from collections import defaultdict

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import (
    block_index,
    block_tiles,
    pool_blocks,
    pooled_scores,
    vs_index,
    vs_scores,
    vs_tiles,
)
from workbench_kernels.index_ref import selected_block_tiles
from workbench_kernels.topk import top_positions

from workbench.core.timing import environment, time_ms

out = {"environment": environment(), "results": {}}


def prof(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    agg = defaultdict(float)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:70]] += e.device_time / reps
    wall = time_ms(fn, cuda=True, warmup=1, min_reps=9, max_reps=9)
    return {"wall_ms": wall, "kernel_us_total": sum(agg.values()),
            "kernels_us": dict(sorted(agg.items(), key=lambda x: -x[1]))}


for shape in sys.argv[1].split(","):
    hq, hkv, d, theta = SHAPES[shape]
    for n in [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "65536,131072").split(",")]:
        q, k, v = planted_inputs(hq, hkv, d, n, theta, dev="cuda", dtype=torch.bfloat16)
        cols, offs = vs_index(q, k, 1 / math.sqrt(d), 1000, 6096)
        col, diag = vs_scores(q, k, 1 / math.sqrt(d))
        r = {"vs_index": prof(lambda: vs_index(q, k, 1 / math.sqrt(d), 1000, 6096)),
             "vs_scores": prof(lambda: vs_scores(q, k, 1 / math.sqrt(d))),
             "top_columns": prof(lambda: top_positions(col, 30, 1000)),
             "top_offsets": prof(lambda: top_positions(diag, 100, 6096)),
             "vs_tiles": prof(lambda: vs_tiles(cols, offs, n)),
             "block_tiles": prof(lambda: block_tiles(q, k, 100)),  # what BlockSparse.layer_tiles runs
             "block_index": prof(lambda: selected_block_tiles(block_index(q, k, 100))),
             "pooled_scores": prof(lambda: pooled_scores(q, k)),
             "pool_q": prof(lambda: pool_blocks(q))}
        out["results"][f"{shape}/{n}"] = r
        print(shape, n, json.dumps({a: {"wall_ms": b["wall_ms"], "kern": b["kernel_us_total"],
                                        "top": list(b["kernels_us"].items())[:8]} for a, b in r.items()}), flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
