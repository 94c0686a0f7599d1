"""Per-head pattern search: score every candidate on every calibration sample, keep the cheapest that
captures enough attention on the worst sample.

For each (sample, layer) one exact pass over the rows (`metrics.layer_sums`) gives column, diagonal
and tile masses and each row's log-normaliser; then the probabilities at the chosen columns alone give
the mass those columns hold on each diagonal (the pairs a VS index would count twice). From those
sums the captured mass of every candidate is exact:

- A-shape(sink, window): columns 0..sink-1 plus offsets 0..window-1.
- VS(vertical, slash): the index the online proxy (`vs_proxy`) picks for this prompt, i.e. what the
  kernel will really run; its oracle is the best known same-budget index chosen from full attention.
- block(topk): the `block_proxy` table; its oracle is the exact best table of the same budget.
- dense: mass 1, every causal tile.

Besides the mass over all rows, every candidate is scored on the answer rows: the last `TAIL_ROWS`
query rows, where a retrieval prompt asks its question. A head can hold 95% of its mass in a local
window and still lose the one far-away needle those rows read; `choose` requires both.

The evidence is a few plain tensors `[S, L, H, C]` (samples, layers, heads, candidates) that can be
summed across workers (each fills its own (sample, layer) slices), and the choice is deterministic.
"""
from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench import __version__
from workbench.analysis.metrics import (
    best_offsets,
    block_mass_of,
    block_oracle,
    column_offset_mass,
    layer_sums,
    segment_mass,
    vs_mass,
)
from workbench.analysis.stats import attention_rows, captured_mass
from workbench.config import PARAMS, PROXY_DEFAULTS, HeadConfig, HeadEntry
from workbench.core.model import ModelShape
from workbench.core.timing import environment
from workbench.patterns import (
    BLOCK,
    AShape,
    BlockSparse,
    Stack,
    VerticalSlash,
    block_proxy,
    causal_edges,
    causal_tiles,
    pattern_class,
    vs_proxy,
    vs_tile_count,
)
from workbench.patterns.proxy import top_positions

TARGET = 0.95
TAIL_ROWS = 64
METRICS = ("mass", "tail", "oracle", "tiles", "edges")


@dataclass(frozen=True)
class Candidate:
    """One pattern with its sizes: ("vs", (vertical, slash)), ("ashape", (sink, window)),
    ("block", (topk,)) or ("dense", ())."""

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


def default_candidates(n: int) -> list[Candidate]:
    """A grid that scales with the prompt length n: budgets of n/64 .. n/4 keys per query.

    A-shape: 64 sink tokens + window b. VS: b/2 columns (>= 30) + b slashes (>= 50), as MInference
    clamps them, up to b = n/8 (larger VS budgets already cost about as many tiles as dense).
    Block-sparse: b / 64 blocks (>= 2). Dense last (always reaches the target)."""
    out: list[Candidate] = []
    budgets = sorted({max(64, round(n / f)) for f in (64, 32, 16, 8, 4)})
    out += [Candidate("ashape", (64, b)) for b in budgets]
    out += [Candidate("vs", (max(30, b // 2), max(50, b))) for b in budgets[:-1]]
    out += sorted({Candidate("block", (max(2, round(b / BLOCK)),)) for b in budgets}, key=lambda c: c.sizes)
    out.append(Candidate("dense"))
    return out


def method_candidates(n: int) -> list[Candidate]:
    """Issue 19's methods as extra candidates (pass `default_candidates(n) + method_candidates(n)`):
    Tri-shape (64 sink, window n/16 .. n/4, 64 answer rows), XAttention (tau 0.9 / 0.95, stride 8),
    FlexPrefill (gamma 0.9 / 0.95, tau 0.1, min budget 256). Scored by a generic exact pass each (slower
    than the closed forms above); the adaptive ones are recorded with their thresholds, not budgets."""
    windows = sorted({max(64, round(n / f)) for f in (16, 8, 4)})
    return ([Candidate("trishape", (64, w, 64)) for w in windows]
            + [Candidate("xattention", (tau, 8)) for tau in (900, 950)]
            + [Candidate("flexprefill", (gamma, 100, 256)) for gamma in (900, 950)])


def _ashape_overlap(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor, sink: int,
                    n_rows: int) -> torch.Tensor:
    """`[Hq, N]`: mass the first `sink` columns hold at each offset, from rows < n_rows only (the
    sink-window overlap of A-shape(sink, w) lies in rows < sink + w)."""
    cols = torch.arange(min(sink, q.shape[1])).expand(q.shape[0], -1)
    return column_offset_mass(q, k, scale, lse, [cols], rows=n_rows)[0]


def _vs_scores(colm, diagm, overlaps, cols, offs, vertical_best, slash):
    """(proxy mass, oracle mass) `[H]` from the overlaps of the proxy's columns and the best columns."""
    mass = vs_mass(colm, diagm, overlaps[0], cols, offs)
    oracle = mass
    for c, ov in zip((cols, vertical_best), overlaps):
        oracle = torch.maximum(oracle, vs_mass(colm, diagm, ov, c, best_offsets(diagm, ov, slash)))
    return mass, oracle


@torch.no_grad()
def layer_scores(q: torch.Tensor, k: torch.Tensor, scale: float, candidates: Sequence[Candidate],
                 proxy: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Score every candidate on all heads of one layer of one prompt.

    q `[Hq, N, D]`, k `[Hkv, N, D]`. Returns {"mass", "tail", "oracle", "tiles", "edges"}: `[Hq, C]` float64;
    mass = exact captured fraction of the index the candidate would run, tail = the same over the
    last `TAIL_ROWS` query rows only (the answer rows), oracle = the same-budget
    oracle's mass (`metrics.vs_oracle`, `metrics.block_oracle`; = mass where the pattern has no online
    choice), tiles = physical 64x64 tiles, edges = logical edges. Computed on q's device, returned on the CPU.
    """
    with torch.device(q.device):  # factories below follow the capture onto its device
        proxy = {**PROXY_DEFAULTS, **(proxy or {})}
        hq, n, _ = q.shape
        st = layer_sums(q, k, scale)
        colm, diagm = st.column_mass, st.diag_mass
        out = {name: torch.zeros(hq, len(candidates), dtype=torch.float64) for name in METRICS}
        vs_cands = [(c, cand.sizes) for c, cand in enumerate(candidates) if cand.pattern == "vs"]
        indexes: dict[int, Any] = {}  # candidate -> the pattern it runs on this prompt (dense: none)
        for c, cand in enumerate(candidates):
            if cand.pattern == "ashape":
                p = indexes[c] = AShape(*cand.sizes, n_heads=hq)
                out["tiles"][:, c], out["edges"][:, c] = p.tiles(n), p.edges(n)
            elif cand.pattern == "block":
                table = block_proxy(q, k, cand.sizes[0])
                p = indexes[c] = BlockSparse(table)
                out["tiles"][:, c], out["edges"][:, c] = p.tiles(n), p.edges(n)
                out["mass"][:, c] = block_mass_of(st.block_mass, table, n)
                out["oracle"][:, c] = block_mass_of(st.block_mass, block_oracle(st.block_mass, cand.sizes[0]), n)
            elif cand.pattern == "dense":
                out["tiles"][:, c], out["edges"][:, c] = causal_tiles(n), causal_edges(n)
                out["mass"][:, c] = out["oracle"][:, c] = 1.0
            elif cand.pattern not in ("vs", "ashape"):  # any other registered pattern: built online, one exact pass
                built = pattern_class(cand.pattern).build([cand.params] * hq, q, k, scale, proxy, BLOCK)
                p = indexes[c] = Stack([built[h] for h in range(hq)])
                out["tiles"][:, c], out["edges"][:, c] = p.tiles(n), p.edges(n)
                out["mass"][:, c] = out["oracle"][:, c] = captured_mass(q, k, scale, p).mean(-1).double()
        if vs_cands:
            # budgets are nested: one ranked proxy (and one ranked column list for the oracle) at the largest
            # budget serves every VS candidate as a prefix, and one pass gives all their overlaps
            levels = sorted({v for _, (v, _) in vs_cands})
            cols_all, offs_all = vs_proxy(q, k, scale, levels[-1], max(s for _, (_, s) in vs_cands), ranked=True, **proxy)
            best_all = top_positions(colm, 0, levels[-1], None, ranked=True)
            proxy_ov, best_ov = column_offset_mass(q, k, scale, st.lse, [cols_all, best_all], prefixes=[levels, levels])
            pad = lambda t, size: torch.nn.functional.pad(t, (0, t.shape[-1] and size - t.shape[-1]), value=-1)  # noqa: E731
            tiles = vs_tile_count(torch.stack([pad(cols_all[:, :v], levels[-1]) for _, (v, _) in vs_cands]),
                                  torch.stack([pad(offs_all[:, :s], offs_all.shape[-1]) for _, (_, s) in vs_cands]), n)
            for (c, (v, s)), t in zip(vs_cands, tiles):
                li = levels.index(v)
                cols, offs, best = cols_all[:, :v], offs_all[:, :s], best_all[:, :v]
                indexes[c] = VerticalSlash(cols, offs)
                out["tiles"][:, c] = t
                out["edges"][:, c] = indexes[c].edges(n)
                out["mass"][:, c], out["oracle"][:, c] = _vs_scores(colm, diagm, (proxy_ov[li], best_ov[li]),
                                                                    cols, offs, best, s)
        ashape_later = [(c, *cand.sizes) for c, cand in enumerate(candidates) if cand.pattern == "ashape"]
        if ashape_later:
            sinks = {g for _, g, _ in ashape_later}
            rows = max(g + w for _, g, w in ashape_later)
            by_sink = {g: _ashape_overlap(q, k, scale, st.lse, g, rows) for g in sinks}
            for c, g, w in ashape_later:
                mass = (colm[:, :g].sum(-1) + diagm[:, :w].sum(-1) - by_sink[g][:, :w].sum(-1)) / n
                out["mass"][:, c] = out["oracle"][:, c] = mass
        r0 = max(0, n - TAIL_ROWS)
        p_tail = next(attention_rows(q, k, scale, chunk=n - r0, rows=(r0, n)))[2]  # [Hq, T, n] exact
        for c in range(len(candidates)):
            kept = p_tail * indexes[c].row_mask(r0, n, n) if c in indexes else p_tail
            out["tail"][:, c] = kept.sum(-1).mean(-1)
    return {name: (t.clamp(max=1.0) if name in ("mass", "tail", "oracle") else t).cpu() for name, t in out.items()}


@dataclass
class Evidence:
    """Per-head evidence: tensors `[S, L, H, C]` float64 (samples, layers, heads, candidates).

    Plain and additive: workers that scored disjoint (sample, layer) slices can be merged with `+`
    (or a torch.distributed all_reduce of each tensor). `lengths[s]` is sample s's token count."""

    candidates: list[Candidate]
    samples: list[dict[str, Any]]
    lengths: list[int]
    mass: torch.Tensor
    tail: torch.Tensor
    oracle: torch.Tensor
    tiles: torch.Tensor
    edges: torch.Tensor
    done: torch.Tensor = field(default=None)  # [S, L] 1 where scored

    @classmethod
    def empty(cls, candidates: Sequence[Candidate], samples: Sequence[dict[str, Any]], lengths: Sequence[int],
              n_layers: int, n_heads: int) -> Evidence:
        shape = (len(samples), n_layers, n_heads, len(candidates))
        z = lambda: torch.zeros(shape, dtype=torch.float64)  # noqa: E731
        return cls(list(candidates), list(samples), list(lengths), *(z() for _ in METRICS),
                   torch.zeros(len(samples), n_layers, dtype=torch.float64))

    def fill(self, sample: int, layer: int, scores: dict[str, torch.Tensor]) -> None:
        for name in METRICS:
            getattr(self, name)[sample, layer] = scores[name]
        self.done[sample, layer] = 1

    def __add__(self, other: Evidence) -> Evidence:
        if other.candidates != self.candidates or other.lengths != self.lengths:
            raise ValueError("evidence from different candidate grids or samples cannot be merged: "
                             "run every worker with the same candidates and calibration samples")
        return Evidence(self.candidates, self.samples, self.lengths,
                        *(getattr(self, n) + getattr(other, n) for n in (*METRICS, "done")))

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
            raise ValueError(f"latency table lacks per_tile_ms for some of {sorted({c.pattern for c in evidence.candidates})}")
        cost = (evidence.tiles * rate[:, 0] + rate[:, 1]).mean(0)
    ok = (worst >= target - 1e-12) & (evidence.tail.amin(0) >= tail_target - 1e-12)
    ok[..., [c.pattern == "dense" for c in evidence.candidates]] = True  # dense is the fallback
    key = torch.where(ok, cost, math.inf)  # infeasible candidates cost infinitely much
    best = torch.empty(worst.shape[:2], dtype=torch.long)
    for l in range(worst.shape[0]):
        for h in range(worst.shape[1]):  # lexicographic: cost, then higher worst mass, then grid order
            best[l, h] = min(range(len(evidence.candidates)), key=lambda c: (float(key[l, h, c]), -float(worst[l, h, c]), c))
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
                     shard: tuple[int, int] = (0, 1)) -> Evidence:
    """Score every layer of every capture (an iterable, so each can be made and freed in turn).

    `shard=(rank, world)` scores only the (sample, layer) slices with (sample * L + layer) % world ==
    rank; summing the evidence of all ranks (`+`, or `all_reduce`) gives the full evidence. Layers the
    model fixes (`cap.shape.fixed_layers`: sliding window) are never scored, only marked done."""
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard {shard} is not (rank, world) with 0 <= rank < world")
    ev = Evidence.empty(candidates, samples, lengths, n_layers, n_heads)
    mine = [(s, l) for s in range(len(samples)) for l in range(n_layers) if (s * n_layers + l) % world == rank]
    bar = tqdm(total=len(mine), desc="search", unit="layer", disable=not progress)
    for s, cap in enumerate(captures):
        fixed = set(cap.shape.fixed_layers)
        for layer in sorted(fixed):
            if (s * n_layers + layer) % world == rank:
                ev.done[s, layer] = 1
                bar.update(1)
        for layer in cap.layers:
            if layer in fixed or (s * n_layers + layer) % world != rank:
                continue
            q, k, _ = cap.layer_qkv(layer)
            ev.fill(s, layer, layer_scores(q, k, cap.scale, candidates, proxy))
            bar.update(1)
    bar.close()
    return ev


def search_heads(model: torch.nn.Module, tokenizer: Any, shape: Any, samples: Sequence[Any], *,
                 candidates: Sequence[Candidate] | None = None, target: float = TARGET,
                 proxy: dict[str, Any] | None = None, progress: bool = True,
                 latency: dict[str, dict[str, float]] | None = None,
                 provenance: dict[str, Any] | None = None,
                 tail_target: float | None = None) -> tuple[HeadConfig, Evidence]:
    """Capture each calibration sample (`workbench.core.corpus.Sample`), score all heads, choose (cost:
    physical tiles, or `latency` rates as in `choose`; `tail_target` as there), and return
    (HeadConfig, Evidence). Default candidates scale with the longest sample. Only the layers the model
    does not fix are captured and searched (`shape.free_layers`)."""
    from workbench.core.capture import capture_attention

    if not samples:
        raise ValueError("no calibration samples: give at least one (e.g. --tasks passkey,code,vartrack)")
    lengths = [int(s.input_ids.numel()) for s in samples]
    candidates = list(candidates or default_candidates(max(lengths)))
    captures = (capture_attention(model, shape, s.input_ids, shape.free_layers, progress=False) for s in samples)
    ev = collect_evidence(captures, [s.describe() for s in samples], lengths, candidates,
                          shape.n_layers, shape.n_heads, proxy, progress)
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
        scores = layer_scores(q, k, capture.scale, cands, config.proxy)
        for h, e in enumerate(entries):
            c = cands.index(Candidate(e.pattern, tuple(e.params[p] for p in PARAMS[e.pattern])))
            oracle[layer, h] = scores["oracle"][h, c]
    for value in segments.values():
        value[fixed] = 1.0
    return {"mass": mass, "segments": segments, "oracle": oracle}


@dataclass
class HeadCache:
    """What re-scoring one head needs, per sample: its q `[N, D]`, its KV head's k `[N, D]`, and its
    exact sums (`metrics.LayerSums` of that head alone: column, diagonal, tile masses and lse)."""

    scale: float
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    sums: list[Any]

    @classmethod
    def from_captures(cls, captures: Sequence[Any], layer: int, head: int) -> HeadCache:
        qs, ks, sums = [], [], []
        for cap in captures:
            q, k, _ = cap.head_qkv(layer, head)
            qs.append(q)
            ks.append(k)
            sums.append(layer_sums(q[None], k[None], cap.scale))
        return cls(scale=captures[0].scale, q=qs, k=ks, sums=sums)


@torch.no_grad()
def rescore_head(cache: HeadCache, candidate: Candidate, proxy: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score one (edited) head on every cached sample: captured mass, oracle mass, tiles and density.

    Reuses the cached exact statistics; VS and A-shape need one extra row pass over this head only.
    Returns {"mass": [S], "oracle": [S], "tiles": [S], "physical_density": [S], "worst": float, "mean": float}."""
    proxy = {**PROXY_DEFAULTS, **(proxy or {})}
    out: dict[str, list[float]] = {"mass": [], "oracle": [], "tiles": [], "physical_density": []}
    for q, k, st in zip(cache.q, cache.k, cache.sums):
        n = q.shape[0]
        q1, k1, colm, diagm, bm = q[None], k[None], st.column_mass, st.diag_mass, st.block_mass
        if candidate.pattern == "dense":
            mass = oracle = 1.0
            tiles = causal_tiles(n)
        elif candidate.pattern == "block":
            table = block_proxy(q1, k1, candidate.sizes[0])
            mass = float(block_mass_of(bm, table, n))
            oracle = float(block_mass_of(bm, block_oracle(bm, candidate.sizes[0]), n))
            tiles = int(BlockSparse(table).tiles(n))
        elif candidate.pattern == "ashape":
            g, w = candidate.sizes
            tiles = int(AShape(g, w).tiles(n))
            overlap = _ashape_overlap(q1, k1, cache.scale, st.lse, g, g + w)
            mass = float((colm[0, :g].sum() + diagm[0, :w].sum() - overlap[0, :w].sum()) / n)
            oracle = mass
        elif candidate.pattern != "vs":  # any other registered pattern: its own builder, one exact pass
            index = pattern_class(candidate.pattern).build([candidate.params], q1, k1, cache.scale, proxy, BLOCK)[0]
            mass = oracle = float(captured_mass(q1, k1, cache.scale, index).mean())
            tiles = int(index.tiles(n))
        else:
            v, s = candidate.sizes
            cols, offs = vs_proxy(q1, k1, cache.scale, v, s, **proxy)
            tiles = int(vs_tile_count(cols[None], offs[None], n))
            best_cols = top_positions(colm, 0, v)
            # one pass for both column sets: prefix v is the proxy's, prefix 2v adds the best columns
            both = column_offset_mass(q1, k1, cache.scale, st.lse, [torch.cat([cols, best_cols], -1)],
                                      prefixes=[[v, 2 * v]])[0]
            m, o = _vs_scores(colm, diagm, (both[0], both[1] - both[0]), cols, offs, best_cols, s)
            mass, oracle = float(m), float(o)
        out["mass"].append(min(mass, 1.0))
        out["oracle"].append(min(oracle, 1.0))
        out["tiles"].append(tiles)
        out["physical_density"].append(tiles / causal_tiles(n))
    return {**out, "worst": min(out["mass"]), "mean": sum(out["mass"]) / len(out["mass"])}


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
    b = budget or max(64, n // 16)
    fixed = [Candidate("ashape", (64, b)), Candidate("vs", (max(30, b // 2), max(50, b))),
             Candidate("block", (max(2, b // BLOCK),))]
    grid = default_candidates(n)
    cands = grid + [c for c in fixed if c not in grid]
    at = {c.pattern: cands.index(c) for c in fixed}
    applied = evaluate_config(config, capture) if config is not None else None
    heads, layers = [], []
    for layer in tqdm(capture.layers, desc="pattern fits", unit="layer", disable=not progress, leave=False):
        q, k, _ = capture.layer_qkv(layer)
        sc = layer_scores(q, k, capture.scale, cands, config.proxy if config else None)
        ev = Evidence.empty(cands, [{}], [n], 1, q.shape[0])
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
        st = layer_sums(q, k, capture.scale)
        indexes = [vs_proxy(q, k, capture.scale, vertical, slash, **{**PROXY_DEFAULTS, **v}) for v in variants]
        best_cols = top_positions(st.column_mass, 0, vertical)
        overlaps = column_offset_mass(q, k, capture.scale, st.lse, [cols for cols, _ in indexes] + [best_cols])
        oracle = vs_mass(st.column_mass, st.diag_mass, overlaps[-1], best_cols,
                         best_offsets(st.diag_mass, overlaps[-1], slash))
        for i, ((cols, offs), ov) in enumerate(zip(indexes, overlaps)):
            mass = vs_mass(st.column_mass, st.diag_mass, ov, cols, offs)
            masses[i].append(mass)
            oracle = torch.maximum(oracle, vs_mass(st.column_mass, st.diag_mass, ov, cols,
                                                   best_offsets(st.diag_mass, ov, slash)))
        oracles.append(oracle)
    oracle = torch.cat(oracles).double()
    rows = []
    for v, m in zip(variants, masses):
        m = torch.cat(m).double()
        rows.append({**v, "vertical": vertical, "slash": slash, "mass_mean": round(float(m.mean()), 5),
                     "mass_worst_head": round(float(m.min()), 5),
                     "oracle_gap_mean": round(float((oracle - m).mean()), 5)})
    return rows
