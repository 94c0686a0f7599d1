"""`workbench bench prefill`: end-to-end prefill timing on a GPU: a random-weight Llama-3-8B-shaped model, dense SDPA vs sparse.

The model is built from a `LlamaConfig` with Llama-3-8B dimensions (hidden 4096, 32 query / 8 KV heads,
head_dim 128, intermediate 14336, vocab 128256, RoPE theta 5e5, 131072 positions) and random weights,
in bf16, directly on the GPU, with `--layers` decoder layers (the per-layer numbers are extrapolated
to 32 layers). Random weights make the attention of real prompts unrealistic, so the configs are
named by their budgets: block-sparse top-100 (MInference's block_sparse default), A-shape, VS with
MInference's default budget (1000 columns, 6096 slashes: on random weights its slashes scatter, the
worst case for tiles), the same VS sizes with one index per KV group (`vs_group`) and a mixed layer (a third of
the heads each VS, block-sparse, A-shape: one launch per kind on an H100 / H200, `--merged` adds its merged launch).
Per config and length: end-to-end prefill time (CUDA events around `model(ids)`, logits of the last
position only), the per-layer breakdown T_proj / T_index / T_sparse / T_other
(`SparsePrefill(timing=True)`, one forward timed after a first that records the physical density), the physical
density, and the crossover length below which dense wins. The 32-layer extrapolation takes the measured forward's
time per layer (its total less the timed embedding, final norm and last-position head, over `--layers`), not the
breakdown's: the breakdown syncs the device after each stage, which exposes each stage's host launches (most in an
index of many small launches, at short lengths), so its stage times overstate what the unsynced forward spends.

Transformers' eager RMSNorm and MLP run several unfused fp32 passes over [N, hidden] per layer, which
inflates T_other for dense and sparse alike (and so shrinks the speed-up). `--compile-other` fuses
them with torch.compile (each layer's MLP and norms; attention untouched), as a serving engine's
fused kernels would; both settings are worth reporting.
"""
from __future__ import annotations

import argparse
import functools
import math
import time
from typing import Any

FULL_LAYERS = 32
CONFIGS = {  # name: per-head (pattern, params) by head index
    "block_top100": lambda h: ("block", {"topk": 100}),
    "ashape_128_4096": lambda h: ("ashape", {"sink": 128, "window": 4096}),
    "vs_1000_6096": lambda h: ("vs", {"vertical": 1000, "slash": 6096}),
    "vs_group_1000_6096": lambda h: ("vs_group", {"vertical": 1000, "slash": 6096}),
    "mixed_thirds": lambda h: [("vs", {"vertical": 1000, "slash": 6096}), ("block", {"topk": 100}),
                               ("ashape", {"sink": 128, "window": 4096})][h % 3],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="8192,16384,32768,65536,131072", help="comma-separated prompt lengths")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the random model (default 4; "
                   "per-layer times are extrapolated to 32)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    p.add_argument("--reps", type=int, default=3, help="timed forwards per point (median; one warm-up first)")
    p.add_argument("--merged", action="store_true",
                   help="also run each config whose layers mix kinds with one merged launch per layer (`SparsePrefill("
                        "per_kind=False)`), as CONFIG/merged beside the default")
    p.add_argument("--compile-other", action="store_true",
                   help="torch.compile each layer's MLP and RMSNorms (dense and sparse alike; attention untouched)")
    p.add_argument("--out", default="reports/benchmarks/prefill_e2e_<gpu>.json",
                   help="JSON output path; <gpu>: this machine's GPU as `timing.gpu_tag` names it (h100, h200, ...)")


def _model(n_layers: int):
    from workbench_benchmarks.shapes import random_llama

    from workbench.core.model import model_shape

    model, _ = random_llama(n_layers)
    return model, model_shape(model, f"random Llama-3-8B shape ({n_layers} layers)", fp="random-seed0")


def compile_other(model) -> None:
    """Replace every decoder layer's MLP and RMSNorms by torch.compile'd versions (fused elementwise work)."""
    import torch

    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    for layer in model.model.layers:
        for name in ("mlp", "input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, torch.compile(getattr(layer, name)))


def _config(shape, make):
    from workbench.config import HeadConfig, HeadEntry

    heads = [HeadEntry(l, h, *make(h)) for l in range(shape.n_layers) for h in range(shape.n_heads)]
    return HeadConfig(model=shape.to_dict(), heads=heads, provenance={"source": "prefill bench (synthetic budgets)"})


def _time_forward(model, ids, reps: int) -> float:
    """Median ms of model(ids) (prefill, cache written, last-position logits) over `reps` after a warm-up."""
    import torch

    from workbench.core.timing import time_ms

    with torch.no_grad():
        return time_ms(lambda: model(ids, use_cache=True, logits_to_keep=1), cuda=True, min_reps=reps, max_reps=reps)


def run(args: argparse.Namespace) -> int:
    import torch

    from workbench.core.io import write_json
    from workbench.prefill.sparse import SparsePrefill

    if not torch.cuda.is_available():
        raise ValueError("workbench bench prefill needs a CUDA GPU (none found): run it on the GPU machine")

    from workbench.core.timing import environment, gpu_tag, time_ms

    args.out = args.out.replace("<gpu>", gpu_tag())
    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            raise ValueError(f"--configs: unknown config {c!r}; use some of {list(CONFIGS)}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    t0 = time.time()
    env = environment()
    env["inputs"] = ("random-weight model with Llama-3-8B dimensions (LlamaConfig: hidden 4096, 32 q / 8 KV heads, "
                     f"head_dim 128, intermediate 14336, vocab 128256, RoPE theta 5e5), {args.layers} of 32 layers, "
                     "bf16, batch 1, random token ids; per-layer times extrapolated to 32 layers"
                     + ("; MLP and RMSNorms torch.compile'd (dense and sparse alike)" if args.compile_other else ""))
    model, shape = _model(args.layers)
    if args.compile_other:
        compile_other(model)
    configs = {c: (_config(shape, CONFIGS[c]), None) for c in names}
    if args.merged:
        configs.update({f"{c}/merged": (cfg, False) for c, (cfg, _) in list(configs.items())
                        if len({e.pattern for e in cfg.layer(0)}) > 1})
    result: dict[str, Any] = {"environment": env, "settings": {k: v for k, v in vars(args).items() if k != "func"},
                              "full_layers": FULL_LAYERS, "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device="cuda", generator=g)
        points = {"dense": (None, None), **configs}
        with torch.no_grad():
            outside = time_ms(functools.partial(outside_layers, model, ids), cuda=True, min_reps=args.reps, max_reps=args.reps)
        for name, (cfg, per_kind) in points.items():
            if cfg is None:
                total = _time_forward(model, ids, args.reps)
                with torch.no_grad(), SparsePrefill(model, shape, configs[names[0]][0], min_length=n + 1,
                                                    timing=True) as sp:
                    layers = _breakdown(model, ids, sp)
                density = 1.0
            else:
                with SparsePrefill(model, shape, cfg, min_length=0, per_kind=per_kind) as sp:
                    total = _time_forward(model, ids, args.reps)
                with torch.no_grad(), SparsePrefill(model, shape, cfg, min_length=0, timing=True,
                                                    record_density=True, per_kind=per_kind) as sp:
                    layers = _breakdown(model, ids, sp)
                density = sum(sp.density.values()) / len(sp.density)
            mean = {k: sum(r[k] for r in layers) / len(layers) for k in ("proj_ms", "index_ms", "sparse_ms",
                                                                          "other_ms", "layer_ms")}
            layer_ms = (total - outside) / len(layers)  # the unsynced forward's time per layer
            row = {"n": n, "config": name, "physical_density": density, "prefill_ms": total,
                   "layers_measured": len(layers), "per_layer_mean": mean, "per_layer": layers,
                   "outside_layers_ms": outside, "forward_layer_ms": layer_ms,
                   "prefill_ms_32_layers": outside + FULL_LAYERS * layer_ms}
            result["rows"].append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                   if k not in ("per_layer", "per_layer_mean")},
                  {k: round(v, 2) for k, v in mean.items()}, flush=True)
            write_json(args.out, result)
        del ids
        torch.cuda.empty_cache()
    result["summary"] = summarize(result["rows"])
    result["elapsed_s"] = time.time() - t0
    write_json(args.out, result)
    for line in result["summary"]["table"]:
        print(line)
    return 0


def outside_layers(model, ids):
    """Logits [1, 1, vocab] of the forward's work outside its decoder layers: embedding, rotary tables, final norm,
    last-position head (what `model(ids, logits_to_keep=1)` computes with no layers)."""
    import torch

    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    h = model.model.embed_tokens(ids)
    model.model.rotary_emb(h, positions)
    return model.lm_head(model.model.norm(h[:, -1:]))


def _breakdown(model, ids, sp) -> list[dict[str, Any]]:
    """Per-layer breakdown of one forward under `sp` (`timing=True`), timed after a first forward on the same `sp`:
    that one builds its caches and index graphs and records the density where asked, so neither the first call's
    costs nor the density's host syncs (one per kind and layer) land in the times."""
    model(ids, use_cache=True, logits_to_keep=1)
    sp.record_density = False
    model(ids, use_cache=True, logits_to_keep=1)
    return sp.breakdown()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Speed-ups over dense (measured layers and 32-layer extrapolation) and the crossover length per config:
    the length where the 32-layer speed-up crosses 1, interpolated in log2(length) between measured points."""
    dense = {r["n"]: r for r in rows if r["config"] == "dense"}
    out: dict[str, Any] = {"speedup": {}, "crossover_length": {}, "table": []}
    for name in sorted({r["config"] for r in rows} - {"dense"}):
        pts = []
        for r in sorted((r for r in rows if r["config"] == name), key=lambda r: r["n"]):
            d = dense[r["n"]]
            s_meas, s_32 = d["prefill_ms"] / r["prefill_ms"], d["prefill_ms_32_layers"] / r["prefill_ms_32_layers"]
            s_attn = d["per_layer_mean"]["sparse_ms"] / (r["per_layer_mean"]["sparse_ms"] + r["per_layer_mean"]["index_ms"])
            out["speedup"].setdefault(name, {})[r["n"]] = {"measured_layers": s_meas, "extrapolated_32_layers": s_32,
                                                           "attention_with_index": s_attn}
            pts.append((r["n"], s_32))
            m = r["per_layer_mean"]
            out["table"].append(f"{name:16s} n={r['n']:6d} density={r['physical_density']:.3f} "
                                f"proj={m['proj_ms']:.2f} index={m['index_ms']:.2f} sparse={m['sparse_ms']:.2f} "
                                f"other={m['other_ms']:.2f} | dense attn={d['per_layer_mean']['sparse_ms']:.2f} "
                                f"| e2e x{s_meas:.2f} (32 layers x{s_32:.2f}, attention x{s_attn:.2f})")
        cross = None
        if pts and pts[0][1] >= 1:
            cross = f"<= {pts[0][0]}"
        for (n0, s0), (n1, s1) in zip(pts, pts[1:]):
            if s0 < 1 <= s1:
                f = (0 - math.log(s0)) / (math.log(s1) - math.log(s0))
                cross = round(2 ** (math.log2(n0) + f * (math.log2(n1) - math.log2(n0))))
                break
        out["crossover_length"][name] = cross if cross is not None else f"> {pts[-1][0]}" if pts else None
    return out


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
