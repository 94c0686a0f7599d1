"""`workbench bench notebooks`: wall time of every notebook at its default settings, executed top to
bottom in a real Jupyter kernel (nbclient) on this machine -> assets/benchmarks/notebooks_cpu.json.

The WORKBENCH_NB_* variables are cleared so each notebook runs at its own defaults; files the
notebooks write go to reports/notebooks (their default)."""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
    p.add_argument("--out", default="reports/benchmarks/notebooks_cpu.json", help="JSON output path")


def run(args: argparse.Namespace) -> int:
    import nbformat
    from nbclient import NotebookClient

    from workbench.core.io import write_json
    from workbench.core.timing import environment

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
        "environment": environment(),  # its load average is read at the end
        "bar_seconds_each": 300, "notebooks": rows, "all_within_bar": all(r["seconds"] <= 300 for r in rows)})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
