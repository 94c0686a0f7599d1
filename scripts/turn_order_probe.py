"""Exploratory (H100 / H200): does the order of the Gluon kernel's turns hold Vertical-Slash (1000, 512) below
block-sparse per tile? (issue 25, kernels/NOTES.md session 43.)

On the bench's planted inputs (`kernels_prefill.planted_inputs`, Llama-3-8B 32/8/128, bf16) at each of --lengths:
per-head tiles of VS(1000, 512), VS(1000, 6096) (columns per head, as `VerticalSlash.layer_tiles` deploys them) and
block top-100, each run through `sparse_prefill`'s Gluon route in two turn orders, KV head first (`kv_major=True`:
every row block of one KV head's query heads before the next KV head's, most pieces first within) and longest first
(`kv_major=False`), timed in turn with dense SDPA (`timing.paired_ms`, --rounds). Efficiency per tile = the tiles'
physical density x dense ms / ms, as `bench kernels`. Both orders' outputs are compared (bf16, max abs diff).
  python3 scripts/turn_order_probe.py --lengths 65536,131072 --out assets/benchmarks/turn_order_probe_<commit>_<gpu>.json
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, dense_baseline, environment, planted_inputs
from workbench_kernels.index_build import block_index, vs_index, vs_tiles
from workbench_kernels.index_ref import selected_block_tiles, tile_area
from workbench_kernels.prefill import default_program, sparse_prefill

from workbench.core.io import write_json
from workbench.core.timing import paired_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--rounds", type=int, default=7, help="paired_ms rounds per fn")
    p.add_argument("--out", required=True)
    args = p.parse_args()
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
            area = tile_area(tiles, n).sum().item()
            fns = {order: (lambda kv=kv: sparse_prefill(q, k, v, tiles, scale=scale, kv_major=kv))
                   for order, kv in (("kv_head_first", True), ("longest_first", False))}
            outs = {order: fn()[0] for order, fn in fns.items()}
            gap = (outs["kv_head_first"].float() - outs["longest_first"].float()).abs().max().item()
            outs = None
            dense_ms, *ms = paired_ms([dense, *fns.values()], rounds=args.rounds)
            row = {"shape": args.shape, "n": n, "kernel": name, "program": default_program(q, tiles, None),
                   "physical_density": area / (hq * pairs), "dense_ms": dense_ms, "dense_form": form,
                   "max_abs_diff_between_orders": gap}
            for order, t in zip(fns, ms):
                row[f"{order}_ms"] = t
                row[f"{order}_ratio_to_dense_tflops"] = area / (hq * pairs) * dense_ms / t
            row["longest_first_vs_kv_head_first"] = row["kv_head_first_ms"] / row["longest_first_ms"]
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
