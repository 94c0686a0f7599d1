"""`workbench bench WHAT`: every benchmark of the project; each prints what it measured and writes JSON
with its environment (`workbench.core.timing.environment`: GPU, driver, versions, CPU, load, command).

Results go under reports/benchmarks/ unless --out says otherwise: a committed result is written with an
explicit `--out assets/benchmarks/NAME.json`, so no default run replaces one.

Each benchmark is a module of `workbench_benchmarks` (the folder benchmarks/) with `add_arguments(parser)`
and `run(args) -> int`; `python -m workbench_benchmarks.MODULE` runs the same code. Add one by adding a
line to `BENCHMARKS`.
"""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {  # what: (module, one-line help)
    "analysis": ("workbench_benchmarks.analysis", "GPU: statistics and search scoring of one layer vs dense SDPA, random q/k/v"),
    "kernels": ("workbench_benchmarks.kernels_prefill",
                "GPU: sparse prefill kernels (index + Triton kernel) vs dense SDPA and FlexAttention, synthetic q/k/v"),
    "prefill": ("workbench_benchmarks.prefill_e2e",
                "GPU: end-to-end prefill of a random-weight Llama-3-8B shape, dense vs sparse, per-layer breakdown"),
    "decode": ("workbench_benchmarks.decode",
               "GPU: the offloaded decode engine's modes on a random-weight Llama-3-8B shape"),
    "search": ("workbench_benchmarks.search",
               "per-head search time: the embedded model on the CPU, or a random Llama-3-8B over torchrun ranks"),
    "dashboard": ("workbench_benchmarks.dashboard_cpu", "CPU: dashboard first paint and one head edit"),
    "notebooks": ("workbench_benchmarks.notebooks_cpu", "CPU: every notebook top to bottom in a real kernel"),
    "foundation": ("workbench_benchmarks.foundation_cpu",
                   "CPU: model load, capture at 2K/4K/8K, statistics of every head at 8K"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks that write JSON with their environment "
                                   f"({', '.join(BENCHMARKS)})", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        mod = importlib.import_module(module)
        sub = what.add_parser(name, help=help_text, description=mod.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sub)
        sub.set_defaults(func=mod.run)
