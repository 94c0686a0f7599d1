"""`workbench bench decode`: the offload engine on the H200, in three parts (`--part`), each within ~4 minutes.

    workbench bench decode --part modes --out decode_h200.json --layers 8 --reuse 0.79 --plan "131072:8,16" --quick
    workbench bench decode --part embedded --out decode_embedded_h200.json      # real SmolLM2-135M beside HF generate
    workbench bench decode --part capacity --out decode_capacity_h200.json --context 32768 --capacity-layers 32

`modes`: the five engine modes on a random-weight Llama-3-8B-shaped model with synthetic KV (say so in the
results): block reuse between steps is then not realistic, so offload modes also run with `ImposedReuse` at
the dynamic reuse rate measured on the embedded model (`--reuse`), and so does one sparse-resident run (the same
hook's work on both sides of the forecast / resident ratio). One pass per host KV store dtype (`--store-dtypes`,
bf16 / FP8 / INT8 / INT4 codes). Measures, in the same process: the pinned host->device copy rate, the UVA gather
kernel's rate per CTA count, then per (context, batch, mode, reuse, store) tokens/s (CUDA graphs), kernel
launches per layer per step (PyTorch profiler, with and without the hook), bytes moved, cache hit rate, copy
rate (eager CUDA events, and the profiled gather kernels' own time), fraction of transfer hidden, peak GPU
memory. Writes JSON after every run.
`embedded`: the real embedded model, batch 1, bf16, `--prompt` tokens, every mode and store dtype through
`workbench.decode.compare.compare_modes` (CUDA graphs; quality vs dense) beside `model.generate` (HF dense
decode, static cache, eager and auto-compiled), decode-only tokens/s from per-token timestamps; passkey retrieval
per store dtype; where the engine's dense greedy tokens leave HF's plain greedy ones (bf16 and fp32).
`capacity`: at `--context` with `--capacity-layers` layers, the largest batch dense-resident and
sparse-offload-forecast actually allocate and decode (the next batch is refused), and the host-RAM cap at 128K.
`embedded` and `capacity` also run on the CPU at tiny sizes (`--device cpu`, `--tiny`): that is how they are tested.
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
from workbench_kernels.gather_ref import gather_ctas

from workbench.core.io import write_json
from workbench.core.shapes import resolve_shape
from workbench.core.timing import environment as timing_environment
from workbench.core.timing import measure, nvidia_smi
from workbench.decode.engine.decoder import OFFLOAD, STORE_DTYPES, DecodeEngine, EngineConfig, kv_bytes
from workbench.decode.engine.llama import LlamaLayers
from workbench.decode.engine.reuse import ImposedReuse
from workbench.decode.engine.store import BLOCK, BlockStore, GiB, StoreCapacityError, StoreSpec, host_memory_available
from workbench.patterns.infllm import Budget

PAPER_BUDGET = Budget(init=1, local=32, topk=64)  # MiniCPM4.1 release: 96 blocks of 64 tokens


def environment() -> dict[str, Any]:
    link = f"gen{nvidia_smi('pcie.link.gen.current')} x{nvidia_smi('pcie.link.width.current')}"
    return {**timing_environment(), "pcie": link}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_rates(store: BlockStore, ctas_list: list[int]) -> dict[str, Any]:
    """Pinned host->device rate: one large cudaMemcpy, and the UVA gather kernel on random 64-token blocks (a
    quantised store: codes and scales read, bf16 written; rates count the bytes that cross PCIe)."""
    from workbench_kernels.gather import gather_blocks

    src_k, src_v = store.k[0], store.v[0]
    n = min(src_k.numel() * src_k.element_size(), 1024 ** 3)  # 1 GiB
    raw = src_k.view(torch.uint8)[:n]
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    ms = measure(partial(dst.copy_, raw, non_blocking=True), cuda=True, min_reps=5, max_reps=5).median_ms
    memcpy = n / (ms / 1e3) / 1e9
    del dst
    E = BLOCK * store.spec.head_dim  # elements of a block
    width_k, width_v = (BLOCK * p.codes for p in store.spec.parts)  # codes of a K / V block
    blocks = src_k.numel() // width_k
    m = 8192  # 8192 blocks of K + 8192 of V
    dk = torch.empty(m, E, dtype=store.spec.dtype, device="cuda")
    dv = torch.empty_like(dk)
    src_idx = torch.randperm(blocks, device="cuda")[:m]
    dst_idx = torch.arange(m, device="cuda")
    count = torch.tensor([m], dtype=torch.int32, device="cuda")
    scales = {}
    if store.spec.quant:
        scales = {"scale_k": store.sk[0].view(blocks, -1), "scale_v": store.sv[0].view(blocks, -1)}
    block_bytes = store.spec.block_bytes // 2  # K or V (their mean: int8k-int4v's K and V blocks differ)
    gather = {}
    for ctas in ctas_list:
        ms = measure(partial(gather_blocks, src_k.view(-1, width_k), src_v.view(-1, width_v), dk, dv, src_idx, dst_idx,
                             count, ctas=ctas, **scales), cuda=True, min_reps=4, max_reps=4).median_ms
        gather[str(ctas)] = m * store.spec.block_bytes / (ms / 1e3) / 1e9
    return {"pinned_memcpy_gbps": memcpy, "gather_gbps_by_ctas": gather, "gather_block_bytes": block_bytes,
            "store_dtype": next(k for k, v in STORE_DTYPES.items() if v == store.spec.quant)}


def main_run(result: dict[str, Any], run: dict[str, Any]) -> bool:
    """Whether a modes run is at its store's main CTA count, not one of the `--sweep-ctas` extras (files before
    `ctas_main`: the file's `ctas`, else 16)."""
    return run.get("ctas_main", run["ctas"] == (result.get("ctas") or 16))


def fill_store(store: BlockStore) -> None:
    """Random KV once (every later layout views the same memory): model-dtype values, or the codes and scales of
    random values for a quantised store (drawn on the GPU when there is one)."""
    from workbench_kernels.gather_ref import quantize_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    D = store.spec.head_dim
    for i in range(store.spec.layers):
        for codes, scales, part in ((store.k[i], store.sk[i] if store.spec.quant else None, store.spec.parts[0]),
                                    (store.v[i], store.sv[i] if store.spec.quant else None, store.spec.parts[1])):
            width, per_row = part.codes, part.scales  # per token row
            for start in range(0, codes.numel(), 256 * 1024 ** 2):
                chunk = codes[start:start + 256 * 1024 ** 2]
                x = torch.randn(chunk.numel() // width, D, device=device, dtype=store.spec.dtype)
                if scales is None:
                    chunk.copy_(x.view(-1))
                else:
                    q, sc = quantize_rows(x, part.quant)
                    chunk.copy_(q.view(-1))
                    row = start // width * per_row
                    scales[row:row + sc.numel()].copy_(sc.view(-1))
    _sync()


def run_one(model, store, mode: str, context: int, batch: int, *, steps: int, warmup: int, ctas: int,
            reuse: float | None, budget: Budget, store_dtype: str = "model", gather_warps: int = 4,
            splits: int | None = None) -> dict[str, Any]:
    max_tokens = context + warmup + 2 * steps + 4
    hook = ImposedReuse(budget, reuse, -(-max_tokens // BLOCK)) if reuse is not None and mode != "dense-resident" else None
    cfg = EngineConfig(mode=mode, budget=budget, ctas=ctas, selector="same-layer", store_dtype=store_dtype,
                       gather_warps=gather_warps, splits=splits)
    eng = DecodeEngine(model, cfg, batch=batch, max_tokens=max_tokens, store=store if mode in OFFLOAD else None,
                       select_hook=hook)
    lengths = [context - (i * 997) % 4096 for i in range(batch)]  # different lengths in one batch
    eng.fill_synthetic(lengths, fill_host=False)
    first = torch.randint(0, 1000, (batch,), device=eng.device)
    graph_error = None
    try:
        eng.run(first, warmup, graph=eng.cuda, progress=False)  # compiles, then captures the step as a CUDA graph
        _, _, stats = eng.run(first, steps, graph=eng.cuda, progress=False)
    except RuntimeError as e:  # report it and time the eager loop instead
        if not eng.cuda:
            raise
        graph_error = str(e)[:300]
        eng.drop_graph()
        _sync()
        _, _, stats = eng.run(first, steps, progress=False)
    eng.drop_graph()
    _, _, eager = eng.run(first, steps, timing=True, progress=False)  # events around every copy and wait
    out = stats.to_dict()
    with_hook = profile_step(eng, first)
    eng.select_hook = None  # the engine's own work: its selector, no imposed reuse
    alone = profile_step(eng, first)
    out.update(launches_per_layer_step=alone["launches_per_layer"],
               launches_per_layer_step_with_imposed_reuse=with_hook["launches_per_layer"] if hook else None,
               launch_names=alone["names"], profiled_copy_gbps=with_hook["copy_gbps"])
    for k in ("copy_seconds", "stall_seconds"):
        out.pop(k)
        out[f"eager_{k}_per_step"] = None if getattr(eager, k) is None else getattr(eager, k) / eager.steps
    out.update(eager_tokens_per_s=eager.tokens_per_s, eager_hit_rate=eager.hit_rate, eager_hidden_fraction=eager.hidden_fraction,
               eager_copy_gbps=eager.copy_gbps, hidden_fraction=None, copy_gbps=None)
    out.update(context=context, ctas=ctas, gather_warps=gather_warps, splits=splits, reuse_imposed=reuse,
               lengths=[min(lengths), max(lengths)], cuda_graph=eng.cuda and graph_error is None, graph_error=graph_error,
               fused_layers=eng.fused)
    eng.close()
    _free()
    return out


def profile_step(eng: DecodeEngine, tokens: torch.Tensor) -> dict[str, Any]:
    """One eager step under the PyTorch profiler: GPU kernel launches (memcpy/memset included) per layer, the
    kernels by name, and the gather kernels' transfer rate (bytes of this step's misses over their summed time).
    On the CPU the step runs unprofiled and every figure is None."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    if not eng.cuda:
        eng.step(tokens)
        return {"launches_per_layer": None, "names": None, "copy_gbps": None}
    _, m0 = eng._counters()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step(tokens)
        torch.cuda.synchronize()
    _, m1 = eng._counters()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gather_us = sum(e.device_time for e in kernels if "gather_blocks" in e.name)
    names = Counter(e.name[:60] for e in kernels)
    return {"launches_per_layer": len(kernels) / eng.lm.n_layers, "names": dict(names.most_common()),
            "copy_gbps": (m1 - m0) * eng.block_bytes / (gather_us / 1e6) / 1e9 if gather_us else None}


def check_lossless(model, store, budget: Budget, context: int = 16384, batch: int = 4, steps: int = 24,
                   store_dtype: str = "model") -> dict[str, Any]:
    """On the GPU: offload modes must give exactly the tokens of sparse-resident with the same selector and store
    dtype, eagerly and under CUDA-graph replay (the same synthetic KV in the resident cache and the host store)."""
    lengths = [context - (i * 997) % (context // 4) for i in range(batch)]
    device = next(model.parameters()).device
    first = torch.randint(0, 1000, (batch,), device=device)
    out: dict[str, Any] = {"context": context, "batch": batch, "steps": steps, "store_dtype": store_dtype}
    for graph in (False, True) if device.type == "cuda" else (False,):
        tokens = {}
        for mode, selector in (("sparse-resident", "same-layer"), ("sparse-offload-sync", "same-layer"),
                               ("sparse-resident", "forecast"), ("sparse-offload-forecast", "forecast"),
                               ("forecast-without-prefetch", "forecast")):
            eng = DecodeEngine(model, EngineConfig(mode=mode, budget=budget, selector=selector, store_dtype=store_dtype),
                               batch=batch, max_tokens=context + steps + 1, store=store if mode in OFFLOAD else None)
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
    _free()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--part", choices=("modes", "embedded", "capacity", "divergence"), default="modes",
                   help="modes: engine modes on the random Llama-3-8B shape (needs --reuse); embedded: the real embedded "
                        "model beside HF generate; capacity: largest batch per mode at --context; divergence: where the "
                        "engine's dense greedy tokens leave HF's, bf16 and fp32 (CPU or GPU)")
    p.add_argument("--merge", nargs="+", default=None,
                   help="instead of running: merge result files of several modes runs (same model) into --out")
    p.add_argument("--layers", type=int, default=8, help="modes: decoder layers of the random model")
    p.add_argument("--reuse", type=float, default=None,
                   help="modes: dynamic-block reuse rate measured on the embedded model (required there)")
    p.add_argument("--plan", default="32768:1,8,32,64;65536:1,8,32;131072:1,4,8,16",
                   help="modes: context:batches;... (batches ascending)")
    p.add_argument("--ctas", type=int, default=None, help="programs of the gather kernel (default: gather_ctas per store)")
    p.add_argument("--sweep-ctas", default=None,
                   help="modes: more CTA counts for the offload modes at the longest context "
                        "(default 8,16,32,64; none with --quick)")
    p.add_argument("--variants", default="4:0",
                   help="modes: gather warps:decode splits[:gather programs] per engine variant (splits 0: "
                        "default_splits; programs 0 or left out: --ctas / gather_ctas), comma-separated; the first is the "
                        "main one, the others rerun the resident-with-hook and offload jobs beside it")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--host-gib", type=float, default=100.0, help="pinned host memory the store may take")
    p.add_argument("--check", action="store_true", help="modes: first check on the GPU that offload modes are lossless")
    p.add_argument("--quick", action="store_true", help="modes: imposed reuse only, no CTA sweep, no natural-reuse run")
    p.add_argument("--store-dtypes", default="model,fp8,int8",
                   help="modes / embedded: host KV stores of the offload modes (model = the model's dtype, fp8, int8, "
                        "int4, int8k-int4v)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (modes: with --tiny)")
    p.add_argument("--prompt", type=int, default=4096, help="embedded: prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="embedded: tokens decoded per mode")
    p.add_argument("--budget", default="1,2,8", help="embedded: init,local,topk blocks of 64 tokens")
    p.add_argument("--no-compile", action="store_true", help="embedded: skip the torch.compile'd HF generate")
    p.add_argument("--retrieval", type=int, default=10, help="embedded: passkey prompts decoded per store dtype (0: none)")
    p.add_argument("--context", type=int, default=32768, help="capacity: tokens per sequence")
    p.add_argument("--capacity-layers", type=int, default=32, help="capacity: decoder layers of the random model")
    p.add_argument("--tiny", action="store_true", help="modes / capacity: the tiny Llama shape (CPU smoke run)")


def run(a: argparse.Namespace) -> int:
    if a.merge:
        parts = [json.loads(Path(f).read_text()) for f in a.merge]
        merged = dict(parts[0])
        merged["runs"] = [r for part in parts for r in part["runs"]]
        merged["parts"] = [{"command": part["environment"]["command"], "stores": part.get("stores"),
                            "copy": part.get("copy_by_store", part.get("copy"))} for part in parts]
        merged["summary"] = summarize(merged)
        write_json(a.out, merged)
        return 0
    if a.part == "embedded":
        return _finish(a.out, run_embedded(a))
    if a.part == "divergence":
        return _finish(a.out, run_divergence(a))
    if a.part == "capacity":
        return _finish(a.out, run_capacity(a))
    device, dtype = _where(a)
    if device != "cuda" and not a.tiny:
        raise ValueError("workbench bench decode --part modes needs a CUDA GPU (none found): run it on the GPU machine "
                         "(--device cpu --tiny: a CPU smoke run of the tiny shape)")
    if a.reuse is None:
        raise ValueError("--part modes needs --reuse (the dynamic-block reuse rate measured on the embedded model, e.g. 0.79)")
    plan = [(int(c), [int(b) for b in bs.split(",")]) for c, bs in (x.split(":") for x in a.plan.split(";"))]
    sweep = a.sweep_ctas if a.sweep_ctas is not None else "" if a.quick else "8,16,32,64"
    ctas_list = [int(c) for c in sweep.split(",") if c]
    variants = [(*(int(x) for x in v.split(":")), 0)[:3] for v in a.variants.split(",")]
    stores = [x.strip() for x in a.store_dtypes.split(",")]
    if any(x not in STORE_DTYPES for x in stores) or not stores:
        raise ValueError(f"--store-dtypes {a.store_dtypes!r}: give a comma list of {', '.join(STORE_DTYPES)}")
    budget = Budget(init=1, local=2, topk=8) if a.tiny else PAPER_BUDGET
    result: dict[str, Any] = {
        "what": f"decode engine modes on a RANDOM-WEIGHT {'TINY' if a.tiny else 'Llama-3-8B'}-shaped model (synthetic "
                f"KV), {a.layers} of 32 layers (layer 0 resident, {a.layers - 1} offloaded), {dtype}, host KV stores "
                f"{stores}; offload modes and 'sparse-resident' with reuse_imposed run the same ImposedReuse hook",
        "layers": a.layers, "budget": budget.to_dict(), "ctas": a.ctas,
        "environment": environment() if device == "cuda" else timing_environment(), "runs": [], "stores": {},
        "copy_by_store": {}}
    out = Path(a.out)
    model, shape = random_llama(a.layers, tiny=a.tiny, device=device, dtype=dtype,
                                max_positions=max(c for c, _ in plan) + 4096)
    result["weights_gib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / GiB
    # One store per store dtype, made when its pass starts and freed after it: batch x blocks per sequence of the
    # largest run (other layouts view it).
    blocks = max(b * -(-(c + a.warmup + 2 * a.steps + 4) // BLOCK) for c, bs in plan for b in bs)
    for n, store_dtype in enumerate(stores):
        spec = StoreSpec(a.layers - 1, 1, shape.n_kv_heads, blocks, shape.head_dim, dtype,
                         STORE_DTYPES[store_dtype])
        t0 = time.perf_counter()
        print(f"pinning a {spec.nbytes / GiB:.1f} GiB {store_dtype} store", flush=True)
        ctas = a.ctas or gather_ctas(spec.quant is not None)  # this store's main CTA count
        store = BlockStore(spec, limit_bytes=int(a.host_gib * GiB))
        fill_store(store)
        result["stores"][store_dtype] = {"gib": spec.nbytes / GiB, "seconds_to_pin_and_fill": time.perf_counter() - t0}
        result["copy_by_store"][store_dtype] = copy_rates(store, sorted({ctas, *ctas_list})) \
            if device == "cuda" else None
        if n == 0:
            result["copy"] = result["copy_by_store"][store_dtype]
        print("copy", store_dtype, json.dumps(result["copy_by_store"][store_dtype]), flush=True)
        write_json(out, result)
        if a.check:
            result.setdefault("lossless_gpu", {})[store_dtype] = check_lossless(
                model, store, budget, context=min(16384, max(c for c, _ in plan)),
                batch=min(4, max(b for _, bs in plan for b in bs)), store_dtype=store_dtype)
            print("lossless", json.dumps(result["lossless_gpu"][store_dtype]), flush=True)
            write_json(out, result)
        for context, batches in plan:
            for batch in batches:
                jobs = []
                if n == 0:  # resident modes do not touch the store: once
                    jobs += [("dense-resident", None, ctas), ("sparse-resident", None, ctas),
                             ("sparse-resident", a.reuse, ctas)]
                jobs += [(m, r, ctas) for m in OFFLOAD for r in ((a.reuse,) if a.quick else (None, a.reuse))]
                if context == max(c for c, _ in plan):
                    jobs += [(m, a.reuse, c) for m in ("sparse-offload-sync", "sparse-offload-forecast")
                             for c in ctas_list if c != ctas]
                jobs = [(*job, v) for v in range(len(variants)) for job in jobs
                        if v == 0 or (job[1] is not None and job[2] == ctas)]
                for mode, reuse, job_ctas, v in jobs:
                    warps, splits, programs = variants[v]
                    job_ctas = programs or job_ctas
                    try:
                        r = run_one(model, store, mode, context, batch, steps=a.steps, warmup=a.warmup, ctas=job_ctas,
                                    reuse=reuse, budget=budget, store_dtype=store_dtype if mode in OFFLOAD else "model",
                                    gather_warps=warps, splits=splits or None)
                    except Exception as e:  # a refusal (capacity, OOM) or a failure: record it, go on
                        r = {"mode": mode, "context": context, "batch": batch, "ctas": job_ctas, "reuse_imposed": reuse,
                             "store_dtype": store_dtype, "refused": f"{type(e).__name__}: {str(e)[:300]}"}
                        _free()
                    r["ctas_main"] = job_ctas == ctas and v == 0
                    result["runs"].append(r)
                    write_json(out, result)
                    print(f"{context:>7} b{batch:<3} {mode:<26} {r['store_dtype']:<5} reuse={reuse} ctas={job_ctas:<3} "
                          f"warps:splits={warps}:{splits} "
                          + (f"{r['tokens_per_s']:9.1f} tok/s (eager {r['eager_tokens_per_s']:7.1f}) hit={r['hit_rate']} "
                             f"launches/layer={r['launches_per_layer_step']} copy(events)={r['eager_copy_gbps']} "
                             f"copy(kernel)={r['profiled_copy_gbps']} MB/step={r['bytes_moved_per_step'] / 1e6:.1f}"
                             if "tokens_per_s" in r else "refused: " + r["refused"][:80]), flush=True)
        store.close()
        _free()
    result["summary"] = summarize(result)
    write_json(out, result)
    print(json.dumps(result["summary"], indent=1))
    return 0


def _finish(out: str, result: dict[str, Any]) -> int:
    write_json(out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1, default=str))
    return 0


def _where(a: argparse.Namespace) -> tuple[str, torch.dtype]:
    cuda = torch.cuda.is_available() and a.device != "cpu"
    if a.device not in (None, "cpu", "cuda") or (a.device == "cuda" and not cuda):
        raise ValueError(f"--device {a.device!r}: use cuda (on a GPU machine) or cpu")
    return ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)


def _parse_budget(text: str) -> Budget:
    try:
        init, local, topk = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--budget {text!r} must be three integers init,local,topk such as 1,2,8") from None
    return Budget(init=init, local=local, topk=topk)


class _Stamps:
    """A `generate` streamer that stamps the time of every push (the prompt, then each new token)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.times = cuda, []

    def put(self, _value: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None: ...


def _greedy_kwargs(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """`generate` arguments for plain greedy decoding of exactly `new_tokens` tokens, comparable token for token
    with the engine: no end-of-sequence token can stop it (an id outside the vocabulary) and none is suppressed
    (`min_new_tokens` masks EOS: the engine's argmax may pick it), and an explicit all-ones attention mask (with a
    pad id that differs from EOS, generate would otherwise mask the prompt's pad-id tokens, such as <|im_end|>)."""
    return dict(attention_mask=torch.ones_like(ids[None]), do_sample=False, max_new_tokens=new_tokens,
                eos_token_id=model.config.vocab_size, pad_token_id=model.config.eos_token_id)


def hf_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, compiled: bool) -> dict[str, Any]:
    """HF's own greedy dense decode with a static cache (auto-compiled by `generate` on CUDA when `compiled`):
    decode-only tokens/s from the stamps of tokens 2..n (prefill excluded), after one warm-up call."""
    kw = dict(_greedy_kwargs(model, ids, new_tokens), cache_implementation="static", disable_compile=not compiled)
    model.generate(ids[None], **kw)  # warm-up (and compilation)
    stamps = _Stamps(ids.is_cuda)
    out = model.generate(ids[None], streamer=stamps, **kw)
    t = stamps.times  # [prompt, token 1 (after prefill), ..., token n]
    return {"tokens_per_s": (len(t) - 2) / (t[-1] - t[1]), "compiled": compiled and hasattr(model, "_compiled_call"),
            "greedy_tokens": out[0, ids.numel():].tolist()}


@torch.no_grad()
def divergence(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Where the engine's dense-resident greedy tokens first leave HF's (`generate`, plain greedy, eager static
    cache), with both top-2 logit margins there; both sides see the same prefix up to that token."""
    hf = model.generate(ids[None], **_greedy_kwargs(model, ids, new_tokens), cache_implementation="static",
                        disable_compile=True, output_logits=True, return_dict_in_generate=True)
    hf_tokens, hf_logits = hf.sequences[0, ids.numel():].cpu(), torch.stack(hf.logits, 1)[0].float().cpu()
    with DecodeEngine(model, EngineConfig(mode="dense-resident"), batch=1, max_tokens=ids.numel() + new_tokens + 1) as e:
        first = e.prefill([ids], new_tokens)
        rest, logits, _ = e.run(first, new_tokens - 1, keep_logits=True, graph=False, progress=False)
    tokens = torch.cat([first.cpu(), rest[0].cpu()])
    diff = (tokens != hf_tokens).nonzero().flatten().tolist()
    out: dict[str, Any] = {"dtype": str(next(model.parameters()).dtype), "tokens_equal": len(diff) == 0,
                           "first_difference": diff[0] if diff else None, "equal_tokens": sum(map(int, tokens == hf_tokens)),
                           "hf_tokens": hf_tokens.tolist(), "engine_tokens": tokens.tolist()}
    if diff and diff[0] > 0:  # step 0 is the prefill's token: the engine's logits start at step 1
        s = diff[0]
        top = {"hf": hf_logits[s].topk(2), "engine": logits[0, s - 1].float().topk(2)}
        out["at_first_difference"] = {k: {"ids": t.indices.tolist(), "logits": t.values.tolist(),
                                          "margin": float(t.values[0] - t.values[1])} for k, t in top.items()}
    return out


def retrieval(model: torch.nn.Module, tok: Any, prompt: int, samples: int, budget: Budget, stores: list[str]
              ) -> dict[str, Any]:
    """Passkey retrieval on `samples` prompts: does each mode's greedy answer contain the key? dense-resident beside
    sparse-offload-forecast with every store dtype (CUDA graphs; 16 new tokens)."""
    from workbench.core.corpus import make_sample
    from workbench.decode.compare import compare_modes

    specs = ["dense-resident"] + [f"sparse-offload-forecast@{s}" for s in stores]
    found: dict[str, list[bool]] = {s: [] for s in specs}
    for seed in range(samples):
        sample = make_sample("passkey", tok, prompt, seed=seed)
        ids = sample.input_ids.to(next(model.parameters()).device)
        cmp = compare_modes(model, ids, modes=specs, new_tokens=16, budget=budget, trace=False, progress=False)
        for spec in specs:
            found[spec].append(sample.answer in tok.decode(cmp.runs[spec].tokens[0]))
    return {"samples": samples, "found": {s: sum(v) for s, v in found.items()}, "per_sample": found}


def run_embedded(a: argparse.Namespace) -> dict[str, Any]:
    """The real embedded model, batch 1: every engine mode and store dtype (CUDA graphs) with its quality cost
    (teacher-forced top-1 and KL vs dense), passkey retrieval per store dtype, HF generate (static cache, eager and
    compiled) on the same prompt, and where the engine's dense greedy tokens leave HF's (bf16, then fp32)."""
    from workbench.core.corpus import make_sample
    from workbench.core.model import load_model
    from workbench.decode.compare import ALL_MODES, compare_modes

    device, dtype = _where(a)
    model, tok, shape = load_model(device=device, dtype=dtype)
    ids = make_sample("passkey", tok, a.prompt, seed=0).input_ids.to(device)
    budget = _parse_budget(a.budget)
    stores = [x for x in a.store_dtypes.split(",") if x != "model"]
    modes = list(ALL_MODES) + [f"{m}@{s}" for s in stores for m in ("sparse-resident", "sparse-offload-sync",
                                                                     "sparse-resident/forecast", "sparse-offload-forecast")]
    cmp = compare_modes(model, ids, modes=modes, new_tokens=a.new_tokens, budget=budget, quality=True, progress=False)
    dense = cmp.runs["dense-resident"].tokens[0].tolist()
    hf: dict[str, Any] = {}
    for compiled in ((False, True) if device == "cuda" and not a.no_compile else (False,)):
        key = "static_cache_compiled" if compiled else "static_cache_eager"
        try:
            hf[key] = hf_generate(model, ids, a.new_tokens, compiled)
            hf[key]["same_tokens_as_dense_resident"] = sum(x == y for x, y in zip(hf[key]["greedy_tokens"], dense)) / len(dense)
        except Exception as e:  # e.g. torch.compile failing on this machine: say so
            hf[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(key, {k: v for k, v in hf[key].items() if k != "greedy_tokens"}, flush=True)
    evidence = {"model_dtype": divergence(model, ids, a.new_tokens)}
    if dtype != torch.float32:
        fp32, _, _ = load_model(device=device, dtype=torch.float32)
        evidence["float32"] = divergence(fp32, ids, a.new_tokens)
        del fp32
    print("divergence", json.dumps({k: {kk: vv for kk, vv in v.items() if not kk.endswith("tokens")}
                                    for k, v in evidence.items()}), flush=True)
    found = retrieval(model, tok, a.prompt, a.retrieval, budget, ["model", *stores]) if a.retrieval else None
    rows = {r["mode"]: r for r in cmp.rows()}
    anchor = max((v["tokens_per_s"] for v in hf.values() if "tokens_per_s" in v), default=None)
    return {"what": f"real embedded model {shape.name}, batch 1, {dtype}, {a.prompt}-token passkey prompt, "
                    f"{a.new_tokens} new tokens; engine {cmp.device}, CUDA graphs where cuda_graph is true",
            "environment": environment() if device == "cuda" else timing_environment(),
            "engine": cmp.to_dict(), "hf_generate": hf, "divergence_from_hf": evidence, "retrieval": found,
            "summary": {"tokens_per_s": {m: r["tokens_per_s"] for m, r in rows.items()},
                        "hf_generate_best_tokens_per_s": anchor, "lossless": cmp.lossless,
                        "quality_vs_dense": cmp.quality,
                        "retrieval_found": found and found["found"],
                        "slowest_mode_tokens_per_s": min(r["tokens_per_s"] for r in rows.values()),
                        "goal_300_tok_s": {m: r["tokens_per_s"] >= 300 for m, r in rows.items()}}}


def run_divergence(a: argparse.Namespace) -> dict[str, Any]:
    """`divergence` of the real embedded model on a `--prompt`-token passkey prompt, in bf16 and in fp32, on
    `--device` (the CPU path runs the model's own modules and the reference kernels)."""
    from workbench.core.corpus import make_sample
    from workbench.core.model import load_model

    device, _ = _where(a)
    out: dict[str, Any] = {"what": f"engine dense-resident vs HF generate (plain greedy, static cache), embedded model, "
                                   f"{a.prompt}-token passkey prompt, {a.new_tokens} tokens, {device}",
                           "environment": environment() if device == "cuda" else timing_environment()}
    for dtype in (torch.bfloat16, torch.float32):
        model, tok, _ = load_model(device=device, dtype=dtype)
        ids = make_sample("passkey", tok, a.prompt, seed=0).input_ids.to(device)
        out[str(dtype).replace("torch.", "")] = divergence(model, ids, a.new_tokens)
        del model
        gc.collect()
    return out


def largest_batch(model: torch.nn.Module, mode: str, context: int, budget: Budget, *, steps: int, host_limit: int,
                  ) -> dict[str, Any]:
    """The largest batch `mode` allocates and decodes `steps` tokens with at `context` tokens per sequence: start
    at the engine's own byte accounting (`kv_bytes`) against free GPU memory (host memory on the CPU) and the
    host limit, step down on an out-of-memory, then show that one more sequence is refused."""
    lm = LlamaLayers(model)
    cfg = EngineConfig(mode=mode, budget=budget)
    max_tokens = context + steps + 1
    gpu1, host1 = kv_bytes(cfg, layers=lm.n_layers, kv_heads=lm.n_kv_heads, head_dim=lm.head_dim, dtype=lm.dtype,
                           batch=1, max_tokens=max_tokens)
    cuda = lm.device.type == "cuda"
    device_free = torch.cuda.mem_get_info(lm.device)[0] if cuda else host_limit
    by_device, by_host = device_free // gpu1, (host_limit // host1 if host1 else None)
    batch = min(by_device, by_host) if by_host is not None else by_device
    out: dict[str, Any] = {"mode": mode, "context": context, "gpu_bytes_per_seq": gpu1, "host_bytes_per_seq": host1,
                           "device_free_bytes": device_free, "host_limit_bytes": host_limit,
                           "batch_bound_by_device": by_device, "batch_bound_by_host": by_host, "stepped_down": []}
    while batch >= 1:
        try:
            with DecodeEngine(model, cfg, batch=batch, max_tokens=max_tokens, host_limit_bytes=host_limit) as eng:
                eng.fill_synthetic([context] * batch, fill_host=False)
                first = torch.zeros(batch, dtype=torch.long, device=lm.device)
                eng.run(first, 1, graph=False, progress=False)  # eager: an out-of-memory inside a graph capture
                _, _, stats = eng.run(first, steps, graph=False, progress=False)  # would spoil the stream
            out.update(largest_batch=batch, eager_tokens_per_s=stats.tokens_per_s, peak_gpu_bytes=stats.peak_gpu_bytes)
            break
        except (StoreCapacityError, torch.OutOfMemoryError) as e:
            out["stepped_down"].append({"batch": batch, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            batch = min(batch - 1, int(batch * 0.97))
    try:  # one more sequence: refused before anything is allocated?
        DecodeEngine(model, cfg, batch=out.get("largest_batch", 0) + 1, max_tokens=max_tokens,
                     host_limit_bytes=host_limit).close()
        out["next_batch_refused"] = None
    except StoreCapacityError as e:
        out["next_batch_refused"] = str(e)[:300]
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def run_capacity(a: argparse.Namespace) -> dict[str, Any]:
    """Largest batch dense-resident vs sparse-offload-forecast at `--context` (all `--capacity-layers` layers of
    the random-weight Llama-3-8B shape, or the tiny shape), and the host-RAM cap at 128K tokens."""
    device, dtype = _where(a)
    budget = Budget(init=1, local=2, topk=8) if a.tiny else PAPER_BUDGET
    model, _ = random_llama(a.capacity_layers, tiny=a.tiny, device=device, dtype=dtype,
                            max_positions=max(a.context, 131072) + 4096)
    host_limit = int(a.host_gib * GiB)
    runs = {m: largest_batch(model, m, a.context, budget, steps=a.steps, host_limit=host_limit)
            for m in ("dense-resident", "sparse-offload-forecast")}
    for m, r in runs.items():
        print(m, {k: v for k, v in r.items() if k != "stepped_down"}, flush=True)
    lm = LlamaLayers(model)
    per_seq_128k = kv_bytes(EngineConfig(mode="sparse-offload-forecast", budget=budget), layers=lm.n_layers,
                            kv_heads=lm.n_kv_heads, head_dim=lm.head_dim, dtype=lm.dtype, batch=1, max_tokens=131072)
    dense_b, offload_b = (runs[m].get("largest_batch", 0) for m in runs)
    off = runs["sparse-offload-forecast"]
    return {"what": f"largest batch per mode at {a.context} tokens, {'TINY' if a.tiny else 'Llama-3-8B'}-shaped RANDOM-weight "
                    f"model, all {a.capacity_layers} layers, {dtype}, budget {budget.to_dict()}, host store limit "
                    f"{a.host_gib} GiB pinned",
            "environment": environment() if device == "cuda" else timing_environment(),
            "host_memory_available_gib": host_memory_available() / GiB, "runs": runs,
            "summary": {"dense_resident_largest_batch": dense_b, "offload_largest_batch": offload_b,
                        "offload_over_dense": offload_b / dense_b if dense_b else None,
                        "offload_bound_by": "host" if (off["batch_bound_by_host"] or 0) < off["batch_bound_by_device"]
                        else "device",
                        "offload_over_dense_if_host_unbounded": off["batch_bound_by_device"] / dense_b if dense_b else None,
                        "host_gib_per_seq_at_128k": per_seq_128k[1] / GiB,
                        "host_cap_batch_at_128k": int(host_limit // per_seq_128k[1])}}


def capacity(context: int, layers: int, budget: Budget, weights_gib: float, gpu_gib: float, host_gib: float
             ) -> dict[str, dict[str, float]]:
    """Largest batch per mode at `context` tokens for a Llama-3-8B-shaped model of `layers` layers, from the
    bytes each sequence needs (bf16 KV and compressed keys) against 92% of GPU memory after weights and
    85% of host memory (pinned store)."""
    shape = resolve_shape(LLAMA3_8B)
    hkv, d = shape.n_kv_heads, shape.head_dim
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
    """Ratios the issue asks for, from the runs, per (context, batch, reuse, store dtype): forecast vs sync (same
    store), vs no-prefetch, vs sparse-resident (without the imposed-reuse hook, and with it: the same work besides
    the KV placement); hidden fraction derived from graph step times and the eager copy time; the prefetch's
    transfer rate (eager CUDA events around each copy, and the gather kernels' own profiled time) over the pinned
    memcpy rate of the same run; launches per layer and step; best CTA count; largest feasible batch per mode."""
    runs = [r for r in result["runs"] if "tokens_per_s" in r]
    gpu_gib = result["environment"].get("gpu_memory_gib")
    copies = result.get("copy_by_store") or {"model": result["copy"]}
    memcpy = max((c["pinned_memcpy_gbps"] for c in copies.values() if c), default=None)

    def find(mode, context, batch, reuse, store="model"):
        for r in runs:
            key = (r["mode"], r["context"], r["batch"], r["reuse_imposed"], r.get("store_dtype", "model"))
            if main_run(result, r) and key == (mode, context, batch, reuse, store):
                return r
        return None

    def ratio(a, b):
        return a["tokens_per_s"] / b["tokens_per_s"] if a and b else None

    ratios = []
    for r in runs:
        if r["mode"] != "sparse-offload-forecast" or not main_run(result, r):
            continue
        key, store = (r["context"], r["batch"]), r.get("store_dtype", "model")
        sync = find("sparse-offload-sync", *key, r["reuse_imposed"], store)
        nopf = find("forecast-without-prefetch", *key, r["reuse_imposed"], store)
        res, res_hook = find("sparse-resident", *key, None), find("sparse-resident", *key, r["reuse_imposed"])
        dense = find("dense-resident", *key, None)
        hidden = None
        if nopf and nopf["eager_copy_seconds_per_step"]:
            t_fc, t_nopf = r["seconds"] / r["steps"], nopf["seconds"] / nopf["steps"]
            hidden = min(1.0, max(0.0, (t_nopf - t_fc) / nopf["eager_copy_seconds_per_step"]))
        ratios.append({
            "context": key[0], "batch": key[1], "store_dtype": store, "reuse_imposed": r["reuse_imposed"],
            "hit_rate": r["hit_rate"], "forecast_tok_s": r["tokens_per_s"], "mb_moved_per_step": r["bytes_moved_per_step"] / 1e6,
            "forecast_over_sync": ratio(r, sync), "forecast_over_no_prefetch": ratio(r, nopf),
            "forecast_over_sparse_resident": ratio(r, res),
            "forecast_over_sparse_resident_same_hook": ratio(r, res_hook),
            "forecast_over_dense_resident": ratio(r, dense),
            "hidden_fraction_graph_derived": hidden, "hidden_fraction_eager_events": r["eager_hidden_fraction"],
            "copy_rate_over_pinned_memcpy_eager_events": r["eager_copy_gbps"] / memcpy if r["eager_copy_gbps"] and memcpy
            else None,
            "copy_rate_over_pinned_memcpy_kernel_time":
                r["profiled_copy_gbps"] / memcpy if r.get("profiled_copy_gbps") and memcpy else None,
            "launches_per_layer_step": {m: x.get("launches_per_layer_step") for m, x in
                                        (("forecast", r), ("sync", sync), ("no_prefetch", nopf)) if x}})
    best_ctas = {}
    for r in runs:
        if r["reuse_imposed"] is None or r["mode"] not in ("sparse-offload-sync", "sparse-offload-forecast"):
            continue
        k = f"{r['mode']} ctx={r['context']} b={r['batch']} store={r.get('store_dtype', 'model')}"
        if k not in best_ctas or r["tokens_per_s"] > best_ctas[k]["tokens_per_s"]:
            best_ctas[k] = {"ctas": r["ctas"], "tokens_per_s": r["tokens_per_s"]}
    layers = result["layers"]
    budget = Budget(**result["budget"])
    contexts = sorted({r["context"] for r in runs})
    feasible = {str(c): {f"{layers}_layers": capacity(c, layers, budget, result["weights_gib"], gpu_gib, host_gib),
                         "32_layers": capacity(c, 32, budget, result["weights_gib"] * 32 / layers, gpu_gib, host_gib)}
                for c in contexts} if gpu_gib else None
    launches = {f"{r['mode']}@{r.get('store_dtype', 'model')}": r.get("launches_per_layer_step") for r in runs}
    return {"ratios": ratios, "best_ctas": best_ctas, "feasible_batch": feasible, "pinned_memcpy_gbps": memcpy,
            "max_launches_per_layer_step_offload": max((v for k, v in launches.items()
                                                        if k.split("@")[0] in OFFLOAD and v is not None), default=None),
            "launches_per_layer_step": launches}


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
