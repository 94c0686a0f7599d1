"""Exploratory (issue 25, CPU or GPU): what more query rows on each loaded K/V tile would cost in computed area, on a
real model's own selections (kernels/NOTES.md, session 29: the per-head loop at head_dim 256 reads 64 rows per K/V
load and is L2-bound).

    python scripts/rows_per_load.py --model gemma-3-270m --length 16384 --out rows_per_load_gemma16k_cpu.json

For the layers the model leaves free (Gemma-3: its global layers), from a passkey prompt's post-RoPE q / k, each
head's own Vertical-Slash (--vertical, --slash; the online proxy, default `VerticalSlash.at_budget(--budget)`) and
block top-k (--topk; default --budget / 64) index, tiled three ways:
  rows64   the deployed 64-row tiles (the loop's computed area, `tile_area`)
  rows128  128-row tiles over 64-key pieces of one head: each K/V piece serves 128 rows (lead 1)
  union    per 64-row block and KV head, the union of its G query heads' keys, computed for all G heads: one load for
           G x 64 rows, each head masked to its own keys (lead 2). Counted in keys against the per-head keys (a
           lower bound: no re-cover of the union into 64-key pieces).
Prints and writes each tiling's area over rows64's, per layer and kind.
"""
from __future__ import annotations

import argparse
import time

import torch


def union_area(keys: torch.Tensor, block: int, group: int) -> int:
    """Computed (row, key) pairs when each KV group's G heads run the union of their keys per row block; keys Bool
    `[H, M, n]` (`index_ref.tile_keys` of one prompt), `block` rows a row block."""
    H, M, n = keys.shape
    union = keys.view(H // group, group, M, n).any(1).sum(-1).long()  # [Hkv, M]
    rows = torch.full((M,), block, dtype=torch.long)
    rows[-1] = n - (M - 1) * block
    return int((union * rows).sum()) * group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M; gemma-3-270m: 32K")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--budget", type=int, default=1024, help="keys per query row for the default sizes")
    p.add_argument("--vertical", type=int, default=None)
    p.add_argument("--slash", type=int, default=None)
    p.add_argument("--topk", type=int, default=None)
    p.add_argument("--out", default="rows_per_load.json")
    args = p.parse_args()

    from workbench_kernels.index_ref import block_sparse_to_tiles, tile_area, tile_keys, vs_to_tiles

    from workbench.config.head_config import PROXY_DEFAULTS
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.core.timing import environment
    from workbench.patterns import VerticalSlash
    from workbench.patterns.proxy import block_proxy, vs_proxy

    t0 = time.time()
    model, tok, shape = load_model(args.model)
    n = shape.check_length(args.length)
    sizes = VerticalSlash.at_budget(args.budget, n)
    vertical, slash = args.vertical or sizes["vertical"], args.slash or sizes["slash"]
    topk = args.topk or max(1, args.budget // 64)
    ids = make_sample("passkey", tok, n, seed=0).input_ids
    layers = shape.free_layers
    cap = capture_attention(model, shape, ids, layers, dtype=torch.float32)
    G = shape.group
    result = {"environment": environment(), "settings": vars(args), "model": shape.to_dict(),
              "sizes": {"vertical": vertical, "slash": slash, "topk": topk}, "layers": {}}
    for i, layer in enumerate(cap.layers):
        q, k = cap.q[i], cap.k[i].repeat_interleave(G, 0)  # [Hq, N, D]: each head's own KV head
        scale = cap.scale
        cols, offs = vs_proxy(q, k, scale, vertical, slash, **PROXY_DEFAULTS)
        table = block_proxy(q, k, topk)  # [Hq, M, topk]
        kinds = {"vs": lambda block, width: vs_to_tiles(cols[None], offs[None], n, block, width=width),
                 "block": lambda block, width: block_sparse_to_tiles(table[None], n, block, width)}
        row = {}
        for kind, tiles_of in kinds.items():
            base = tiles_of(64, 0)
            area64, keys = int(tile_area(base, n).sum()), tile_keys(base, n)[0]
            row[kind] = {"density_rows64": area64 / (shape.n_heads * n * (n + 1) / 2),
                         "rows128_over_rows64": int(tile_area(tiles_of(128, 64), n).sum()) / area64,
                         "union_over_rows64": union_area(keys, 64, G) / union_area(keys, 64, 1)}
        result["layers"][str(layer)] = row
        print(layer, {kind: {key: round(v, 3) for key, v in r.items()} for kind, r in row.items()}, flush=True)
    for kind in ("vs", "block"):
        for key in ("rows128_over_rows64", "union_over_rows64"):
            values = [r[kind][key] for r in result["layers"].values()]
            result.setdefault("mean", {}).setdefault(kind, {})[key] = sum(values) / len(values)
    result["seconds"] = time.time() - t0
    print("mean", result["mean"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
