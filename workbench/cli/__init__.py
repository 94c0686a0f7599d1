"""`workbench` command line: one subcommand per module of this package (each has `register(subparsers)`).

One flag vocabulary for every command (helpers in `workbench.cli._args`; flags are never abbreviated):

    --length N           one prompt length in tokens           (analyze, decode, dashboard, export, forecast report)
    --lengths N,M        several prompt lengths                (search, compare, prefill quality, forecast train)
    --tasks a,b          corpus tasks (passkey, multikey, vartrack, code) or UTF-8 text files; commands that
                         run one task take one name (analyze, decode, dashboard, prefill quality)
    --layers 0-3,7       layer indices and ranges (default: all, or the command's sample of layers)
    --out PATH           where the command writes: a file or a folder, as its --help says; defaults go under
                         reports/, so no default ever overwrites a shipped or committed file
    --model M            a local Hugging Face folder or a hub id (default: the embedded SmolLM2-135M-Instruct)
    --device, --dtype    wherever a model is loaded (default: cuda when visible; float32, or the command's
                         GPU dtype)

Older spellings (--context, --task, --sample, --json, --configs-dir, --length for several lengths) stop with
an error naming the new flag. Shipped head configs and Forecast heads are package data (`workbench.data`),
so every command runs from any folder.

Errors: a library error (ValueError and its kinds: ConfigError, ModelError, DeviceError) or a file error
(OSError: missing, a folder, permission denied ...) prints one line `workbench COMMAND: error: ...` naming
the file, field or flag and the fix, and exits with status 2; usage errors exit with 2 too. Any other
exception is a bug and shows its traceback; WORKBENCH_TRACEBACK=1 shows it for every error. Warnings print
as `workbench COMMAND: warning: ...`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import warnings

from workbench import __version__
from workbench.cli._args import Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="workbench", description="Sparse attention workbench for long-context LLMs.")
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # helpers shared by subcommands (e.g. _args)
            continue
        importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2), --help and --version (0): a status, also when called in-process
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    name = " ".join(["workbench", args.command, *(getattr(args, k) for k in ("what", "verb") if getattr(args, k, None))])
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, **__: print(f"{name}: warning: {message}", file=sys.stderr)
        try:
            return int(args.func(args) or 0)
        except (ValueError, OSError) as e:  # our errors name the problem and the fix
            if os.environ.get("WORKBENCH_TRACEBACK"):
                raise
            print(f"{name}: error: {_message(e)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{name}: interrupted", file=sys.stderr)
            return 130


_OS_HINTS = {  # OSError kind -> the fix, for errors raised outside our own readers (which say it themselves)
    IsADirectoryError: "it is a folder: give a file",
    NotADirectoryError: "a part of the path is a file, not a folder: choose another path",
    PermissionError: "permission denied: fix the permissions or choose another path",
    FileNotFoundError: "no such file or folder: check the path",
    FileExistsError: "it exists already: choose another path",
}


def _message(e: Exception) -> str:
    """One line for an error: ours carry their own text; a bare OSError gets its path and the fix."""
    if isinstance(e, OSError) and e.filename is not None:
        hint = next((h for kind, h in _OS_HINTS.items() if isinstance(e, kind)), e.strerror or "cannot be used")
        return f"{e.filename}: {hint}"
    if isinstance(e, UnicodeDecodeError):
        return (f"a file is not UTF-8 text ({e.reason} at byte {e.start}): give a UTF-8 text file, or re-save it "
                "as UTF-8")
    return str(e).replace("\n", " ")
