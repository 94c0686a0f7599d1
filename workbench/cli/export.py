"""`workbench export`: convert head configs: to MInference's format (whole or one tensor-parallel rank),
from it (strict; only the model's shape is needed), to FlexAttention masks, or print the JSON Schema.

A rank's view (`--tp T --rank R`) records that it is one: exporting a view again writes its heads under
their global ids, and splitting it again maps through them (or refuses, naming the heads it lacks)."""
from __future__ import annotations

import argparse

from workbench.cli._args import add_device, add_length, add_out, positive_int, resolve_device_args

SHAPE_HELP = ("the model's shape without weights: a config.json path (or its folder), a hub id in the local "
              "Hugging Face cache, or a named shape ({names})")


def register(sub: argparse._SubParsersAction) -> None:
    from workbench.core.shapes import NAMED

    p = sub.add_parser("export", help="export a head config to MInference / FlexAttention (or import a MInference one)",
                       description=__doc__)
    p.add_argument("config", nargs="?", help="a workbench head config (or, with --from minference, a MInference one)")
    p.add_argument("--format", choices=("minference", "workbench", "flex", "check", "schema"), default="minference",
                   help="output: minference (default), workbench, flex (torch.save of the static layers' FlexAttention "
                        "masks at --length; layers with Vertical-Slash / block heads need a prompt and are listed), "
                        "check (validate and summarise only), schema (the head-config JSON Schema)")
    p.add_argument("--from", dest="source", choices=("workbench", "minference"), default="workbench",
                   help="format of the input file (default workbench)")
    p.add_argument("--shape", default=None, help=SHAPE_HELP.format(names=", ".join(NAMED)))
    p.add_argument("--model", default=None,
                   help="or load the model itself (weights; a folder, a hub id, or 'embedded') to get its shape")
    add_device(p)
    p.add_argument("--fill-missing", action="store_true",
                   help="with --from minference: give heads the file lacks MInference's default vertical_and_slash "
                        "(1000, 6096) and read keys with int(), warning for each, instead of refusing the file")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size: with --rank, export one rank's view")
    p.add_argument("--rank", type=int, default=None,
                   help="tensor-parallel rank to export: workbench format numbers its heads locally; minference format "
                        "keys them rank * H/T + local, the ids MInference's vLLM path looks up on that rank")
    add_length(p, None, what="sequence length of the flex masks in tokens, at most the model's max length")
    add_out(p, None, "output file: JSON, or a torch file for --format flex (required there); none prints the JSON")
    p.set_defaults(func=run)


def shape_of(args: argparse.Namespace):
    """The ModelShape named by --shape or --model (None when neither is given)."""
    if args.shape and args.model:
        raise ValueError("give --shape or --model, not both")
    if args.shape:
        from workbench.core.shapes import resolve_shape

        return resolve_shape(args.shape)
    if args.model:
        from workbench.core.model import load_model

        return load_model(args.model, **resolve_device_args(args))[2]
    return None


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from workbench.cli._args import out_file
    from workbench.config import SCHEMA, HeadConfig
    from workbench.core.io import json_safe, write_json

    if args.out:
        out_file(args.out)
    if args.format == "schema":
        data = SCHEMA
    else:
        if not args.config:
            raise ValueError("give the config file to export, e.g. `workbench export reports/configs/MODEL.json`")
        if args.format == "flex" and not (args.out and args.length):
            raise ValueError("--format flex writes a torch file: give --length N (tokens) and --out FILE.pt")
        shape = shape_of(args)
        if args.source == "minference":
            if shape is None:
                raise ValueError("--from minference needs the model's shape: add --shape MODEL (a config.json, a cached "
                                 "hub id or a named shape such as Llama-3-8B-262k) or --model MODEL")
            cfg = HeadConfig.load_minference(Path(args.config), shape, fill_missing=args.fill_missing)
        else:
            if args.fill_missing:
                raise ValueError("--fill-missing applies to MInference files: add --from minference")
            cfg = HeadConfig.load(Path(args.config))
            if shape is not None:  # a rank's view matches the shape one rank of that model sees
                view = cfg.rank_view
                cfg.validate(shape if view is None else _rank_shape(shape, view["size"]))
        if args.rank is not None:
            cfg = cfg.for_rank(args.rank, args.tp)
        elif args.tp != 1:
            raise ValueError("--tp needs --rank: say which rank's view to export")
        if args.format == "check":
            where = f" matches {shape.name}" if shape is not None else " is well formed (add --shape to check a model)"
            kind = f" ({cfg.describe_rank_view()})" if cfg.rank_view else ""
            print(f"{args.config}{where}{kind}: {len(cfg.heads)} heads, {cfg.summary()}")
            return 0
        if args.format == "flex":
            from workbench.prefill.flex import save_masks

            limit = cfg.model["max_positions"]
            if args.length > limit:
                raise ValueError(f"--length {args.length} exceeds the config's model max length {limit} tokens "
                                 f"(model.max_positions of {cfg.model['name']}): use at most {limit}")
            saved = save_masks(cfg, args.length, args.out)
            print(f"wrote {args.out}: FlexAttention masks of {len(saved['layers'])} static layers at n={args.length}; "
                  f"{len(saved['online'])} layers with Vertical-Slash / block heads need the prompt's q/k "
                  "(workbench.prefill.flex.block_mask)")
            return 0
        data = cfg.to_minference() if args.format == "minference" else cfg.to_dict()
    if args.out:
        write_json(args.out, data)
        print(f"wrote {args.out}")
    else:
        print(json.dumps(json_safe(data), indent=1, allow_nan=False))
    return 0


def _rank_shape(shape, tp_size: int):
    """The shape one of `tp_size` tensor-parallel ranks sees (`search.distributed.local_shape`)."""
    from workbench.search.distributed import local_shape

    return local_shape(shape, tp_size)
