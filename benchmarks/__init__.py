"""Every benchmark, imported as `workbench_benchmarks`: a module with `add_arguments(parser)` and
`run(args) -> int` that prints what it measured and writes JSON with `workbench.core.timing.environment()`.
Run them as `workbench bench WHAT` (or `python -m workbench_benchmarks.MODULE`)."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def standalone(add_arguments: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], int], description: str | None = None) -> int:
    """`python -m workbench_benchmarks.MODULE ARGS`: the same as `workbench bench WHAT ARGS`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args())
