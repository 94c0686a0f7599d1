"""`--random-weights SHAPE` and `--chunk N` for the commands that analyse a whole model layer by layer
(`workbench analyze`, `workbench search`), and the model and samples they then run on."""
from __future__ import annotations

import argparse
import sys
import zlib
from typing import Any

import torch

from workbench.cli._args import resolve_device_args


def add_stream_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-weights", metavar="SHAPE", default=None,
                   help="size a run without weights: a model of this shape (a name as in `workbench export --shape`, "
                        "a config.json or a cached hub id) with random weights, built on the device in bf16 (GPU); "
                        "--layers 0-3 builds only the layers up to the last one asked for. Random token ids; "
                        "the results mean nothing (time and memory only)")
    p.add_argument("--chunk", type=int, default=None,
                   help="query rows per call of each decoder layer in the layer-by-layer forward (default 32768 on "
                        "a GPU, 4096 on the CPU); smaller uses less memory")


def load_for_stream(args: argparse.Namespace, layers: list[int] | None) -> tuple[Any, Any, Any]:
    """(model, tokenizer or None, ModelShape): `--model` loaded, or a `--random-weights` model (tokenizer None),
    whose requested layers and length are checked against the named shape before it is built."""
    from workbench.core.model import load_model

    if args.chunk is not None and args.chunk < 1:
        raise ValueError(f"--chunk {args.chunk}: give a positive number of query rows, e.g. 8192")
    if not args.random_weights:
        return load_model(args.model, **resolve_device_args(args))
    from workbench.core.shapes import random_model, resolve_shape

    if args.model:
        raise ValueError("--random-weights builds a model of that shape instead of loading --model: give one of them")
    where = resolve_device_args(args, gpu_dtype=torch.bfloat16)
    if where["device_map"] is not None:
        raise ValueError("--random-weights builds the model on one device: leave out --device-map")
    shape = resolve_shape(args.random_weights)
    for layer in layers or ():
        shape.check_layer(layer)
    for n in _lengths(args):
        shape.check_length(n)
    model, shape = random_model(args.random_weights, max(layers) + 1 if layers else None, where["device"],
                                where["dtype"], seed=args.seed)
    print(f"workbench {args.command}: {shape.name}: {model.workbench_random}", file=sys.stderr)
    return model, None, shape


def _lengths(args: argparse.Namespace) -> list[int]:
    """The prompt lengths a command asks for (`--lengths` or `--length`)."""
    return list(getattr(args, "lengths", None) or [args.length])


def random_sample(model: Any, length: int, seed: int, task: str = "random"):
    """A `Sample` of `length` random token ids (seeded by task and seed) for a random-weight model."""
    from workbench.core.corpus import Sample

    g = torch.Generator().manual_seed(zlib.crc32(f"{task}:{length}:{seed}".encode()))
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=g)
    return Sample(task, ids, "", seed, meta={"tokens": "random ids (random weights: time and memory only)"})


def stream_sample(args: argparse.Namespace, tokenizer: Any, shape: Any, task: str, model: Any = None):
    """`task` at `--length` for a loaded model, or random ids for a random-weight one (tokenizer None)."""
    from workbench.core.corpus import make_sample

    if tokenizer is None:
        return random_sample(model, shape.check_length(args.length), args.seed)
    return make_sample(task, tokenizer, args.length, seed=args.seed, max_length=shape.max_positions)
