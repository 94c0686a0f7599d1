"""The flags every `workbench` command shares, one helper per flag, so that a flag is spelled, parsed and
explained the same way everywhere (the vocabulary is in the docstring of `workbench.cli`).

Parsing errors are argparse errors (usage, exit status 2) naming the flag; old spellings are kept only as
errors that name the new one (`renamed`). Checks that need the model (a length above its max length, a
layer it lacks) run right after it loads, before any output is written.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from workbench.core.device import DTYPES, check_device_map, parse_dtype, resolve_device
from workbench.core.ranges import parse_counts, parse_ranges


class Parser(argparse.ArgumentParser):
    """An ArgumentParser without prefix matching: `--len` or `--task` is an error, never silently another flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


# ---- types (argparse `type=`: bad text becomes "argument --flag: <why>") ------------------------------

def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: write e.g. 4096") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def int_list(text: str) -> list[int]:
    """"4096,8192" -> [4096, 8192] (`workbench.core.ranges.parse_counts`)."""
    try:
        return parse_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def layer_list(text: str) -> list[int]:
    """"0-3,7" -> [0, 1, 2, 3, 7] (`workbench.core.ranges.parse_ranges`)."""
    try:
        return parse_ranges(text, "layers")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def name_list(text: str) -> list[str]:
    """"passkey,code" -> ["passkey", "code"] (at least one name)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one name, comma-separated, e.g. passkey,code")
    return names


# ---- the shared flags ---------------------------------------------------------------------------------

def renamed(p: argparse.ArgumentParser, **old_to_new: str) -> None:
    """Old spellings (keyword: old flag without dashes, '_' for '-') that now stop with an error naming the
    new flag, e.g. renamed(p, context="--length")."""
    for old, new in old_to_new.items():
        p.add_argument(f"--{old.replace('_', '-')}", action=_Renamed, new=new, nargs="?", help=argparse.SUPPRESS)


class _Renamed(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is now {self.new} (one spelling for every command: "
                     "`workbench --help` lists them)")


def add_length(p: argparse.ArgumentParser, default: int | None, what: str = "prompt length in tokens") -> None:
    """--length N (one length); --lengths is refused naming it."""
    p.add_argument("--length", type=positive_int, default=default,
                   help=f"{what}" + (f" (default {default})" if default is not None else ""))
    renamed(p, lengths="--length (this command runs one length)")


def add_lengths(p: argparse.ArgumentParser, default: str, what: str = "prompt lengths in tokens") -> None:
    """--lengths N,M (one or more lengths); --length is refused naming it."""
    p.add_argument("--lengths", type=int_list, default=int_list(default),
                   help=f"{what}, comma-separated (default {default}; one value is fine)")
    renamed(p, length="--lengths (comma-separated; one value is fine)")


def add_tasks(p: argparse.ArgumentParser, default: str, what: str = "tasks", one: bool = False) -> None:
    """--tasks a,b: corpus tasks (passkey, multikey, vartrack, code) or UTF-8 text files; with `one`,
    the command runs a single task (`one_task`). --task / --sample are refused naming it."""
    p.add_argument("--tasks", type=name_list, default=name_list(default),
                   help=f"{what}: " + ("one of" if one else "comma-separated") + " passkey, multikey, vartrack, "
                   f"code or UTF-8 text files (default {default})")
    renamed(p, task="--tasks", sample="--tasks")


def add_layers(p: argparse.ArgumentParser, default: str | None, what: str = "layers") -> None:
    """--layers 0-3,7 (None: all layers)."""
    p.add_argument("--layers", type=layer_list, default=None if default is None else layer_list(default),
                   help=f"{what}: indices and ranges such as 0-3,7 (default {default or 'all'})")


def add_out(p: argparse.ArgumentParser, default: str | None, what: str, shown: str | None = None) -> None:
    """--out PATH: `what` says whether it is a file or a folder and what goes there; `shown`: the default as
    the help states it when the command computes it (e.g. from the model's name)."""
    p.add_argument("--out", default=default, help=f"{what} (default {shown or default or 'none'})")


def add_device(p: argparse.ArgumentParser, device_map: bool = False) -> None:
    """--device (default: cuda when available), --dtype (default float32) and, with `device_map`,
    --device-map (accelerate's layer placement, for models larger than one GPU)."""
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    p.add_argument("--dtype", default=None, help=f"model dtype: {', '.join(DTYPES)} (default float32, or the "
                   "command's GPU default)")
    if device_map:
        p.add_argument("--device-map", default=None,
                       help="place the model's layers over several GPUs with accelerate (auto, balanced, ...)")


def resolve_device_args(args: argparse.Namespace, gpu_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """{device, dtype, device_map} for `load_model`, validated (bad input raises naming the fix); without
    --dtype: float32 on the CPU, `gpu_dtype` on a GPU."""
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (gpu_dtype if device.type == "cuda" else torch.float32)
    device_map = check_device_map(getattr(args, "device_map", None), device)
    return {"device": device, "dtype": dtype, "device_map": device_map}


# ---- checks once the model or the inputs are known ----------------------------------------------------

def one_task(tasks: list[str]) -> str:
    """The single task of a command that runs one."""
    if len(tasks) != 1:
        raise ValueError(f"--tasks {','.join(tasks)}: this command runs one task; give one, e.g. --tasks passkey")
    return tasks[0]


def check_tasks(tasks: list[str], known: tuple[str, ...], flag: str = "--tasks") -> None:
    """Every task is a known name (a `name@depth` suffix allowed) or a readable UTF-8 text file."""
    from workbench.core.io import read_text

    for task in tasks:
        name = task.partition("@")[0]
        if name in known:
            continue
        if not Path(name).exists():
            raise ValueError(f"{flag} {task!r} is neither a task ({', '.join(known)}) nor an existing text file: "
                             "check the spelling or the path")
        read_text(name, f"{flag} text file")


def check_layers(layers: list[int] | None, n_layers: int, flag: str = "--layers") -> None:
    """Every index below the model's layer count."""
    if layers and max(layers) >= n_layers:
        raise ValueError(f"{flag} {max(layers)} is outside the model's layers 0-{n_layers - 1}: "
                         f"use indices from 0 to {n_layers - 1}, e.g. 0-3,7")


def check_lengths(lengths: list[int], max_positions: int, name: str, flag: str = "--lengths") -> None:
    """Every length within the model's max length (max_position_embeddings)."""
    if max(lengths) > max_positions:
        raise ValueError(f"{flag} {max(lengths)} exceeds {name}'s max length {max_positions} tokens "
                         f"(max_position_embeddings): use at most {max_positions}")


def out_file(path: str, flag: str = "--out") -> Path:
    """An output file path that is not a folder (checked before any work)."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{flag} {path} is a folder: give a file path, e.g. {out / 'result.json'}")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{flag} {path}: {parent} is a file, not a folder: choose another path")
    return out


def out_dir(path: str, flag: str = "--out") -> Path:
    """An output folder path that is not a file (checked before any work)."""
    out = Path(path)
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise ValueError(f"{flag} {path}: {p} is a file, and this command writes a folder: give a folder path")
    return out
