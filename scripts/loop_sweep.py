"""Exploratory (H200): the Triton-language loop's knobs on one pattern's tiles, each timed beside dense SDPA in one
process (ratio of effective TFLOP/s over the tiles' area to SDPA's; the bench's planted inputs and shapes).

    python3 scripts/loop_sweep.py --shape embedded --pattern ashape --lengths 65536,131072 --out sweep.json

Patterns: ashape (sink --sink, window --window on every head, per-head tiles: `sparse_prefill`'s A-shape at
head_dim 64, where an odd group rules out the Gluon kernel's paired heads), block (top --topk per head) and vs
(Vertical-Slash (--vertical, --slash) per head from the online index, as `VerticalSlash.layer_tiles` builds them).
Grid: --warps x --stages x --loads (single / split / tma) x --widths (keys per piece: A-shape's tiles built at that
width, the others' 64-key pieces cut by `index_ref.narrow_pieces`), not persistent; a combination
that does not compile is recorded. Each combination is timed synced (`time_ms`: host launch time included) and queued
(`queued_ms`: the GPU's time while the host runs ahead), in --rounds interleaved rounds (medians recorded)."""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, dense_baseline, planted_inputs
from workbench_kernels.index_build import block_tiles, vs_index, vs_tiles
from workbench_kernels.index_ref import ashape_to_tiles, narrow_pieces, tile_area
from workbench_kernels.prefill import sparse_prefill

from workbench.core.io import write_json
from workbench.core.timing import environment, queued_ms, time_ms

LOADS = {"single": (False, False), "split": (True, False), "tma": (True, True)}  # (split, tma)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="embedded")
    p.add_argument("--pattern", default="ashape", choices=("ashape", "block", "vs"))
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--vertical", type=int, default=1000)
    p.add_argument("--slash", type=int, default=6096)
    p.add_argument("--loads", default="single,split,tma", help="K/V loads: single loop, split (pointer), split + TMA")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--widths", default="64", help="keys per piece (64 = the row block)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default="loop_sweep.json")
    args = p.parse_args()
    hq, hkv, d, theta = SHAPES[args.shape]
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v = planted_inputs(hq, hkv, d, n, theta, dev="cuda" if torch.cuda.is_available() else "cpu")
        kx, vx = (x.repeat_interleave(hq // hkv, 1) for x in (k, v))
        dense, dense_form, dense_forms = dense_baseline(q, k, v, kx, vx)
        dense_ms, dense_queued_ms = dense_forms[dense_form], queued_ms(dense)
        pairs = hq * n * (n + 1) / 2  # causal (query, key) pairs of all heads: dense SDPA's area
        kw = {}
        if args.pattern == "ashape":
            kw = {"sink": torch.full((hq,), args.sink), "window": torch.full((hq,), args.window)}
            tiles_of = {w: ashape_to_tiles([args.sink] * hq, [args.window] * hq, n, 1, 64, q.device, width=w)
                        for w in ints(args.widths)}
        else:
            if args.pattern == "block":
                wide = block_tiles(q, k, args.topk)
            else:
                cols, offs = vs_index(q, k, 1 / math.sqrt(d), args.vertical, min(args.slash, n))
                wide = vs_tiles(cols, offs, n, 64, 0, head_columns=True)
            tiles_of = {w: narrow_pieces(wide, w, n) for w in ints(args.widths)}
        base = {"n": n, "dense_ms": dense_ms, "dense_queued_ms": dense_queued_ms, "dense_form": dense_form}
        combos = [{"num_warps": warps, "num_stages": stages, "split": split, "tma": tma, "persistent": False,
                   "warp_specialize": False, "width": width}
                  for width, warps, stages, (split, tma) in itertools.product(
                      tiles_of, ints(args.warps), ints(args.stages), [LOADS[x] for x in args.loads.split(",")])]
        combos.append({"default": True, "width": 64})
        times: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(combos))}
        errors: dict[int, str] = {}
        for _ in range(args.rounds):
            for i, knobs in enumerate(combos):
                if i in errors:
                    continue
                tiles = tiles_of[knobs["width"]]
                run = {key: val for key, val in knobs.items() if key not in ("default", "width")}

                def call():
                    return sparse_prefill(q, k, v, tiles, scale=1 / math.sqrt(d), **run, **kw)

                try:
                    times[i].append((time_ms(call), queued_ms(call)))
                except Exception as e:  # noqa: BLE001 - record what does not compile or fit
                    errors[i] = f"{type(e).__name__}: {str(e)[:160]}"
        for i, knobs in enumerate(combos):
            if i in errors:
                row = {**base, **knobs, "error": errors[i]}
            else:
                area = tile_area(tiles_of[knobs["width"]], n).sum().item()
                ms = statistics.median(t for t, _ in times[i])
                qms = statistics.median(t for _, t in times[i])
                row = {**base, **knobs, "ms": ms, "queued_ms": qms, "rounds_ms": times[i],
                       "ratio_to_dense": area / ms / (pairs / dense_ms),
                       "queued_ratio_to_dense": area / qms / (pairs / dense_queued_ms)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
