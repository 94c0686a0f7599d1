"""Exploratory (H200): XAttention's score kernel (`antidiagonal.antidiagonal_scores`) at each launch tile, timed in
turn (`timing.paired_ms`) on the bench's planted inputs, each checked against the first tile's scores.

    python3 scripts/antidiagonal_probe.py --shapes llama3-8b,embedded --lengths 65536,131072 --out probe.json

Per (shape, length, tile): ms per call and TFLOP/s (both passes: N^2 D / S per query head, causal half)."""
from __future__ import annotations

import argparse
import json

from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.antidiagonal import antidiagonal_scores

from workbench.core.io import write_json
from workbench.core.timing import environment, paired_ms

TILES = ((64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3),
         (256, 128, 8, 3), (256, 128, 8, 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama3-8b,embedded")
    p.add_argument("--lengths", default="65536")
    p.add_argument("--stride", type=int, default=8)
    p.add_argument("--out", default="antidiagonal_probe.json")
    args = p.parse_args()
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    for shape in args.shapes.split(","):
        hq, hkv, d, theta = SHAPES[shape]
        for n in [int(x) for x in args.lengths.split(",")]:
            q, k, _ = planted_inputs(hq, hkv, d, n, theta)
            q, k = q[0], k[0]
            scale = d ** -0.5
            want = antidiagonal_scores(q, k, scale, args.stride, tile=TILES[0])
            fns, tiles = [], []
            for tile in TILES:
                try:
                    got = antidiagonal_scores(q, k, scale, args.stride, tile=tile)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                    result["rows"].append({"shape": shape, "n": n, "tile": tile, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                err = float((got - want).abs().max())
                tiles.append((tile, err))
                fns.append(lambda tile=tile: antidiagonal_scores(q, k, scale, args.stride, tile=tile))
            flop = 2 * hq * n * n * d / args.stride  # two passes of (N/S)^2 / 2 dots of S*D, 2 FLOP each
            for (tile, err), ms in zip(tiles, paired_ms(fns, rounds=5), strict=True):
                row = {"shape": shape, "n": n, "tile": tile, "ms": ms, "tflops": flop / ms / 1e9, "max_diff": err}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            write_json(args.out, result)


if __name__ == "__main__":
    main()
