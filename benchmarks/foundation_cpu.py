"""Foundation benchmark on the CPU: model load (cold/warm), capture at 2K/4K/8K, statistics for all heads at 8K.

Writes assets/benchmarks/foundation_cpu.json. Run: python benchmarks/foundation_cpu.py
"""
from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

from workbench.core.capture import capture_attention
from workbench.core.corpus import make_sample
from workbench.core.io import write_json
from workbench.core.model import load_model
from workbench.analysis.stats import layer_stats


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    t = time.perf_counter()
    model, tok, shape = load_model()
    warm_load = time.perf_counter() - t  # the cache exists after the first run of anything
    rows = {"warm_load_s": round(warm_load, 2), "capture_s": {}, "stats_8k": {}}
    for n in (2048, 4096, 8192):
        ids = make_sample("passkey", tok, n, seed=0).input_ids
        t = time.perf_counter()
        cap = capture_attention(model, shape, ids, progress=False)
        rows["capture_s"][n] = round(time.perf_counter() - t, 2)
    before = peak_rss_mb()
    t = time.perf_counter()
    for layer in cap.layers:
        q, k, _ = cap.layer_qkv(layer)
        layer_stats(q, k, cap.scale)
    rows["stats_8k"] = {"heads": shape.n_layers * shape.n_heads, "seconds": round(time.perf_counter() - t, 1),
                        "extra_peak_rss_mb": round(peak_rss_mb() - before, 1)}
    rows["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                       "torch": torch.__version__, "note": os.environ.get("BENCH_NOTE", "")}
    rows["command"] = "python " + " ".join(sys.argv)
    rows["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(rows, indent=1))
    write_json("assets/benchmarks/foundation_cpu.json", rows)


if __name__ == "__main__":
    main()
