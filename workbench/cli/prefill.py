"""`workbench prefill quality`: what a head config costs in quality.

quality: sparse vs dense prefill on retrieval prompts (KL and top-1 at the answer position, greedy
retrieval accuracy, per-layer cosine, one-layer-at-a-time sensitivity) -> JSON + HTML.
What it saves in time is `workbench bench prefill` (end to end, per-layer breakdown, on a GPU) and
`workbench bench kernels` (the sparse kernels alone).
"""
from __future__ import annotations

import argparse

from workbench.cli._args import add_device, add_lengths, add_out, add_tasks, positive_int, resolve_device_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefill", help="sparse prefill from a head config: quality vs dense (time: workbench bench)",
                       description=__doc__)
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    q = what.add_parser("quality", help="quality of a head config's sparse prefill vs dense (JSON + HTML)")
    q.add_argument("--config", default=None, help="head config (default: the one the package ships for the model)")
    q.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    add_lengths(q, "4096,8192")
    q.add_argument("--samples", type=positive_int, default=20, help="samples per length, needle depths spread (default 20)")
    add_tasks(q, "passkey", what="the retrieval task (passkey or multikey: tasks with one answer)", one=True)
    q.add_argument("--max-new-tokens", type=positive_int, default=8, help="greedy decoding length (default 8)")
    q.add_argument("--cosine-samples", type=int, default=4, help="samples per length with per-layer cosine (default 4)")
    q.add_argument("--sensitivity-length", type=positive_int, default=None, help="prompt length of the sensitivity "
                   "table (default: the shortest length)")
    q.add_argument("--sensitivity-samples", type=int, default=2, help="prompts for the sensitivity table (default 2)")
    add_out(q, "reports/prefill_quality.json", "JSON file (HTML beside it); a run with the same settings resumes it")
    q.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    q.add_argument("--backend", choices=("auto", "triton", "torch", "flex"), default="auto",
                   help="sparse path: auto (Triton on CUDA, PyTorch reference on the CPU), triton (CUDA), torch or flex")
    q.add_argument("--no-drift", action="store_true", help="in a non-fp32 run, skip the dense fp32 drift column")
    add_device(q)
    q.add_argument("--no-progress", action="store_true", help="hide progress bars")
    q.set_defaults(func=run_quality)


def run_quality(args: argparse.Namespace) -> int:
    import os

    import torch

    from workbench.cli._args import check_lengths, one_task, out_file
    from workbench.config import HeadConfig
    from workbench.core.io import read_json
    from workbench.core.model import load_model
    from workbench.data import shipped_config
    from workbench.prefill.quality import quality_report

    if args.threads:
        torch.set_num_threads(args.threads)
    task = one_task(args.tasks)
    if task not in ("passkey", "multikey"):
        raise ValueError(f"--tasks {task!r}: use passkey or multikey (tasks with one answer to retrieve)")
    out = out_file(args.out)
    if out.exists():  # resumed when its settings match: it must be a report
        read_json(out, "--out report (a run with the same settings resumes it; give another --out to start anew)")
    where = resolve_device_args(args)
    if args.backend == "triton" and where["device"].type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError("--backend triton runs the Triton kernels, which need a GPU: add --device cuda on a GPU "
                         "machine, or use --backend torch (or auto) on the CPU")
    config = HeadConfig.load(args.config) if args.config else None  # before the model: a bad file fails in seconds
    model, tok, shape = load_model(args.model, **where)
    check_lengths(args.lengths + [args.sensitivity_length or 1], shape.max_positions, shape.name)
    config_path = args.config or shipped_config(shape.name)
    if config_path is None:
        raise ValueError(f"no head config ships for {shape.name}: make one with `workbench search --model ...` and "
                         "pass it with --config FILE")
    config = config or HeadConfig.load(config_path)
    config.validate(shape)
    drift = None
    if where["dtype"] != torch.float32 and not args.no_drift:
        drift = load_model(args.model, device=where["device"], dtype=torch.float32, device_map=where["device_map"])[0]
    lengths = ",".join(map(str, args.lengths))
    command = (f"workbench prefill quality --device {where['device']} --dtype {args.dtype} --backend {args.backend} "
               f"--config {config_path} --lengths {lengths} --samples {args.samples} "
               f"--tasks {task} --max-new-tokens {args.max_new_tokens} --cosine-samples {args.cosine_samples} "
               f"--sensitivity-samples {args.sensitivity_samples}"
               + (f" --sensitivity-length {args.sensitivity_length}" if args.sensitivity_length else "")
               + (f" --model {args.model}" if args.model else "") + f" --out {out}")
    report = quality_report(model, tok, shape, config, lengths=args.lengths, samples=args.samples, task=task,
                            max_new_tokens=args.max_new_tokens, cosine_samples=args.cosine_samples,
                            sensitivity_length=args.sensitivity_length, sensitivity_samples=args.sensitivity_samples,
                            out=out, command=command, progress=not args.no_progress, backend=args.backend,
                            drift_model=drift)
    for n, row in report["summary"].get("per_length", {}).items():
        print(f"n={n}: samples {row['samples']}, accuracy dense {row['dense_accuracy']:.2f} sparse "
              f"{row['sparse_accuracy']:.2f}, KL mean {row['kl_mean']:.4f} max {row['kl_max']:.4f}, "
              f"top-1 agreement {row['top1_agreement']:.2f}"
              + (f"; dense fp32 accuracy {row['dense_fp32_accuracy']:.2f}, dense drift KL mean "
                 f"{row['dense_drift_kl_mean']:.4f}" if "dense_drift_kl_mean" in row else ""))
    for row in report["summary"].get("worst_layers", []):
        print(f"worst layer {row['layer']}: sensitivity KL {row['sensitivity_kl_mean']:.5f}")
    print(f"wrote {out} and {out.with_suffix('.html')}")
    return 0

