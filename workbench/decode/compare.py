"""Decode one prompt in several engine modes side by side: the one call notebook 06 and the dashboard's Decode
tab make.

A *mode spec* is an engine mode, optionally with the selector of sparse-resident after a slash and the KV
store dtype after an at sign: `"sparse-resident"` (same-layer selection) and `"sparse-resident/forecast"` are the
lossless references of `sparse-offload-sync` and of the two forecast modes (`"sparse-offload-sync/quest"`
offloads Quest's selection, whose reference is `"sparse-resident/quest"`); `"sparse-offload-forecast@fp8"` keeps
the offloaded KV as FP8 codes (`"@int8"`: INT8, `"@int4"`: 4-bit codes with a scale per 32 elements,
`"@int8k-int4v"`: INT8 keys and INT4 values; no suffix:
the `store_dtype` argument, default the model's dtype), and its lossless reference is
`"sparse-resident/forecast@fp8"`, whose distance from dense is the cost of the store (`quality=True`). Every mode
decodes the same prefilled prompt(s) greedily;
on CUDA the speed run replays CUDA graphs (Triton kernels), then a few eager steps with CUDA events measure
how much of the copy is hidden and one more eager step is traced as a compute/copy timeline. On the CPU the
engine runs the PyTorch reference kernels with no streams: nothing overlaps, so no share hidden is reported.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.core.progress import Progress, reporter
from workbench.decode.engine.adapters import decoder_layers
from workbench.decode.engine.decoder import MODES, OFFLOAD, STORE_DTYPES, DecodeEngine, EngineConfig, check_budget
from workbench.decode.engine.reuse import ReuseMeter
from workbench.decode.timeline import trace_step
from workbench.patterns.infllm import Budget

DEFAULT_MODES = ("dense-resident", "sparse-resident", "sparse-offload-sync", "sparse-resident/forecast",
                 "sparse-offload-forecast")
ALL_MODES = (*DEFAULT_MODES, "forecast-without-prefetch")
EVENT_STEPS = 4  # eager CUDA steps timed with events (copy time, stall) after the speed run


def parse_spec(spec: str, store_dtype: str = "model") -> tuple[str, str, str]:
    """A mode spec -> (engine mode, selector, store dtype); `store_dtype` when the spec names none."""
    head, at, store = spec.partition("@")
    if at and store not in STORE_DTYPES:
        raise ValueError(f"mode {spec!r}: store dtype {store!r} is unknown: choose one of {', '.join(STORE_DTYPES)}")
    return (*parse_mode(head), store if at else store_dtype)


def parse_mode(spec: str) -> tuple[str, str]:
    """`"mode"`, `"sparse-resident/<selector>"` or `"sparse-offload-sync/quest"` (any `@store` suffix is
    ignored) -> (engine mode, selector)."""
    mode, _, selector = spec.partition("@")[0].partition("/")
    if mode not in MODES:
        raise ValueError(f"mode {spec!r} is unknown: choose from {', '.join(ALL_MODES)}")
    if selector and mode != "sparse-resident" and (mode, selector) != ("sparse-offload-sync", "quest"):
        raise ValueError(f"mode {spec!r}: only sparse-resident takes a selector (e.g. sparse-resident/forecast); "
                         "sparse-offload-sync takes quest")
    fixed = "forecast" if mode in ("sparse-offload-forecast", "forecast-without-prefetch") else "same-layer"
    return mode, selector or fixed


def with_store(modes: Sequence[str], store: str) -> list[str]:
    """The mode specs with the KV of every mode but dense-resident kept as `store` (a key of `STORE_DTYPES`):
    dense-resident stays exact, the baseline every mode's tokens are compared with, so its distance shows the
    store's cost; a spec with its own `@` suffix keeps it."""
    if store not in STORE_DTYPES:
        raise ValueError(f"store {store!r} is unknown: choose one of {', '.join(STORE_DTYPES)}")
    return [m if store == "model" or m == "dense-resident" or "@" in m else f"{m}@{store}" for m in modes]


def reference_of(spec: str) -> str | None:
    """The resident mode whose tokens an offload mode must reproduce exactly (None for resident modes); it
    keeps the spec's store suffix."""
    mode, selector = parse_mode(spec)
    if mode not in OFFLOAD:
        return None
    at = spec.partition("@")[1:]
    return ("sparse-resident" if selector == "same-layer" else f"sparse-resident/{selector}") + "".join(at)


def device_label(model: torch.nn.Module) -> str:
    """"cuda: <GPU name> (Triton kernels)" or "cpu reference path (PyTorch kernels)"."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)} (Triton kernels)"
    return "cpu reference path (PyTorch kernels)"


@dataclass
class ModeRun:
    """One mode's decode. tokens `[B, new_tokens]` (CPU; the first is the prefill's, as `model.generate` counts);
    rates per second of decode steps; bytes per decode step (host->GPU)."""

    spec: str
    tokens: torch.Tensor
    store_dtype: str
    tokens_per_s: float
    bytes_moved_per_step: float
    hit_rate: float | None
    hidden_fraction: float | None
    copy_gbps: float | None
    peak_gpu_bytes: int | None
    cuda_graph: bool
    timeline: list[dict[str, Any]]
    note: str = ""
    dynamic_reuse: float | None = None  # with measure_reuse: share of dynamic blocks selected at the previous step
    logits: torch.Tensor | None = None  # quality runs only: `[B, new_tokens - 1, V]` of the decode steps (CPU)

    def row(self) -> dict[str, Any]:
        """Table row (no tensors, no spans): greedy tokens of the first sequence as a list."""
        return {"mode": self.spec, "selector": parse_mode(self.spec)[1], "store_dtype": self.store_dtype,
                "tokens_per_s": self.tokens_per_s,
                "bytes_moved_per_step": self.bytes_moved_per_step,
                "hit_rate": self.hit_rate, "hidden_fraction": self.hidden_fraction, "copy_gbps": self.copy_gbps,
                "peak_gpu_bytes": self.peak_gpu_bytes, "cuda_graph": self.cuda_graph,
                "dynamic_reuse": self.dynamic_reuse, "greedy_tokens": self.tokens[0].tolist(), "note": self.note}


@dataclass
class Comparison:
    """Every mode's run on one prompt batch, the device label and the losslessness checks."""

    device: str
    budget: Budget
    prompt_tokens: list[int]
    new_tokens: int
    runs: dict[str, ModeRun] = field(default_factory=dict)
    # with quality=True: "same-layer", "forecast" (model-dtype KV), "<selector>@<store>" and "dense@<store>" (the
    # store's rounding alone) for every other store dtype of the run -> top-1 agreement and KL vs dense-resident
    quality: dict[str, dict[str, float | None]] | None = None

    @property
    def lossless(self) -> dict[str, bool]:
        """offload spec -> its greedy tokens equal those of its resident reference (when both ran)."""
        out = {}
        for spec, run in self.runs.items():
            ref = reference_of(spec)
            if ref in self.runs:
                out[spec] = bool(torch.equal(run.tokens, self.runs[ref].tokens))
        return out

    def rows(self) -> list[dict[str, Any]]:
        lossless = self.lossless
        return [{**r.row(), "steps": self.new_tokens - 1, "equals_reference": lossless.get(spec),
                 "reference": reference_of(spec)} for spec, r in self.runs.items()]

    def to_dict(self) -> dict[str, Any]:
        out = {"device": self.device, "budget": self.budget.to_dict(), "prompt_tokens": self.prompt_tokens,
               "new_tokens": self.new_tokens, "runs": self.rows(), "lossless": self.lossless,
               "timelines": {spec: r.timeline for spec, r in self.runs.items()}}
        if self.quality is not None:
            out["quality_vs_dense"] = self.quality
        return out


def decode_length(prompt_tokens: int, new_tokens: int, cuda: bool, trace: bool = True) -> int:
    """Tokens a sequence reaches in `compare_modes`: the prompt, the new tokens, the untimed steps that warm
    the CUDA events (on CUDA) and the traced step, plus one."""
    return prompt_tokens + new_tokens + (EVENT_STEPS if cuda else 0) + (1 if trace else 0) + 1


@torch.no_grad()
def compare_modes(model: torch.nn.Module, prompts: torch.Tensor | Sequence[torch.Tensor], *,
                  modes: Sequence[str] = DEFAULT_MODES, new_tokens: int = 16, budget: Budget | None = None,
                  heads: Any = None, graph: bool | None = None, trace: bool = True, ctas: int | None = None,
                  measure_reuse: bool = False, quality: bool = False, store_dtype: str = "model",
                  progress: bool | Progress = True) -> Comparison:
    """Greedy-generate `new_tokens` (the prefill's token, then new_tokens - 1 decode steps) after each prompt
    (`[N]` one sequence, or a list of `[N_b]`: a batch) in every mode of `modes` (see `parse_mode`) with the
    same `budget` (default: init 1, local 2, top-k 8 blocks, cut to the sequence by `Budget.fitted`).

    `graph` (default: on CUDA, unless measure_reuse) times CUDA-graph replay; `trace` records one step's compute/copy spans
    (`workbench.decode.timeline`); `ctas` = programs of the UVA gather kernel. `measure_reuse` (eager steps, a
    host sync per layer) counts how many dynamic blocks stay selected from one step to the next. `store_dtype`
    ("model", "fp8", "int8", "int4", "int8k-int4v") is the KV store of specs without an `@` suffix. `quality` also decodes
    dense-resident and sparse-resident (same-layer, forecast) teacher-forced on dense's tokens, eagerly, for the
    model-dtype store and for every other store dtype the modes use (and dense-resident with that store), and
    fills `Comparison.quality` (top-1 agreement, KL dense -> sparse, free-running agreement where that mode ran).
    `progress`: True draws a tqdm bar, a callable gets (what, done, total) after each decoded step, False is
    silent. Raises ValueError naming a bad mode, size or budget (e.g. a top-k beyond the blocks a sequence has)
    before decoding.
    """
    specs = [s.strip() for s in modes]
    if not specs:
        raise ValueError("modes is empty: give at least one mode, e.g. sparse-resident")
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store_dtype {store_dtype!r} is unknown: choose one of {', '.join(STORE_DTYPES)}")
    parsed = [parse_spec(s, store_dtype) for s in specs]
    if len(set(specs)) != len(specs):
        raise ValueError(f"modes {specs} repeats a mode: list each once")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (the prefill's token and at least one decode step), got {new_tokens}")
    prompts = [prompts] if isinstance(prompts, torch.Tensor) else list(prompts)
    prompts = [p.reshape(-1) for p in prompts]
    lm = decoder_layers(model)
    cuda = lm.device.type == "cuda"
    use_graph = cuda and not measure_reuse if graph is None else graph
    if use_graph and not cuda:
        raise ValueError("graph=True needs the model on CUDA: pass graph=None or False on the CPU")
    if use_graph and measure_reuse:
        raise ValueError("measure_reuse counts blocks in Python at every step: pass graph=None or False")
    max_tokens = decode_length(max(p.numel() for p in prompts), new_tokens, cuda, trace)
    budget = budget or Budget.fitted(max_tokens)
    if max_tokens > lm.max_positions:
        raise ValueError(f"prompt + new_tokens = {max_tokens} tokens exceed the model's {lm.max_positions} "
                         "positions: use a shorter prompt or fewer new tokens")
    if any(mode != "dense-resident" for mode, _, _ in parsed) or quality:
        check_budget(budget, max_tokens)
    report, close = reporter(progress)
    stores = sorted({store for _, _, store in parsed} - {"model"})
    total = (len(specs) + (3 + 3 * len(stores)) * quality) * (new_tokens - 1) + len(prompts)
    result = Comparison(device_label(model), budget, [int(p.numel()) for p in prompts], new_tokens)
    try:
        prefilled = []
        for i, p in enumerate(prompts):
            report(f"prefill {i + 1}/{len(prompts)}", i, total)
            prefilled.append(lm.prefill(p))
        done = len(prompts)
        def config(mode: str, selector: str, store: str = "model") -> EngineConfig:
            return EngineConfig(mode=mode, budget=budget, selector=selector, ctas=ctas, store_dtype=store)

        for spec, (mode, selector, store) in zip(specs, parsed):
            def on_step(s: int, _n: int, spec: str = spec, base: int = done) -> None:
                report(spec, base + s, total)

            result.runs[spec] = _run_mode(model, spec, config(mode, selector, store), prompts, prefilled, new_tokens,
                                          max_tokens, heads, use_graph, trace, on_step, measure_reuse)
            done += new_tokens - 1
        if quality:
            result.quality = _quality(model, result, config, prompts, prefilled, max_tokens, heads, report, done, total,
                                      stores)
    finally:
        close()
    return result


def _quality(model, result, config, prompts, prefilled, max_tokens, heads, report, done, total, stores) -> dict:
    """Dense-resident's logits beside sparse-resident's (same-layer, forecast), teacher-forced on dense's tokens,
    for the model-dtype store and each store dtype in `stores` (plus dense-resident with that store)."""
    steps = result.new_tokens - 1
    k = 0

    def forced(mode: str, selector: str, store: str, force: torch.Tensor | None) -> ModeRun:  # eager, logits kept
        nonlocal k
        base, k = done + k * steps, k + 1

        def on_step(s: int, _n: int) -> None:
            report(f"quality: {mode}/{selector}" + (f"@{store}" if store != "model" else ""), base + s, total)

        return _decode(model, mode, config(mode, selector, store), prompts, prefilled, result.new_tokens, max_tokens,
                       heads, False, on_step, False, False, force, True)

    dense = forced("dense-resident", "same-layer", "model", None)
    lp = dense.logits.log_softmax(-1)
    out = {}
    runs = [(sel, sel, "model") for sel in ("same-layer", "forecast")]
    runs += [(f"{name}@{store}", name, store) for store in stores for name in ("dense", "same-layer", "forecast")]
    for key, selector, store in runs:
        mode = "dense-resident" if selector == "dense" else "sparse-resident"
        other = forced(mode, "same-layer" if selector == "dense" else selector, store, dense.tokens[:, 1:])
        lq = other.logits.log_softmax(-1)
        want = (mode, "forecast" if selector == "forecast" else "same-layer")
        free = next((r for r in result.runs.values() if parse_mode(r.spec) == want and r.store_dtype == store), None)
        out[key] = {
            "top1_agreement_teacher_forced": float((other.tokens == dense.tokens).float()[:, 1:].mean()),
            "kl_dense_to_sparse_mean": float((lp.exp() * (lp - lq)).sum(-1).mean()),
            "free_running_tokens_equal_to_dense":
                None if free is None else float((free.tokens == dense.tokens).float()[:, 1:].mean())}
    return out


def _run_mode(model, spec, cfg, prompts, prefilled, new_tokens, max_tokens, heads, use_graph, trace, on_step,
              measure_reuse) -> ModeRun:
    """One mode; if CUDA-graph capture fails the mode is decoded again eagerly by a fresh engine, and says so."""
    args = (model, spec, cfg, prompts, prefilled, new_tokens, max_tokens, heads, trace, on_step, measure_reuse)
    try:
        return _decode(*args, use_graph)
    except RuntimeError as e:
        if not use_graph:
            raise
        run = _decode(*args, False)
        run.note = f"CUDA graph failed ({str(e)[:120]}); eager"
        return run


def _decode(model, spec, cfg, prompts, prefilled, new_tokens, max_tokens, heads, trace, on_step, measure_reuse,
            use_graph, force=None, keep_logits=False) -> ModeRun:
    """Greedy tokens and speed (with graphs: `warm` steps capture the graph, the rest replay it and are timed),
    then CUDA-event timing of a few eager steps (offload modes on CUDA) and one traced step. `force` `[B, steps]`
    (eager only) teacher-forces the decode steps; `keep_logits` (eager only) keeps their logits."""
    steps = new_tokens - 1
    reuse = measure_reuse and cfg.mode != "dense-resident"
    meter = ReuseMeter(cfg.budget, -(-max_tokens // cfg.budget.block)) if reuse else None
    with DecodeEngine(model, cfg, batch=len(prompts), max_tokens=max_tokens, heads=heads, select_hook=meter) as eng:
        first = eng.prefill(prompts, steps, prefilled=prefilled)
        warm = min(2, steps - 1) if use_graph else 0
        head = first[:, None]
        if warm:
            head = torch.cat([head, eng.run(first, warm, graph=True, progress=False, on_step=on_step)[0]], 1)
        tail, logits, stats = eng.run(head[:, -1], steps - warm, force=force, keep_logits=keep_logits,
                                      graph=use_graph, progress=False, on_step=lambda s, n: on_step(warm + s, steps))
        tokens = torch.cat([head, tail], 1)
        last = tokens[:, -1]
        hidden = copy_gbps = None
        if eng.cuda and eng.offload and not keep_logits:
            eng.drop_graph()
            timed, _, ev = eng.run(last, EVENT_STEPS, timing=True, graph=False, progress=False)
            hidden, copy_gbps, last = ev.hidden_fraction, ev.copy_gbps, timed[:, -1]
        spans = trace_step(eng, last)[1] if trace else []
    return ModeRun(spec, tokens.cpu(), cfg.store_dtype, stats.tokens_per_s, stats.bytes_moved_per_step, stats.hit_rate,
                   hidden, copy_gbps, stats.peak_gpu_bytes, use_graph, spans,
                   dynamic_reuse=meter.rate if meter else None, logits=logits)
