"""What group-shared selection costs: captured attention mass of per-head vs group-shared indexes (CPU).

InfLLM-V2-style group sharing gives the G query heads of a KV head one index (chosen from their scores
added together), which lets the prefill kernel run GQA-packed. This measures the price in attention mass
on the embedded model (real text, every `--every`-th layer): block top-k tables from `block_index` and Vertical-Slash
indexes from `vs_index`, per head vs `group_shared=True`, scored by `workbench.analysis.stats.captured_mass`
(exact dense attention, mean over heads and rows). Writes JSON; runs on the CPU (Triton interpreter for the
VS index builder).

    python -m workbench_benchmarks.group_shared_mass --length 2048 --out assets/benchmarks/group_shared_mass_cpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench_benchmarks.group_shared_mass", description=__doc__)
    p.add_argument("--length", type=int, default=2048, help="prompt tokens")
    p.add_argument("--topk", type=int, default=8, help="block-sparse key blocks per query block")
    p.add_argument("--vertical", type=int, default=128, help="VS columns per head")
    p.add_argument("--slash", type=int, default=256, help="VS slash offsets per head")
    p.add_argument("--every", type=int, default=5, help="score every k-th layer (1 = all 30; ~1 min per layer)")
    p.add_argument("--out", default="reports/benchmarks/group_shared_mass_cpu.json")
    args = p.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the VS index builder is a Triton kernel
    import torch
    from workbench_kernels.index_build import block_index, vs_index

    from workbench.analysis.stats import captured_mass
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.core.timing import environment
    from workbench.patterns import BlockSparse, VerticalSlash

    t0 = time.time()
    model, tok, shape = load_model()
    sample = make_sample("passkey", tok, args.length, seed=0)
    layers = list(range(0, shape.n_layers, args.every))
    cap = capture_attention(model, shape, sample.input_ids, layers=layers, dtype=torch.float32, progress=False)
    G = shape.n_heads // shape.n_kv_heads
    rows = []
    for i, layer in enumerate(layers):
        q, k = cap.q[i][None], cap.k[i][None]
        scale = cap.scale
        row = {"layer": layer}
        for shared in (False, True):
            tag = "group_shared" if shared else "per_head"
            table = block_index(q, k, args.topk, group_shared=shared)[0]
            cols, offs = vs_index(q, k, scale, args.vertical, args.slash, sink=30, local=min(100, args.slash),
                                  group_shared=shared)
            if shared:
                table, cols, offs = (x.repeat_interleave(G, 0) for x in (table, cols[0], offs[0]))
            else:
                cols, offs = cols[0], offs[0]
            row[f"block_{tag}"] = captured_mass(q[0], k[0], scale, BlockSparse(table)).mean().item()
            row[f"vs_{tag}"] = captured_mass(q[0], k[0], scale, VerticalSlash(cols, offs)).mean().item()
        rows.append(row)
        print(row, flush=True)
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if key != "layer"}
    result = {"environment": environment("python -m workbench_benchmarks.group_shared_mass " + " ".join(sys.argv[1:])),
              "model": "embedded SmolLM2-135M (9 query / 3 KV heads, G = 3), fp32",
              "prompt": f"passkey sample, {args.length} tokens, seed 0",
              "settings": vars(args), "mean_over_layers": mean, "layers": rows, "elapsed_s": time.time() - t0}
    write_json(args.out, result)
    print("mean captured mass:", {k_: round(v_, 4) for k_, v_ in mean.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
