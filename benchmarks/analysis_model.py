"""Whole-model analysis at long context (part "model" of `workbench bench analysis`): a random-weight
Llama-3-8B shape analysed layer by layer (`workbench.core.stream`), next to the same runner's dense prefill.

Per point n:layers (default 131072:32 and 1048576:4): random token ids, then
- dense prefill: the layer-major runner with no analysis (the model's own decoder layers over the
  prompt in query chunks; each chunk's attention two fused calls, cuDNN's where it takes the inputs,
  merged by their row log-sum-exps), its own forward time per layer;
- analysis: the same forward keeping each layer's q/k, then per layer the head profiles of
  `workbench analyze` (`LayerProfiles`: `layer_stats` with the profile maps) and the search evidence of
  one sample (`layer_scores` on `default_candidates(n)`), each timed on its own (synchronised), both
  reading the forward's row log-sum-exps (`LayerRunner.row_lse`) instead of a first pass of their own.
  One forward serves both: "capture + statistics" = forward + statistics, "search evidence" = forward +
  scoring; each would be one such pass on its own.
Per-layer times are extrapolated to the full 32 layers (setup + 32 x the mean measured layer), as
`benchmarks/prefill_e2e.py` does; a point run with all 32 layers is measured, not extrapolated. Peak GPU
memory per pass (torch allocator, weights included) beside the estimate `check_memory` refuses with.
Random weights: the times and memory are those of the real shape; the attention itself is not
realistic (the statistics' and the scoring's cost do not depend on it, the picked heads do).

Every pass stops adding layers when the next one (predicted from the last, or from the previous point
scaled by n^2) would pass `--deadline-s` from the start; the JSON says how many layers each measured.
The result is written under the key "whole_model" of `--out` (other keys, e.g. the per-layer part,
are kept).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

FULL_LAYERS = 32
SHAPE = "Llama-3-8B-1048k"  # Llama-3-8B's dimensions, 1M positions (gradientai's RoPE base)
GIB = 2 ** 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of this part alone (`python -m workbench_benchmarks.analysis_model`)."""
    add_model_arguments(p)
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu for a smoke run")
    p.add_argument("--out", default="reports/benchmarks/analysis.json", help="JSON file (key whole_model)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags `workbench bench analysis --part model` adds to the shared ones (--device, --out)."""
    p.add_argument("--points", default="131072:32,1048576:4",
                   help="comma-separated n:layers (prompt length : decoder layers run); default 131072:32,1048576:4")
    p.add_argument("--shape", default=SHAPE, help=f"named shape or config.json of the random model (default {SHAPE})")
    p.add_argument("--chunk", type=int, default=None, help="query rows per layer call (default: the runner's, 32768 on a GPU)")
    p.add_argument("--deadline-s", type=float, default=420.0,
                   help="stop adding layers when the next would end later than this many seconds after the start")
    p.add_argument("--model-forward-max", type=int, default=131072,
                   help="also time the model's own forward (transformers, all layers at once) up to this length")


def _points(text: str) -> list[tuple[int, int]]:
    try:
        pts = [tuple(int(x) for x in p.split(":")) for p in text.split(",") if p.strip()]
    except ValueError:
        pts = []
    if not pts or any(len(p) != 2 or p[0] < 1 or p[1] < 1 for p in pts):
        raise ValueError(f"--points {text!r}: give n:layers pairs, e.g. 131072:32,1048576:4")
    return pts  # type: ignore[return-value]


class _Clock:
    """Synchronised wall time and the deadline of the whole run."""

    def __init__(self, device, deadline_s: float):
        import torch

        self.cuda = device.type == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self.end = time.perf_counter() + deadline_s

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def left(self) -> float:
        return self.end - time.perf_counter()


def _peak_gib(clock: _Clock) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated() / GIB, 2) if clock.cuda else None


def _reset_peak(clock: _Clock) -> None:
    import torch

    if clock.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _dense(model, ids, layers: int, chunk, clock: _Clock, predict: float | None) -> dict[str, Any]:
    from workbench.core.stream import LayerRunner

    runner = LayerRunner(model, chunk=chunk, progress=False)
    _reset_peak(clock)
    t0 = clock.now()
    steps = runner.steps(ids, last=layers - 1)
    for layer, hidden in steps:
        if layer + 1 == layers or clock.left() < runner.layer_seconds[-1] * 1.2:
            model.lm_head(model.model.norm(hidden[:, -1:]))  # the prefill's output: last position's logits
            break
    steps.close()
    total = clock.now() - t0
    return {"layers_measured": len(runner.layer_seconds), "setup_s": runner.setup_seconds,
            "per_layer_s": runner.layer_seconds, "seconds_measured": total, "peak_gib": _peak_gib(clock),
            "predicted_s": predict}


def _analysis(model, shape, ids, layers: int, chunk, clock: _Clock) -> dict[str, Any]:
    from workbench.analysis.layer_profiles import LayerProfiles
    from workbench.core.stream import LayerRunner
    from workbench.search.search import default_candidates, layer_scores

    n = ids.numel()
    runner = LayerRunner(model, chunk=chunk, progress=False)
    scale = float(model.model.layers[0].self_attn.scaling)
    profiles = LayerProfiles(scale)
    cands = default_candidates(n)
    stats_s, scores_s = [], []
    _reset_peak(clock)
    t0 = clock.now()
    stream = runner.layers(ids, range(layers))
    lse_from_forward = []
    for layer, q, k, _ in stream:
        lse = runner.row_lse  # the forward's row log-sum-exps (fused kernels on a GPU): pass 1 skipped
        lse_from_forward.append(lse is not None)
        a = clock.now()
        profiles(layer, q, k, lse=lse)
        b = clock.now()
        layer_scores(q, k, scale, cands, lse=lse)
        c = clock.now()
        stats_s.append(b - a)
        scores_s.append(c - b)
        per = runner.layer_seconds[-1] + stats_s[-1] + scores_s[-1]
        if layer + 1 < layers and clock.left() < per * 1.2:
            break
    stream.close()
    return {"layers_measured": len(stats_s), "setup_s": runner.setup_seconds,
            "forward_per_layer_s": runner.layer_seconds, "statistics_per_layer_s": stats_s,
            "scoring_per_layer_s": scores_s, "candidates": len(cands), "lse_from_forward": all(lse_from_forward),
            "seconds_measured": clock.now() - t0,
            "peak_gib": _peak_gib(clock)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _summarise(dense: dict, ana: dict | None) -> dict[str, Any]:
    """Seconds for the full 32 layers (measured when all 32 ran): dense prefill, capture + statistics,
    search evidence of one sample, and the ratio the bar reads."""
    full = lambda setup, per: setup + FULL_LAYERS * _mean(per)  # noqa: E731
    out: dict[str, Any] = {"dense_prefill_s": full(dense["setup_s"], dense["per_layer_s"])}
    if ana:
        fwd, st, sc = ana["forward_per_layer_s"], ana["statistics_per_layer_s"], ana["scoring_per_layer_s"]
        m = len(st)
        out["capture_statistics_s"] = full(ana["setup_s"], [f + s for f, s in zip(fwd[:m], st)])
        out["search_evidence_s"] = full(ana["setup_s"], [f + s for f, s in zip(fwd[:m], sc)])
        out["capture_statistics_over_dense"] = out["capture_statistics_s"] / out["dense_prefill_s"]
        out["statistics_over_dense_layer"] = _mean(st) / _mean(dense["per_layer_s"])
        out["search_evidence_minutes"] = out["search_evidence_s"] / 60
    measured = dense["layers_measured"] == FULL_LAYERS and (not ana or ana["layers_measured"] == FULL_LAYERS)
    out["extrapolated"] = None if measured else (
        f"setup + {FULL_LAYERS} x the mean of {min(dense['layers_measured'], ana['layers_measured'] if ana else 99)}"
        " measured layers")
    return out


def run(argv: list[str] | argparse.Namespace | None = None) -> int:
    import torch
    from workbench_benchmarks.analysis import write_part

    from workbench.core.device import resolve_device
    from workbench.core.model import ModelError
    from workbench.core.shapes import random_model, resolve_shape
    from workbench.core.stream import check_memory, default_chunk
    from workbench.core.timing import environment

    if not isinstance(argv, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="workbench bench analysis --part model", description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        argv = parser.parse_args(argv)
    args = argv
    points = _points(args.points)
    device = resolve_device(args.device)
    clock = _Clock(device, args.deadline_s)
    spec = resolve_shape(args.shape)
    max_n = max(n for n, _ in points)
    model, shape = random_model(args.shape, max(layers for _, layers in points), device,
                                max_positions=max(spec.max_positions, max_n))
    chunk = args.chunk or default_chunk(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result: dict[str, Any] = {
        "environment": environment(),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "model": {"shape": spec.name, "built_layers": shape.n_layers, "full_layers": FULL_LAYERS,
                  "dtype": str(next(model.parameters()).dtype), "weights_gib": round(weights / GIB, 2),
                  "chunk": chunk, "random_weights": model.workbench_random},
        "note": ("random weights: times and memory only. One analysis forward serves both measurements: capture + "
                 "statistics = forward + LayerProfiles (layer_stats, analyze's maps); search evidence = forward + "
                 "layer_scores(default_candidates(n)) for one sample. Points with fewer than 32 layers are "
                 "extrapolated to 32 (setup + 32 x mean measured layer)."),
        "points": [],
    }
    g = torch.Generator(device=device).manual_seed(0)
    warm = torch.randint(0, model.config.vocab_size, (min(8192, max_n),), device=device, generator=g)
    _analysis(model, shape, warm, 1, chunk, clock)  # compile / autotune the kernels outside the timings
    previous: dict[str, Any] | None = None
    for n, layers in points:
        print(f"n={n}, {layers} layers ({clock.left():.0f} s left)", flush=True)
        ids = torch.randint(0, model.config.vocab_size, (n,), device=device, generator=g)
        row: dict[str, Any] = {"n": n, "layers_requested": layers}
        scale2 = (n / previous["n"]) ** 2 if previous else None
        try:
            row["estimate_gib"] = {k: round(v / GIB, 2) for k, v in
                                   check_memory(model, shape, n, chunk, analysis="evidence").items()}
        except ModelError as e:
            row["estimate_refused"] = str(e)
        predict = scale2 * _mean(previous["dense"]["per_layer_s"]) if previous else None
        if predict is not None and predict > clock.left():
            row["skipped"] = f"one dense layer predicted at {predict:.0f} s, {clock.left():.0f} s left"
        else:
            try:
                row["dense"] = _dense(model, ids, layers, chunk, clock, predict)
                if n <= args.model_forward_max and clock.left() > row["dense"]["seconds_measured"] * 1.5:
                    with torch.no_grad():
                        t = clock.now()
                        model(ids[None], logits_to_keep=1)
                        row["model_forward_s"] = clock.now() - t  # transformers' own forward, all at once
                        row["model_forward_layers"] = shape.n_layers
                per = _mean(row["dense"]["per_layer_s"])
                guess = (per + sum(_mean(previous["analysis"][k]) for k in
                                   ("statistics_per_layer_s", "scoring_per_layer_s")) * scale2
                         if previous and previous.get("analysis") else per * 4)
                if "estimate_refused" in row:
                    row["analysis_skipped"] = "the memory estimate refuses this length"
                elif guess > clock.left():
                    row["analysis_skipped"] = f"one layer predicted at {guess:.0f} s, {clock.left():.0f} s left"
                else:
                    row["analysis"] = _analysis(model, shape, ids, layers, chunk, clock)
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"out of memory: {str(e).splitlines()[0][:300]}"
            if "dense" in row:
                row["summary"] = _summarise(row["dense"], row.get("analysis"))
                previous = row
        result["points"].append(row)
        print(json.dumps({k: row.get(k) for k in ("n", "summary", "error", "skipped", "analysis_skipped")},
                         default=str), flush=True)
        del ids
        write_part(args.out, "whole_model", result)
    result["bars"] = _bars(result["points"])
    result["elapsed_s"] = round(args.deadline_s - clock.left(), 1)
    write_part(args.out, "whole_model", result)
    print(json.dumps(result["bars"], indent=1))
    return 0


def _bars(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's bars on the longest point that has both measurements."""
    done = [p for p in points if "summary" in p and "capture_statistics_s" in p["summary"]]
    if not done:
        return {"met": None, "why": "no point completed the analysis"}
    p = max(done, key=lambda p: p["n"])
    s = p["summary"]
    longest = max([p["dense"]["seconds_measured"]] + [p.get("analysis", {}).get("seconds_measured", 0)])
    return {"n": p["n"], "capture_statistics_over_dense": round(s["capture_statistics_over_dense"], 3),
            "capture_statistics_bar_3x": s["capture_statistics_over_dense"] <= 3,
            "search_evidence_minutes_32_layers": round(s["search_evidence_minutes"], 2),
            "search_evidence_bar_30_min": s["search_evidence_minutes"] <= 30,
            "longest_measurement_s": round(longest, 1), "measurement_bar_600_s": longest <= 600}


if __name__ == "__main__":
    raise SystemExit(run())
