"""Exploratory (H100 / H200): two ways of running `sparse_prefill` on the same tiles, side by side in one run.

  --baseline DIR  this tree's `sparse_prefill` ("this") against another commit's ("baseline"), DIR a copy of that
                  commit's kernels/ folder, imported as its own package:
                    mkdir -p /tmp/base && git archive <commit> kernels | tar -x -C /tmp/base
                    python3 scripts/ab_probe.py --baseline /tmp/base/kernels --out assets/benchmarks/ab_probe_<commit>_<gpu>.json
  --orders        the Gluon route's turns longest first (`kv_major=False`) against KV head first (`kv_major=True`:
                  every row block of one KV head's query heads before the next KV head's)
On the bench's planted inputs (`kernels_prefill.planted_inputs`, --shape, bf16) at each of --lengths: per-head tiles of
VS(1000, 512), VS(1000, 6096) (columns per head, as `VerticalSlash.layer_tiles` deploys them) and block top-100, both
ways timed in turn with dense SDPA (`timing.paired_ms`, --rounds). Efficiency per tile = the tiles' physical density x
dense ms / ms, as `bench kernels`; `<a>_vs_<b>` = b's ms / a's (a's speed over b's); the outputs' max abs difference
is recorded (bf16).
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, dense_baseline, environment, planted_inputs
from workbench_kernels.index_build import block_index, vs_index, vs_tiles
from workbench_kernels.index_ref import selected_block_tiles, tile_area
from workbench_kernels.prefill import default_program, sparse_prefill

from workbench.core.io import write_json
from workbench.core.timing import paired_ms


def load_baseline(folder: str):
    """The `prefill` module of the kernels/ copy in `folder`, imported as the package `workbench_kernels_base` (a
    namespace package, as kernels/ is)."""
    link = Path(tempfile.mkdtemp()) / "workbench_kernels_base"
    link.symlink_to(Path(folder).resolve())
    sys.path.insert(0, str(link.parent))
    return importlib.import_module("workbench_kernels_base.prefill")


def probe_layer(shape: str, n: int):
    """The probe's layer at `shape`, n tokens: ((q, k, v, scale) of the bench's planted inputs, bf16 on the GPU;
    (dense SDPA's fn, its GQA form: `dense_baseline`); {name: per-head tiles} of VS(1000, 512), VS(1000, 6096) with
    columns per head and block top-100)."""
    hq, hkv, d, theta = SHAPES[shape]
    q, k, v = planted_inputs(hq, hkv, d, n, theta)
    scale = 1.0 / math.sqrt(d)
    kx, vx = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    dense, form, _ = dense_baseline(q, k, v, kx, vx)  # the fn holds kx / vx only where it uses them
    kinds = {f"vertical_slash@{slash}": vs_tiles(*vs_index(q, k, scale, 1000, slash), n, 64, 0, head_columns=True)
             for slash in (512, 6096)}
    kinds["block_sparse"] = selected_block_tiles(block_index(q, k, 100))
    return (q, k, v, scale), (dense, form), kinds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--baseline", help="a copy of another commit's kernels/ folder")
    way.add_argument("--orders", action="store_true", help="longest first against KV head first")
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=7, help="paired_ms rounds per fn")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.orders:
        ways = {"longest_first": lambda q, k, v, tiles, scale: sparse_prefill(q, k, v, tiles, scale=scale, kv_major=False),
                "kv_head_first": lambda q, k, v, tiles, scale: sparse_prefill(q, k, v, tiles, scale=scale, kv_major=True)}
    else:
        base = load_baseline(args.baseline)
        ways = {"this": lambda q, k, v, tiles, scale: sparse_prefill(q, k, v, tiles, scale=scale),
                "baseline": lambda q, k, v, tiles, scale: base.sparse_prefill(q, k, v, tiles, scale=scale)}
    a, b = ways  # the two labels
    hq = SHAPES[args.shape][0]
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    t0 = time.time()
    for n in map(int, args.lengths.split(",")):
        (q, k, v, scale), (dense, form), kinds = probe_layer(args.shape, n)
        for name, tiles in kinds.items():
            density = tile_area(tiles, n).sum().item() / (hq * n * (n + 1) // 2)
            fns = {label: (lambda run=run: run(q, k, v, tiles, scale)) for label, run in ways.items()}
            gap = (fns[a]()[0].float() - fns[b]()[0].float()).abs().max().item()
            dense_ms, *ms = paired_ms([dense, *fns.values()], rounds=args.rounds)
            row = {"shape": args.shape, "n": n, "kernel": name, "program": default_program(q, tiles, None),
                   "physical_density": density, "dense_ms": dense_ms, "dense_form": form, "max_abs_diff": gap}
            for label, t in zip(fns, ms):
                row[f"{label}_ms"] = t
                row[f"{label}_ratio_to_dense_tflops"] = density * dense_ms / t
            row[f"{a}_vs_{b}"] = row[f"{b}_ms"] / row[f"{a}_ms"]
            result["rows"].append(row)
            print({k_: (round(x, 4) if isinstance(x, float) else x) for k_, x in row.items()}, flush=True)
            write_json(args.out, result)
        q = k = v = dense = kinds = None
        torch.cuda.empty_cache()
    result["elapsed_s"] = time.time() - t0
    write_json(args.out, result)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
