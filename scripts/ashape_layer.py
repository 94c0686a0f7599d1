"""Exploratory (GPU): a layer of A-shape heads only, as `SparsePrefill` runs it, beside dense SDPA (random weights,
the bench's planted q / k / v; no model). Each length times, in turn over five rounds (`paired_ms`), dense causal
SDPA, the layer's default path (`layer_kernel`: A-shape's own kernel where it takes the layer) and the one launch
over the merged tiles (`num_stages` set, which keeps the loop); then the two paths alone, in turn over --rounds
rounds.

    python3 scripts/ashape_layer.py --shape llama3-8b --lengths 65536,131072 --out ashape_layer.json
"""
from __future__ import annotations

import argparse
import json

from workbench_benchmarks.kernels_prefill import SHAPES, dense_baseline, one_kind_layer, planted_inputs
from workbench_kernels.index_ref import tile_area

from workbench.core.io import write_json
from workbench.core.timing import environment, paired_ms
from workbench.prefill.sparse import SparsePrefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=9, help="rounds of the two paths timed in turn without dense")
    p.add_argument("--out", default="ashape_layer.json")
    args = p.parse_args()
    hq, hkv, d, theta = SHAPES[args.shape]
    shape, config = one_kind_layer(args.shape, "ashape", {"sink": args.sink, "window": args.window})
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v = planted_inputs(hq, hkv, d, n, theta)
        scale = d ** -0.5
        runs = {name: SparsePrefill(None, shape, config, min_length=0, num_stages=stages)
                for name, stages in (("default", None), ("one_launch", 3))}
        index = runs["default"].layer_index(0, q, k, scale, "triton")
        calls = {name: (lambda sp=sp: sp.layer_kernel(0, index, q, k, v, scale, "triton")) for name, sp in runs.items()}
        dense, dense_form, _ = dense_baseline(q, k, v, *(x.repeat_interleave(hq // hkv, 1) for x in (k, v)))
        dense_ms, *ms = paired_ms([dense, *calls.values()])
        alone = paired_ms(list(calls.values()), rounds=args.rounds)  # the two paths in turn, without dense between
        density = tile_area(index[0], n).sum().item() / (hq * n * (n + 1) / 2)  # the 64-key tiles', both paths
        row = {"n": n, "dense_form": dense_form, "dense_ms": dense_ms, "physical_density": density,
               **{f"{name}_ms": t for name, t in zip(calls, ms)},
               **{f"{name}_ratio_to_dense": dense_ms * density / t for name, t in zip(calls, ms)},
               **{f"{name}_alone_ms": t for name, t in zip(calls, alone)},
               "max_abs_diff": (calls["default"]() - calls["one_launch"]()).abs().max().item()}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
