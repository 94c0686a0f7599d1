"""`workbench compare`: every prefill method on the same prompts, one report.

For each task and length: one prompt from `workbench.core.corpus`, its q/k/v captured at a few layers,
and for every method (`workbench.analysis.compare.default_methods`) at every value of its sweep, plus
the static searched head config: captured mass over all rows and the answer rows vs logical and
physical density and index time (`sweep_layer`, averaged over the layers); on a GPU the Triton
sparse prefill kernel's time on those layers vs dense SDPA; then the whole model prefilled with the
method in every layer: next-token KL and top-1 agreement vs dense, and the greedy answer vs dense
(passkey / multikey outcome). Decode stays dense (the KV cache is complete), as in MInference.

Everything runs on the model's device. On the CPU the sparse model runs an exact PyTorch reference under
each pattern's logical row mask (over only the keys some head of a row chunk reads); on CUDA the Triton
kernel over `to_tiles` (which may compute a few more keys than the logical mask: the tile expansion),
and every point's index build and kernel are timed there beside dense SDPA (`kernel_times`; the
searched config through the deployed path, `SparsePrefill.layer_index` + its one launch).
"""
from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from workbench.analysis.compare import Method, default_methods, pareto_front, sweep_layer, timed
from workbench.config import HeadConfig
from workbench.core.attention import attention_override, dense_attention
from workbench.core.capture import capture_attention
from workbench.core.corpus import make_sample
from workbench.core.model import ModelShape
from workbench.patterns import Pattern
from workbench.prefill.quality import dense_greedy, kl_top1
from workbench.prefill.sparse import SparsePrefill, generate_greedy, masked_prefill

LayerBuilder = Callable[[int, torch.Tensor, torch.Tensor, float], Pattern]  # (layer, q [Hq,N,D], k, scale)
QUALITY = ("all", "mid", "none")
SEARCHED = "searched config"


def mask_rows(pattern: Pattern, n: int, device: torch.device) -> Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]:
    """`masked_prefill` rows of a pattern: the keys any head of rows r0..r1-1 reads and each head's mask."""
    def rows(r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = pattern.row_mask(r0, r1, n)[:, :, :r1].to(device)
        used = mask.any(1).any(0).nonzero().squeeze(1)
        return used, mask[:, :, used]
    return rows


def pattern_attention(build: LayerBuilder, triton: bool | None = None) -> Callable[..., tuple[torch.Tensor, None]]:
    """An attention function (`attention_override`) that runs every prefill call of batch 1 under the
    pattern `build(layer, q, k, scale)` makes; decode steps and cached prefixes stay dense. `triton`:
    the Triton kernel over `to_tiles` (default on CUDA) or the PyTorch reference under the row mask."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        n = query.shape[2]
        if n != key.shape[2] or n == 1 or query.shape[0] != 1:
            return dense_attention(module, query, key, value, attention_mask, **kwargs)
        scale = kwargs.get("scaling") or module.scaling
        pattern = build(module.layer_idx, query[0], key[0], scale)
        if query.is_cuda if triton is None else triton:
            from workbench_kernels.prefill import sparse_prefill

            band = pattern.token_band()
            sink, window = (None, None) if band is None else band
            o, _ = sparse_prefill(query, key, value, pattern.to_tiles(n), sink=sink, window=window, scale=scale)
        else:
            o = masked_prefill(query, key, value, mask_rows(pattern, n, query.device), scale)
        return o.transpose(1, 2).contiguous(), None
    return attention


def quality_point(model: torch.nn.Module, tok: Any, shape: ModelShape, sample: Any, build: LayerBuilder | None,
                  max_new_tokens: int, config: HeadConfig | None = None) -> dict[str, Any]:
    """The whole model prefilled under `build` (or a head `config`, through `SparsePrefill`, the path
    the project deploys): KL / top-1 vs dense, greedy answer vs dense."""
    dense_tokens, dense_logits, _ = dense_greedy(model, tok, shape, sample, max_new_tokens)
    t0 = time.perf_counter()
    ctx = attention_override(model, pattern_attention(build)) if config is None else \
        SparsePrefill(model, shape, config, min_length=0)
    with ctx:
        tokens, logits = generate_greedy(model, sample.input_ids, max_new_tokens, tok.eos_token_id)
    kl, agree = kl_top1(dense_logits, logits)
    text = tok.decode(tokens, skip_special_tokens=True)
    out = {"kl": round(kl, 6), "top1_agree": agree, "seconds": round(time.perf_counter() - t0, 2),
           "text": text}
    if sample.answer:
        out["correct"] = sample.answer in text
        out["dense_correct"] = sample.answer in tok.decode(dense_tokens, skip_special_tokens=True)
    return out


def method_builder(method: Method, value: float) -> LayerBuilder:
    return lambda layer, q, k, scale: method.build(q, k, scale, value)


TilesBuilder = Callable[[torch.Tensor, torch.Tensor], Any]  # (q, k [1, H, N, D]) -> kernel input
Attend = Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (input, q, k, v) -> o


def pattern_tiles(build: Callable[[torch.Tensor, torch.Tensor], Pattern]) -> TilesBuilder:
    """A method's kernel input on q's device: (tiles, sink, window) of the pattern `build(q, k)` makes (tiles per
    KV head for a kind that shares one index per KV head, as `SparsePrefill` runs a layer of it)."""
    def tiles(q: torch.Tensor, k: torch.Tensor) -> tuple[Any, Any, Any]:
        pattern = build(q[0], k[0])
        band = pattern.token_band()
        sink, window = (None, None) if band is None else (band[0].to(q.device), band[1].to(q.device))
        n = q.shape[2]
        t = pattern.kv_tiles(n, q.shape[1] // k.shape[1]) if pattern.kv_shared else pattern.to_tiles(n)
        return t.to(q.device), sink, window
    return tiles


def tiles_kernel(scale: float) -> Attend:
    """The Triton sparse prefill over `pattern_tiles`' (tiles, sink, window)."""
    from workbench_kernels.prefill import sparse_prefill

    return lambda index, q, k, v: sparse_prefill(q, k, v, index[0], sink=index[1], window=index[2], scale=scale)[0]


def kernel_times(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 kernels: Sequence[tuple[TilesBuilder, Attend]],
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 reps: int = 10) -> tuple[float, list[tuple[float, float]]]:
    """One layer on `device`: (dense SDPA ms, [(index ms, kernel ms)] per (builder, kernel)). Each builder
    indexes fp32 q, k `[1, H, N, D]` on the device into its kernel's input; the kernel runs in `dtype`. Medians of
    `reps` runs after a warm-up (CUDA events on a GPU; on the CPU under TRITON_INTERPRET only the path is exercised,
    the times mean nothing). q `[Hq, N, D]`, k/v `[Hkv, N, D]`."""
    qb, kb, vb = (x[None].to(device, dtype).contiguous() for x in (q, k, v))
    qf, kf = (x[None].to(device, torch.float32) for x in (q, k))

    def median(fn: Callable[[], Any]) -> float:
        fn()
        return statistics.median(timed(fn, device)[1] for _ in range(reps))

    dense = median(lambda: torch.nn.functional.scaled_dot_product_attention(
        qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True))
    out = []
    for build, attend in kernels:
        index = build(qf, kf)
        index_ms = median(lambda: build(qf, kf))
        out.append((index_ms, median(lambda: attend(index, qb, kb, vb))))
    return dense, out


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 6) if vals else None


def compare(model: torch.nn.Module, tok: Any, shape: ModelShape, *, tasks: Sequence[str] = ("passkey", "multikey", "code"),
            lengths: Sequence[int] = (4096, 8192), layers: Sequence[int] = (3, 11, 19, 27),
            methods: Sequence[Method] | None = None, config: HeadConfig | None = None, rows: int | None = 256,
            quality: str = "mid", quality_lengths: Sequence[int] | None = None,
            quality_tasks: Sequence[str] | None = None, max_new_tokens: int = 8, seed: int = 0,
            depth: float = 0.5, progress: bool = True,
            kernels: bool | None = None, reps: int = 10) -> dict[str, Any]:
    """The comparison report (see the module docstring). `rows`: sampled query rows per layer for the
    masses (None = all rows, exact). `quality`: KL / answer at "all" sweep values, the "mid" one, or
    "none", at `quality_lengths` (default all) on `quality_tasks` (default: the tasks with an answer).
    The model's device decides CPU or GPU: masses, index builds, the sparse model and (`kernels`, default
    on CUDA) the Triton kernel times of every point, `reps` runs each, all run there."""
    if quality not in QUALITY:
        raise ValueError(f"quality={quality!r}: use one of {QUALITY}")
    methods = list(methods or default_methods())
    layers = [shape.check_layer(l) for l in layers]
    device = next(model.parameters()).device
    kernels = device.type == "cuda" if kernels is None else kernels
    kernel_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter has no bf16
    quality_lengths = list(lengths if quality_lengths is None else quality_lengths)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if progress else (lambda *a: None)
    points: list[dict[str, Any]] = []
    for length in lengths:
        for task in tasks:
            sample = make_sample(task, tok, length, seed=seed, depth=depth, max_length=shape.max_positions)
            cap = capture_attention(model, shape, sample.input_ids, layers, dtype=torch.float32, progress=False)
            per_layer = []
            for layer in layers:
                q, k, v = (x.to(device, torch.float32) for x in cap.layer_qkv(layer))
                # the searched config is indexed on the CPU (its parts of mixed kinds stay together there)
                extra = {SEARCHED: config.layer_index(layer, q.cpu(), k.cpu(), cap.scale)} if config is not None else None
                t0 = time.perf_counter()
                rows_l = sweep_layer(q, k, cap.scale, methods, extra, rows)
                if kernels:
                    tiled = tiles_kernel(cap.scale)
                    kernels = [(pattern_tiles(lambda qc, kc, m=m, val=val, s=cap.scale: m.build(qc, kc, s, val)), tiled)
                               for m in methods for val in m.values]
                    if config is not None:  # the deployed path: the config's layer index and kernel(s)
                        sp = SparsePrefill(None, shape, config, min_length=0, backend="triton")
                        kernels.append((lambda qc, kc, sp=sp, l=layer, s=cap.scale: sp.layer_index(l, qc, kc, s, "triton"),
                                        lambda i, qb, kb, vb, sp=sp, l=layer, s=cap.scale: sp.layer_kernel(
                                            l, i, qb, kb, vb, s, "triton")))
                    dense_ms, times = kernel_times(q, k, v, cap.scale, kernels, device, kernel_dtype, reps)
                    for r, (index_ms, kernel_ms) in zip(rows_l, times):
                        r.update(gpu_index_ms=index_ms if r["index_ms"] != 0.0 else None, kernel_ms=kernel_ms,
                                 dense_kernel_ms=dense_ms)
                per_layer.append(rows_l)
                say(f"compare {task}@{length} layer {layer}: {len(rows_l)} points in {time.perf_counter() - t0:.1f} s")
            del cap
            for i, first in enumerate(per_layer[0]):
                point = {"task": task, "length": length, "method": first["method"], "value": first["value"],
                         "adaptive": first["adaptive"], "sample": sample.describe()}
                for key in ("mass", "answer_mass", "logical", "physical", "index_ms", "gpu_index_ms", "kernel_ms",
                            "dense_kernel_ms"):
                    point[key] = _mean([rl[i].get(key) for rl in per_layer])
                point["layers"] = {str(l): {key: rl[i][key] for key in ("mass", "answer_mass", "physical")}
                                   for l, rl in zip(layers, per_layer)}
                points.append(point)
            wanted = task in quality_tasks if quality_tasks is not None else bool(sample.answer)
            if quality == "none" or length not in quality_lengths or not wanted:
                continue
            todo = [p for p in points if p["task"] == task and p["length"] == length]
            for m in methods:
                for p in todo:
                    if p["method"] == m.name and (quality == "all" or p["value"] == m.mid()):
                        p["quality"] = quality_point(model, tok, shape, sample, method_builder(m, p["value"]), max_new_tokens)
                        say(f"  {task}@{length} {m.name}={p['value']}: KL {p['quality']['kl']:.4f} "
                            f"{p['quality'].get('correct', '')} ({p['quality']['seconds']} s)")
            if config is not None:
                p = next(p for p in todo if p["method"] == SEARCHED)
                p["quality"] = quality_point(model, tok, shape, sample, None, max_new_tokens, config=config)
                say(f"  {task}@{length} searched config: KL {p['quality']['kl']:.4f} {p['quality'].get('correct', '')}")
    return {"points": points, "pareto": fronts(points), "pareto_ms": fronts(points, "ms") if kernels else None,
            "settings": {"tasks": list(tasks), "lengths": list(lengths), "layers": layers, "rows": rows,
                         "quality": quality, "quality_lengths": quality_lengths, "quality_tasks": quality_tasks,
                         "max_new_tokens": max_new_tokens, "seed": seed, "depth": depth, "device": device.type,
                         "methods": {m.name: {"knob": m.knob, "values": list(m.values), "adaptive": m.adaptive}
                                     for m in methods},
                         "config": None if config is None else {key: config.provenance.get(key) for key in
                                                                 ("command", "target", "tail_target", "created")}},
            "model": shape.to_dict(), "environment": environment()}


def device_ms(point: dict[str, Any]) -> float | None:
    """A point's measured attention time on the device: index build (0 for static patterns) + kernel, ms."""
    return None if point.get("kernel_ms") is None else (point.get("gpu_index_ms") or 0.0) + point["kernel_ms"]


def fronts(points: Sequence[dict[str, Any]], cost: str = "physical") -> dict[str, list[dict[str, Any]]]:
    """Per "task@length": the Pareto front of mass vs `cost`: "physical" density, or "ms" (`device_ms`, the
    points with kernel times only) -> [{method, value, physical, ms, mass, answer_mass}]."""
    of = (lambda p: p["physical"]) if cost == "physical" else device_ms
    out = {}
    for key in sorted({(p["task"], p["length"]) for p in points}):
        group = [p for p in points if (p["task"], p["length"]) == key and of(p) is not None]
        front = pareto_front([of(p) for p in group], [p["mass"] for p in group])
        out[f"{key[0]}@{key[1]}"] = [{**{k: group[i][k] for k in ("method", "value", "physical", "mass", "answer_mass")},
                                      "ms": device_ms(group[i])} for i in front]
    return out


def environment() -> dict[str, Any]:
    """Machine and versions (the command is added by the caller)."""
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        import subprocess

        import triton

        env.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    return env
