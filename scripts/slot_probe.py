"""Exploratory (GPU): does a kernel timed right after dense SDPA run slower, and is it the clock?

Session 19 found a short kernel timed right after a 55-250 ms dense SDPA call reading up to 12 % slower than one
batch later, and guessed the GPU's clocks after dense SDPA's power draw. Here each measured batch (a kernel queued
for about `--batch-ms` between two CUDA events) follows one prelude of about `--prelude-ms`, queued just before it with no
sync between: `idle` (the host sleeps, the GPU has nothing), `dense` (dense causal SDPA), `gemm` (bf16 matmuls of
8192^3), `same` (the measured kernel itself: its steady state). Kernels measured, on the bench's planted inputs (Llama
32/8/128): the A-shape layer's Gluon route (`ashape_prefill`, sink 128, window 4096), Vertical-Slash (1000, 6096)
as the bench's default runs it (`sparse_prefill` on `vs_tiles(head_columns=True)`) and dense SDPA; with `--kernels`
also every causal 64-row tile through the loop VS takes (`ring_dense`: `sparse_prefill` on all causal block tiles,
per-head rings) and through A-shape's shared ring (`shared_dense`: `ashape_prefill` without sink or band limit), so
the energy per computed tile of the tile loop itself reads beside VS's and cuDNN's. Conditions are interleaved over
`--rounds` rounds; medians.
`nvidia-smi -lms` samples SM clock, power and throttle reasons meanwhile; each batch's window (host time after its
end event, minus its GPU time) picks the samples that fall in it.

    python3 scripts/slot_probe.py --lengths 65536,131072 --out slot_probe.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import vs_index, vs_tiles
from workbench_kernels.index_ref import selected_block_tiles, tile_area
from workbench_kernels.prefill import ashape_prefill, sparse_prefill
from workbench_kernels.tiling import NO_WINDOW

from workbench.core.io import write_json
from workbench.core.timing import environment

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,{}.active"


def sampler(path: str, every_ms: int) -> subprocess.Popen:
    """nvidia-smi writing a line every `every_ms` to `path` (the throttle field under its newer or older name)."""
    for reasons in ("clocks_event_reasons", "clocks_throttle_reasons"):
        fields = FIELDS.format(reasons)
        if subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv"], capture_output=True).returncode == 0:
            break
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", f"-lms={every_ms}",
                             "-f", path])


def samples(path: str) -> list[tuple[float, float, float, str]]:
    """(unix time, SM MHz, watts, throttle reasons) per line nvidia-smi wrote."""
    out = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            t = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
            out.append((t, float(parts[1]), float(parts[2]), parts[4]))
        except (ValueError, IndexError):
            continue
    return out


def run_slot(prelude, fn, reps: int) -> tuple[float, float, float]:
    """(ms per call of fn, host time of the batch's start, of its end): prelude, then `reps` calls between events."""
    torch.cuda.synchronize()
    prelude()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    end = time.time()
    ms = a.elapsed_time(b)
    return ms / reps, end - ms / 1000, end


def repeat(fn, ms_each: float, total_ms: float):
    count = max(1, round(total_ms / ms_each))
    return lambda: [fn() for _ in range(count)]


def one_length(args: argparse.Namespace, n: int, log: list) -> dict:
    hq, hkv, d, theta = SHAPES["llama3-8b"]
    q, k, v = planted_inputs(hq, hkv, d, n, theta)
    sink, window = torch.full((hq,), args.sink), torch.full((hq,), args.window)
    tiles = vs_tiles(*vs_index(q, k, d ** -0.5, 1000, 6096), n, head_columns=True)
    m = torch.arange(-(-n // 64), device="cuda")
    every = selected_block_tiles(torch.where(m[None, :] <= m[:, None], m[None, :], -1).expand(1, hq, len(m), len(m)))
    no_limit = torch.full((hq,), NO_WINDOW)
    kernels = {"ashape": lambda: ashape_prefill(q, k, v, sink, window),
               "vertical_slash": lambda: sparse_prefill(q, k, v, tiles),
               "dense": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                 enable_gqa=True),
               "ring_dense": lambda: sparse_prefill(q, k, v, every),
               "shared_dense": lambda: ashape_prefill(q, k, v, torch.zeros(hq, dtype=torch.long), no_limit)}
    kernels = {name: kernels[name] for name in args.kernels.split(",")}
    causal = n * (n + 1) / 2
    area = {name: tile_area(t, n).float().mean().item() / causal  # of the causal area
            for name, t in (("vertical_slash", tiles), ("ring_dense", every))}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: a @ a  # noqa: E731
    one = {}
    for name, fn in {**kernels, "gemm": gemm}.items():
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one[name] = (time.perf_counter() - t) * 1000
    preludes = {"idle": lambda: time.sleep(args.prelude_ms / 1000),
                "dense": repeat(kernels["dense"], one["dense"], args.prelude_ms),
                "gemm": repeat(gemm, one["gemm"], args.prelude_ms)}
    times: dict[str, dict[str, list[float]]] = {k_: {} for k_ in kernels}
    for r in range(args.rounds):
        for kname, fn in kernels.items():
            reps = max(1, round(args.batch_ms / one[kname]))
            order = list(preludes) + ["same"]
            for slot in order[r % len(order):] + order[: r % len(order)]:
                pre = preludes.get(slot) or repeat(fn, one[kname], args.prelude_ms)
                ms, t0, t1 = run_slot(pre, fn, reps)
                times[kname].setdefault(slot, []).append(ms)
                log.append({"n": n, "kernel": kname, "slot": slot, "round": r, "ms": ms, "t0": t0, "t1": t1})
    return {"n": n, "one_call_ms": one, "tile_area_of_causal": area,
            "median_ms": {kn: {s: statistics.median(v_) for s, v_ in d_.items()} for kn, d_ in times.items()},
            "all_ms": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--prelude-ms", type=float, default=250.0)
    p.add_argument("--batch-ms", type=float, default=100.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kernels", default="ashape,vertical_slash,dense",
                   help="of ashape, vertical_slash, dense, ring_dense, shared_dense")
    p.add_argument("--sample-ms", type=int, default=10)
    p.add_argument("--out", default="slot_probe.json")
    args = p.parse_args()
    smi = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    proc = sampler(smi, args.sample_ms)
    time.sleep(1.0)
    result = {"environment": environment(), "settings": vars(args), "rows": []}
    log: list[dict] = []
    try:
        for n in [int(x) for x in args.lengths.split(",")]:
            result["rows"].append(one_length(args, n, log))
            torch.cuda.empty_cache()
    finally:
        time.sleep(0.5)
        proc.terminate()
        proc.wait()
    smp = samples(smi)
    for entry in log:  # the samples inside each measured batch
        inside = [s for s in smp if entry["t0"] <= s[0] <= entry["t1"]]
        entry["samples"] = len(inside)
        if inside:
            entry["sm_mhz"] = statistics.mean(s[1] for s in inside)
            entry["watts"] = statistics.mean(s[2] for s in inside)
            entry["throttle"] = sorted({s[3] for s in inside})
    for row in result["rows"]:
        for key, field in (("sm_mhz_median", "sm_mhz"), ("watts_median", "watts")):
            row[key] = {kn: {slot: statistics.median([e[field] for e in log if e["n"] == row["n"] and e["kernel"] == kn
                                                      and e["slot"] == slot and field in e] or [float("nan")])
                             for slot in row["median_ms"][kn]} for kn in row["median_ms"]}
        print(json.dumps({k_: row[k_] for k_ in ("n", "median_ms", "sm_mhz_median", "watts_median")}), flush=True)
    result["batches"] = log
    result["samples_taken"] = len(smp)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
