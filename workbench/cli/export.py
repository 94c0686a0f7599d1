"""`workbench export`: convert head configs (to MInference's format, from it, or print the JSON Schema)."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a head config to MInference's format (or import one)",
                       description=__doc__)
    p.add_argument("config", nargs="?", help="a workbench head config (or, with --from minference, a MInference one)")
    p.add_argument("--format", choices=("minference", "workbench", "schema"), default="minference",
                   help="output format (default minference); 'schema' writes the head-config JSON Schema")
    p.add_argument("--from", dest="source", choices=("workbench", "minference"), default="workbench",
                   help="format of the input file (default workbench)")
    p.add_argument("--model", default=None,
                   help="model the MInference file belongs to (needed with --from minference; default embedded)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size: with --rank, export one rank's view")
    p.add_argument("--rank", type=int, default=None, help="tensor-parallel rank to export (local head numbering)")
    p.add_argument("--out", default=None, help="output file (default: print to stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from workbench.search.config import SCHEMA, HeadConfig
    from workbench.core.io import write_json

    if args.format == "schema":
        data = SCHEMA
    else:
        if not args.config:
            raise ValueError("give the config file to export, e.g. `workbench export configs/SmolLM2-135M-Instruct.json`")
        path = Path(args.config)
        if args.source == "minference":
            from workbench.core.model import load_model

            if not path.exists():
                raise FileNotFoundError(f"{path} does not exist: give an existing MInference config file")
            _, _, shape = load_model(args.model)
            cfg = HeadConfig.from_minference(json.loads(path.read_text()), shape, source=str(path),
                                             provenance={"path": str(path)})
        else:
            cfg = HeadConfig.load(path)
        if args.rank is not None:
            cfg = cfg.for_rank(args.rank, args.tp)
        elif args.tp != 1:
            raise ValueError("--tp needs --rank: say which rank's view to export")
        data = cfg.to_minference() if args.format == "minference" else cfg.to_dict()
    if args.out:
        write_json(args.out, data)
        print(f"wrote {args.out}")
    else:
        print(json.dumps(data, indent=1))
    return 0
