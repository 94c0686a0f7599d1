"""`workbench bench analysis`: what the analysis costs beside the attention it analyses (GPU).

--part layer: one layer of the Llama-3-8B attention shape (32 query / 8 KV heads, head_dim 128; random bf16
q/k/v, no model weights: times and memory only) at each of --lengths, in one process: the dense causal SDPA
forward of the layer (the yardstick), `workbench.analysis.stats.layer_stats` with every map (resolution
1024), and the search's scoring `workbench.search.search.layer_scores` on `default_candidates(n)`; each
with its median time, its ratio to dense and its peak GPU memory beyond q/k/v. The parts of the statistics
are timed too: pass 1 (row log-sum-exp + entropy), pass 2 (every reduction of `layer_stats`),
`metrics.layer_sums` and `metrics.column_offset_mass` of two nested column sets at the VS grid's largest
budget (what `layer_scores` asks). `--reference` also times the PyTorch reference of `layer_stats` and
`layer_scores` (`stats.backend("torch")`; slow: ~20 s at 128K).

Bars: statistics <= 3x dense and scoring <= 4x dense at 64K and 128K; memory beyond q/k/v <= 2 GB at 128K.
`--device cpu` runs the same code under TRITON_INTERPRET=1 at tiny lengths (a dry run: timings meaningless).
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

SHAPE = (32, 8, 128)  # Llama-3-8B attention: query heads, KV heads, head_dim
PARTS = ("layer", "model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workbench_benchmarks.analysis_model import add_model_arguments

    p.add_argument("--part", choices=PARTS, default="layer", help="what to measure: layer (default: one attention "
                   "layer at each of --lengths) or model (a whole random-weight model at each of --points)")
    p.add_argument("--lengths", default="16384,32768,65536,131072", help="comma-separated sequence lengths "
                   "(default 16384,32768,65536,131072)")
    p.add_argument("--budget-ms", type=float, default=3000.0,
                   help="timed calls per measurement: at least 2, more while their total stays under this (default 3000)")
    p.add_argument("--reference", action="store_true", help="also time the PyTorch reference (slow)")
    p.add_argument("--sweep", action="store_true", help="instead: time the launch settings of pass 1 (rows per program, "
                   "warps, stages) and pass 2 (walk order, tiles per program, warps, stages) at the first of --lengths")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a dry run under TRITON_INTERPRET=1 "
                   "at tiny lengths)")
    p.add_argument("--out", default="reports/benchmarks/analysis.json", help="JSON output path: each part writes its "
                   "own key (layer, whole_model) and keeps the others (default reports/benchmarks/analysis.json)")
    add_model_arguments(p)


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths {text!r} must be comma-separated integers, e.g. 16384,65536") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {text!r}: give at least one positive length, e.g. 16384")
    return lengths


def run(args: argparse.Namespace) -> int:
    lengths = parse_lengths(args.lengths)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    elif args.device != "cuda":
        raise ValueError(f"--device {args.device!r}: use cuda, or cpu for a dry run")
    if args.part == "model":
        from workbench_benchmarks.analysis_model import run as model_part

        return model_part(args)
    return layer_part(args, lengths)


def write_part(path: str, key: str, result: dict[str, Any]) -> None:
    """Put one part's `result` under `key` of the JSON at `path` (atomic), keeping the other parts."""
    import json
    from pathlib import Path

    from workbench.core.io import write_json

    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[key] = result
    write_json(p, data)


def peak_gb(fn: Callable[[], Any], cuda: bool) -> float | None:
    """Peak GPU memory of fn() in GB beyond what was allocated before it (None on the CPU)."""
    import torch

    if not cuda:
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 1e9, 3)


def layer_part(args: argparse.Namespace, lengths: list[int]) -> int:
    import torch

    from workbench.core.timing import environment

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu for a dry run")
    hq, hkv, d = SHAPE
    dtype = torch.bfloat16 if cuda else torch.float16  # the interpreter has no bf16
    report = {"environment": {**environment(), "part": "layer", "inputs": f"random {dtype} q/k/v of shape "
                              f"{hq} q / {hkv} KV heads, head_dim {d} (no model weights: times and memory only)"},
              "bars": {"stats_ratio": 3.0, "scores_ratio": 4.0, "peak_gb_128k": 2.0}, "rows": []}
    print(f"{'n':>7} {'dense ms':>9} {'stats ms':>9} {'x':>6} {'scores ms':>10} {'x':>6} "
          f"{'peak GB stats/scores':>21}  parts ms: lse / sums / layer_sums / overlap")
    if args.sweep:
        report["sweep"] = sweep(lengths[0], args, dtype)
        write_part(args.out, "layer", report)
        print(f"wrote {args.out}")
        return 0
    for n in lengths:
        row = layer_row(n, args, dtype)
        report["rows"].append(row)
        write_part(args.out, "layer", report)  # rows are kept as they are measured
        peaks = "/".join("-" if row[x]["peak_gb"] is None else f"{row[x]['peak_gb']:.2f}" for x in ("stats", "scores"))
        print(f"{n:>7} {row['dense']['median_ms']:>9.2f} {row['stats']['median_ms']:>9.1f} "
              f"{row['stats']['ratio_to_dense']:>6.2f} {row['scores']['median_ms']:>10.1f} "
              f"{row['scores']['ratio_to_dense']:>6.2f} {peaks:>21}  "
              + " / ".join(f"{t:.1f}" for t in row["parts_ms"].values()), flush=True)
    print(f"wrote {args.out}")
    return 0


def layer_row(n: int, args: argparse.Namespace, dtype: Any) -> dict[str, Any]:
    """One length: dense SDPA, the statistics' parts, `layer_stats`, `layer_scores` (and the reference)."""
    import torch
    from workbench_kernels import attn_stats

    from workbench.analysis import metrics, stats
    from workbench.core.timing import measure
    from workbench.patterns.proxy import top_positions
    from workbench.search.search import default_candidates, layer_scores

    cuda = args.device == "cuda"
    hq, hkv, d = SHAPE
    scale = d ** -0.5
    time_of = lambda fn: measure(fn, cuda=cuda, warmup=1, min_reps=2, max_reps=20, budget_ms=args.budget_ms)  # noqa: E731
    g = torch.Generator(device=args.device).manual_seed(n)
    q, k, v = (torch.randn(h, n, d, generator=g, device=args.device).to(dtype) for h in (hq, hkv, hkv))
    row: dict[str, Any] = {"n": n}
    kx, vx = (x.repeat_interleave(hq // hkv, 0)[None] for x in (k, v))  # dense reads repeated KV heads, as a model does
    dense = lambda: torch.nn.functional.scaled_dot_product_attention(q[None], kx, vx, is_causal=True)  # noqa: E731
    row["dense"] = time_of(dense).to_dict()
    row["dense"]["peak_gb"] = peak_gb(dense, cuda)
    kx = vx = None
    with stats.backend("auto" if cuda else "triton"):
        lse = attn_stats.row_lse(q, k, scale, entropy=True)[0]
        cell = math.ceil(n / 1024)
        levels = sorted({c.sizes[0] for c in default_candidates(n) if c.pattern == "vs"}) or [min(64, n)]
        cols = top_positions(torch.rand(hq, n, generator=g, device=args.device), 0, levels[-1], None, ranked=True)
        parts = {"lse": lambda: attn_stats.row_lse(q, k, scale, entropy=True),
                 "sums": lambda: attn_stats.attention_sums(q, k, scale, lse, block=64, cell=cell, max_map=True,
                                                           mean_map=True),
                 "layer_sums": lambda: metrics.layer_sums(q, k, scale),
                 "overlap": lambda: metrics.column_offset_mass(q, k, scale, lse, [cols, cols.flip(-1)],
                                                               prefixes=[levels, levels])}
        row["parts_ms"] = {name: round(time_of(fn).median_ms, 3) for name, fn in parts.items()}
        lse = parts = None
        calls = {"stats": lambda: stats.layer_stats(q, k, scale),
                 "scores": lambda: layer_scores(q, k, scale, default_candidates(n))}
        for name, fn in calls.items():
            row[name] = time_of(fn).to_dict()
            row[name]["peak_gb"] = peak_gb(fn, cuda)
            row[name]["ratio_to_dense"] = round(row[name]["median_ms"] / row["dense"]["median_ms"], 2)
    if args.reference:
        with stats.backend("torch"):
            for name, fn in calls.items():
                row[f"{name}_reference"] = measure(fn, cuda=cuda, warmup=1, min_reps=1, max_reps=3,
                                                   budget_ms=args.budget_ms).to_dict()
    return row


def sweep(n: int, args: argparse.Namespace, dtype: Any) -> list[dict[str, Any]]:
    """Median ms of pass 1 (with entropy) and pass 2 (every `layer_stats` reduction) per launch setting."""
    import itertools

    import torch
    from workbench_kernels import attn_stats

    from workbench.core.timing import measure

    cuda = args.device == "cuda"
    hq, hkv, d = SHAPE
    scale = d ** -0.5
    g = torch.Generator(device=args.device).manual_seed(n)
    q, k = (torch.randn(h, n, d, generator=g, device=args.device).to(dtype) for h in (hq, hkv))
    lse = attn_stats.row_lse(q, k, scale)[0]
    cell = math.ceil(n / 1024)
    runs = [("lse", dict(block_m=bm, num_warps=w, num_stages=st), lambda c: attn_stats.row_lse(q, k, scale, entropy=True, **c))
            for bm, w, st in itertools.product((64, 128), (4, 8), (1, 2, 3))]
    sums = lambda c: attn_stats.attention_sums(q, k, scale, lse, block=64, cell=cell, max_map=True,  # noqa: E731
                                               mean_map=True, **c)
    runs += [("sums", dict(walk="diagonal", chunk=ch, num_warps=w, num_stages=st), sums)
             for ch, w, st in itertools.product((16, 32, 64), (4, 8), (1, 2, 3))]
    runs += [("sums", dict(walk="rows", num_warps=w, num_stages=st), sums) for w, st in itertools.product((4, 8), (1, 2, 3))]
    out = []
    for name, config, fn in runs:
        try:
            ms = measure(lambda: fn(config), cuda=cuda, warmup=1, min_reps=2, max_reps=5, budget_ms=args.budget_ms).median_ms
        except Exception as e:  # a setting the compiler refuses (out of shared memory): record it, go on
            out.append({"pass": name, **config, "error": f"{type(e).__name__}: {e}"[:200]})
            print(f"{name} {config}: {type(e).__name__}", flush=True)
            continue
        out.append({"pass": name, **config, "median_ms": round(ms, 3)})
        print(f"{name} {config}: {ms:.2f} ms", flush=True)
    for name in ("lse", "sums"):
        best = min((r for r in out if r["pass"] == name and "median_ms" in r), key=lambda r: r["median_ms"], default=None)
        print(f"fastest {name} at n={n}: {best}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
