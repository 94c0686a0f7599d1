"""`workbench export`: convert head configs: to MInference's format (whole or one tensor-parallel rank),
from it (strict; only the model's shape is needed), to FlexAttention masks, or print the JSON Schema."""
from __future__ import annotations

import argparse

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
    p.add_argument("--fill-missing", action="store_true",
                   help="with --from minference: give heads the file lacks MInference's default vertical_and_slash "
                        "(1000, 6096) and read keys with int(), warning for each, instead of refusing the file")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: with --rank, export one rank's view")
    p.add_argument("--rank", type=int, default=None,
                   help="tensor-parallel rank to export: workbench format numbers its heads locally; minference format "
                        "keys them rank * H/T + local, the ids MInference's vLLM path looks up on that rank")
    p.add_argument("--length", type=int, default=None, help="sequence length of the flex masks (tokens)")
    p.add_argument("--out", default=None, help="output file (default: print to stdout; required for flex)")
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

        return load_model(args.model)[2]
    return None


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from workbench.config import SCHEMA, HeadConfig
    from workbench.core.io import write_json

    if args.format == "schema":
        data = SCHEMA
    else:
        if not args.config:
            raise ValueError("give the config file to export, e.g. `workbench export configs/SmolLM2-135M-Instruct.json`")
        shape = shape_of(args)
        if args.source == "minference":
            if shape is None:
                raise ValueError("--from minference needs the model's shape: add --shape MODEL (a config.json, a cached "
                                 "hub id or a named shape such as Llama-3-8B-262k) or --model MODEL")
            cfg = HeadConfig.load_minference(Path(args.config), shape, fill_missing=args.fill_missing)
        else:
            if args.fill_missing:
                raise ValueError("--fill-missing applies to MInference files: add --from minference")
            cfg = HeadConfig.load(Path(args.config), shape)
        if args.rank is not None:
            cfg = cfg.for_rank(args.rank, args.tp)
        elif args.tp != 1:
            raise ValueError("--tp needs --rank: say which rank's view to export")
        if args.format == "check":
            where = f" matches {shape.name}" if shape is not None else " is well formed (add --shape to check a model)"
            print(f"{args.config}{where}: {len(cfg.heads)} heads, {cfg.summary()}")
            return 0
        if args.format == "flex":
            from workbench.prefill.flex import save_masks

            if not args.out or not args.length:
                raise ValueError("--format flex writes a torch file: give --length N (tokens) and --out FILE.pt")
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
        print(json.dumps(data, indent=1))
    return 0
