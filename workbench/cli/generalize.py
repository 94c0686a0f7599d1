"""`workbench generalize`: does a head config searched at length L hold at other (longer) lengths?

Per head, the captured attention mass of the config's online indexes on held-out prompts at L and at each of
--lengths (all query rows and the answer rows), the heads that fall below the config's target (the ones to
search again) and the heads whose mass drops by more than 0.01 from L to 4L; beside it the same config with
every budget scaled to the length (a fraction of n); at the longest length, retrieval and next-token KL vs
dense for both. Writes JSON + HTML (`workbench.prefill.generalize`, `workbench.views.lengths`).
"""
from __future__ import annotations

import argparse

from workbench.cli._args import add_device, add_out, add_tasks, int_list, positive_int, resolve_device_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generalize", help="evaluate a head config searched at one length at longer lengths (JSON + HTML)",
                       description=__doc__)
    p.add_argument("--config", required=True, help="head config to evaluate (searched at length L)")
    p.add_argument("--model", default=None, help="model folder, hub id or gemma-3-270m (default: the embedded SmolLM2-135M)")
    p.add_argument("--lengths", type=int_list, required=True, help="prompt lengths in tokens, comma-separated, "
                   "usually longer than L (L is added), e.g. 4096,8192")
    add_tasks(p, "multikey", what="held-out tasks")
    p.add_argument("--samples", type=positive_int, default=1, help="held-out prompts per task and length (default 1)")
    p.add_argument("--searched-at", type=positive_int, default=None, help="L, when the config does not record its "
                   "calibration lengths (default: the longest calibration prompt in its provenance)")
    p.add_argument("--target", type=float, default=None, help="mass a head must keep (default: the config's target)")
    p.add_argument("--quality-samples", type=int, default=4, help="prompts at the longest length run end to end "
                   "(retrieval, KL vs dense) for both variants (default 4; 0 skips)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="greedy decoding length of that check (default 8)")
    p.add_argument("--backend", default="auto", help="sparse path of that check: auto (Triton on CUDA, PyTorch "
                   "reference on CPU), triton or torch")
    add_out(p, None, "JSON path, the HTML report beside it", shown="reports/generalize/<model>.json")
    add_device(p)  # --dtype default: bfloat16 on a GPU
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from workbench.cli._args import check_lengths, check_tasks, out_file
    from workbench.config import HeadConfig
    from workbench.core.corpus import TASKS
    from workbench.core.model import load_model
    from workbench.data import file_stem
    from workbench.prefill.generalize import generalization_report
    from workbench.views.lengths import write_html

    check_tasks(args.tasks, TASKS)
    if args.quality_samples < 0:
        raise ValueError(f"--quality-samples {args.quality_samples}: give 0 (skip) or more prompts")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.out:
        out_file(args.out)
    where = resolve_device_args(args, gpu_dtype=torch.bfloat16)
    device, dtype = where["device"], where["dtype"]
    config = HeadConfig.load(args.config)  # before the model: a bad file fails in seconds
    model, tok, shape = load_model(args.model, **where)
    check_lengths(args.lengths, shape.max_positions, shape.name)
    config.validate(shape)
    out = out_file(args.out or f"reports/generalize/{file_stem(shape.name)}.json")
    command = (f"workbench generalize --config {args.config} --lengths {','.join(map(str, args.lengths))} "
               f"--tasks {','.join(args.tasks)} --samples {args.samples} --quality-samples {args.quality_samples} "
               f"--max-new-tokens {args.max_new_tokens} --device {device} --dtype {str(dtype).removeprefix('torch.')}"
               + (f" --model {args.model}" if args.model else "") + (f" --searched-at {args.searched_at}" if args.searched_at
                                                                      else "")
               + (f" --target {args.target}" if args.target is not None else "")
               + (f" --backend {args.backend}" if args.backend != "auto" else "") + f" --out {out}")
    report = generalization_report(model, tok, shape, config, lengths=args.lengths, tasks=args.tasks,
                                   samples=args.samples, searched_at=args.searched_at, target=args.target,
                                   quality_samples=args.quality_samples, max_new_tokens=args.max_new_tokens,
                                   backend=args.backend, out=out, command=command, config_source=str(args.config),
                                   progress=not args.no_progress)
    html = write_html(report, out.with_suffix(".html"))
    L = report["config"]["searched_at"]
    for variant, rows in report["summary"].items():
        for n, row in rows.items():
            print(f"{variant:6s} n={n:>6}: mass mean {row['mass_mean']:.4f}, worst head {row['mass_worst_head']:.4f} "
                  f"(answer rows {row['tail_worst_head']:.4f}), {row['heads_below_target']}/{row['heads']} heads below "
                  f"target, physical density {row['physical_density_mean']:.3f}")
        drops = report["dropping"][variant]
        print(f"{variant:6s}: {len(drops)} heads lose more than {report['settings']['drop']} from {L} to "
              f"{report['settings']['drop_to']} tokens" + (": " + ", ".join(f"L{r['layer']}H{r['head']} {r['drop']:.3f}"
                                                                           for r in drops[:10]) if drops else ""))
    for variant, q in report["quality"].items():
        print(f"{variant:6s} n={q['n']}: retrieval dense {q['dense_correct']}/{q['samples']} sparse "
              f"{q['sparse_correct']}/{q['samples']}, KL mean {q['kl_mean']:.4f} max {q['kl_max']:.4f}")
    print(f"wrote {out} and {html}")
    return 0
