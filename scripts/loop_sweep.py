"""Exploratory (H200): the Triton-language loop's knobs on one pattern's tiles, each timed beside dense SDPA in one
process (ratio of effective TFLOP/s over the tiles' area to SDPA's; the bench's planted inputs and shapes).

    python3 scripts/loop_sweep.py --shape embedded --pattern ashape --lengths 65536,131072 --out sweep.json

Patterns: ashape (sink --sink, window --window on every head, per-head tiles: `sparse_prefill`'s A-shape at
head_dim 64, where an odd group rules out the Gluon kernel's paired heads) and block (top --topk per head).
Grid: num_warps x num_stages x (split, tma), not persistent; a combination that does not compile is recorded."""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import block_tiles
from workbench_kernels.index_ref import ashape_to_tiles, tile_area
from workbench_kernels.prefill import sparse_prefill

from workbench.core.io import write_json
from workbench.core.timing import environment, time_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="embedded")
    p.add_argument("--pattern", default="ashape", choices=("ashape", "block"))
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--out", default="loop_sweep.json")
    args = p.parse_args()
    hq, hkv, d, theta = SHAPES[args.shape]
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v = planted_inputs(hq, hkv, d, n, theta)
        kx, vx = (x.repeat_interleave(hq // hkv, 1) for x in (k, v))
        dense_ms = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True))
        dense_tf = 4 * d * hq * n * (n + 1) / 2 / dense_ms / 1e9
        kw = {}
        if args.pattern == "ashape":
            tiles = ashape_to_tiles([args.sink] * hq, [args.window] * hq, n, 1, 64, "cuda")
            kw = {"sink": torch.full((hq,), args.sink), "window": torch.full((hq,), args.window)}
        else:
            tiles = block_tiles(q, k, args.topk)
        area = tile_area(tiles, n).sum().item()
        base = {"n": n, "dense_ms": dense_ms}
        for warps, stages, (split, tma) in itertools.product((4, 8), (2, 3, 4),
                                                             ((False, False), (True, False), (True, True))):
            knobs = {"num_warps": warps, "num_stages": stages, "split": split, "tma": tma, "persistent": False,
                     "warp_specialize": False}
            try:
                ms = time_ms(lambda: sparse_prefill(q, k, v, tiles, scale=1 / math.sqrt(d), **knobs, **kw))
                row = {**base, **knobs, "ms": ms, "ratio_to_dense": 4 * d * area / ms / 1e9 / dense_tf}
            except Exception as e:  # noqa: BLE001 - record what does not compile or fit
                row = {**base, **knobs, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        default_ms = time_ms(lambda: sparse_prefill(q, k, v, tiles, scale=1 / math.sqrt(d), **kw))
        result["rows"].append({**base, "default": True, "ms": default_ms,
                               "ratio_to_dense": 4 * d * area / default_ms / 1e9 / dense_tf})
        print(json.dumps(result["rows"][-1]), flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
