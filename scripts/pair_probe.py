"""Exploratory (sm_90): the row-block pairs (`prefill_pair`, two row blocks of one head on one K / V ring, each tile
loaded once for 128 rows) at head_dim 128, beside the kernel the library deploys there (`prefill_ws` through
`sparse_prefill`'s default; `ashape_prefill` for A-shape), on Llama-3-8B's attention shape (32 / 8 / 128, random
planted inputs: `benchmarks.kernels_prefill.planted_inputs`). Issue 25's head_dim-128 bar: Vertical-Slash at 1.0 of
dense SDPA per computed tile.

`--orders`: the deployed Gluon kernel (`prefill_ws`) again in other launch orders (`prefill_ws.work_order` swapped
for the call): `heads` one head after another, its row blocks last first (the pairs' order, `PairItems.ordered`, which
won 1.09x / 1.24x at head_dim 256), `kv` every item of a KV head's query heads before the next KV head's, most pieces
first within (Vertical-Slash's default), `longest` most pieces first over all heads (block-sparse's default).

`--ws-ashape`: the A-shape rows also on `prefill_ws.ws_ashape`, configs WIDTHxSTAGES[vV][kv][s][n] (keys per step,
K ring slots, V ring slots, KV head first, `s`: two heads of one band on a shared ring (`prefill_ws.head_pairs`), else
per-head rings; `n`: no overlap). `--shape gemma3-270m` runs the same rows at head_dim 256 (4 / 1), where A-shape
deploys the GQA-packed loop (`a_shape`: one band per group) or the row-block pairs (`a_shape_per_head`).

Steps: each kernel against the loop on the same tiles at 4K (bf16, max |o - loop|; no timings if any exceeds 0.05);
then per length the rows timed side by side (`paired_ms`: batches in a balanced sequence), efficiency per
computed tile = physical density x dense ms / ms.
Run: python3 scripts/pair_probe.py --lengths 65536,131072 --stages 3,4,5 --out pair_probe_d128.json
     python3 scripts/pair_probe.py --stages "" --orders heads,kv,longest --patterns vs,vs512,block
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--stages", default="3,4,5", help="ring slots of the pair rows (164 KB of shared memory at 4)")
    p.add_argument("--patterns", default="vs,vs512,block,a_shape_per_head", help="also a_shape: one band per group")
    p.add_argument("--shape", default="llama3-8b", help="an attention shape of benchmarks.kernels_prefill.SHAPES")
    p.add_argument("--orders", default="", help="launch orders of the deployed Gluon kernel: heads, kv, longest")
    p.add_argument("--ws-ashape", default="", help="ws_ashape configs for the A-shape rows: 64x2,64x3kv,64x3v2sn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="pair_probe_d128.json")
    a = p.parse_args()
    from workbench_benchmarks.kernels_prefill import SHAPES, dense_baseline, planted_inputs
    from workbench_kernels import prefill_pair, prefill_ws
    from workbench_kernels.index_build import block_index, vs_index, vs_tiles
    from workbench_kernels.index_ref import _head_runs, band_tiles, selected_block_tiles, tile_area
    from workbench_kernels.prefill import ashape_prefill, default_program, sparse_prefill

    from workbench.core.io import write_json
    from workbench.core.timing import environment, paired_ms

    hq, hkv, d, theta = SHAPES[a.shape]
    stages = [int(s) for s in a.stages.split(",") if s]
    orders = [x for x in a.orders.split(",") if x]
    ws_cfgs = [x for x in a.ws_ashape.split(",") if x]
    patterns = [x for x in a.patterns.split(",") if x]
    out = {"environment": environment(), "check": {}, "rows": []}
    t0 = time.time()

    def build(pattern, q, k, v, n):
        """(tiles, A-shape band on the GPU, (sink, window) on the CPU or None, the deployed kernel, its program)."""
        if pattern.startswith("vs"):
            cols, offs = vs_index(q, k, 1 / math.sqrt(d), 1000, min(512 if pattern == "vs512" else 6096, n))
            tiles = vs_tiles(cols, offs, n, 64, 0, head_columns=True)
        elif pattern == "block":
            tiles = selected_block_tiles(block_index(q, k, 100 if n > 8192 else 16))
        else:  # sink 128, window 4096; a_shape_per_head: 4096 / 2048 in turn (as `bench kernels`' rows)
            sink = torch.tensor([128] * hq, dtype=torch.int32)
            window = torch.tensor([4096 // (1 + h % 2 * (pattern == "a_shape_per_head")) for h in range(hq)],
                                  dtype=torch.int32)
            tiles, band = band_tiles(sink, window, n, 1, 64, q.device)
            return tiles, band, (sink, window), lambda: ashape_prefill(q, k, v, sink, window)[0], "ashape_prefill"
        return tiles, None, None, lambda: sparse_prefill(q, k, v, tiles)[0], default_program(q, tiles)

    def pair(q, k, v, tiles, band, s):
        return prefill_pair._launch(q, k, v, tiles, None, band, s)[0]

    library_order = prefill_ws.work_order

    @contextlib.contextmanager
    def launch_order(name):
        def order(tiles, sub, group=0):
            B, H, M = tiles.block_count.shape
            if name == "heads":
                return _head_runs(B * H, M, tiles.block_count.device)
            return library_order(tiles, sub, hq // hkv if name == "kv" else 0)

        prefill_ws.work_order = order
        try:
            yield
        finally:
            prefill_ws.work_order = library_order

    def ordered(fn, name):
        def call():
            with launch_order(name):
                return fn()
        return call

    def ws_ashape(q, k, v, sw, cfg):
        width, stages, v_stages, kv, share, no_overlap = re.fullmatch(r"(\d+)x(\d+)(?:v(\d+))?(kv)?(s)?(n)?", cfg).groups()
        return prefill_ws.ws_ashape(q, k, v, *sw, stages=int(stages), width=int(width), kv_major=bool(kv),
                                    share_kv=bool(share), overlap=not no_overlap,
                                    v_stages=int(v_stages) if v_stages else None)[0]

    def variants(deployed, program, tiles, band, sw, q, k, v):
        """(row name, fn) of the kernels beside dense SDPA."""
        rows = [(program, deployed)] + [(f"pair/{s}", lambda s=s: pair(q, k, v, tiles, band, s)) for s in stages]
        rows += [(f"ws_ashape/{c}", lambda c=c: ws_ashape(q, k, v, sw, c)) for c in ws_cfgs if sw is not None]
        return rows + [(f"gluon/{x}", ordered(deployed, x)) for x in orders if program == "gluon"]

    q, k, v = planted_inputs(hq, hkv, d, 4096, theta)
    for pattern in patterns:
        tiles, band, sw, deployed, program = build(pattern, q, k, v, 4096)
        sink, window = sw or (None, None)
        ref = sparse_prefill(q, k, v, tiles, sink=sink, window=window, warp_specialize=False)[0].float()
        for name, fn in variants(deployed, program, tiles, band, sw, q, k, v):
            out["check"][f"{pattern}/{name}"] = float((fn().float() - ref).abs().max())
    print(json.dumps(out["check"]), flush=True)
    if any(not e < 0.05 for e in out["check"].values()):
        write_json(a.out, out)
        print("check failed: no timings", flush=True)
        return 1
    for n in [int(x) for x in a.lengths.split(",") if x]:
        q, k, v = planted_inputs(hq, hkv, d, n, theta)
        kx, vx = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        dense, form, _ = dense_baseline(q, k, v, kx, vx)
        pairs = n * (n + 1) // 2
        for pattern in patterns:
            tiles, band, sw, deployed, program = build(pattern, q, k, v, n)
            density = tile_area(tiles, n).sum().item() / (hq * pairs)
            names, fns = zip(("dense_sdpa", dense), *variants(deployed, program, tiles, band, sw, q, k, v))
            ms = dict(zip(names, paired_ms(list(fns), rounds=a.rounds)))
            row = {"n": n, "pattern": pattern, "dense_form": form, "physical_density": density, "ms": ms,
                   "of_dense_per_tile": {x: density * ms["dense_sdpa"] / t for x, t in ms.items() if x != "dense_sdpa"},
                   "speedup_vs_deployed": {x: ms[program] / t for x, t in ms.items() if "/" in x}}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            write_json(a.out, out)
        kx = vx = dense = None
        torch.cuda.empty_cache()
    out["elapsed_s"] = time.time() - t0
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
