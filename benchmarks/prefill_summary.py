"""Print a compact table of a `workbench bench kernels` JSON (default: assets/benchmarks/prefill_h200.json)."""
from __future__ import annotations

import json
import sys


def main(path: str = "assets/benchmarks/prefill_h200.json") -> None:
    data = json.load(open(path))
    print({k: v for k, v in data.get("environment", {}).items() if k != "inputs"})
    if "tuned" in data:
        print("tuned:", data["tuned"])
    cols = ["shape", "n", "kernel", "block", "num_warps", "num_stages", "longest_first", "time_ms", "index_ms",
            "logical_density", "physical_density", "effective_tflops", "ratio_to_dense_tflops", "speedup_vs_dense",
            "index_share_of_kernel", "flex_time_ms", "flex_compile_ms", "speedup_vs_flex", "flex_physical_density",
            "max_abs_diff_vs_flex"]
    short = {"longest_first": "lf", "num_warps": "w", "num_stages": "s", "logical_density": "logd",
             "physical_density": "physd", "effective_tflops": "tflops", "ratio_to_dense_tflops": "r_dense",
             "speedup_vs_dense": "x_dense", "index_share_of_kernel": "idx_sh", "flex_time_ms": "flex_ms",
             "flex_compile_ms": "flex_comp", "speedup_vs_flex": "x_flex", "flex_physical_density": "flex_d",
             "max_abs_diff_vs_flex": "dflex"}
    print(" ".join(short.get(c, c) for c in cols))
    for r in data["rows"]:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        extra = r.get("flex_error") or r.get("error") or r.get("flex_skipped") or ""
        print(" ".join(cells), extra[:120])


if __name__ == "__main__":
    main(*sys.argv[1:])
