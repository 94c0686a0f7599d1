"""Distributed search timing: the per-head search of a random-weight Llama-3-8B-shaped model over the ranks
of a torchrun job (NCCL on GPUs, gloo on the CPU), to compare N GPUs against one.

Run once per world size with the same arguments, e.g. on a host with 2 H200s:

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 1 -m workbench bench search --out a1.json
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 2 -m workbench bench search --out a2.json

Every rank builds the same model (seed 0) and the same random-token samples, and scores its (sample,
layer) shard; rank 0 writes the JSON: wall time of the search (excluding model build), per-rank
seconds and items, the sha256 of the chosen heads (equal across world sizes when the result is the
single-process one), the environment and the command. Random weights make attention patterns
unrealistic: the numbers are about time and scaling, not about which patterns win.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the random model (default 32)")
    p.add_argument("--length", type=int, default=16384, help="tokens per calibration sample (default 16384)")
    p.add_argument("--samples", type=int, default=4, help="calibration samples of random tokens (default 4)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny Llama shape (hidden 256, 4 q / 2 KV heads, d 64) for a CPU smoke run")
    p.add_argument("--out", default="assets/benchmarks/search_distributed.json", help="JSON output path (rank 0)")


@dataclass
class RandomSample:
    """Random token ids `[N]` standing in for a calibration prompt (what `search` needs of a Sample)."""

    input_ids: Any
    seed: int

    def describe(self) -> dict[str, Any]:
        return {"task": "random tokens", "length": int(self.input_ids.numel()), "seed": self.seed}


def _model(args: argparse.Namespace, device: Any):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.core.model import model_shape
    from workbench_benchmarks.prefill_e2e import LLAMA3_8B

    dims = dict(LLAMA3_8B)
    if args.tiny:
        dims.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    vocab_size=1024)
    cfg = LlamaConfig(num_hidden_layers=args.layers, attn_implementation="sdpa", **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    what = "tiny Llama" if args.tiny else "Llama-3-8B"
    # the fingerprint hashes sampled weight bytes: the ranks' agreement check compares real weights
    return model, model_shape(model, f"random {what} shape ({args.layers} layers)"), cfg.vocab_size


def run(args: argparse.Namespace) -> int:
    import platform

    import torch

    from workbench.search import distributed
    from workbench.core.io import write_json

    d = distributed.init()
    t_build = time.perf_counter()
    model, shape, vocab = _model(args, d.device)
    g = torch.Generator().manual_seed(0)
    samples = [RandomSample(torch.randint(vocab, (args.length,), generator=g), seed=i) for i in range(args.samples)]
    build_seconds = time.perf_counter() - t_build
    if d.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    cfg, ev = distributed.search_heads_distributed(model, shape, samples, d, progress=d.is_main)
    seconds = time.perf_counter() - t0
    if d.is_main:
        heads = json.dumps([h.to_dict() for h in cfg.heads], sort_keys=True).encode()
        env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
        if d.device.type == "cuda":
            import triton

            env.update(gpu=torch.cuda.get_device_name(d.device), gpus=d.world_size, triton=triton.__version__,
                       driver=torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None,
                       cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
        data = {
            "what": "per-head search (exact captured mass of every default candidate) over torchrun ranks",
            "command": "torchrun --standalone --nproc_per_node " + str(d.world_size) + " -m workbench bench search "
                       + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "search"] else sys.argv[1:]),
            "inputs": f"{shape.name}, random weights (seed 0), {args.samples} samples x {args.length} random tokens",
            "model": shape.to_dict(), "world_size": d.world_size, "backend": d.backend, "environment": env,
            "model_build_seconds": round(build_seconds, 2), "search_seconds": round(seconds, 2),
            "ranks": cfg.provenance["distributed"]["ranks"],
            "heads_sha256": hashlib.sha256(heads).hexdigest(), "patterns": cfg.summary(),
            "note": "compare search_seconds between world sizes; heads_sha256 equal = same config as one process",
        }
        write_json(args.out, data)
        print(f"wrote {args.out}: {d.world_size} rank(s), search {seconds:.1f} s, heads {data['heads_sha256'][:12]}")
    distributed.close()
    return 0
