"""`workbench decode`: greedy decoding through the offload engine, one mode or all of them side by side."""
from __future__ import annotations

import argparse
from typing import Any

from workbench.cli._device import add_device_arguments, resolve_device_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="decode with the sparse / offloaded engine and report speed and traffic",
                       description="Decode --steps tokens for --batch prompts of about --context tokens with the "
                                   "engine in --mode (or 'all'), then print tokens/s, bytes moved per step, cache "
                                   "hit rate, transfer hidden under compute and peak GPU memory.")
    p.add_argument("--mode", default="sparse-offload-forecast",
                   help="dense-resident, sparse-resident, sparse-offload-sync, sparse-offload-forecast, "
                        "forecast-without-prefetch, or all")
    p.add_argument("--selector", default="same-layer", choices=["same-layer", "forecast", "quest"],
                   help="selector of sparse-resident (offload modes fix theirs; quest also runs in sparse-offload-sync)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of the longest sequence")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--task", default="passkey", help="corpus task of the prompts (passkey, multikey, vartrack, code)")
    p.add_argument("--budget", default="1,2,8", help="init,local,topk blocks of 64 tokens")
    p.add_argument("--heads", default=None, help="trained Forecast heads (.safetensors); default: q_proj warm start")
    p.add_argument("--ctas", type=int, default=16, help="programs of the UVA gather kernel")
    add_device_arguments(p)  # --dtype default: bfloat16 on a GPU
    p.add_argument("--graph", action="store_true",
                   help="CUDA only: replay each step as a CUDA graph (faster; no per-copy event timings)")
    p.add_argument("--quality", action="store_true",
                   help="also compare each sparse mode with dense-resident (teacher-forced top-1 agreement, KL)")
    p.add_argument("--measure-reuse", action="store_true",
                   help="count how many dynamic blocks stay selected from one step to the next (adds host syncs)")
    p.add_argument("--json", default=None, help="write the results here (atomic)")
    p.set_defaults(func=run)


def _budget(text: str):
    from workbench.patterns.infllm import Budget

    try:
        init, local, topk = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--budget {text!r} must be three integers init,local,topk such as 1,2,8") from None
    return Budget(init=init, local=local, topk=topk)


def run(args: argparse.Namespace) -> int:
    import torch

    from workbench.core.corpus import make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.decode.engine import MODES, DecodeEngine, EngineConfig
    from workbench.decode.engine.llama import LlamaLayers
    from workbench.decode.engine.reuse import ReuseMeter

    modes = list(MODES) if args.mode == "all" else [args.mode]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--mode {m!r} is unknown: choose one of {', '.join(MODES)} or all")
    for name in ("batch", "context", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    budget = _budget(args.budget)
    where = resolve_device_args(args, gpu_dtype=torch.bfloat16)
    device = where["device"].type if where["device"].index is None else str(where["device"])
    model, tok, shape = load_model(args.model, **where)
    shape.check_length(args.context + args.steps)
    heads = None
    if args.heads:
        from workbench.decode.forecast.heads import ForecastHeads

        heads = ForecastHeads.load(args.heads, shape)
    lengths = [max(64, args.context - 97 * b) for b in range(args.batch)]  # different lengths in one batch
    prompts = [make_sample(args.task, tok, n, seed=b).input_ids for b, n in enumerate(lengths)]
    lm = LlamaLayers(model)
    prefilled = [lm.prefill(p) for p in prompts]
    n_blocks = -(-(args.context + args.steps) // 64)

    def decode(mode: str, selector: str, force=None, keep_logits=False):
        meter = ReuseMeter(budget, n_blocks) if args.measure_reuse and mode != "dense-resident" else None
        cfg = EngineConfig(mode=mode, budget=budget, selector=selector, ctas=args.ctas)
        eng = DecodeEngine(model, cfg, batch=args.batch, max_tokens=args.context + args.steps, heads=heads,
                           select_hook=meter)
        first = eng.prefill(prompts, args.steps, prefilled=prefilled)
        graph = args.graph and eng.cuda
        tokens, logits, stats = eng.run(first, args.steps, force=force, keep_logits=keep_logits,
                                        timing=eng.cuda and not graph, graph=graph)
        eng.close()
        row = stats.to_dict()
        row["selector"] = selector if mode == "sparse-resident" or (selector == "quest" and mode == MODES[2]) else (
            "same-layer" if mode in MODES[:3] else "forecast")
        row["dynamic_reuse"] = meter.rate if meter else None
        return tokens, logits, row

    rows: list[dict[str, Any]] = []
    tokens: dict[str, Any] = {}
    for mode in modes:
        selectors = ["same-layer", "forecast"] if (mode == "sparse-resident" and args.mode == "all") else [args.selector]
        for sel in selectors:
            t, _, row = decode(mode, sel)
            tokens[f"{mode}/{row['selector']}"] = t
            rows.append(row)
    import sys

    result: dict[str, Any] = {"command": "workbench " + " ".join(sys.argv[1:]), "model": shape.name, "device": device,
                              "batch": args.batch, "lengths": lengths, "steps": args.steps, "budget": budget.to_dict(),
                              "task": args.task, "runs": rows}
    if args.mode == "all":
        same = tokens["sparse-resident/same-layer"]
        fc = tokens["sparse-resident/forecast"]
        pairs = {"sparse-offload-sync == sparse-resident(same-layer)": ("sparse-offload-sync/same-layer", same),
                 "sparse-offload-forecast == sparse-resident(forecast)": ("sparse-offload-forecast/forecast", fc),
                 "forecast-without-prefetch == sparse-resident(forecast)": ("forecast-without-prefetch/forecast", fc)}
        result["lossless"] = {name: bool(torch.equal(tokens[run], ref)) for name, (run, ref) in pairs.items()}
    if args.quality:
        dense_tokens, dense_logits, _ = decode("dense-resident", "same-layer", keep_logits=True)
        force = dense_tokens
        quality = {}
        for sel in ("same-layer", "forecast"):
            t, logits, _ = decode("sparse-resident", sel, force=force, keep_logits=True)
            lp, lq = dense_logits.log_softmax(-1), logits.log_softmax(-1)
            free = tokens.get(f"sparse-resident/{sel}")
            quality[sel] = {
                "top1_agreement_teacher_forced": float((t.cpu() == dense_tokens.cpu()).float().mean()),
                "kl_dense_to_sparse_mean": float((lp.exp() * (lp - lq)).sum(-1).mean()),
                "free_running_tokens_equal_to_dense":
                    None if free is None else float((free.cpu() == dense_tokens.cpu()).float().mean())}
        result["quality_vs_dense"] = quality
    _print_table(rows)
    if "lossless" in result:
        for k, v in result["lossless"].items():
            print(f"  {k}: {'yes' if v else 'NO'}")
    for sel, q in result.get("quality_vs_dense", {}).items():
        print(f"  sparse({sel}) vs dense: top-1 agreement {q['top1_agreement_teacher_forced']:.3f}, "
              f"KL {q['kl_dense_to_sparse_mean']:.4f}")
    if args.json:
        write_json(args.json, result)
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = (f"{'mode':<26}{'selector':<11}{'tok/s':>9}{'MB/step':>9}{'hit':>6}{'reuse':>7}{'hidden':>8}"
            f"{'copy GB/s':>10}{'peak GPU GiB':>13}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['mode']:<26}{r['selector']:<11}{r['tokens_per_s']:>9.2f}{r['bytes_moved_per_step'] / 1e6:>9.2f}"
              f"{f(r['hit_rate'], '.3f'):>6}{f(r['dynamic_reuse'], '.3f'):>7}{f(r['hidden_fraction'], '.2f'):>8}"
              f"{f(r['copy_gbps'], '.1f'):>10}{f(r['peak_gpu_bytes'] and r['peak_gpu_bytes'] / 2**30, '.2f'):>13}")
