"""`workbench compare`: every prefill method (A-shape, Tri-shape, dilated, strided, Vertical-Slash,
block-sparse, XAttention, FlexPrefill) and the searched head config on the same prompts: captured mass
(all rows, answer rows) vs physical density, index time, kernel time on a GPU, next-token KL and the
retrieval outcome vs dense, the Pareto front per task -> JSON + HTML (+ a Pareto PNG with --png)."""
from __future__ import annotations

import argparse
import shlex
import sys

from workbench.cli._args import (
    add_device,
    add_layers,
    add_lengths,
    add_out,
    add_tasks,
    int_list,
    name_list,
    positive_int,
    resolve_device_args,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="every prefill method through one harness: mass, cost, KL, retrieval (JSON + HTML)",
                       description=__doc__)
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    add_tasks(p, "passkey,multikey,code")
    add_lengths(p, "4096,8192")
    add_layers(p, "3,11,19,27", what="layers whose masses and kernel times are measured")
    p.add_argument("--rows", type=int, default=256, help="sampled query rows per layer for the masses, plus the "
                   "64 answer rows (0 = all rows, exact; default 256)")
    p.add_argument("--config", default=None,
                   help="the searched head config shown beside the methods (default: the one the package ships for "
                        "the model, if any; 'none' leaves it out)")
    p.add_argument("--quality", choices=("all", "mid", "none"), default="mid",
                   help="KL / retrieval with every layer sparse at all sweep values, the middle one (default), or none")
    p.add_argument("--quality-lengths", type=int_list, default=None, help="lengths with quality runs (default: all lengths)")
    p.add_argument("--quality-tasks", type=name_list, default=None,
                   help="tasks with quality runs (default: those with an answer)")
    p.add_argument("--max-new-tokens", type=positive_int, default=8, help="greedy decoding length (default 8)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    add_out(p, "reports/methods.json", "JSON file; the HTML goes beside it")
    p.add_argument("--png", default=None, help="also write the Pareto figure of the first length as PNG (kaleido)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only re-render a report JSON (e.g. one from a GPU machine without plotly) as HTML "
                        "beside --out and the --png figure; runs nothing")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="quiet")
    add_device(p)  # on cuda: Triton kernel and GPU index times too
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from workbench.cli._args import check_layers, check_lengths, check_tasks, out_file
    from workbench.config import HeadConfig
    from workbench.core.corpus import TASKS
    from workbench.core.io import read_json, write_json
    from workbench.core.model import load_model
    from workbench.data import shipped_config
    from workbench.prefill.compare import compare

    out = out_file(args.out)
    if args.png:
        out_file(args.png, "--png")
    if args.render:
        _write(read_json(args.render, "--render report"), out, args.png)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    check_tasks(args.tasks + (args.quality_tasks or []), TASKS)
    config = HeadConfig.load(args.config) if args.config not in (None, "none") else None  # before the model
    model, tok, shape = load_model(args.model, **resolve_device_args(args))
    check_lengths(args.lengths + (args.quality_lengths or []), shape.max_positions, shape.name)
    check_layers(args.layers, shape.n_layers)
    shipped = None if args.config else shipped_config(shape.name)  # ("none": no config)
    config = config or (HeadConfig.load(shipped) if shipped else None)
    if config is not None:
        config.validate(shape)
    report = compare(model, tok, shape, tasks=args.tasks, lengths=args.lengths, layers=args.layers, config=config,
                     rows=args.rows or None, quality=args.quality, quality_lengths=args.quality_lengths,
                     quality_tasks=args.quality_tasks, max_new_tokens=args.max_new_tokens, seed=args.seed,
                     progress=not args.no_progress)
    report["command"] = "workbench compare " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("compare") + 1:]) \
        if "compare" in sys.argv else "workbench compare"
    write_json(out, report)
    _write(report, out, args.png)
    note = "" if config is not None or args.config == "none" else \
        f"; no head config beside the methods (none ships for {shape.name}: pass --config FILE)"
    print(f"wrote {out} ({len(report['points'])} points){note}")
    return 0


def _write(report: dict, out, png: str | None) -> None:
    """HTML beside `out` and the Pareto PNG; without plotly (the GPU image) only a note."""
    from workbench.core.io import atomic_path, write_text

    try:
        from workbench.views.methods import pareto_figure, report_html

        write_text(out.with_suffix(".html"), report_html(report))
        if png:
            with atomic_path(png) as tmp:
                pareto_figure(report).write_image(str(tmp), format="png", scale=2)
    except ImportError as e:  # the JSON is the result: render it elsewhere with --render
        print(f"workbench compare: {e}; wrote JSON only (render it with `workbench compare --render JSON`)", file=sys.stderr)
