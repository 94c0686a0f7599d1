"""`workbench prefill quality`: what a head config costs in quality.

quality: sparse vs dense prefill on retrieval prompts (KL and top-1 at the answer position, greedy
retrieval accuracy, per-layer cosine, one-layer-at-a-time sensitivity) -> JSON + HTML.
What it saves in time is `workbench bench prefill` (end to end, per-layer breakdown, on a GPU) and
`workbench bench kernels` (the sparse kernels alone).
"""
from __future__ import annotations

import argparse

from workbench.cli._device import add_device_arguments, resolve_device_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="sparse prefill from a head config: quality vs dense (time: workbench bench)",
                       description=__doc__)
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    q = what.add_parser("quality", help="quality of a head config's sparse prefill vs dense (JSON + HTML)")
    q.add_argument("--config", default="configs/SmolLM2-135M-Instruct.json", help="head config (default: the shipped one)")
    q.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    q.add_argument("--lengths", default="4096,8192", help="comma-separated prompt lengths (default 4096,8192)")
    q.add_argument("--samples", type=int, default=20, help="samples per length, needle depths spread (default 20)")
    q.add_argument("--task", default="passkey", help="passkey (default) or multikey")
    q.add_argument("--max-new-tokens", type=int, default=8, help="greedy decoding length (default 8)")
    q.add_argument("--cosine-samples", type=int, default=4, help="samples per length with per-layer cosine (default 4)")
    q.add_argument("--sensitivity-length", type=int, default=None, help="prompt length of the sensitivity table "
                   "(default: the shortest length)")
    q.add_argument("--sensitivity-samples", type=int, default=2, help="prompts for the sensitivity table (default 2)")
    q.add_argument("--out", default="assets/reports/prefill_quality_cpu.json", help="JSON path (HTML beside it)")
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    q.add_argument("--backend", default="auto", help="sparse path: auto (Triton on CUDA, PyTorch reference on "
                   "CPU), triton or torch")
    q.add_argument("--no-drift", action="store_true", help="in a non-fp32 run, skip the dense fp32 drift column")
    add_device_arguments(q)
    q.add_argument("--no-progress", action="store_true", help="hide progress bars")
    q.set_defaults(func=run_quality)


def run_quality(args: argparse.Namespace) -> int:
    import torch

    from workbench.config import HeadConfig
    from workbench.core.model import load_model
    from workbench.prefill.quality import quality_report

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.task not in ("passkey", "multikey"):
        raise ValueError(f"--task {args.task!r}: use passkey or multikey (tasks with one answer to retrieve)")
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lengths {args.lengths!r} must be comma-separated integers, e.g. 4096,8192") from None
    where = resolve_device_args(args)
    model, tok, shape = load_model(args.model, **where)
    drift = None
    if where["dtype"] != torch.float32 and not args.no_drift:
        drift = load_model(args.model, device=where["device"], dtype=torch.float32, device_map=where["device_map"])[0]
    config = HeadConfig.load(args.config, shape)
    command = (f"workbench prefill quality --device {where['device']} --dtype {args.dtype} --backend {args.backend} "
               f"--config {args.config} --lengths {args.lengths} --samples {args.samples} "
               f"--task {args.task} --max-new-tokens {args.max_new_tokens} --cosine-samples {args.cosine_samples} "
               f"--sensitivity-samples {args.sensitivity_samples}"
               + (f" --sensitivity-length {args.sensitivity_length}" if args.sensitivity_length else "")
               + (f" --model {args.model}" if args.model else "") + f" --out {args.out}")
    report = quality_report(model, tok, shape, config, lengths=lengths, samples=args.samples, task=args.task,
                            max_new_tokens=args.max_new_tokens, cosine_samples=args.cosine_samples,
                            sensitivity_length=args.sensitivity_length, sensitivity_samples=args.sensitivity_samples,
                            out=args.out, command=command, progress=not args.no_progress, backend=args.backend,
                            drift_model=drift)
    for n, row in report["summary"].get("per_length", {}).items():
        print(f"n={n}: samples {row['samples']}, accuracy dense {row['dense_accuracy']:.2f} sparse "
              f"{row['sparse_accuracy']:.2f}, KL mean {row['kl_mean']:.4f} max {row['kl_max']:.4f}, "
              f"top-1 agreement {row['top1_agreement']:.2f}"
              + (f"; dense fp32 accuracy {row['dense_fp32_accuracy']:.2f}, dense drift KL mean "
                 f"{row['dense_drift_kl_mean']:.4f}" if "dense_drift_kl_mean" in row else ""))
    for row in report["summary"].get("worst_layers", []):
        print(f"worst layer {row['layer']}: sensitivity KL {row['sensitivity_kl_mean']:.5f}")
    print(f"wrote {args.out} and {args.out.rsplit('.', 1)[0]}.html")
    return 0

