"""Wall time of every notebook at its default settings, executed top to bottom in a real Jupyter
kernel (nbclient) on this machine -> assets/benchmarks/notebooks_cpu.json.

    python benchmarks/notebooks_cpu.py [--timeout 900] [--out assets/benchmarks/notebooks_cpu.json]

The WORKBENCH_NB_* variables are cleared so each notebook runs at its own defaults; files the
notebooks write go to reports/notebooks (their default)."""
from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    import nbformat
    import torch
    from nbclient import NotebookClient

    from workbench.core.io import write_json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
    p.add_argument("--out", default=str(ROOT / "assets" / "benchmarks" / "notebooks_cpu.json"))
    args = p.parse_args()
    for key in [k for k in os.environ if k.startswith("WORKBENCH_NB_")]:
        del os.environ[key]
    rows = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        seconds = time.perf_counter() - t0
        rows.append({"notebook": path.name, "seconds": round(seconds, 1), "cells": len(nb.cells)})
        print(f"{path.name}: {seconds:.0f} s", flush=True)
    write_json(args.out, {
        "what": "each notebook executed top to bottom at its default settings (WORKBENCH_NB_* unset), real Jupyter kernel",
        "command": "python benchmarks/notebooks_cpu.py",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()], "gpu": torch.cuda.is_available()},
        "bar_seconds_each": 300, "notebooks": rows, "all_within_bar": all(r["seconds"] <= 300 for r in rows)})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
