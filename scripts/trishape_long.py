"""Exploratory (GPU): a layer of Tri-shape heads at long lengths, as `SparsePrefill` runs it (random weights,
random q / k / v at the shape; no model). Its question rows are dense rows outside the tile lists
(`VSTiles.dense_from`), so the lists stay as wide as the band at any length. Per length: the layer (A-shape's Gluon
kernel over the band where it takes the layer, then the dense rows: `TriShape.layer_attention`) beside the one
launch of the loop over its tiles, an A-shape layer of the same band (its lists alone) and the dense rows alone
(`last_rows_attention`), timed in turn (`paired_ms`); dense causal SDPA where `--dense-up-to` allows (one call at
1M takes seconds); the width of the lists; and checks: the rows before the question against the A-shape layer
(the same kernel where both take the Gluon route: equal), the question rows against SDPA under an explicit mask,
the whole layer against the loop's launch (another kernel: bf16 rounding).

    python3 scripts/trishape_long.py --lengths 131072,262144,1048576 --out trishape_long.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, one_kind_layer
from workbench_kernels.prefill import sparse_prefill
from workbench_kernels.prefill_ref import last_rows_attention

from workbench.core.io import write_json
from workbench.core.timing import environment, paired_ms, time_ms
from workbench.prefill.sparse import SparsePrefill


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def one_length(args: argparse.Namespace, n: int) -> dict:
    hq, hkv, d, _ = SHAPES[args.shape]
    scale = d ** -0.5
    band = {"sink": args.sink, "window": args.window}
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hkv, hkv))
    layers = {}
    for kind, params in (("trishape", {**band, "last": args.last}), ("ashape", band)):
        shape, config = one_kind_layer(args.shape, kind, params)
        layers[kind] = SparsePrefill(None, shape, config, min_length=0)
    t0 = time.perf_counter()
    index = layers["trishape"].layer_index(0, q, k, scale, "triton")  # first call: builds and caches the tiles
    build_s = time.perf_counter() - t0
    tiles = index[0]
    calls = {kind: (lambda sp=sp: sp.layer_kernel(0, sp.layer_index(0, q, k, scale, "triton"), q, k, v, scale,
                                                   "triton")) for kind, sp in layers.items()}
    calls["trishape_loop"] = lambda: sparse_prefill(q, k, v, tiles, sink=index[1], window=index[2], scale=scale)[0]
    calls["dense_rows"] = lambda: last_rows_attention(q, k, v, args.last, scale)
    out = {kind: fn() for kind, fn in calls.items()}
    first = n - args.last
    mask = torch.arange(n, device="cuda")[None, :] <= torch.arange(first, n, device="cuda")[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, first:], k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=True)
    tri = out["trishape"]
    row = {"shape": args.shape, "n": n, "tiles_build_s": build_s, "list_width": tiles.block_offset.shape[-1],
           "column_width": tiles.column_index.shape[-1], "dense_rows": tiles.dense_rows,
           "band_rows_rel_err_vs_ashape": rel(tri[:, :, :first], out["ashape"][:, :, :first]),
           "question_rel_err_vs_sdpa": rel(tri[:, :, first:], ref),
           "rel_err_vs_loop": rel(tri, out["trishape_loop"]),
           **dict(zip(("trishape_ms", "ashape_ms", "trishape_loop_ms", "dense_rows_ms"),
                      paired_ms(list(calls.values()))))}
    if n <= args.dense_up_to:
        row["dense_sdpa_ms"] = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True))
        row["speedup_vs_dense"] = row["dense_sdpa_ms"] / row["trishape_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="131072,262144,1048576")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--last", type=int, default=64)
    p.add_argument("--dense-up-to", type=int, default=262144, help="time dense SDPA up to this length")
    p.add_argument("--out", default="trishape_long.json")
    args = p.parse_args()
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    for n in [int(x) for x in args.lengths.split(",")]:
        row = one_length(args, n)
        result["rows"].append(row)
        print(json.dumps({k_: (round(v_, 5) if isinstance(v_, float) else v_) for k_, v_ in row.items()}), flush=True)
        write_json(args.out, result)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
