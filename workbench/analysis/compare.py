"""Every prefill method through one harness: a sweep of each method's budget or threshold on one layer.

A `Method` turns (q, k, scale, value) into a `Pattern` of one layer; `sweep_layer` builds every method
at every value (timing the index build) and, in one pass over the exact dense attention rows, measures
what each keeps: captured mass over all rows and over the answer rows (the last 64), logical and
physical density. `pareto_front` picks the points no other point beats on both cost and mass.

q `[Hq, N, D]`, k `[Hkv, N, D]` (query head h reads KV head h // (Hq // Hkv)).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workbench.analysis.metrics import density
from workbench.analysis.stats import attention_rows
from workbench.patterns import BLOCK, PATTERNS, Pattern

ANSWER_ROWS = 64
Builder = Callable[[torch.Tensor, torch.Tensor, float, float], Pattern]


@dataclass(frozen=True)
class Method:
    """One prefill method and the sweep of its knob. `adaptive`: decides per prompt from a threshold
    (the config records the threshold); otherwise a static budget in tokens or blocks."""

    name: str
    knob: str
    values: tuple[float, ...]
    adaptive: bool
    online: bool  # needs an index built from q and k (else static geometry)
    build: Builder

    def mid(self) -> float:
        return self.values[len(self.values) // 2]


def sweep_builder(cls: type) -> Builder:
    """(q, k, scale, value) -> the kind's pattern over all Hq heads of one layer at the config params
    `cls.sweep.params(value)`, built as the prefill builds it (`for_heads`, the proxies' default settings; a kind
    that shares one index per KV head gets the KV heads)."""
    def build(q: torch.Tensor, k: torch.Tensor, scale: float, value: float) -> Pattern:
        hq = q.shape[0]
        kv = k if cls.kv_shared else k.repeat_interleave(hq // k.shape[0], 0)
        return cls.for_heads([cls.sweep.params(value)] * hq, q, kv, scale, {}, BLOCK)
    return build


def default_methods() -> list[Method]:
    """The `sweep` of every registered kind that has one (sized for 4K-8K-token prompts: windows and
    budgets in tokens), in registry order."""
    return [Method(cls.sweep.name, cls.sweep.knob, cls.sweep.values, cls.sweep.adaptive, cls.sweep.online,
                   sweep_builder(cls)) for cls in PATTERNS.values() if cls.sweep is not None]


def timed(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, float]:
    """(fn(), milliseconds): CUDA events on a GPU (one sync at the end), wall time on the CPU."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def row_ranges(n: int, rows: int | None, chunk: int = 32) -> list[tuple[int, int]]:
    """Query-row ranges to measure: all rows (rows=None or >= n), else `rows // chunk` chunks of `chunk`
    rows spread evenly over the rows before the answer rows, plus the last `ANSWER_ROWS` rows."""
    body = max(n - ANSWER_ROWS, 0)
    if rows is None or rows >= n or body == 0:
        return [(0, n)]
    count = max(1, min(rows // chunk, body // chunk))
    starts = [round(i * (body - chunk) / max(count - 1, 1)) for i in range(count)]
    return [(r, r + chunk) for r in starts] + [(body, n)]


@torch.no_grad()
def masses(q: torch.Tensor, k: torch.Tensor, scale: float, patterns: Sequence[Pattern],
           rows: int | None = None) -> dict[str, torch.Tensor]:
    """Exact captured mass of several patterns -> {"mass", "answer_mass"} `[P, Hq]`: the mean over all
    query rows (rows=None) or a stratified estimate from about `rows` sampled rows (each row exact; the
    answer rows always measured), and the mean over the last `ANSWER_ROWS` rows."""
    hq, n, _ = q.shape
    ranges = row_ranges(n, rows)
    kept = torch.zeros(len(patterns), hq, n, device=q.device)
    measured = torch.zeros(n, dtype=torch.bool)
    for a, b in ranges:
        for r0, r1, p, _ in attention_rows(q, k, scale, chunk=256, rows=(a, b)):
            for i, pat in enumerate(patterns):
                kept[i, :, r0:r1] = (p * pat.row_mask(r0, r1, n)[:, :, :r1].to(p.device)).sum(-1)
        measured[a:b] = True
    answer = max(n - ANSWER_ROWS, 0)
    body = measured.clone()
    body[answer:] = False
    tail = kept[:, :, answer:].mean(-1)
    mass = tail if not body.any() else (kept[:, :, body.to(q.device)].mean(-1) * answer + tail * (n - answer)) / n
    return {"mass": mass, "answer_mass": tail}


@torch.no_grad()
def sweep_layer(q: torch.Tensor, k: torch.Tensor, scale: float, methods: Sequence[Method],
                extra: dict[str, Pattern] | None = None, rows: int | None = None) -> list[dict[str, Any]]:
    """Every method at every value (plus `extra` named patterns, e.g. a searched config's layer) on
    one layer -> rows {method, value, mass, answer_mass, logical, physical, index_ms}, each a mean
    over heads, with the per-head lists under "heads". `rows`: see `masses`."""
    n = q.shape[1]
    built, out = [], []
    for m in methods:
        for v in m.values:
            pat, ms = timed(lambda: m.build(q, k, scale, v), q.device)
            built.append(pat)
            out.append({"method": m.name, "value": v, "adaptive": m.adaptive, "index_ms": ms if m.online else 0.0})
    for name, pat in (extra or {}).items():
        built.append(pat)
        out.append({"method": name, "value": None, "adaptive": False, "index_ms": None})
    kept = masses(q, k, scale, built, rows)
    for i, (row, pat) in enumerate(zip(out, built)):
        dens = density(pat, n)
        heads = {"mass": kept["mass"][i], "answer_mass": kept["answer_mass"][i],
                 "logical": dens["logical"], "physical": dens["physical"]}
        row.update({key: float(val.double().mean()) for key, val in heads.items()})
        row["heads"] = {key: [round(float(x), 5) for x in val] for key, val in heads.items()}
    return out


def pareto_front(cost: Sequence[float], value: Sequence[float]) -> list[int]:
    """Indices of the points that no other point beats: lower or equal cost and higher or equal value,
    one of them strictly. Ascending cost."""
    idx = sorted(range(len(cost)), key=lambda i: (cost[i], -value[i]))
    front, best = [], float("-inf")
    for i in idx:
        if value[i] > best:
            front.append(i)
            best = value[i]
    return front
