"""`workbench` command line: one subcommand per module of this package (each has `register(subparsers)`)."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from workbench import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="Sparse attention workbench for long-context LLMs.")
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # helpers shared by subcommands (e.g. _device)
            continue
        importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # our errors name the problem and the fix
        print(f"workbench {args.command}: error: {e}", file=sys.stderr)
        return 2
