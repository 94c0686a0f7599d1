"""`workbench bench decode`: the five engine modes on a random-weight Llama-3-8B-shaped model (H200).

    workbench bench decode --out decode_h200.json --layers 8 --reuse 0.8

Random weights and synthetic KV (say so in the results): block reuse between steps is then not
realistic, so offload modes also run with `ImposedReuse` at the dynamic reuse rate measured on the
embedded model (`--reuse`). Measures, in the same process: the pinned host->device copy rate, the
UVA gather kernel's rate per CTA count, then per (context, batch, mode, reuse) tokens/s, bytes moved,
cache hit rate, copy rate, fraction of transfer hidden, peak GPU memory. Writes JSON after every run.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from workbench_benchmarks.shapes import LLAMA3_8B, random_llama

from workbench.core.io import write_json
from workbench.core.timing import environment as timing_environment
from workbench.core.timing import measure, nvidia_smi
from workbench.decode.engine.decoder import MODES, DecodeEngine, EngineConfig
from workbench.decode.engine.reuse import ImposedReuse
from workbench.decode.engine.store import BLOCK, BlockStore, GiB, StoreSpec
from workbench.patterns.infllm import Budget

PAPER_BUDGET = Budget(init=1, local=32, topk=64)  # MiniCPM4.1 release: 96 blocks of 64 tokens


def environment() -> dict[str, Any]:
    link = f"gen{nvidia_smi('pcie.link.gen.current')} x{nvidia_smi('pcie.link.width.current')}"
    return {**timing_environment(), "pcie": link}


def copy_rates(store: BlockStore, ctas_list: list[int]) -> dict[str, Any]:
    """Pinned host->device rate: one large cudaMemcpy, and the UVA gather kernel on random 64-token blocks."""
    from workbench_kernels.gather import gather_blocks

    src_k, src_v = store.k[0], store.v[0]
    n = min(src_k.numel(), 512 * 1024 ** 2)  # 1 GiB of bf16
    dst = torch.empty(n, dtype=src_k.dtype, device="cuda")
    ms = measure(partial(dst.copy_, src_k[:n], non_blocking=True), cuda=True, min_reps=5, max_reps=5).median_ms
    memcpy = n * 2 / (ms / 1e3) / 1e9
    del dst
    E = BLOCK * store.spec.head_dim
    blocks = src_k.numel() // E
    m = 8192  # 8192 blocks of K + 8192 of V = 256 MiB
    dk = torch.empty(m, E, dtype=src_k.dtype, device="cuda")
    dv = torch.empty_like(dk)
    src_idx = torch.randperm(blocks, device="cuda")[:m]
    dst_idx = torch.arange(m, device="cuda")
    count = torch.tensor([m], dtype=torch.int32, device="cuda")
    gather = {}
    for ctas in ctas_list:
        ms = measure(partial(gather_blocks, src_k.view(-1, E), src_v.view(-1, E), dk, dv, src_idx, dst_idx, count,
                             ctas=ctas), cuda=True, min_reps=4, max_reps=4).median_ms
        gather[str(ctas)] = 2 * m * E * 2 / (ms / 1e3) / 1e9
    ok = torch.equal(dk[:4].cpu(), src_k.view(-1, E)[src_idx[:4].cpu()])
    return {"pinned_memcpy_gbps": memcpy, "gather_gbps_by_ctas": gather, "gather_checked_equal": ok,
            "gather_block_bytes": E * 2}


def run_one(model, store, mode: str, context: int, batch: int, *, steps: int, warmup: int, ctas: int,
            reuse: float | None, budget: Budget) -> dict[str, Any]:
    max_tokens = context + warmup + 2 * steps + 2
    hook = ImposedReuse(budget, reuse, -(-max_tokens // BLOCK)) if reuse is not None and mode != "dense-resident" else None
    cfg = EngineConfig(mode=mode, budget=budget, ctas=ctas, selector="same-layer")
    eng = DecodeEngine(model, cfg, batch=batch, max_tokens=max_tokens, store=store, select_hook=hook)
    lengths = [context - (i * 997) % 4096 for i in range(batch)]  # different lengths in one batch
    eng.fill_synthetic(lengths, fill_host=False)
    first = torch.randint(0, 1000, (batch,), device="cuda")
    graph_error = None
    try:
        eng.run(first, warmup, graph=True, progress=False)  # compiles, then captures the step as a CUDA graph
        _, _, stats = eng.run(first, steps, graph=True, progress=False)
    except RuntimeError as e:  # report it and time the eager loop instead
        graph_error = str(e)[:300]
        eng.drop_graph()
        torch.cuda.synchronize()
        _, _, stats = eng.run(first, steps, progress=False)
    _, _, eager = eng.run(first, steps, timing=True, progress=False)  # events around every copy and wait
    out = stats.to_dict()
    out["launches_per_layer_step"] = launches_per_layer(eng, first)
    for k in ("copy_seconds", "stall_seconds"):
        out.pop(k)
        out[f"eager_{k}_per_step"] = None if getattr(eager, k) is None else getattr(eager, k) / eager.steps
    out.update(eager_tokens_per_s=eager.tokens_per_s, eager_hit_rate=eager.hit_rate, eager_hidden_fraction=eager.hidden_fraction,
               eager_copy_gbps=eager.copy_gbps, hidden_fraction=None, copy_gbps=None)
    out.update(context=context, ctas=ctas, reuse_imposed=reuse, lengths=[min(lengths), max(lengths)],
               cuda_graph=graph_error is None, graph_error=graph_error)
    eng.close()
    gc.collect()
    torch.cuda.empty_cache()
    return out


def launches_per_layer(eng: DecodeEngine, tokens: torch.Tensor) -> float:
    """GPU kernel launches (memcpy/memset included) of one eager step, per layer, from the PyTorch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step(tokens)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / eng.lm.n_layers


def check_lossless(model, store, budget: Budget, context: int = 16384, batch: int = 4, steps: int = 24) -> dict[str, Any]:
    """On the GPU: offload modes must give exactly the tokens of sparse-resident with the same selector,
    eagerly and under CUDA-graph replay (same synthetic KV in the resident cache and the host store)."""
    lengths = [context - (i * 997) % 4096 for i in range(batch)]
    first = torch.randint(0, 1000, (batch,), device="cuda")
    out: dict[str, Any] = {"context": context, "batch": batch, "steps": steps}
    for graph in (False, True):
        tokens = {}
        for mode, selector in (("sparse-resident", "same-layer"), ("sparse-offload-sync", "same-layer"),
                               ("sparse-resident", "forecast"), ("sparse-offload-forecast", "forecast"),
                               ("forecast-without-prefetch", "forecast")):
            eng = DecodeEngine(model, EngineConfig(mode=mode, budget=budget, selector=selector), batch=batch,
                               max_tokens=context + steps + 1, store=store)
            eng.fill_synthetic(lengths, seed=1, fill_host=True)
            tokens[(mode, selector)] = eng.run(first, steps, graph=graph, progress=False)[0].cpu()
            eng.close()
        key = "graph" if graph else "eager"
        out[key] = {
            "sync == resident(same-layer)": torch.equal(tokens[("sparse-offload-sync", "same-layer")],
                                                        tokens[("sparse-resident", "same-layer")]),
            "forecast == resident(forecast)": torch.equal(tokens[("sparse-offload-forecast", "forecast")],
                                                          tokens[("sparse-resident", "forecast")]),
            "no-prefetch == resident(forecast)": torch.equal(tokens[("forecast-without-prefetch", "forecast")],
                                                             tokens[("sparse-resident", "forecast")])}
    gc.collect()
    torch.cuda.empty_cache()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--merge", nargs="+", default=None,
                   help="instead of running: merge result files of several runs (same model) into --out")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reuse", type=float, required=True, help="dynamic-block reuse rate measured on the embedded model")
    p.add_argument("--plan", default="32768:1,8,32,64;65536:1,8,32;131072:1,4,8,16",
                   help="context:batches;... (batches ascending)")
    p.add_argument("--sweep-ctas", default="8,16,32,64")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--host-gib", type=float, default=100.0, help="pinned host memory the store may take")
    p.add_argument("--check", action="store_true", help="first check on the GPU that offload modes are lossless")
    p.add_argument("--quick", action="store_true", help="imposed reuse only, no CTA sweep, no no-prefetch natural run")


def run(a: argparse.Namespace) -> int:
    if not torch.cuda.is_available() and not a.merge:
        raise ValueError("workbench bench decode needs a CUDA GPU (none found): run it on the GPU machine")
    if a.merge:
        parts = [json.loads(Path(f).read_text()) for f in a.merge]
        merged = dict(parts[0])
        merged["runs"] = [r for part in parts for r in part["runs"]]
        merged["parts"] = [{"command": part["environment"]["command"], "store": part.get("store"),
                            "copy": part.get("copy")} for part in parts]
        merged["summary"] = summarize(merged)
        write_json(a.out, merged)
        return 0
    plan = [(int(c), [int(b) for b in bs.split(",")]) for c, bs in (x.split(":") for x in a.plan.split(";"))]
    ctas_list = [int(c) for c in a.sweep_ctas.split(",")]
    budget = PAPER_BUDGET
    result: dict[str, Any] = {
        "what": "decode engine modes on a RANDOM-WEIGHT Llama-3-8B-shaped model (synthetic KV), "
                f"{a.layers} of 32 layers (layer 0 resident, {a.layers - 1} offloaded), bf16",
        "layers": a.layers, "budget": budget.to_dict(), "environment": environment(), "runs": []}
    out = Path(a.out)
    # One store for every run: batch x blocks per sequence of the largest run (other layouts view it).
    blocks = max(b * -(-(c + a.warmup + 2 * a.steps + 2) // BLOCK) for c, bs in plan for b in bs)
    spec = StoreSpec(a.layers - 1, 1, LLAMA3_8B["num_key_value_heads"], blocks, LLAMA3_8B["head_dim"], torch.bfloat16)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    print(f"pinning a {spec.nbytes / GiB:.1f} GiB store", flush=True)
    store = BlockStore(spec, limit_bytes=int(a.host_gib * GiB))
    for t in store.k + store.v:  # random content once: every later layout views the same memory
        for chunk in t.split(256 * 1024 ** 2):
            chunk.copy_(torch.randn(chunk.numel(), device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    result["store"] = {"gib": spec.nbytes / GiB, "seconds_to_pin_and_fill": time.perf_counter() - t0}
    print(f"store {spec.nbytes / GiB:.1f} GiB pinned+filled in {time.perf_counter() - t0:.1f}s", flush=True)
    result["copy"] = copy_rates(store, ctas_list)
    print("copy", json.dumps(result["copy"]), flush=True)
    write_json(out, result)
    model = random_llama(a.layers, max_positions=max(c for c, _ in plan) + 4096)
    result["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / GiB
    if a.check:
        result["lossless_gpu"] = check_lossless(model, store, budget)
        print("lossless", json.dumps(result["lossless_gpu"]), flush=True)
        write_json(out, result)
    for context, batches in plan:
        for batch in batches:
            jobs = [(m, None, 16) for m in MODES[:2]]
            jobs += [(m, r, 16) for m in MODES[2:] for r in ((a.reuse,) if a.quick else (None, a.reuse))]
            if context == max(c for c, _ in plan) and not a.quick:
                jobs += [(m, a.reuse, c) for m in ("sparse-offload-sync", "sparse-offload-forecast")
                         for c in ctas_list if c != 16]
            for mode, reuse, ctas in jobs:
                try:
                    r = run_one(model, store, mode, context, batch, steps=a.steps, warmup=a.warmup, ctas=ctas,
                                reuse=reuse, budget=budget)
                except Exception as e:  # a refusal (capacity, OOM) or a failure: record it, go on
                    r = {"mode": mode, "context": context, "batch": batch, "ctas": ctas, "reuse_imposed": reuse,
                         "refused": f"{type(e).__name__}: {str(e)[:300]}"}
                    gc.collect()
                    torch.cuda.empty_cache()
                result["runs"].append(r)
                write_json(out, result)
                print(f"{context:>7} b{batch:<3} {mode:<26} reuse={reuse} ctas={ctas:<3} "
                      + (f"{r['tokens_per_s']:9.1f} tok/s (eager {r['eager_tokens_per_s']:7.1f}) hit={r['hit_rate']} "
                         f"hidden(eager)={r['eager_hidden_fraction']} copy={r['eager_copy_gbps']} "
                         f"MB/step={r['bytes_moved_per_step'] / 1e6:.1f}"
                         if "tokens_per_s" in r else "refused: " + r["refused"][:80]), flush=True)
    store.close()
    result["summary"] = summarize(result)
    write_json(out, result)
    print(json.dumps(result["summary"], indent=1))
    return 0


def capacity(context: int, layers: int, budget: Budget, weights_gib: float, gpu_gib: float, host_gib: float
             ) -> dict[str, dict[str, float]]:
    """Largest batch per mode at `context` tokens for a Llama-3-8B-shaped model of `layers` layers, from the
    bytes each sequence needs (bf16 KV and compressed keys) against 92% of GPU memory after weights and
    85% of host memory (pinned store)."""
    hkv, d = LLAMA3_8B["num_key_value_heads"], LLAMA3_8B["head_dim"]
    full = context * hkv * d * 2 * 2 / GiB
    cache = budget.total * BLOCK * hkv * d * 2 * 2 / GiB
    ck = context / budget.stride * hkv * d * 2 / GiB
    per_seq = {"dense-resident": (layers * full, 0.0), "sparse-resident": (layers * (full + ck), 0.0),
               "offload (any)": (full + (layers - 1) * cache + layers * ck, (layers - 1) * full)}
    out = {}
    for mode, (g, h) in per_seq.items():
        by_gpu = int((0.92 * gpu_gib - weights_gib) // g)
        by_host = int(0.85 * host_gib // h) if h else None
        out[mode] = {"gpu_gib_per_seq": g, "host_gib_per_seq": h, "max_batch_gpu": by_gpu, "max_batch_host": by_host,
                     "max_batch": min(by_gpu, by_host) if by_host is not None else by_gpu}
    return out


def summarize(result: dict[str, Any], host_gib: float = 128.0) -> dict[str, Any]:
    """Ratios the issue asks for, from the runs: forecast vs sync, no-prefetch and sparse-resident per
    (context, batch, reuse); hidden fraction derived from graph step times and the eager copy time;
    copy rate vs pinned memcpy; best CTA count per batch; largest feasible batch per mode."""
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    gpu_gib = result["environment"]["gpu_memory_gib"]
    memcpy = result["copy"]["pinned_memcpy_gbps"]

    def find(mode, context, batch, reuse, ctas=16):
        for r in runs:
            if (r["mode"], r["context"], r["batch"], r["reuse_imposed"], r["ctas"]) == (mode, context, batch, reuse, ctas):
                return r
        return None

    ratios = []
    for r in runs:
        if r["mode"] != "sparse-offload-forecast" or r["ctas"] != 16:
            continue
        key = (r["context"], r["batch"])
        sync = find("sparse-offload-sync", *key, r["reuse_imposed"])
        nopf = find("forecast-without-prefetch", *key, r["reuse_imposed"])
        res = find("sparse-resident", *key, None)
        dense = find("dense-resident", *key, None)
        hidden = None
        if nopf and nopf["eager_copy_seconds_per_step"]:
            t_fc, t_nopf = r["seconds"] / r["steps"], nopf["seconds"] / nopf["steps"]
            hidden = min(1.0, max(0.0, (t_nopf - t_fc) / nopf["eager_copy_seconds_per_step"]))
        ratios.append({
            "context": key[0], "batch": key[1], "reuse_imposed": r["reuse_imposed"], "hit_rate": r["hit_rate"],
            "forecast_tok_s": r["tokens_per_s"],
            "forecast_over_sync": r["tokens_per_s"] / sync["tokens_per_s"] if sync else None,
            "forecast_over_no_prefetch": r["tokens_per_s"] / nopf["tokens_per_s"] if nopf else None,
            "forecast_over_sparse_resident": r["tokens_per_s"] / res["tokens_per_s"] if res else None,
            "forecast_over_dense_resident": r["tokens_per_s"] / dense["tokens_per_s"] if dense else None,
            "hidden_fraction_graph_derived": hidden, "hidden_fraction_eager_events": r["eager_hidden_fraction"],
            "copy_rate_over_pinned_memcpy": r["eager_copy_gbps"] / memcpy if r["eager_copy_gbps"] else None})
    best_ctas = {}
    for r in runs:
        if r["reuse_imposed"] is None or r["mode"] not in ("sparse-offload-sync", "sparse-offload-forecast"):
            continue
        k = f"{r['mode']} ctx={r['context']} b={r['batch']}"
        if k not in best_ctas or r["tokens_per_s"] > best_ctas[k]["tokens_per_s"]:
            best_ctas[k] = {"ctas": r["ctas"], "tokens_per_s": r["tokens_per_s"]}
    layers = result["layers"]
    budget = Budget(**result["budget"])
    contexts = sorted({r["context"] for r in runs})
    feasible = {str(c): {f"{layers}_layers": capacity(c, layers, budget, result["weights_gib"], gpu_gib, host_gib),
                         "32_layers": capacity(c, 32, budget, result["weights_gib"] * 32 / layers, gpu_gib, host_gib)}
                for c in contexts}
    return {"ratios": ratios, "best_ctas": best_ctas, "feasible_batch": feasible, "pinned_memcpy_gbps": memcpy}


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
