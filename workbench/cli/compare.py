"""`workbench compare`: every prefill method (A-shape, Tri-shape, dilated, strided, Vertical-Slash,
block-sparse, XAttention, FlexPrefill) and the searched head config on the same prompts: captured mass
(all rows, answer rows) vs physical density, index time, kernel time on a GPU, next-token KL and the
retrieval outcome vs dense, the Pareto front per task -> JSON + HTML (+ a Pareto PNG with --png)."""
from __future__ import annotations

import argparse
import shlex
import sys

from workbench.cli._device import add_device_arguments, resolve_device_args


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated integers, e.g. 4096,8192") from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="every prefill method through one harness: mass, cost, KL, retrieval (JSON + HTML)",
                       description=__doc__)
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--tasks", default="passkey,multikey,code", help="comma-separated tasks (default passkey,multikey,code)")
    p.add_argument("--lengths", default="4096,8192", help="comma-separated prompt lengths (default 4096,8192)")
    p.add_argument("--layers", default="3,11,19,27", help="layers whose masses and kernel times are measured")
    p.add_argument("--rows", type=int, default=256, help="sampled query rows per layer for the masses, plus the "
                   "64 answer rows (0 = all rows, exact; default 256)")
    p.add_argument("--config", default="configs/SmolLM2-135M-Instruct.json",
                   help="the searched head config shown beside the methods ('none' to leave it out)")
    p.add_argument("--quality", choices=("all", "mid", "none"), default="mid",
                   help="KL / retrieval with every layer sparse at all sweep values, the middle one (default), or none")
    p.add_argument("--quality-lengths", default=None, help="lengths with quality runs (default: all lengths)")
    p.add_argument("--quality-tasks", default=None, help="tasks with quality runs (default: those with an answer)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy decoding length (default 8)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--out", default="reports/methods.json", help="JSON path; HTML beside it")
    p.add_argument("--png", default=None, help="also write the Pareto figure of the first length as PNG (kaleido)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only re-render a report JSON (e.g. one from a GPU machine without plotly) as HTML "
                        "beside --out and the --png figure; runs nothing")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="quiet")
    add_device_arguments(p)  # on cuda: Triton kernel and GPU index times too
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from workbench.config import HeadConfig
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.prefill.compare import compare

    if args.render:
        import json

        report = json.loads(Path(args.render).read_text())
        _write(report, Path(args.out), args.png)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = [t for t in args.tasks.split(",") if t.strip()]
    model, tok, shape = load_model(args.model, **resolve_device_args(args))
    config = None if args.config == "none" else HeadConfig.load(args.config, shape)
    report = compare(model, tok, shape, tasks=tasks, lengths=_ints(args.lengths, "--lengths"),
                     layers=_ints(args.layers, "--layers"), config=config, rows=args.rows or None,
                     quality=args.quality,
                     quality_lengths=None if args.quality_lengths is None else _ints(args.quality_lengths, "--quality-lengths"),
                     quality_tasks=None if args.quality_tasks is None else args.quality_tasks.split(","),
                     max_new_tokens=args.max_new_tokens, seed=args.seed, progress=not args.no_progress)
    report["command"] = "workbench compare " + " ".join(shlex.quote(a) for a in sys.argv[sys.argv.index("compare") + 1:]) \
        if "compare" in sys.argv else "workbench compare"
    out = Path(args.out)
    write_json(out, report)
    _write(report, out, args.png)
    print(f"wrote {out} ({len(report['points'])} points)")
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
