"""`workbench bench search`: how long the per-head pattern search takes.

Embedded (default, CPU): `workbench search` of the embedded SmolLM2 as a user runs it (every head, the
calibration tasks at --length, held-out recall), timed end to end, then the re-scoring of one edited
head (what the dashboard does per edit) and the VS proxy's settings compared on the held-out prompt
-> reports/benchmarks/search_cpu.json (committed results: --out assets/benchmarks/...). The searched config goes to --config-out.

--random-llama: the search of a random-weight Llama-3-8B shape (random-token samples) over the ranks of
a torchrun job (NCCL on GPUs, gloo on the CPU), to compare N GPUs against one; run once per world size
with the same arguments, e.g. on a host with 2 H200s:

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 1 -m workbench bench search --random-llama --out a1.json
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 -m workbench bench search --random-llama --out a2.json

Rank 0 writes the search's wall time (model build excluded), per-rank seconds and items, and the sha256
of the chosen heads (equal across world sizes when the result is the single-process one). Random
weights make attention patterns unrealistic: those numbers are about time and scaling only.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

EDIT_LAYER, EDIT_HEAD = 5, 4  # the head whose re-scoring is timed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", default="passkey,code,vartrack", help="embedded: calibration tasks (as `workbench search`)")
    p.add_argument("--length", type=int, default=None,
                   help="tokens per calibration sample (default: 4096 embedded, 16384 --random-llama)")
    p.add_argument("--seed", type=int, default=0, help="sample seed (default 0)")
    p.add_argument("--target", type=float, default=0.95, help="embedded: captured-mass target (default 0.95)")
    p.add_argument("--tail-target", type=float, default=None, help="embedded: answer-row target (default --target)")
    p.add_argument("--holdout", default="multikey", help="embedded: held-out task (default multikey)")
    p.add_argument("--reps", type=int, default=5, help="embedded: timed re-scorings per edit (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--config-out", default="reports/bench/search_config.json",
                   help="embedded: where the searched config goes (default reports/bench/search_config.json)")
    p.add_argument("--random-llama", action="store_true",
                   help="search a random-weight Llama-3-8B shape over the ranks of a torchrun job instead")
    p.add_argument("--layers", type=int, default=32, help="--random-llama: decoder layers (default 32)")
    p.add_argument("--samples", type=int, default=4, help="--random-llama: random-token samples (default 4)")
    p.add_argument("--tiny", action="store_true",
                   help="--random-llama: a tiny Llama shape (hidden 256, 4 q / 2 KV heads, d 64) for a CPU smoke run")
    p.add_argument("--out", default=None, help="JSON output path (default reports/benchmarks/search_cpu.json, "
                   "with --random-llama reports/benchmarks/search_distributed.json; rank 0 writes)")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return random_llama_search(args) if args.random_llama else embedded_search(args)


def embedded_search(args: argparse.Namespace) -> int:
    """`workbench search` timed end to end, then one head's re-scoring and the proxy variants."""
    import torch

    from workbench.cli import build_parser
    from workbench.cli.search import task_depth
    from workbench.config import HeadConfig
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.core.timing import environment, measure
    from workbench.patterns.base import default_budget
    from workbench.search.search import Candidate, HeadCache, compare_proxies, rescore_head

    n = args.length or 4096
    argv = ["search", "--tasks", args.tasks, "--lengths", str(n), "--seed", str(args.seed), "--target",
            str(args.target), "--holdout", args.holdout, "--out", args.config_out, "--no-progress"]
    argv += ["--tail-target", str(args.tail_target)] if args.tail_target is not None else []
    search = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    search.func(search)
    seconds = time.perf_counter() - t0  # model load, captures, scoring, choice, held-out evaluation

    model, tok, shape = load_model()
    cfg = HeadConfig.load(args.config_out, shape)
    samples = [make_sample(t, tok, n, seed=args.seed, **d) for t, d in map(task_depth, args.tasks.split(","))]
    t0 = time.perf_counter()
    caps = [capture_attention(model, shape, s.input_ids, layers=[EDIT_LAYER], progress=False) for s in samples]
    cache = HeadCache.from_captures(caps, EDIT_LAYER, EDIT_HEAD)
    cache_seconds = time.perf_counter() - t0
    edits = [Candidate.at_budget(kind, default_budget(n), n) for kind in ("vs", "ashape", "block")]  # n/16 keys
    rescore = {}
    for cand in edits:
        t = measure(lambda cand=cand: rescore_head(cache, cand, cfg.proxy), cuda=False, warmup=0,
                    min_reps=args.reps, max_reps=args.reps)
        rescore[cand.label()] = {"median_ms_all_samples": round(t.median_ms, 1), "min_ms_all_samples": round(t.min_ms, 1),
                                 "median_ms_per_sample": round(t.median_ms / len(samples), 1),
                                 "worst_mass": round(rescore_head(cache, cand, cfg.proxy)["worst"], 5)}
    proxies = None
    if args.holdout:
        hold = make_sample(args.holdout, tok, n, seed=args.seed)
        cap = capture_attention(model, shape, hold.input_ids, progress=False)
        proxies = {"sample": hold.describe(),
                   "note": "VS proxy at one budget on the held-out prompt, all heads; forced sink/local per proxy defaults",
                   "rows": compare_proxies(cap, n // 32, n // 8, progress=True)}
    data = {
        "what": "per-head pattern search of the embedded model on the CPU, and re-scoring one edited head",
        "environment": environment(),
        "search_command": cfg.provenance.get("command"),
        "model": shape.to_dict(),
        "calibration": [s.describe() for s in samples],
        "search": {"seconds": round(seconds, 1), "seconds_in_provenance": cfg.provenance.get("search_seconds"),
                   "bar_seconds": 300, "cpu_seconds_of_this_process": cfg.provenance.get("search_cpu_seconds"),
                   "layers": shape.n_layers, "heads": shape.n_layers * shape.n_heads,
                   "candidates": len(cfg.provenance["candidates"]), "patterns": cfg.summary()},
        "rescore_one_head": {"layer": EDIT_LAYER, "head": EDIT_HEAD, "samples": len(samples), "tokens": n,
                             "cache_build_seconds": round(cache_seconds, 2), "bar_ms": 300, "edits": rescore},
        "holdout": cfg.provenance.get("holdout"),
        "proxy_variants": proxies,
        "calibration_recall": {
            "mean_of_head_means": round(sum(e.recall["mean"] for e in cfg.heads) / len(cfg.heads), 5),
            "worst_head_worst_sample": round(min(e.recall["worst"] for e in cfg.heads), 5),
            "mean_physical_density": round(sum(e.density["physical"] for e in cfg.heads) / len(cfg.heads), 5)},
        "torch_threads": torch.get_num_threads(),
    }
    out = args.out or "reports/benchmarks/search_cpu.json"
    write_json(out, data)
    print(f"wrote {out}: search {seconds:.0f} s (bar 300 s); re-score one head "
          + ", ".join(f"{k} {v['median_ms_all_samples']} ms" for k, v in rescore.items()) + " (bar 300 ms)")
    return 0


@dataclass
class RandomSample:
    """Random token ids `[N]` standing in for a calibration prompt (what `search` needs of a Sample)."""

    input_ids: Any
    seed: int

    def describe(self) -> dict[str, Any]:
        return {"task": "random tokens", "length": int(self.input_ids.numel()), "seed": self.seed}


def random_llama_search(args: argparse.Namespace) -> int:
    """The search of a random Llama-3-8B shape over the torchrun ranks; rank 0 writes the JSON."""
    import torch
    from workbench_benchmarks.shapes import random_llama

    from workbench.core.io import write_json
    from workbench.core.model import model_shape
    from workbench.core.timing import environment
    from workbench.search import distributed

    d = distributed.init()
    length = args.length or 16384
    t_build = time.perf_counter()
    model, _ = random_llama(args.layers, tiny=args.tiny, device=d.device,
                         dtype=torch.bfloat16 if d.device.type == "cuda" else torch.float32)
    # the fingerprint hashes sampled weight bytes: the ranks' agreement check compares real weights
    shape = model_shape(model, f"random {'tiny Llama' if args.tiny else 'Llama-3-8B'} shape ({args.layers} layers)")
    g = torch.Generator().manual_seed(args.seed)
    samples = [RandomSample(torch.randint(model.config.vocab_size, (length,), generator=g), seed=i)
               for i in range(args.samples)]
    build_seconds = time.perf_counter() - t_build
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    cfg, _ = distributed.search_heads_distributed(model, shape, samples, d, progress=d.is_main)
    seconds = time.perf_counter() - t0
    if d.is_main:
        heads = json.dumps([h.to_dict() for h in cfg.heads], sort_keys=True).encode()
        data = {
            "what": "per-head search (exact captured mass of every default candidate) over torchrun ranks",
            "environment": environment(),
            "inputs": f"{shape.name}, random weights (seed 0), {args.samples} samples x {length} random tokens",
            "model": shape.to_dict(), "world_size": d.world_size, "backend": d.backend,
            "model_build_seconds": round(build_seconds, 2), "search_seconds": round(seconds, 2),
            "ranks": cfg.provenance["distributed"]["ranks"],
            "heads_sha256": hashlib.sha256(heads).hexdigest(), "patterns": cfg.summary(),
            "note": "compare search_seconds between world sizes; heads_sha256 equal = same config as one process",
        }
        out = args.out or "reports/benchmarks/search_distributed.json"
        write_json(out, data)
        print(f"wrote {out}: {d.world_size} rank(s), search {seconds:.1f} s, heads {data['heads_sha256'][:12]}")
    distributed.close()
    return 0


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
