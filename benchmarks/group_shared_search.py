"""What giving whole KV groups one Vertical-Slash index costs the search, on real weights (CPU).

The search's evidence (`search.search_heads` over calibration prompts: exact captured mass of every candidate on
every head, worst sample) with the default grid plus `vs_group`'s, under the default tile cost. For each KV group of
each searched layer it reports the tiles of the heads' own choices and, where one exists, of the cheapest `vs_group`
budget at which every head of the group still meets the target, and their ratio: sharing pays where that ratio is
below a tile's cost ratio (per-head VS / shared, measured on the H200: 1.06 on the Llama-3-8B shape, 0.98 on the
embedded shape; `prefill_minference_eff4416_h200.json` through `prefill.latency.tile_rates`).

    python -m workbench_benchmarks.group_shared_search --lengths 2048 --out assets/benchmarks/group_shared_search_cpu.json
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench_benchmarks.group_shared_search", description=__doc__)
    p.add_argument("--lengths", default="2048", help="calibration lengths (comma-separated tokens)")
    p.add_argument("--tasks", default="passkey,code,vartrack", help="calibration tasks")
    p.add_argument("--target", type=float, default=0.95, help="captured-mass target (worst sample)")
    p.add_argument("--out", default="reports/benchmarks/group_shared_search_cpu.json")
    args = p.parse_args(argv)
    from workbench.core.corpus import make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.core.timing import environment
    from workbench.patterns import PATTERNS
    from workbench.search.search import Candidate, choose, default_candidates, search_heads

    t0 = time.time()
    model, tok, shape = load_model()
    lengths = [int(x) for x in args.lengths.split(",")]
    samples = [make_sample(t, tok, n, seed=0) for t in args.tasks.split(",") for n in lengths]
    grid = default_candidates(max(lengths))
    shared = [Candidate.from_dict({"pattern": kind, "params": p}) for kind, cls in PATTERNS.items() if cls.kv_shared
              for p in cls.grid(max(lengths))]
    cfg, ev = search_heads(model, tok, shape, samples, candidates=grid + shared, target=args.target, progress=False)
    chosen = choose(ev, args.target)  # what the search chose, shared kinds per group included (the config's)
    tiles = ev.tiles.mean(0)  # [L, H, C]
    ok = (ev.mass.amin(0) >= args.target - 1e-12) & (ev.tail.amin(0) >= args.target - 1e-12)
    mine = [c for c, cand in enumerate(ev.candidates) if cand.pattern == "vs_group"]
    own_choice = _own_choice(ev, args.target, len(grid))
    G = ev.group
    groups = []
    for layer in shape.free_layers:
        for h0 in range(0, shape.n_heads, G):
            hs = slice(h0, h0 + G)
            own = float(tiles[layer, hs].gather(-1, own_choice[layer, hs, None]).sum())
            fits = [c for c in mine if bool(ok[layer, hs, c].all())]
            best = min(fits, key=lambda c: float(tiles[layer, hs, c].sum())) if fits else None
            kinds = [ev.candidates[int(c)].pattern for c in own_choice[layer, hs]]
            row = {"layer": layer, "kv_head": h0 // G, "own": kinds, "own_tiles": own,
                   "shared": ev.candidates[best].label() if best is not None else None,
                   "shared_tiles": float(tiles[layer, hs, best].sum()) if best is not None else None,
                   "taken_by_tile_cost": bool((chosen[layer, hs] == best).all()) if best is not None else False}
            row["ratio"] = row["shared_tiles"] / own if best is not None and own > 0 else None
            groups.append(row)
    vs_groups = [g for g in groups if set(g["own"]) == {"vs"}]
    fit = [g for g in groups if g["shared"] is not None]
    summary = {
        "groups": len(groups), "groups_all_vs": len(vs_groups),
        "groups_all_vs_that_can_share": sum(g["shared"] is not None for g in vs_groups),
        "groups_that_can_share": len(fit),
        "median_ratio_all_vs": _median([g["ratio"] for g in vs_groups if g["ratio"] is not None]),
        "median_ratio": _median([g["ratio"] for g in fit if g["ratio"] is not None]),
        "share_below_1.06": sum(g["ratio"] is not None and g["ratio"] < 1.06 for g in groups),
        "taken_by_tile_cost": sum(g["taken_by_tile_cost"] for g in groups),
        "config": cfg.summary(),
    }
    result = {"environment": environment("python -m workbench_benchmarks.group_shared_search " + " ".join(sys.argv[1:])),
              "model": f"embedded {shape.name} ({shape.n_heads} query / {shape.n_kv_heads} KV heads, G = {G}), fp32",
              "settings": vars(args), "summary": summary, "groups": groups, "elapsed_s": round(time.time() - t0, 1)}
    write_json(args.out, result)
    print(summary)
    return 0


def _own_choice(ev, target: float, n_grid: int):
    """Each head's choice among the first `n_grid` candidates (the default grid: no shared kind), `[L, H]`."""
    import torch

    from workbench.search.search import Evidence, choose

    part = Evidence(ev.candidates[:n_grid], ev.samples, ev.lengths, *(getattr(ev, n)[..., :n_grid] for n in
                    ("mass", "tail", "oracle", "tiles", "edges")), ev.done, ev.group)
    return torch.as_tensor(choose(part, target))


def _median(values: list[float]) -> float | None:
    import statistics

    return round(statistics.median(values), 4) if values else None


if __name__ == "__main__":
    sys.exit(main())
