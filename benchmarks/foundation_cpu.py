"""`workbench bench foundation`: the embedded model on the CPU: warm model load, capture at each length,
then the statistics of every head (`layer_stats`, the maps in `--maps`, default all) at the longest length,
with the extra peak memory they take -> assets/benchmarks/foundation_cpu.json. Run it on a quiet machine:
the JSON records the load average (1, 5, 15 min) at the start and just before and after the statistics,
which says what else ran.
"""
from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="2048,4096,8192", help="capture lengths; statistics at the last (default "
                   "2048,4096,8192)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--maps", default="all", help="comma-separated LayerStats maps to compute (default all: "
                   "max_map,mean_map,block_mass,column_mass,diag_mass,row_entropy)")
    p.add_argument("--out", default="reports/benchmarks/foundation_cpu.json", help="JSON output path")


def rss_mb(field: str) -> float:
    """`VmRSS` (now) or `VmHWM` (peak) of this process from /proc/self/status, in MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_peak_rss() -> bool:
    """Restart the VmHWM peak at the current RSS (Linux clear_refs "5"), so that the peak of the statistics
    phase is not hidden under the capture's; False where the kernel refuses (then VmHWM is the lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from workbench.analysis.stats import MAPS, layer_stats
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.core.timing import environment

    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths {args.lengths!r} must be comma-separated integers, e.g. 2048,4096,8192") from None
    if not lengths:
        raise ValueError("--lengths is empty: give at least one length, e.g. 8192")
    maps = MAPS if args.maps == "all" else tuple(m.strip() for m in args.maps.split(",") if m.strip())
    if not set(maps) <= set(MAPS) or not maps:
        raise ValueError(f"--maps {args.maps!r} must be 'all' or a comma-separated subset of {','.join(MAPS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = [round(x, 2) for x in os.getloadavg()]
    t = time.perf_counter()
    model, tok, shape = load_model()
    rows = {"warm_load_s": round(time.perf_counter() - t, 2), "capture_s": {}}  # the cache exists after any first run
    for n in lengths:
        ids = make_sample("passkey", tok, n, seed=0).input_ids
        t = time.perf_counter()
        cap = capture_attention(model, shape, ids, progress=False)
        rows["capture_s"][n] = round(time.perf_counter() - t, 2)
    peak_reset = reset_peak_rss()
    before = rss_mb("VmRSS")
    load_stats = [round(x, 2) for x in os.getloadavg()]
    t, cpu = time.perf_counter(), time.process_time()
    for layer in cap.layers:
        q, k, _ = cap.layer_qkv(layer)
        layer_stats(q, k, cap.scale, maps=maps)
    seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
    rows["stats"] = {"length": lengths[-1], "heads": len(cap.layers) * shape.n_heads, "seconds": round(seconds, 1),
                     "seconds_per_layer": round(seconds / len(cap.layers), 2), "bar_seconds": 60,
                     "cpu_seconds_all_threads": round(cpu_seconds, 1),
                     "extra_peak_rss_mb": round(rss_mb("VmHWM") - before, 1), "peak_reset_before_stats": peak_reset,
                     "bar_extra_mb": 2048, "maps": list(maps),
                     "load_average_1_5_15_before_after": [load_stats, [round(x, 2) for x in os.getloadavg()]]}
    rows["environment"] = {**environment(), "load_average_1_5_15_at_start": load_before}
    write_json(args.out, rows)
    print(rows)
    print(f"wrote {args.out}: statistics of {rows['stats']['heads']} heads at {lengths[-1]} tokens in {seconds:.1f} s "
          f"(bar 60 s), extra peak {rows['stats']['extra_peak_rss_mb']} MB")
    return 0


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
