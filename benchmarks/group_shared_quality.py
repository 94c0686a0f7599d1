"""What one Vertical-Slash index per KV group costs a real model's output at equal sizes (CPU or GPU).

Two head configs that differ only in sharing: every head the model leaves free on per-head VS at a budget of
keys per query (`VerticalSlash.at_budget`), and the same sizes as `vs_group` (one index per KV head, from the
proxy's scores added over the group). Each runs `prefill.quality.quality_report` on the same passkey prompts
(needle depths spread): next-token KL(dense || sparse) and top-1 agreement at the answer position and greedy
retrieval; the dense side is computed once per prompt (cached). Beside it, each config's mean physical density
over the layers the model leaves free, on the first prompt (`SparsePrefill(record_density=True)`): equal sizes need not mean
equal tiles, since the shared index picks different columns and diagonals.

    python -m workbench_benchmarks.group_shared_quality --model gemma-3-270m --length 16384 --budget 1024 \\
        --samples 4 --out assets/benchmarks/group_shared_quality_gemma16k_cpu.json
"""
from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench_benchmarks.group_shared_quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M; gemma-3-270m: 32K)")
    p.add_argument("--length", type=int, default=4096, help="prompt tokens")
    p.add_argument("--budget", type=int, default=None, help="VS keys per query row (default: length / 16)")
    p.add_argument("--samples", type=int, default=4, help="passkey prompts (needle depths spread)")
    p.add_argument("--out", default="reports/benchmarks/group_shared_quality_cpu.json")
    args = p.parse_args(argv)
    import torch

    from workbench.config import HeadConfig
    from workbench.core.corpus import make_sample
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.core.timing import environment
    from workbench.patterns import VerticalSlash
    from workbench.prefill.quality import quality_report
    from workbench.prefill.sparse import SparsePrefill

    t0 = time.time()
    model, tok, shape = load_model(args.model)
    shape.check_length(args.length)
    budget = args.budget or args.length // 16
    sizes = VerticalSlash.at_budget(budget, args.length)
    probe = make_sample("passkey", tok, args.length, seed=0).input_ids.reshape(1, -1)
    result = {"environment": environment(), "settings": vars(args), "model": shape.to_dict(), "sizes": sizes,
              "configs": {}}
    for kind in ("vs", "vs_group"):
        config = HeadConfig.every_head(shape, kind, sizes, source=f"every free head {kind}{tuple(sizes.values())}")
        report = quality_report(model, tok, shape, config, lengths=[args.length], samples=args.samples,
                                cosine_samples=0, sensitivity_samples=0, progress=False)
        with torch.no_grad(), SparsePrefill(model, shape, config, min_length=0, record_density=True) as sp:
            model(probe, use_cache=False, logits_to_keep=1)
        row = report["summary"]["per_length"][str(args.length)]
        free = [layer for layer in shape.free_layers if layer in sp.density]  # the model's own windows aside
        result["configs"][kind] = {
            **{k: row[k] for k in ("samples", "dense_accuracy", "sparse_accuracy", "kl_mean", "kl_median", "kl_max",
                                   "top1_agreement", "sparse_seconds_mean")},
            "kl_per_sample": [round(r["kl"], 6) for r in report["records"]],
            "physical_density_mean": round(sum(sp.density[layer] for layer in free) / len(free), 5),
            "physical_density_per_layer": {str(layer): round(d, 5) for layer, d in sorted(sp.density.items())}}
        print(kind, {k: v for k, v in result["configs"][kind].items() if k != "physical_density_per_layer"},
              flush=True)
    vs, shared = result["configs"]["vs"], result["configs"]["vs_group"]
    result["kl_ratio_shared_to_per_head"] = round(shared["kl_mean"] / max(vs["kl_mean"], 1e-12), 3)
    result["density_ratio_shared_to_per_head"] = round(shared["physical_density_mean"] / vs["physical_density_mean"], 4)
    result["elapsed_s"] = round(time.time() - t0, 1)
    write_json(args.out, result)
    print(f"KL x{result['kl_ratio_shared_to_per_head']}, density x{result['density_ratio_shared_to_per_head']} "
          f"(shared / per head); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
