"""Per-head pattern search: score every candidate on every calibration sample, keep the cheapest that
captures enough attention on the worst sample.

For each (sample, layer) the exact reductions of the layer's dense attention (`metrics.LayerReductions`:
column, diagonal and tile masses and each row's log-normaliser, over all rows and over the answer rows)
are computed once, and each registered pattern class scores its own candidates from them
(`PatternBase.evidence`): the captured mass of the index the candidate runs online (what the kernel
will really run), the same over the answer rows, and the mass of the best known index of the same
budget (the oracle). Closed forms for A-shape, Vertical-Slash, block-sparse and dense; one exact pass
per candidate for the adaptive kinds.

The answer rows are the last `TAIL_ROWS` query rows, where a retrieval prompt asks its question. A head
can hold 95% of its mass in a local window and still lose the one far-away needle those rows read;
`choose` requires both.

The evidence is a few plain tensors `[S, L, H, C]` (samples, layers, heads, candidates) that can be
summed across workers (each fills its own (sample, layer) slices), and the choice is deterministic.
"""
from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench import __version__
from workbench.analysis.metrics import TAIL_ROWS, LayerReductions, layer_sums, segment_mass
from workbench.analysis.stats import captured_mass
from workbench.config import PARAMS, PROXY_DEFAULTS, HeadConfig, HeadEntry
from workbench.core.model import ModelShape
from workbench.core.timing import environment
from workbench.patterns import EVIDENCE, PATTERNS, AShape, causal_edges, causal_tiles, pattern_class, vs_proxy
from workbench.patterns.base import default_budget
from workbench.patterns.proxy import top_positions
from workbench.patterns.vertical_slash import best_offsets, vs_mass

TARGET = 0.95
METRICS = EVIDENCE  # ("mass", "tail", "oracle", "tiles", "edges")


@dataclass(frozen=True)
class Candidate:
    """One pattern kind with its sizes in the order of its class's `params`, e.g. ("vs", (vertical, slash))
    or ("dense", ())."""

    pattern: str
    sizes: tuple[int, ...] = ()

    def __post_init__(self):
        if self.pattern not in PARAMS or len(self.sizes) != len(PARAMS[self.pattern]):
            raise ValueError(f"candidate {self.pattern}{self.sizes} is not valid: use one of "
                             + ", ".join(f"{p}{PARAMS[p]}" for p in PARAMS))
        for name, size in zip(PARAMS[self.pattern], self.sizes):
            low = 0 if name in ("sink", "vertical") else 1
            if size < low:
                raise ValueError(f"candidate {self.label()}: {name} = {size} must be >= {low}")

    @property
    def params(self) -> dict[str, int]:
        return dict(zip(PARAMS[self.pattern], self.sizes))

    def label(self) -> str:
        return self.pattern + ("(" + ",".join(map(str, self.sizes)) + ")" if self.sizes else "")

    def to_dict(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "params": self.params}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        pattern = d.get("pattern")
        if pattern not in PARAMS:
            raise ValueError(f"candidate pattern {pattern!r} is unknown: use one of {list(PARAMS)}")
        params = d.get("params", {})
        missing = [k for k in PARAMS[pattern] if k not in params]
        if missing:
            raise ValueError(f"candidate {pattern!r} needs params {list(PARAMS[pattern])}; missing {missing}")
        return cls(pattern, tuple(int(params[k]) for k in PARAMS[pattern]))

    @classmethod
    def at_budget(cls, pattern: str, budget: int, n: int) -> Candidate:
        """`pattern` at `budget` keys per query row, prompt length n (its class's `at_budget`); a kind without a
        key budget (dense, the adaptive thresholds) at its `defaults(n)`."""
        kind = pattern_class(pattern)
        params = kind.at_budget(budget, n)
        return cls.from_dict({"pattern": pattern, "params": kind.defaults(n) if params is None else params})


def default_candidates(n: int) -> list[Candidate]:
    """The search grid at prompt length n: the `grid(n)` of every kind with `default_search`, in registry
    order (A-shape, VS, block-sparse at budgets of n/64 .. n/4 keys per query; dense last, always reaching
    the target)."""
    return [Candidate.from_dict({"pattern": kind, "params": p})
            for kind, cls in PATTERNS.items() if cls.default_search for p in cls.grid(n)]


def method_candidates(n: int) -> list[Candidate]:
    """The other kinds' grids as extra candidates (pass `default_candidates(n) + method_candidates(n)`):
    Tri-shape, XAttention, FlexPrefill today. Scored by one exact pass each (slower than the closed forms
    of the default grid); the adaptive ones are recorded with their thresholds, not budgets."""
    return [Candidate.from_dict({"pattern": kind, "params": p})
            for kind, cls in PATTERNS.items() if not cls.default_search for p in cls.grid(n)]


@torch.no_grad()
def layer_scores(q: torch.Tensor, k: torch.Tensor, scale: float, candidates: Sequence[Candidate],
                 proxy: dict[str, Any] | None = None, lse: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Score every candidate on all heads of one layer of one prompt.

    q `[Hq, N, D]`, k `[Hkv, N, D]`. Returns {"mass", "tail", "oracle", "tiles", "edges"}: `[Hq, C]` float64;
    mass = exact captured fraction of the index the candidate would run, tail = the same over the
    last `TAIL_ROWS` query rows only (the answer rows), oracle = the same-budget oracle's mass (= mass
    where the pattern has no online choice), tiles = physical 64x64 tiles, edges = logical edges: each kind's
    `evidence` from one set of exact reductions. Computed on q's device, returned on the CPU. `lse` `[Hq, N]`:
    the rows' log-sum-exps when the caller has them (`capture.layer_lse(layer)`: the streamed forward's),
    saving the first pass.
    """
    out = {name: torch.zeros(q.shape[0], len(candidates), dtype=torch.float64) for name in METRICS}
    with torch.device(q.device):  # factories below follow the capture onto its device
        sums = LayerReductions(q, k, scale, {**PROXY_DEFAULTS, **(proxy or {})}, lse=lse)
        for kind, cls in PATTERNS.items():
            mine = [c for c, cand in enumerate(candidates) if cand.pattern == kind]
            if mine:
                scores = cls.evidence([candidates[c].params for c in mine], sums)
                for name in METRICS:
                    out[name][:, mine] = scores[name]
    return {name: t.clamp(max=1.0) if name in ("mass", "tail", "oracle") else t for name, t in out.items()}


@dataclass
class Evidence:
    """Per-head evidence: tensors `[S, L, H, C]` float64 (samples, layers, heads, candidates).

    Plain and additive: workers that scored disjoint (sample, layer) slices can be merged with `+`
    (or a torch.distributed all_reduce of each tensor). `lengths[s]` is sample s's token count; `group`:
    query heads per KV head (heads g*group .. g*group + group - 1 share one; `choose` gives kinds that share
    an index per KV head to whole groups)."""

    candidates: list[Candidate]
    samples: list[dict[str, Any]]
    lengths: list[int]
    mass: torch.Tensor
    tail: torch.Tensor
    oracle: torch.Tensor
    tiles: torch.Tensor
    edges: torch.Tensor
    done: torch.Tensor = field(default=None)  # [S, L] 1 where scored
    group: int = 1

    @classmethod
    def empty(cls, candidates: Sequence[Candidate], samples: Sequence[dict[str, Any]], lengths: Sequence[int],
              n_layers: int, n_heads: int, group: int = 1) -> Evidence:
        shape = (len(samples), n_layers, n_heads, len(candidates))
        z = lambda: torch.zeros(shape, dtype=torch.float64)  # noqa: E731
        return cls(list(candidates), list(samples), list(lengths), *(z() for _ in METRICS),
                   torch.zeros(len(samples), n_layers, dtype=torch.float64), group)

    def fill(self, sample: int, layer: int, scores: dict[str, torch.Tensor]) -> None:
        for name in METRICS:
            getattr(self, name)[sample, layer] = scores[name]
        self.done[sample, layer] = 1

    def __add__(self, other: Evidence) -> Evidence:
        if other.candidates != self.candidates or other.lengths != self.lengths or other.group != self.group:
            raise ValueError("evidence from different candidate grids, samples or models cannot be merged: "
                             "run every worker with the same model, candidates and calibration samples")
        return Evidence(self.candidates, self.samples, self.lengths,
                        *(getattr(self, n) + getattr(other, n) for n in (*METRICS, "done")), self.group)

    def all_reduce(self) -> Evidence:
        """Sum every rank's evidence in place (torch.distributed must be initialised)."""
        import torch.distributed as dist

        for name in (*METRICS, "done"):
            dist.all_reduce(getattr(self, name))
        return self

    def density(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical, physical) density `[S, L, H, C]`: edges and tiles over their causal totals."""
        e = torch.tensor([causal_edges(n) for n in self.lengths], dtype=torch.float64).view(-1, 1, 1, 1)
        t = torch.tensor([causal_tiles(n) for n in self.lengths], dtype=torch.float64).view(-1, 1, 1, 1)
        return self.edges / e, self.tiles / t


def choose(evidence: Evidence, target: float = TARGET, latency: dict[str, dict[str, float]] | None = None,
           tail_target: float | None = None) -> torch.Tensor:
    """Candidate index `[L, H]` per head: the cheapest candidate whose captured mass reaches `target`
    over all rows and `tail_target` (default `target`) over the answer rows, on the worst sample; ties
    go to the higher worst-sample mass, then to the earlier candidate.

    Kinds that share one index per KV head (`PatternBase.kv_shared`) are chosen per KV group
    (`evidence.group` heads): a group takes the cheapest such candidate that every one of its heads can take,
    where its heads' summed cost is below the sum of their own choices.

    Cost = mean physical density (64x64 tiles / causal tiles) or, with a measured `latency` table
    {pattern: {"per_tile_ms": a, "index_ms": b}}, a * tiles + b averaged over samples."""
    tail_target = target if tail_target is None else tail_target
    for name, value in (("target", target), ("tail_target", tail_target)):
        if not 0 <= value <= 1 or (name == "target" and value == 0):
            raise ValueError(f"{name}={value} must be a captured-mass fraction in (0, 1], e.g. 0.95")
    if not bool(evidence.done.all()):
        missing = (evidence.done == 0).nonzero().tolist()[:3]
        raise ValueError(f"evidence is incomplete: (sample, layer) {missing} were not scored; merge every worker's part")
    worst = evidence.mass.amin(0)  # [L, H, C]
    if latency is None:
        cost = evidence.density()[1].mean(0)
    else:
        rate = torch.tensor([[latency.get(c.pattern, {}).get("per_tile_ms", math.nan),
                              latency.get(c.pattern, {}).get("index_ms", 0.0)] for c in evidence.candidates],
                            dtype=torch.float64)
        if rate[:, 0].isnan().any():
            missing = sorted({c.pattern for c in evidence.candidates if c.pattern not in latency})
            raise ValueError(f"the latency table has no per-tile time for {missing}: give a benchmark that timed their "
                             "kernels (`workbench bench prefill` on a GPU) or leave those candidates out")
        cost = (evidence.tiles * rate[:, 0] + rate[:, 1]).mean(0)
    ok = (worst >= target - 1e-12) & (evidence.tail.amin(0) >= tail_target - 1e-12)
    ok[..., [c.pattern == "dense" for c in evidence.candidates]] = True  # dense is the fallback
    key = torch.where(ok, cost, math.inf)  # infeasible candidates cost infinitely much
    shared = [c for c, cand in enumerate(evidence.candidates) if pattern_class(cand.pattern).kv_shared]
    key[..., shared] = math.inf  # chosen per KV group below
    best = torch.empty(worst.shape[:2], dtype=torch.long)
    for l in range(worst.shape[0]):
        for h in range(worst.shape[1]):  # lexicographic: cost, then higher worst mass, then grid order
            best[l, h] = min(range(len(evidence.candidates)), key=lambda c: (float(key[l, h, c]), -float(worst[l, h, c]), c))
    g = evidence.group
    for l in range(worst.shape[0]) if shared else ():
        for h0 in range(0, worst.shape[1], g):
            heads = slice(h0, h0 + g)
            fits = [c for c in shared if bool(ok[l, heads, c].all())]
            if not fits:
                continue
            c = min(fits, key=lambda c: (float(cost[l, heads, c].sum()), -float(worst[l, heads, c].min()), c))
            own = sum(float(key[l, h, best[l, h]]) for h in range(h0, h0 + g))
            if float(cost[l, heads, c].sum()) < own:
                best[l, heads] = c
    return best


def _round(t: torch.Tensor, digits: int = 5) -> list[float]:
    return [round(float(x), digits) for x in t]


def build_config(evidence: Evidence, choice: torch.Tensor, model: dict[str, Any], *, target: float,
                 tail_target: float | None = None, proxy: dict[str, Any] | None = None,
                 provenance: dict[str, Any] | None = None) -> HeadConfig:
    """Turn evidence and a choice `[L, H]` into a HeadConfig with per-head recall, density and evidence.

    Layers the model fixes (sliding window, from `model`'s layer types) get the model's own entry
    (`HeadEntry.model_fixed`: recall 1 by definition, density of its window at the calibration lengths)."""
    logical, physical = evidence.density()
    shape = ModelShape.from_dict(model)
    heads = []
    n_layers, n_heads = choice.shape
    for l in range(n_layers):
        for h in range(n_heads):
            window = shape.window(l) if n_layers == shape.n_layers else None  # evidence of every model layer
            if window is not None:
                e = HeadEntry.model_fixed(l, h, window)
                band = AShape(0, window)
                mean = lambda f: round(sum(float(f(n)) for n in evidence.lengths) / len(evidence.lengths), 6)  # noqa: E731
                e.recall = {"mean": 1.0, "worst": 1.0, "tail_worst": 1.0}
                e.density = {"logical": mean(lambda n: band.edges(n).sum() / causal_edges(n)),
                             "physical": mean(lambda n: band.tiles(n).sum() / causal_tiles(n))}
                heads.append(e)
                continue
            c = int(choice[l, h])
            cand = evidence.candidates[c]
            mass, tail = evidence.mass[:, l, h], evidence.tail[:, l, h]
            heads.append(HeadEntry(
                layer=l, head=h, pattern=cand.pattern, params=cand.params,
                recall={"mean": round(float(mass[:, c].mean()), 6), "worst": round(float(mass[:, c].min()), 6),
                        "tail_worst": round(float(tail[:, c].min()), 6)},
                density={"logical": round(float(logical[:, l, h, c].mean()), 6),
                         "physical": round(float(physical[:, l, h, c].mean()), 6)},
                oracle=round(float(evidence.oracle[:, l, h, c].mean()), 6),
                evidence={"mass_mean": _round(mass.mean(0)), "mass_worst": _round(mass.amin(0)),
                          "tail_worst": _round(tail.amin(0)),
                          "oracle_mean": _round(evidence.oracle[:, l, h].mean(0)),
                          "physical_density": _round(physical[:, l, h].mean(0))}))
    prov = {
        "tool": f"workbench {__version__}",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": environment(),
        "metric": f"captured attention mass (exact), worst calibration sample, over all rows and over the last "
                  f"{TAIL_ROWS} (answer) rows",
        "cost": "physical 64x64 tiles (mean density over samples)",
        "target": target,
        "tail_target": target if tail_target is None else tail_target,
        "calibration": evidence.samples,
        "candidates": [c.to_dict() for c in evidence.candidates],
        **({"fixed_layers": list(shape.fixed_layers)} if shape.fixed_layers else {}),
        **(provenance or {}),
    }
    return HeadConfig(model=dict(model), heads=heads, provenance=prov, proxy={**PROXY_DEFAULTS, **(proxy or {})})


def collect_evidence(captures: Iterable[Any], samples: Sequence[dict[str, Any]], lengths: Sequence[int],
                     candidates: Sequence[Candidate], n_layers: int, n_heads: int,
                     proxy: dict[str, Any] | None = None, progress: bool = True,
                     shard: tuple[int, int] = (0, 1), group: int = 1) -> Evidence:
    """Score every layer of every capture (an iterable, so each can be made and freed in turn); `group`:
    query heads per KV head (`Evidence.group`).

    `shard=(rank, world)` scores only the (sample, layer) slices with (sample * L + layer) % world ==
    rank; summing the evidence of all ranks (`+`, or `all_reduce`) gives the full evidence. Layers the
    model fixes (`cap.shape.fixed_layers`: sliding window) are never scored, only marked done."""
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard {shard} is not (rank, world) with 0 <= rank < world")
    ev = Evidence.empty(candidates, samples, lengths, n_layers, n_heads, group)
    mine = [(s, l) for s in range(len(samples)) for l in range(n_layers) if (s * n_layers + l) % world == rank]
    bar = tqdm(total=len(mine), desc="search", unit="layer", disable=not progress)
    for s, cap in enumerate(captures):
        bar.unpause()  # leave the capture just made out of the per-layer rate: the first ETA is one layer's, not a capture's
        fixed = set(cap.shape.fixed_layers)
        for layer in sorted(fixed):
            if (s * n_layers + layer) % world == rank:
                ev.done[s, layer] = 1
                bar.update(1)
        for layer in cap.layers:
            if layer in fixed or (s * n_layers + layer) % world != rank:
                continue
            q, k, _ = cap.layer_qkv(layer)
            ev.fill(s, layer, layer_scores(q, k, cap.scale, candidates, proxy, cap.layer_lse(layer)))
            bar.update(1)
        cap.close()  # a streamed capture ends its forward: the model's own attention is back
    bar.close()
    return ev


def search_heads(model: torch.nn.Module, tokenizer: Any, shape: Any, samples: Sequence[Any], *,
                 candidates: Sequence[Candidate] | None = None, target: float = TARGET,
                 proxy: dict[str, Any] | None = None, progress: bool = True,
                 latency: dict[str, dict[str, float]] | None = None,
                 provenance: dict[str, Any] | None = None,
                 tail_target: float | None = None, chunk: int | None = None) -> tuple[HeadConfig, Evidence]:
    """Capture each calibration sample (`workbench.core.corpus.Sample`), score all heads, choose (cost:
    physical tiles, or `latency` rates as in `choose`; `tail_target` as there), and return
    (HeadConfig, Evidence). Default candidates scale with the longest sample. Samples are captured layer
    by layer (`stream_capture`, `chunk` query rows per call): one layer's q/k/v in memory at a time. Only the
    layers the model does not fix are captured and searched (`shape.free_layers`)."""
    from workbench.core.stream import stream_capture

    if not samples:
        raise ValueError("no calibration samples: give at least one (e.g. --tasks passkey,code,vartrack)")
    lengths = [int(s.input_ids.numel()) for s in samples]
    candidates = list(candidates or default_candidates(max(lengths)))
    captures = (stream_capture(model, shape, s.input_ids, layers=shape.free_layers, chunk=chunk, progress=False)
                for s in samples)
    ev = collect_evidence(captures, [s.describe() for s in samples], lengths, candidates,
                          shape.n_layers, shape.n_heads, proxy, progress, group=shape.n_heads // shape.n_kv_heads)
    cfg = build_config(ev, choose(ev, target, latency, tail_target), shape.to_dict(), target=target,
                       tail_target=tail_target, proxy=proxy, provenance=provenance)
    return cfg, ev


# ---- applying a config: recall of the chosen indexes, and the dashboard's fast re-score -------------

@torch.no_grad()
def evaluate_config(config: HeadConfig, capture: Any, progress: bool = False) -> dict[str, Any]:
    """Recall of the config's indexes on one capture (e.g. a task held out of calibration).

    Returns {"mass": `[L, H]`, "segments": {name: `[L, H]`}, "oracle": `[L, H]`} where mass is the
    exact captured fraction of what the config runs online and oracle the same-budget oracle's mass
    (rows of model layers the capture does not hold stay 0)."""
    n_layers, n_heads = config.model["n_layers"], config.model["n_heads"]
    mass = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    oracle = torch.zeros_like(mass)
    segments: dict[str, torch.Tensor] = {}
    fixed: list[int] = []
    for layer in tqdm(capture.layers, desc="evaluate", unit="layer", disable=not progress, leave=False):
        if config.window(layer) is not None:  # the model's own attention: all of its mass, by definition
            mass[layer] = oracle[layer] = 1.0
            fixed.append(layer)
            continue
        q, k, _ = capture.layer_qkv(layer)
        entries = config.layer(layer)
        rows = captured_mass(q, k, capture.scale, config.layer_index(layer, q, k, capture.scale))
        for name, value in segment_mass(rows).items():
            segments.setdefault(name, torch.zeros_like(mass))[layer] = value.double()
        mass[layer] = rows.mean(-1).double()
        cands = sorted({Candidate(e.pattern, tuple(e.params[p] for p in PARAMS[e.pattern])) for e in entries},
                       key=lambda c: c.label())
        scores = layer_scores(q, k, capture.scale, cands, config.proxy, capture.layer_lse(layer))
        for h, e in enumerate(entries):
            c = cands.index(Candidate(e.pattern, tuple(e.params[p] for p in PARAMS[e.pattern])))
            oracle[layer, h] = scores["oracle"][h, c]
    for value in segments.values():
        value[fixed] = 1.0
    return {"mass": mass, "segments": segments, "oracle": oracle}


@dataclass
class HeadCache:
    """What re-scoring one head needs, per sample: its q `[N, D]`, its KV head's k `[N, D]`, and its
    exact sums (`metrics.LayerSums` of that head alone: column, diagonal, tile masses and lse); the
    answer rows' sums are computed on the first re-score and kept. `group_q`: per sample, q `[G, N, D]` of
    the head's KV group (the head is row `member`; None: the head alone), which kinds that share an index per
    KV head read; their sums over the group are computed on their first re-score and kept."""

    scale: float
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    sums: list[Any]
    group_q: list[torch.Tensor] | None = None
    member: int = 0
    _reductions: list[LayerReductions] = field(init=False, repr=False)
    _group: list[LayerReductions] | None = field(init=False, repr=False, default=None)

    def __post_init__(self):
        self._reductions = [LayerReductions(q[None], k[None], self.scale, all_rows=st)
                            for q, k, st in zip(self.q, self.k, self.sums)]

    @classmethod
    def from_captures(cls, captures: Sequence[Any], layer: int, head: int) -> HeadCache:
        qs, ks, sums, groups = [], [], [], []
        for cap in captures:
            q, k, _ = cap.head_qkv(layer, head)
            qs.append(q)
            ks.append(k)
            sums.append(layer_sums(q[None], k[None], cap.scale))
            group = cap.shape.n_heads // cap.shape.n_kv_heads
            groups.append(cap.layer_qkv(layer)[0][head - head % group:head - head % group + group])
        return cls(scale=captures[0].scale, q=qs, k=ks, sums=sums, group_q=groups, member=head % groups[0].shape[0])

    def reductions(self, proxy: dict[str, Any], group: bool = False) -> list[LayerReductions]:
        """Each sample's `LayerReductions` of this head under `proxy` (its cached sums shared); `group`: of its
        whole KV group (`group_q`), whose row `member` is this head."""
        if group and self._group is None:
            group_q = self.group_q or [q[None] for q in self.q]
            self._group = [LayerReductions(q, k[None], self.scale) for q, k in zip(group_q, self.k)]
        return [LayerReductions(r.q, r.k, r.scale, proxy, r.sums, r.tail)
                for r in (self._group if group else self._reductions)]


@torch.no_grad()
def rescore_head(cache: HeadCache, candidate: Candidate, proxy: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score one (edited) head on every cached sample: captured mass, answer-row mass, oracle mass, tiles
    and density, from the cached exact sums (the kind's `evidence` on this head alone).

    Returns {"mass": [S], "tail": [S], "oracle": [S], "tiles": [S], "physical_density": [S], "worst": float,
    "mean": float}."""
    proxy = {**PROXY_DEFAULTS, **(proxy or {})}
    cls = pattern_class(candidate.pattern)
    row = cache.member if cls.kv_shared else 0  # a group-shared kind is scored on the head's whole KV group
    out: dict[str, list[float]] = {"mass": [], "tail": [], "oracle": [], "tiles": [], "physical_density": []}
    for sums in cache.reductions(proxy, group=cls.kv_shared):
        scores = cls.evidence([candidate.params], sums)
        for name in ("mass", "tail", "oracle"):
            out[name].append(min(float(scores[name][row, 0]), 1.0))
        tiles = int(scores["tiles"][row, 0])
        out["tiles"].append(tiles)
        out["physical_density"].append(tiles / causal_tiles(sums.n))
    return {**out, "worst": min(out["mass"]), "mean": sum(out["mass"]) / len(out["mass"])}


def edit_head(config: HeadConfig, layer: int, head: int, candidate: Candidate,
              cache_of: Callable[[int], HeadCache]) -> dict[int, dict[str, Any]]:
    """Give (layer, head) `candidate` (its whole KV group where the new or the old kind shares one index per KV
    head: `HeadConfig.edit`) and re-score the head and every other head the edit moved on their cached samples
    (`rescore_head`; `cache_of(h)` is head h's `HeadCache`): each entry's recall (mean and worst over the
    samples), physical density and oracle (means) are set from its scores. Returns {head: scores} of the
    re-scored heads. A refused edit, or one whose re-score fails, leaves the config as it was."""
    entries = config.layer(layer)
    before = [e.to_dict() for e in entries]
    config.edit(layer, head, candidate.pattern, candidate.params, keep_score=False)
    try:
        moved = [e for e, b in zip(entries, before)
                 if e.head == head or (e.pattern, e.params) != (b["pattern"], b["params"])]
        scores = {e.head: rescore_head(cache_of(e.head), Candidate.from_dict(e.to_dict()), config.proxy)
                  for e in moved}
    except Exception:
        for e, b in zip(entries, before):
            e.restore(b)
        raise
    mean = lambda xs: round(sum(xs) / len(xs), 6)  # noqa: E731
    for e in moved:
        s = scores[e.head]
        e.recall = {"mean": round(s["mean"], 6), "worst": round(s["worst"], 6)}
        e.density, e.oracle = {"physical": mean(s["physical_density"])}, mean(s["oracle"])
    return scores


@torch.no_grad()
def pattern_fits(capture: Any, config: HeadConfig | None = None, target: float = TARGET,
                 budget: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Pattern fit and proxy-vs-oracle recall of every head of a capture (the `workbench analyze` section).

    Per head: the cheapest default candidate reaching `target` on this prompt ("fit"), and at one
    equal budget b (default n/16 keys per query) the captured mass of A-shape(64, b), of the VS and
    block-sparse proxies, and of their same-budget oracles. With `config`, also the exact recall of
    the config's own indexes (overall and per segment). Returns {"heads": [...], "layers": [...],
    "summary": {...}}, all plain JSON."""
    n = capture.n
    b = budget or default_budget(n)
    fixed = [Candidate.at_budget(kind, b, n) for kind in ("ashape", "vs", "block")]  # the report's equal-budget columns
    grid = default_candidates(n)
    cands = grid + [c for c in fixed if c not in grid]
    at = {c.pattern: cands.index(c) for c in fixed}
    applied = evaluate_config(config, capture) if config is not None else None
    heads, layers = [], []
    for layer in tqdm(capture.layers, desc="pattern fits", unit="layer", disable=not progress, leave=False):
        q, k, _ = capture.layer_qkv(layer)
        sc = layer_scores(q, k, capture.scale, cands, config.proxy if config else None, capture.layer_lse(layer))
        ev = Evidence.empty(cands, [{}], [n], 1, q.shape[0], q.shape[0] // k.shape[0])
        ev.fill(0, 0, sc)
        fit = choose(ev, target)[0]
        density = ev.density()[1][0, 0]
        rows = []
        for h in range(q.shape[0]):
            row = {"layer": layer, "head": h, "fit": cands[int(fit[h])].label(),
                   "fit_density": round(float(density[h, fit[h]]), 4),
                   "ashape": round(float(sc["mass"][h, at["ashape"]]), 4),
                   "vs_proxy": round(float(sc["mass"][h, at["vs"]]), 4),
                   "vs_oracle": round(float(sc["oracle"][h, at["vs"]]), 4),
                   "block_proxy": round(float(sc["mass"][h, at["block"]]), 4),
                   "block_oracle": round(float(sc["oracle"][h, at["block"]]), 4)}
            if applied is not None:
                e = config.entry(layer, h)
                row.update(config=e.label(), config_mass=round(float(applied["mass"][layer, h]), 4),
                           **{f"config_{s}": round(float(v[layer, h]), 4) for s, v in applied["segments"].items()
                              if s != "all"})
            rows.append(row)
        heads += rows
        numeric = [key for key, value in rows[0].items() if isinstance(value, float)]
        layers.append({"layer": layer, **{key: round(sum(r[key] for r in rows) / len(rows), 4) for key in numeric}})
    mean = lambda key: round(sum(r[key] for r in heads) / len(heads), 4)  # noqa: E731
    fits: dict[str, int] = {}
    for r in heads:
        family = r["fit"].split("(")[0]
        fits[family] = fits.get(family, 0) + 1
    summary = {"budget": b, "target": target, "fits": fits, "mean_fit_density": mean("fit_density"),
               "vs_proxy": mean("vs_proxy"), "vs_oracle": mean("vs_oracle"),
               "vs_gap": round(mean("vs_oracle") - mean("vs_proxy"), 4),
               "block_proxy": mean("block_proxy"), "block_oracle": mean("block_oracle"),
               "block_gap": round(mean("block_oracle") - mean("block_proxy"), 4), "ashape": mean("ashape")}
    if applied is not None:
        mass = applied["mass"][list(capture.layers)]  # rows of layers the capture holds
        summary.update(config_mass_mean=round(float(mass.mean()), 4), config_mass_worst=round(float(mass.min()), 4))
    return {"heads": heads, "layers": layers, "summary": summary}


@torch.no_grad()
def compare_proxies(capture: Any, vertical: int, slash: int, variants: Sequence[dict[str, Any]] | None = None,
                    progress: bool = False) -> list[dict[str, Any]]:
    """Captured mass of the VS proxy under several settings (aggregation x diagonal normalisation by
    default) at one budget, against the same-budget oracle, averaged over all heads of the capture.

    Returns one row per variant: its settings, mean and worst head mass, and the mean gap to the oracle."""
    variants = list(variants or [{"aggregate": a, "diag_norm": d} for a in ("sum", "max", "logits")
                                 for d in ("sum", "mean", "prior")])
    masses: list[list[torch.Tensor]] = [[] for _ in variants]
    oracles: list[torch.Tensor] = []
    for layer in tqdm(capture.layers, desc="proxies", unit="layer", disable=not progress, leave=False):
        q, k, _ = capture.layer_qkv(layer)
        sums = LayerReductions(q, k, capture.scale, lse=capture.layer_lse(layer))
        st = sums.sums
        indexes = [vs_proxy(q, k, capture.scale, vertical, slash, **{**PROXY_DEFAULTS, **v}) for v in variants]
        best_cols = top_positions(st.column_mass, 0, vertical)
        overlaps = sums.offset_mass([cols for cols, _ in indexes] + [best_cols])
        oracle = vs_mass(st, overlaps[-1], best_cols, best_offsets(st.diag_mass, overlaps[-1], slash))
        for i, ((cols, offs), ov) in enumerate(zip(indexes, overlaps)):
            mass = vs_mass(st, ov, cols, offs)
            masses[i].append(mass)
            oracle = torch.maximum(oracle, vs_mass(st, ov, cols, best_offsets(st.diag_mass, ov, slash)))
        oracles.append(oracle)
    oracle = torch.cat(oracles).double()
    rows = []
    for v, m in zip(variants, masses):
        m = torch.cat(m).double()
        rows.append({**v, "vertical": vertical, "slash": slash, "mass_mean": round(float(m.mean()), 5),
                     "mass_worst_head": round(float(m.min()), 5),
                     "oracle_gap_mean": round(float((oracle - m).mean()), 5)})
    return rows
