"""`workbench bench WHAT`: GPU benchmarks that print side-by-side ratios and write JSON with their environment.

Each benchmark is a module with `add_arguments(parser)` and `run(args) -> int` that imports its heavy
dependencies inside `run`; add one by adding a line to `BENCHMARKS`.
"""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {  # what: (module, one-line help)
    "prefill": ("workbench_benchmarks.kernels_prefill",
                "sparse prefill kernels vs dense SDPA and FlexAttention (H200; synthetic inputs)"),
    "search": ("workbench_benchmarks.search_distributed",
               "per-head search over torchrun ranks (random Llama-3-8B shape): N GPUs vs one"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="GPU benchmarks (prefill, ...)", description=__doc__)
    what = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        sub = what.add_parser(name, help=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(sub)
        sub.set_defaults(func=mod.run)
