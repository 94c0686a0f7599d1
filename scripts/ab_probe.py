"""Exploratory (H100 / H200): this tree's `sparse_prefill` against another commit's, side by side on the same tiles.

The baseline is a copy of another commit's `kernels/` folder, imported as its own package:
  mkdir -p /tmp/base && git archive <commit> kernels | tar -x -C /tmp/base
  python3 scripts/ab_probe.py --baseline /tmp/base/kernels --out assets/benchmarks/ab_probe_<commit>_<gpu>.json
On the bench's planted inputs (`kernels_prefill.planted_inputs`, --shape, bf16) at each of --lengths: per-head tiles of
VS(1000, 512), VS(1000, 6096) (columns per head, as `VerticalSlash.layer_tiles` deploys them) and block top-100, each
through both trees' `sparse_prefill` default route, timed in turn with dense SDPA (`timing.paired_ms`, --rounds).
Efficiency per tile = the tiles' physical density x dense ms / ms, as `bench kernels`; the outputs' max abs
difference is recorded (bf16).
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="a copy of another commit's kernels/ folder")
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=7, help="paired_ms rounds per fn")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    base = load_baseline(args.baseline)
    hq, hkv, d, theta = SHAPES[args.shape]
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    t0 = time.time()
    for n in map(int, args.lengths.split(",")):
        q, k, v = planted_inputs(hq, hkv, d, n, theta)
        scale = 1.0 / math.sqrt(d)
        kx, vx = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        dense, form, _ = dense_baseline(q, k, v, kx, vx)
        if form != "repeat_kv":
            kx = vx = None
        pairs = n * (n + 1) // 2
        kinds = {}
        for slash in (512, 6096):
            cols, offs = vs_index(q, k, scale, 1000, slash)
            kinds[f"vertical_slash@{slash}"] = vs_tiles(cols, offs, n, 64, 0, head_columns=True)
        kinds["block_sparse"] = selected_block_tiles(block_index(q, k, 100))
        for name, tiles in kinds.items():
            density = tile_area(tiles, n).sum().item() / (hq * pairs)
            fns = {"this": lambda: sparse_prefill(q, k, v, tiles, scale=scale),
                   "baseline": lambda: base.sparse_prefill(q, k, v, tiles, scale=scale)}
            outs = {name_: fn()[0] for name_, fn in fns.items()}
            gap = (outs["this"].float() - outs["baseline"].float()).abs().max().item()
            outs = None
            dense_ms, *ms = paired_ms([dense, *fns.values()], rounds=args.rounds)
            row = {"shape": args.shape, "n": n, "kernel": name, "program": default_program(q, tiles, None),
                   "physical_density": density, "dense_ms": dense_ms, "dense_form": form, "max_abs_diff": gap}
            for which, t in zip(fns, ms):
                row[f"{which}_ms"] = t
                row[f"{which}_ratio_to_dense_tflops"] = density * dense_ms / t
            row["this_vs_baseline"] = row["baseline_ms"] / row["this_ms"]
            result["rows"].append(row)
            print({k_: (round(x, 4) if isinstance(x, float) else x) for k_, x in row.items()}, flush=True)
            write_json(args.out, result)
        q = k = v = kx = vx = dense = None
        torch.cuda.empty_cache()
    result["elapsed_s"] = time.time() - t0
    write_json(args.out, result)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
