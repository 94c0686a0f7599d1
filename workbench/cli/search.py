"""`workbench search`: pick a sparse pattern per (layer, head) on calibration samples, write a HeadConfig."""
from __future__ import annotations

import argparse
import time

from workbench.cli._args import add_device, add_lengths, add_out, add_tasks, resolve_device_args
from workbench.cli._stream import add_stream_arguments, load_for_stream, random_sample

TASKS = "passkey,code,vartrack"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="fit a sparse pattern per head and write a head config",
                       description=__doc__)
    p.add_argument("--model", default=None, help="model folder or hub id (default: the embedded SmolLM2-135M)")
    add_tasks(p, TASKS, what="calibration tasks (a needle depth as task@0.1)")
    add_lengths(p, "4096", what="prompt lengths in tokens; calibrate at the length you deploy at: A-shape windows "
                "and VS budgets are in tokens")
    p.add_argument("--seed", type=int, default=0, help="sample seed (default 0); the search itself is deterministic")
    p.add_argument("--target", type=float, default=0.95,
                   help="captured attention mass each head must reach on its worst calibration sample (default 0.95)")
    p.add_argument("--tail-target", type=float, default=None,
                   help="captured mass each head must keep over the last 64 (answer) rows on the worst sample "
                        "(default: --target)")
    p.add_argument("--candidates", default=None,
                   help="JSON file: a list of {\"pattern\": ..., \"params\": {...}} (default: a grid scaled to the length)")
    p.add_argument("--group-shared", action="store_true",
                   help="also try, per KV group, the kinds that share one index per KV head (vs_group: Vertical-Slash "
                        "shared by the group) at their grid's budgets; a group takes one where every head keeps the "
                        "target and the cost falls, which needs --latency from a benchmark that timed its kernel")
    p.add_argument("--holdout", default="multikey",
                   help="task scored with the chosen config but not used to choose it ('' to skip; default multikey)")
    p.add_argument("--last-rows", type=int, default=64, help="query rows the VS proxy samples (default 64)")
    p.add_argument("--aggregate", choices=("sum", "max", "logits"), default="sum", help="VS proxy aggregation")
    p.add_argument("--diag-norm", choices=("sum", "mean", "prior"), default="sum", help="VS proxy diagonal normalisation")
    p.add_argument("--latency", nargs="?", const="shipped", default=None,
                   help="cost = measured time per tile + index time, from the rows of the benchmark shape nearest this "
                        "model's: a `workbench bench kernels` JSON, the GPU of a shipped table (h100, h200), or alone: "
                        "the table shipped for this machine's GPU, else the H200's (default cost: physical 64x64 tiles)")
    add_out(p, None, "head config file to write", shown="reports/configs/<model>.json")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is faster on a busy shared machine)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_device(p, device_map=True)
    p.add_argument("--distributed", action="store_true",
                   help="spread calibration over the ranks of a torchrun job (implied under torchrun with WORLD_SIZE > 1): "
                        "torchrun --nproc_per_node N -m workbench search --distributed ...; rank 0 writes the config")
    add_stream_arguments(p)
    p.set_defaults(func=run)


def task_depth(task: str) -> tuple[str, dict[str, float]]:
    """"passkey@0.1" -> ("passkey", {"depth": 0.1}); a task without "@" keeps the sample's default depth."""
    name, _, depth = task.partition("@")
    if not depth:
        return name, {}
    try:
        value = float(depth)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise ValueError(f"--tasks {task!r}: the depth after '@' must be a fraction in [0, 1], e.g. passkey@0.1")
    return name, {"depth": value}


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    import torch

    from workbench.cli._args import check_lengths, check_tasks, out_file
    from workbench.core.corpus import TASKS as TASK_NAMES
    from workbench.core.corpus import make_sample
    from workbench.core.io import read_json
    from workbench.core.model import load_model
    from workbench.core.stream import check_memory, default_chunk, stopped_midway, stream_capture
    from workbench.data import file_stem
    from workbench.patterns import PATTERNS
    from workbench.search import distributed
    from workbench.search.search import Candidate, default_candidates, evaluate_config, search_heads

    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.target <= 1:
        raise ValueError(f"--target {args.target} must be a captured-mass fraction in (0, 1], e.g. 0.95")
    tasks, lengths = args.tasks, args.lengths
    check_tasks([name for name, _ in map(task_depth, tasks)], TASK_NAMES)
    if args.holdout:
        check_tasks([args.holdout], TASK_NAMES, "--holdout")
    if args.holdout and args.holdout in [name for name, _ in map(task_depth, tasks)]:
        raise ValueError(f"--holdout {args.holdout} is also a calibration task: hold out a task not in --tasks")
    if args.out:
        out_file(args.out)
    candidates = None
    if args.candidates:
        data = read_json(args.candidates, "--candidates file")
        if not isinstance(data, list) or not data:
            raise ValueError(f"--candidates {args.candidates}: expected a non-empty JSON list of "
                             "{\"pattern\": ..., \"params\": {...}}")
        candidates = [Candidate.from_dict(d) for d in data]
        if not any(c.pattern == "dense" for c in candidates):
            candidates.append(Candidate("dense"))
    if args.group_shared:
        candidates = (candidates or default_candidates(max(lengths))) + [
            Candidate.from_dict({"pattern": kind, "params": p})
            for kind, cls in PATTERNS.items() if cls.kv_shared for p in cls.grid(max(lengths))]
    proxy = {"last_rows": args.last_rows, "aggregate": args.aggregate, "diag_norm": args.diag_norm}
    bench = None
    if args.latency:
        from workbench.prefill.latency import bench_path, load_bench, match_shape, tile_rates

        bench_file = bench_path(None if args.latency == "shipped" else args.latency)
        if args.latency == "shipped":  # the command records the table's GPU, which reads the same table elsewhere
            args.latency = bench_file.stem.removeprefix("prefill_")
        bench = load_bench(bench_file)
    t0, c0 = time.perf_counter(), time.process_time()
    d = distributed.init() if args.distributed or int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    where = resolve_device_args(args)
    if d:  # one device per rank
        where = {**where, "device": d.device, "device_map": None}
    if d is None:
        model, tok, shape = load_for_stream(args, None)
    else:
        model, tok, shape = load_model(args.model, **where)
    check_lengths(lengths, shape.max_positions, shape.name)
    latency = latency_source = None
    if bench is not None:  # the benchmark shape nearest this model's, as the dashboard's estimate picks it
        latency, latency_source = tile_rates(bench, shape), f"{bench_file}: {match_shape(bench, shape)[1]}"
        print(f"latency cost from {latency_source}")
    if tok is None:  # random weights: random ids, one sample per task and length (time and memory only)
        samples = [random_sample(model, n, args.seed, t) for t in tasks for n in lengths]
    else:
        samples = [make_sample(t, tok, n, seed=args.seed, **d) for t, d in map(task_depth, tasks) for n in lengths]
    if d is None:  # refuse a prompt that does not fit before the first forward
        check_memory(model, shape, max(lengths), args.chunk or default_chunk(model.device))
    command = (f"workbench search --tasks {','.join(tasks)} --lengths {','.join(map(str, lengths))} --seed {args.seed} "
               f"--target {args.target}" + (f" --tail-target {args.tail_target}" if args.tail_target is not None else "")
               + f" --holdout '{args.holdout}'" + (f" --model {args.model}" if args.model else "")
               + (" --group-shared" if args.group_shared else "") + (f" --latency {args.latency}" if args.latency else ""))
    settings = dict(candidates=candidates, target=args.target, tail_target=args.tail_target, proxy=proxy,
                    progress=not args.no_progress,
                    latency=latency, provenance={"command": command, "seed": args.seed, "threads": torch.get_num_threads(),
                                                 **({"latency": {"bench": latency_source, "rates": latency},
                                                    "cost": "estimated time: measured ms per 64x64 tile x tiles + index ms"}
                                                   if latency else {})})
    if d is None:
        with stopped_midway("no config was written"):
            cfg, ev = search_heads(model, tok, shape, samples, chunk=args.chunk, **settings)
    else:
        cfg, ev = distributed.search_heads_distributed(model, shape, samples, d, **settings)
        if cfg is None:  # ranks > 0 are done: rank 0 writes the config
            distributed.close()
            return 0
    distributed.add_fingerprints(cfg, model, shape, samples[0].input_ids)  # per-head q fingerprints for tensor-parallel checks
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    cfg.provenance["search_seconds"] = round(seconds, 1)
    cfg.provenance["search_cpu_seconds"] = round(cpu_seconds, 1)
    if args.holdout:
        hold = (make_sample(args.holdout, tok, max(lengths), seed=args.seed) if tok is not None
                else random_sample(model, max(lengths), args.seed, args.holdout))
        with stopped_midway("no config was written"):
            cap = stream_capture(model, shape, hold.input_ids, chunk=args.chunk, progress=False)
            cfg.provenance["holdout"] = holdout_summary(evaluate_config(cfg, cap, progress=not args.no_progress), cfg,
                                                        hold.describe())
            cap.close()
    random = getattr(model, "workbench_random", None)
    if random:
        cfg.provenance["random_weights"] = random
    folder = "reports/random-weights" if random else "reports/configs"  # random-weight configs never sit beside real ones
    out = Path(args.out or f"{folder}/{file_stem(shape.name)}.json")
    cfg.save(out)
    print(f"wrote {out}: {cfg.summary()} heads; search {seconds:.0f} s"
          + (f" - {model.workbench_random}" if getattr(model, "workbench_random", None) else ""))
    if "holdout" in cfg.provenance:
        h = cfg.provenance["holdout"]
        print(f"held-out {h['sample']['task']}: captured mass mean {h['mass_mean']:.4f}, worst head "
              f"{h['mass_worst']:.4f}; proxy-vs-oracle gap mean {h['proxy_oracle_gap_mean']:.4f}")
    if d is not None:
        distributed.close()
    return 0


def holdout_summary(result: dict, cfg, sample: dict) -> dict:
    """Condense `evaluate_config` output for provenance: means, worst head, segment means, oracle gap."""
    import torch

    from workbench.patterns import pattern_class

    mass, oracle = result["mass"], result["oracle"]
    dynamic = torch.tensor([[not pattern_class(e.pattern).static for e in cfg.layer(l)] for l in range(mass.shape[0])])
    gap = (oracle - mass).clamp(min=0)
    worst = divmod(int(mass.argmin()), mass.shape[1])
    return {
        "sample": sample,
        "mass_mean": round(float(mass.mean()), 6),
        "mass_worst": round(float(mass.min()), 6),
        "worst_head": {"layer": worst[0], "head": worst[1]},
        "heads_below_target": int((mass < cfg.provenance.get("target", 0.95)).sum()),
        "segments_mean": {k: round(float(v.mean()), 6) for k, v in result["segments"].items()},
        "segments_worst": {k: round(float(v.min()), 6) for k, v in result["segments"].items()},
        "proxy_oracle_gap_mean": round(float(gap[dynamic].mean()) if dynamic.any() else 0.0, 6),
        "proxy_oracle_gap_mean_all_heads": round(float(gap.mean()), 6),
    }
