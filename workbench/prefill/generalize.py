"""Does a head config searched at one length hold at other lengths, or must it be searched again?

A config is searched at length L (its calibration prompts). On held-out prompts (tasks or seeds the search
never saw) at L and at other lengths (longer ones, where budgets in tokens may fall short, or shorter), every
head's captured attention mass under the index the config runs online, over all query rows and over the
answer rows (the last `TAIL_ROWS`), is compared with its mass at L; the heads that fall below the config's
target at a length are the ones to search again there. Two variants side by side:

- "as_is": the budgets in tokens as searched (a VS head keeps its 1000 columns at 4L);
- "scaled": every budget multiplied by n / L, i.e. the same fraction of the prompt (`scale_config`).

At the longest length both variants also run end to end (`quality.sample_record`): retrieval of the
answer after a sparse prefill and next-token KL vs dense. Heads the model fixes (sliding-window layers) keep
the model's own attention in both variants (mass 1 by definition) and are not evaluated.

`head_mass_by_length` is the per-head mass-vs-length table (the dashboard's view); `generalization_report`
the whole JSON report (`workbench generalize`, notebook 08; `views.lengths.write_html` draws it).
"""
from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench import __version__
from workbench.config import PARAMS, ConfigError, HeadConfig, HeadEntry
from workbench.core.io import write_json
from workbench.core.model import ModelShape
from workbench.core.progress import Progress, reporter
from workbench.core.timing import environment
from workbench.patterns import AShape, causal_tiles
from workbench.prefill.quality import sample_record
from workbench.search.search import TAIL_ROWS, TARGET, Candidate, layer_scores

# Sizes that are budgets (keys a head reads grow with them): scaled with n. Sinks, answer rows, dilation /
# stride and adaptive thresholds are not budgets and stay as searched.
BUDGET_PARAMS = ("vertical", "slash", "window", "topk")
DROP = 0.01  # a head "drops" when its mean mass falls by more than this from L to the drop length
ANSWER_TASKS = ("passkey", "multikey")  # tasks with one answer to retrieve (the end-to-end check)
VARIANTS = {"as_is": "budgets in tokens as searched at L", "scaled": "every budget x n / L (the same fraction of n)"}
HELD_OUT_SEED = 100  # held-out prompts use seeds from here on (the search uses seeds from 0)


def searched_length(config: HeadConfig) -> int:
    """L: the longest calibration prompt of `config` (provenance.calibration[*].length)."""
    lengths = [s.get("length") for s in config.provenance.get("calibration") or [] if isinstance(s, dict)]
    lengths = [n for n in lengths if isinstance(n, int)]
    if not lengths:
        raise ConfigError("the config records no calibration lengths (provenance.calibration[*].length): pass the "
                          "length it was searched at (searched_at=..., --searched-at N)")
    return max(lengths)


def scale_config(config: HeadConfig, n: int, searched_at: int) -> HeadConfig:
    """A copy of `config` whose budgets (`BUDGET_PARAMS`) are multiplied by n / searched_at (rounded, at least
    the searched size's minimum, at most n; a block top-k at most the n / 64 blocks). Fixed heads (the
    model's window) and dense heads keep theirs; recall, density, evidence and MInference fields are dropped
    (they described the searched sizes). `provenance.scaled` records the factor."""
    if n < 1 or searched_at < 1:
        raise ValueError(f"n={n} and searched_at={searched_at} must be >= 1 token")
    factor = n / searched_at
    heads = []
    for e in config.heads:
        if e.fixed or not e.params:
            heads.append(HeadEntry.from_dict(e.to_dict()))
            continue
        params = {}
        for key, value in e.params.items():
            if key not in BUDGET_PARAMS:
                params[key] = value
                continue
            cap = -(-n // config.block) if key == "topk" else n
            params[key] = max(min(round(value * factor), cap), 1 if value >= 1 else 0)
        heads.append(HeadEntry(e.layer, e.head, e.pattern, params))
    prov = dict(config.provenance, scaled={"from_length": searched_at, "to_length": n, "factor": round(factor, 6),
                                           "params": list(BUDGET_PARAMS)})
    return HeadConfig(model=dict(config.model), heads=heads, provenance=prov, proxy=dict(config.proxy),
                      block=config.block)


def held_out_samples(tok: Any, tasks: Sequence[str], lengths: Sequence[int], count: int,
                     config: HeadConfig | None = None) -> dict[int, list[Any]]:
    """{n: samples}: `count` prompts per task and length, seeds from `HELD_OUT_SEED`, needle depths spread.
    Refuses a prompt that is one of `config`'s calibration prompts (same token sha)."""
    from workbench.core.corpus import depths, make_sample

    seen = {s.get("sha") for s in (config.provenance.get("calibration") or []) if isinstance(s, dict)} if config else set()
    out: dict[int, list[Any]] = {}
    for n in lengths:
        out[n] = []
        for task in tasks:
            for i, depth in enumerate(depths(count)):
                sample = make_sample(task, tok, n, seed=HELD_OUT_SEED + i, depth=depth)
                if sample.sha in seen:
                    raise ValueError(f"task {task!r} at {n} tokens (seed {sample.seed}) is one of the config's calibration "
                                     "prompts: evaluate on held-out tasks (e.g. --tasks multikey)")
                out[n].append(sample)
    return out


def head_mass_by_length(model: torch.nn.Module, shape: ModelShape, config: HeadConfig,
                        samples: dict[int, Sequence[Any]], *, scaled_from: int | None = None,
                        layers: Sequence[int] | None = None, progress: bool | Progress = True) -> dict[str, Any]:
    """Per-head captured mass of `config`'s online indexes at each length (the dashboard's mass-vs-length view).

    samples: {n: prompts of n tokens} (`corpus.Sample`). scaled_from: L to scale the budgets from at each n
    (`scale_config`), None to run the sizes as they are. layers: the layers to evaluate (default: every layer
    the model does not fix); fixed layers get mass 1 (the model's own attention), layers not evaluated NaN.
    progress: True a tqdm bar, a callable gets (what, done, total) after each layer. Returns {"lengths":
    [n...], "mass", "mass_worst", "tail", "tail_worst", "density": Float `[len(lengths), L, H]`} (mean / worst over
    the prompts of a length; tail = the last `TAIL_ROWS` query rows; density = physical 64x64 tiles / causal tiles)."""
    config.validate(shape)
    scale = (lambda n: config) if scaled_from is None else (lambda n: scale_config(config, n, scaled_from))
    return mass_tables(model, shape, {"mass": scale}, samples, layers, progress)["mass"]


def _candidate(e: HeadEntry) -> Candidate:
    return Candidate(e.pattern, tuple(e.params[p] for p in PARAMS[e.pattern]))


@torch.no_grad()
def mass_tables(model: torch.nn.Module, shape: ModelShape, variants: dict[str, Callable[[int], HeadConfig]],
                samples: dict[int, Sequence[Any]], layers: Sequence[int] | None = None,
                progress: bool | Progress = True) -> dict[str, dict[str, Any]]:
    """`head_mass_by_length` of several configs at once: {name: a function n -> the config to run at n}. One
    capture per prompt and one exact pass per layer (`search.layer_scores` over the union of the configs'
    candidates: the mass of the index each candidate runs online, all rows and answer rows, and its tiles)
    serve every config. Returns {name: table}."""
    from workbench.core.capture import capture_attention

    lengths = sorted(samples)
    for n in lengths:
        shape.check_length(n)
        if not samples[n]:
            raise ValueError(f"no prompts of length {n}: give at least one per length")
    free = evaluated_layers(shape, layers)
    skipped = [l for l in shape.free_layers if l not in free]
    size = (len(lengths), shape.n_layers, shape.n_heads)
    tables = {name: {key: torch.ones(size, dtype=torch.float64) for key in ("mass", "mass_worst", "tail",
                                                                            "tail_worst", "density")}
              for name in variants}
    report, close = reporter(progress, unit="layer")
    total, done = sum(len(samples[n]) for n in lengths) * len(free), 0
    try:
        for i, n in enumerate(lengths):
            configs = {name: fn(n) for name, fn in variants.items()}
            for cfg in configs.values():
                cfg.validate(shape)
            mass = {name: torch.ones(len(samples[n]), *size[1:], dtype=torch.float64) for name in variants}
            tail = {name: m.clone() for name, m in mass.items()}
            for s, sample in enumerate(samples[n]):
                where = f"{n} tokens, prompt {s + 1}/{len(samples[n])}"
                report(f"{where}: capturing", done, total)
                cap = capture_attention(model, shape, sample.input_ids, free, dtype=torch.float32, progress=False)
                for layer in free:
                    q, k, _ = cap.layer_qkv(layer)
                    entries = {name: cfg.layer(layer) for name, cfg in configs.items()}
                    cands = sorted({_candidate(e) for es in entries.values() for e in es}, key=lambda c: c.label())
                    proxies = {tuple(sorted(cfg.proxy.items())) for cfg in configs.values()}
                    if len(proxies) != 1:
                        raise ValueError("the configs use different online proxy settings: evaluate them one at a time")
                    scores = layer_scores(q, k, cap.scale, cands, next(iter(configs.values())).proxy,
                                          cap.layer_lse(layer))
                    for name, es in entries.items():
                        c = torch.tensor([cands.index(_candidate(e)) for e in es])
                        h = torch.arange(len(es))
                        mass[name][s, layer], tail[name][s, layer] = scores["mass"][h, c], scores["tail"][h, c]
                        tables[name]["density"][i, layer] = scores["tiles"][h, c] / causal_tiles(n)
                    done += 1
                    report(f"{where}: layer {layer}", done, total)
                del cap
            for name, table in tables.items():
                for layer in shape.fixed_layers:
                    table["density"][i, layer] = AShape(0, shape.window(layer), shape.n_heads).tiles(n).double() \
                        / causal_tiles(n)
                table["mass"][i], table["mass_worst"][i] = mass[name].mean(0), mass[name].amin(0)
                table["tail"][i], table["tail_worst"][i] = tail[name].mean(0), tail[name].amin(0)
    finally:
        close()
    for table in tables.values():
        for t in table.values():
            t[:, skipped] = float("nan")
    return {name: {"lengths": lengths, **table} for name, table in tables.items()}


def evaluated_layers(shape: ModelShape, layers: Sequence[int] | None) -> list[int]:
    """The layers a length evaluation captures: `layers` (default: every layer), less the ones the model fixes;
    raises naming a layer the model does not have."""
    if layers is None:
        return list(shape.free_layers)
    bad = [l for l in layers if not 0 <= l < shape.n_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist: {shape.name} has layers 0-{shape.n_layers - 1}")
    free = [l for l in sorted(set(layers)) if l in shape.free_layers]
    if not free:
        raise ValueError(f"layers {sorted(set(layers))} are all fixed by the model (sliding window): give one of "
                         f"{list(shape.free_layers)}")
    return free


def _quality(model, tok, shape, config: HeadConfig, samples: Sequence[Any], max_new_tokens: int, backend: str,
             progress: bool | Progress) -> dict[str, Any]:
    """Retrieval and next-token KL of one config vs dense on `samples` (one length)."""
    records = [sample_record(model, tok, shape, config, s, max_new_tokens, cosine=False, backend=backend)
               for s in tqdm(samples, desc="quality", unit="prompt", disable=progress is not True, leave=False)]
    kls = [r["kl"] for r in records]
    return {"n": samples[0].length, "samples": len(records),
            "dense_correct": sum(r["dense_correct"] for r in records),
            "sparse_correct": sum(r["sparse_correct"] for r in records),
            "same_outcome": sum(r["dense_correct"] == r["sparse_correct"] for r in records),
            "kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
            "top1_agreement": sum(r["top1_agree"] for r in records) / len(records),
            "records": [{k: v for k, v in r.items() if k not in ("dense_seconds", "sparse_seconds")} for r in records]}


def _round(t: torch.Tensor, digits: int = 5) -> list:
    return [[round(float(x), digits) for x in row] for row in t]


def generalization_report(model: torch.nn.Module, tok: Any, shape: ModelShape, config: HeadConfig, *,
                          lengths: Sequence[int], tasks: Sequence[str] = ("multikey",), samples: int = 1,
                          searched_at: int | None = None, target: float | None = None,
                          quality_samples: int = 4, max_new_tokens: int = 8, backend: str = "auto",
                          layers: Sequence[int] | None = None, out: str | Path | None = None, command: str = "",
                          config_source: str = "", progress: bool | Progress = True) -> dict[str, Any]:
    """The length-generalisation report of `config` (see the module docstring) as a plain-JSON dict.

    lengths: the other lengths to evaluate at, usually longer (L itself is added); tasks / samples: held-out prompts per
    length; target: the mass a head must keep (default: the config's search target, else `TARGET`; the
    answer-row target is the config's tail_target when it has one); quality_samples: prompts at the longest
    length run end to end (0: skip), cycling through the answerable tasks among `tasks` (passkey, multikey),
    else passkey; layers: the layers to evaluate (default: every layer the model does not fix); progress: True
    tqdm bars, a callable gets (what, done, total) after each layer. With `out`, the JSON is written atomically
    after each variant."""
    L = searched_at or searched_length(config)
    lengths = sorted({L, *lengths})
    for n in lengths:
        shape.check_length(n)
    target = target if target is not None else float(config.provenance.get("target", TARGET))
    tail_target = float(config.provenance.get("tail_target") or target)
    drop_to = 4 * L if 4 * L in lengths else max(lengths, key=lambda n: (abs(math.log(n / L)), n))  # farthest from L
    prompts = held_out_samples(tok, tasks, lengths, samples, config)
    report: dict[str, Any] = {
        "model": shape.to_dict(),
        "config": {"source": config_source, "summary": config.summary(), "searched_at": L,
                   "target": target, "tail_target": tail_target,
                   "calibration": config.provenance.get("calibration"), "fixed_layers": list(shape.fixed_layers)},
        "settings": {"lengths": lengths, "tasks": list(tasks), "samples": samples, "quality_samples": quality_samples,
                     "max_new_tokens": max_new_tokens, "drop": DROP, "drop_to": drop_to, "tail_rows": TAIL_ROWS,
                     "held_out_seed": HELD_OUT_SEED, "backend": backend,
                     "layers": evaluated_layers(shape, layers)},
        "prompts": {str(n): [s.describe() for s in prompts[n]] for n in lengths},
        "patterns": [[e.pattern for e in config.layer(l)] for l in range(shape.n_layers)],
        "labels": [[e.label() + (" (fixed)" if e.fixed else "") for e in config.layer(l)] for l in range(shape.n_layers)],
        "variants": VARIANTS, "command": command, "tool": f"workbench {__version__}",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "environment": environment(),
        "mass": {}, "summary": {}, "below_target": {}, "dropping": {}, "quality": {}}
    i_L, i_d = lengths.index(L), lengths.index(drop_to)
    free = [(l, h) for l in report["settings"]["layers"] for h in range(shape.n_heads)]
    config.validate(shape)
    tables = mass_tables(model, shape, {"as_is": lambda n: config, "scaled": lambda n: scale_config(config, n, L)},
                         prompts, layers, progress)
    for variant in VARIANTS:
        table = tables[variant]
        report["mass"][variant] = {str(n): {key: _round(table[key][i]) for key in
                                            ("mass", "mass_worst", "tail", "tail_worst", "density")}
                                   for i, n in enumerate(lengths)}
        below, summary = {}, {}
        for i, n in enumerate(lengths):
            low = [[l, h] for l, h in free if table["mass_worst"][i, l, h] < target - 1e-9
                   or table["tail_worst"][i, l, h] < tail_target - 1e-9]
            below[str(n)] = low
            pick = lambda key: torch.stack([table[key][i, l, h] for l, h in free])  # noqa: E731
            summary[str(n)] = {"mass_mean": round(float(pick("mass").mean()), 5),
                               "mass_worst_head": round(float(pick("mass_worst").min()), 5),
                               "tail_worst_head": round(float(pick("tail_worst").min()), 5),
                               "heads_below_target": len(low), "heads": len(free),
                               "physical_density_mean": round(float(pick("density").mean()), 5)}
        drops = []
        for l, h in free:
            drop = float(table["mass"][i_L, l, h] - table["mass"][i_d, l, h])
            if drop > DROP:
                e = config.entry(l, h)
                drops.append({"layer": l, "head": h, "pattern": e.pattern, "params": e.params,
                              "mass_at_L": round(float(table["mass"][i_L, l, h]), 5),
                              "mass_at_drop_to": round(float(table["mass"][i_d, l, h]), 5), "drop": round(drop, 5)})
        report["below_target"][variant] = below
        report["summary"][variant] = summary
        report["dropping"][variant] = sorted(drops, key=lambda r: -r["drop"])
        if out is not None:
            write_json(out, report)
    if quality_samples > 0:
        from workbench.core.corpus import depths, make_sample

        answerable = [t for t in tasks if t in ANSWER_TASKS] or ["passkey"]
        n = lengths[-1]
        qs = [make_sample(answerable[j % len(answerable)], tok, n, seed=HELD_OUT_SEED + 1000 + j, depth=d)
              for j, d in enumerate(depths(quality_samples))]
        for variant in VARIANTS:
            cfg = config if variant == "as_is" else scale_config(config, n, L)
            report["quality"][variant] = _quality(model, tok, shape, cfg, qs, max_new_tokens, backend, progress)
            if out is not None:
                write_json(out, report)
    if out is not None:
        write_json(out, report)
    return report


def dropping_heads(report: dict[str, Any], variant: str = "as_is") -> list[tuple[int, int]]:
    """(layer, head) of the heads whose mean mass drops by more than `DROP` from L to the drop length."""
    return [(r["layer"], r["head"]) for r in report["dropping"][variant]]

