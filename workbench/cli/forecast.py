"""`workbench forecast train | report`: train SparDA Forecast heads, then measure recall and overlap."""
from __future__ import annotations

import argparse
import sys

from workbench.cli._args import (
    add_device,
    add_length,
    add_lengths,
    add_out,
    add_tasks,
    positive_int,
    renamed,
    resolve_device_args,
)

TASKS = "passkey,multikey,vartrack,code"


def _budget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--init", type=int, default=1, help="forced initial blocks (default 1)")
    p.add_argument("--local", type=int, default=2, help="forced local blocks incl. the query's own (default 2)")
    p.add_argument("--topk", type=int, default=8,
                   help="dynamic blocks per query (default 8; the paper uses 64 at 128K)")
    add_tasks(p, TASKS)
    p.add_argument("--rows", type=positive_int, default=256, help="random query rows kept per prompt (default 256)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    add_device(p)


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("forecast", help="train Forecast heads / report their recall vs other selectors")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)

    t = verbs.add_parser("train", help="train Forecast heads on built-in samples (backbone frozen)")
    _budget_args(t)
    add_lengths(t, "2048,4096")
    t.add_argument("--seeds", type=positive_int, default=1, help="prompts per task and length (default 1)")
    t.add_argument("--held-out", type=int, default=1, help="held-out prompts for the KL curve (default 1)")
    t.add_argument("--steps", type=positive_int, default=None, help="optimiser steps (default: TrainConfig)")
    t.add_argument("--lr", type=float, default=None, help="AdamW learning rate, constant (default: TrainConfig)")
    t.add_argument("--batch-rows", type=positive_int, default=None, help="query rows per step (default: TrainConfig)")
    t.add_argument("--teacher", choices=("fine", "coarse"), default="fine",
                   help="fine: keys compressed 2/1 then max-pooled to 32/16 (SparDA); coarse: the 32/16 grid (ablation)")
    t.add_argument("--init-from", choices=("queries", "random"), default="queries",
                   help="start from the group mean of the target layer's q_proj (default) or random")
    add_out(t, None, "checkpoint file to write", shown="reports/forecast/<model>.safetensors")
    t.set_defaults(func=run)

    r = verbs.add_parser("report", help="recall and IoU per target layer for every selector; JSON + HTML")
    _budget_args(r)
    r.add_argument("--heads", default=None, help="trained heads (default: the heads the package ships for the model)")
    r.add_argument("--coarse-heads", default=None, help="heads trained with --teacher coarse (ablation row)")
    add_length(r, 4096)
    r.add_argument("--seeds", type=positive_int, default=1, help="held-out prompts per task (default 1)")
    r.add_argument("--steps", type=positive_int, default=64, help="consecutive decode steps for churn (default 64)")
    r.add_argument("--shallow", type=positive_int, default=6, help="reuse calibration tries layers 0..N-1 (default 6)")
    r.add_argument("--calib", type=int, default=2, help="calibration prompts for the reuse layer (default 2)")
    add_out(r, "reports/forecast/forecast.json", "JSON file; the HTML goes beside it")
    renamed(r, json="--out")
    r.set_defaults(func=run)


def _env(argv: list[str]) -> dict:
    """The shared environment record (core.timing.environment) under the `workbench forecast ...` command."""
    from workbench.core.timing import environment

    return environment("workbench " + " ".join(argv))


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from workbench.cli._args import check_tasks, out_file
    from workbench.core.corpus import TASKS as TASK_NAMES
    from workbench.core.model import load_model
    from workbench.patterns.infllm import Budget

    if args.threads:
        torch.set_num_threads(args.threads)
    budget = Budget(init=args.init, local=args.local, topk=args.topk)
    tasks = args.tasks
    check_tasks(tasks, TASK_NAMES)
    if args.out:
        out_file(args.out)
    argv = sys.argv[1:]
    t0 = time.perf_counter()
    where = resolve_device_args(args)
    model, tok, shape = load_model(args.model, **where)
    for p in model.parameters():
        p.requires_grad_(False)
    if args.verb == "train":
        return _train(args, model, tok, shape, budget, tasks, argv, t0)
    return _report(args, model, tok, shape, budget, tasks, argv, t0)


def _train(args, model, tok, shape, budget, tasks, argv, t0) -> int:
    import time
    from dataclasses import asdict, replace

    from workbench.cli._args import check_lengths
    from workbench.data import file_stem
    from workbench.decode.forecast.heads import ForecastHeads
    from workbench.decode.forecast.train import TrainConfig, lengths_ok, make_prompts, train

    lengths = args.lengths
    check_lengths(lengths, shape.max_positions, shape.name)
    for n in lengths:
        lengths_ok(n, budget)
    if args.held_out < 0:
        raise ValueError(f"--held-out must be >= 0, got {args.held_out}")
    cfg = TrainConfig()
    cfg = replace(cfg, **{k: v for k, v in {"steps": args.steps, "lr": args.lr, "batch_rows": args.batch_rows}.items()
                          if v is not None})
    fine = (2, 1) if args.teacher == "fine" else (budget.window, budget.stride)
    specs = [(task, n, seed) for n in lengths for task in tasks for seed in range(1, args.seeds + 1)]
    held = [(tasks[i % len(tasks)], min(lengths), 1000 + i) for i in range(args.held_out)]
    train_set = make_prompts(model, tok, shape, specs, budget, rows=args.rows, fine=fine)
    held_out = make_prompts(model, tok, shape, held, budget, rows=args.rows, fine=fine)
    prep = time.perf_counter() - t0
    heads = ForecastHeads.from_queries(model, shape) if args.init_from == "queries" else ForecastHeads(shape)
    hist = train(heads, train_set, held_out, cfg)
    kl0, kl1 = hist["held_out_kl_before"], hist["held_out_kl_after"]
    heads.meta = {
        "model": shape.name, "fingerprint": shape.fingerprint, "budget": budget.to_dict(),
        "teacher": {"grid": list(fine), "kind": args.teacher}, "init": args.init_from,
        "train_config": asdict(cfg), "train_prompts": [p.meta for p in train_set],
        "held_out_prompts": [p.meta for p in held_out], **hist,
        "prepare_seconds": round(prep, 1), "total_seconds": round(time.perf_counter() - t0, 1), **_env(argv),
        "device": str(next(model.parameters()).device),
    }
    path = heads.save(args.out or f"reports/forecast/{file_stem(shape.name)}.safetensors")
    kl = "" if kl0 is None else (f"; held-out partition KL {sum(kl0) / len(kl0):.4f} -> {sum(kl1) / len(kl1):.4f} "
                                 f"(mean over {len(kl0)} target layers)")
    print(f"wrote {path}: {cfg.steps} steps in {hist['train_seconds']} s (total {heads.meta['total_seconds']} s){kl}")
    return 0


def _report(args, model, tok, shape, budget, tasks, argv, t0) -> int:
    import time
    from pathlib import Path

    from workbench.cli._args import check_lengths
    from workbench.core.io import write_json, write_text
    from workbench.data import shipped_forecast_heads
    from workbench.decode.forecast.heads import ForecastHeads
    from workbench.decode.forecast.report import build_report, report_html
    from workbench.decode.forecast.train import lengths_ok

    check_lengths([args.length], shape.max_positions, shape.name, "--length")
    lengths_ok(args.length, budget)
    heads_path = args.heads or shipped_forecast_heads(shape.name)
    if heads_path is None:
        raise ValueError(f"no Forecast heads ship for {shape.name}: train them with `workbench forecast train` and "
                         "pass the file with --heads")
    heads = ForecastHeads.load(heads_path, shape)
    coarse = ForecastHeads.load(args.coarse_heads, shape) if args.coarse_heads else None
    for h, name in ((heads, "--heads"), (coarse, "--coarse-heads")):
        if h is not None and h.meta.get("budget", budget.to_dict()) != budget.to_dict():
            print(f"note: {name} were trained with budget {h.meta.get('budget')}, reporting at {budget.to_dict()}",
                  file=sys.stderr)
    evals = [(task, args.length, 2000 + s) for task in tasks for s in range(args.seeds)]
    calib = [(tasks[i % len(tasks)], args.length, 3000 + i) for i in range(args.calib)]
    rep = build_report(model, tok, shape, heads, budget, eval_specs=evals, calib_specs=calib,
                       shallow_candidates=range(0, min(args.shallow, shape.n_layers - 1)), rows=args.rows,
                       steps=args.steps, coarse_heads=coarse)
    m = heads.meta
    kl0, kl1 = m.get("held_out_kl_before"), m.get("held_out_kl_after")
    rep = {"heads": {"path": str(heads_path), "teacher": m.get("teacher"), "steps": m.get("train_config", {}).get("steps"),
                     "train_command": m.get("command"), "train_prompts": len(m.get("train_prompts", [])),
                     "prepare_seconds": m.get("prepare_seconds"), "train_seconds": m.get("train_seconds"),
                     "total_train_seconds": m.get("total_seconds"), "train_threads": m.get("torch_threads"),
                     "train_load_average_1_5_15min": m.get("load_average_1_5_15", m.get("load_average_1_5_15min")),
                     "held_out_kl_mean_before_after": None if not kl0 else
                     [round(sum(kl0) / len(kl0), 4), round(sum(kl1) / len(kl1), 4)]},
           "coarse_heads": None if coarse is None else {"path": args.coarse_heads, "teacher": coarse.meta.get("teacher")},
           "model": shape.to_dict(), **rep, "report_seconds": round(time.perf_counter() - t0, 1), **_env(argv)}
    out = Path(args.out)
    write_json(out, rep)
    write_text(out.with_suffix(".html"), report_html(rep))
    s = rep["summary"]
    print(f"wrote {out} and {out.with_suffix('.html').name}: Forecast recall / same-layer recall = "
          f"{s['forecast_over_same_layer']} (mean over {shape.n_layers} layers); short layers: {s['short_layers']}")
    return 0
