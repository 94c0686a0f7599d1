"""`workbench decode`: greedy decoding through the offload engine, one mode or all of them side by side, through
`workbench.decode.compare.compare_modes` (the call notebook 06 and the dashboard's Decode tab make)."""
from __future__ import annotations

import argparse
from typing import Any

from workbench.cli._args import add_device, add_length, add_out, add_tasks, positive_int, renamed, resolve_device_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="decode with the sparse / offloaded engine and report speed and traffic",
                       description="Decode --steps tokens for --batch prompts of about --length tokens with the "
                                   "engine in --mode (or 'all'), then print tokens/s, bytes moved per step, cache "
                                   "hit rate, transfer hidden under compute and peak GPU memory.")
    p.add_argument("--mode", default="sparse-offload-forecast",
                   help="dense-resident, sparse-resident, sparse-offload-sync, sparse-offload-forecast, "
                        "forecast-without-prefetch, or all (a compare_modes spec such as sparse-resident/forecast "
                        "also works)")
    p.add_argument("--selector", default="same-layer", choices=["same-layer", "forecast", "quest"],
                   help="selector of sparse-resident (offload modes fix theirs; quest also runs in sparse-offload-sync)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together (default 1)")
    add_length(p, 2048, what="prompt tokens of the longest sequence")
    p.add_argument("--steps", type=positive_int, default=64, help="decoded tokens per sequence (default 64)")
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    add_tasks(p, "passkey", what="corpus task of the prompts", one=True)
    p.add_argument("--budget", default="1,2,8", help="init,local,topk blocks of 64 tokens")
    p.add_argument("--heads", default=None, help="trained Forecast heads (.safetensors); default: q_proj warm start")
    p.add_argument("--ctas", type=positive_int, default=None,
                   help="programs of the UVA gather kernel (default 32; 64 with a quantised store)")
    p.add_argument("--store-dtype", default="model", choices=["model", "fp8", "int8", "int4", "int8k-int4v"],
                   help="offloaded KV on the host: the model's dtype, or FP8 (e4m3) / INT8 codes with per-row scales "
                        "(half the PCIe bytes of bf16), or INT4 codes with a float16 scale per 32 elements (0.28x "
                        "bf16's at head_dim 128; lossier), or int8k-int4v: INT8 keys and INT4 values (0.77x FP8's "
                        "bytes, about FP8's quality); resident modes round through the same codes")
    add_device(p)  # --dtype default: bfloat16 on a GPU
    p.add_argument("--graph", action="store_true",
                   help="CUDA only: replay each step as a CUDA graph (faster; no per-copy event timings)")
    p.add_argument("--quality", action="store_true",
                   help="also compare each sparse mode with dense-resident (teacher-forced top-1 agreement, KL)")
    p.add_argument("--measure-reuse", action="store_true",
                   help="count how many dynamic blocks stay selected from one step to the next (adds host syncs)")
    add_out(p, None, "JSON file for the results (atomic); none only prints the table")
    renamed(p, context="--length", json="--out")
    p.set_defaults(func=run)


def _budget(text: str):
    from workbench.patterns.infllm import Budget

    try:
        init, local, topk = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--budget {text!r} must be three integers init,local,topk such as 1,2,8") from None
    return Budget(init=init, local=local, topk=topk)


def _spec(mode: str, selector: str) -> str:
    """--mode and --selector -> one mode spec of `compare_modes` (see `parse_mode`)."""
    from workbench.decode.compare import parse_mode

    if selector != "same-layer" and (mode == "sparse-resident" or (mode, selector) == ("sparse-offload-sync", "quest")):
        mode = f"{mode}/{selector}"
    try:
        own = parse_mode(mode)[1]
    except ValueError as e:
        raise ValueError(f"--mode: {e}, or all") from None
    if selector not in ("same-layer", own):
        raise ValueError(f"--selector {selector} does not apply to --mode {mode}, which selects with {own}: it picks "
                         "sparse-resident's selector (quest also runs in sparse-offload-sync)")
    return mode


def run(args: argparse.Namespace) -> int:
    import sys

    import torch

    from workbench.cli._args import check_lengths, check_tasks, one_task, out_file
    from workbench.core.corpus import TASKS, make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.decode.compare import ALL_MODES, compare_modes, reference_of

    task = one_task(args.tasks)
    check_tasks([task], TASKS)
    if args.mode == "all" and args.selector != "same-layer":
        raise ValueError("--selector applies to one --mode: all runs sparse-resident with same-layer and forecast")
    specs = list(ALL_MODES) if args.mode == "all" else [_spec(args.mode, args.selector)]
    if args.graph and args.measure_reuse:
        raise ValueError("--measure-reuse counts blocks in Python at every step: drop --graph")
    if args.out:
        out_file(args.out)
    budget = _budget(args.budget)
    where = resolve_device_args(args, gpu_dtype=torch.bfloat16)
    if args.graph and where["device"].type != "cuda":
        raise ValueError(f"--graph replays CUDA graphs, which need a GPU, but the device is {where['device']}: "
                         "drop --graph, or add --device cuda on a GPU machine")
    device = where["device"].type if where["device"].index is None else str(where["device"])
    model, tok, shape = load_model(args.model, **where)
    check_lengths([args.length + args.steps], shape.max_positions, shape.name, "--length + --steps")
    heads = None
    if args.heads:
        from workbench.decode.forecast.heads import ForecastHeads

        heads = ForecastHeads.load(args.heads, shape)
    lengths = [max(64, args.length - 97 * b) for b in range(args.batch)]  # different lengths in one batch
    prompts = [make_sample(task, tok, n, seed=b).input_ids for b, n in enumerate(lengths)]
    cmp = compare_modes(model, prompts, modes=specs, new_tokens=args.steps + 1, budget=budget, heads=heads,
                        graph=args.graph, trace=False, ctas=args.ctas,
                        measure_reuse=args.measure_reuse, quality=args.quality, store_dtype=args.store_dtype)
    rows = cmp.rows()
    result: dict[str, Any] = {"command": "workbench " + " ".join(sys.argv[1:]), "model": shape.name, "device": device,
                              "engine": cmp.device, "batch": args.batch, "lengths": lengths, "steps": args.steps,
                              "budget": budget.to_dict(), "task": task, "store_dtype": args.store_dtype,
                              "runs": rows, "lossless": cmp.lossless}
    if cmp.quality is not None:
        result["quality_vs_dense"] = cmp.quality
    _print_table(rows)
    for spec, same in cmp.lossless.items():
        print(f"  {spec} == {reference_of(spec)}: {'yes' if same else 'NO'}")
    for sel, q in (cmp.quality or {}).items():
        print(f"  sparse({sel}) vs dense: top-1 agreement {q['top1_agreement_teacher_forced']:.3f}, "
              f"KL {q['kl_dense_to_sparse_mean']:.4f}")
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = (f"{'mode':<26}{'selector':<11}{'store':<12}{'tok/s':>9}{'MB/step':>9}{'hit':>6}{'reuse':>7}{'hidden':>8}"
            f"{'copy GB/s':>10}{'peak GPU GiB':>13}")
    print(head)
    print("-" * len(head))
    for r in rows:
        mode = r["mode"].partition("@")[0].partition("/")[0]  # the selector and store have their own columns
        print(f"{mode:<26}{r['selector']:<11}{r['store_dtype']:<12}{r['tokens_per_s']:>9.2f}"
              f"{r['bytes_moved_per_step'] / 1e6:>9.2f}"
              f"{f(r['hit_rate'], '.3f'):>6}{f(r['dynamic_reuse'], '.3f'):>7}{f(r['hidden_fraction'], '.2f'):>8}"
              f"{f(r['copy_gbps'], '.1f'):>10}{f(r['peak_gpu_bytes'] and r['peak_gpu_bytes'] / 2**30, '.2f'):>13}")
