"""What the dashboard's computing tabs own: their state and their background `Job` (no Panel here).

`HeadState` (Head tab: one head's exact attention, re-scored live under edits), `ForecastState`,
`LatencyState`, `DecodeState` and `LengthsState`. Each reads the session's sample, config and selection and
registers its job with the session (a new sample waits for it). The latency estimate (`Estimate`) reads a GPU kernel
benchmark and is labelled with the GPU it was measured on: it is never this machine's time.
"""
from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import param

from workbench.config import PARAMS, HeadEntry
from workbench.patterns import default_params
from workbench.views.dashboard.state import MIN_LENGTH, SHARED, Job, Session, config_digest, latency_rates

FORECAST_REPORTS = ("reports/forecast/forecast.json", "assets/benchmarks/forecast_cpu.json")


# ----------------------------------------------------------------------------- the latency estimate

@dataclass(frozen=True)
class Estimate:
    """Time of attention on the benchmark's GPU, from its per-tile rates and index times at each measured
    length (`tile_rates` of the rows at that length): a prompt of n tokens reads the nearest measured
    length, so the index time follows length as it was measured and a shorter prompt says it was not timed."""

    gpu: str
    source: str  # the benchmark file and the shape read
    by_length: dict[int, dict[str, dict[str, float]]]  # n -> {pattern: {"per_tile_ms", "index_ms"}}

    @classmethod
    def load(cls, path: str | Path, shape: Any) -> tuple[Estimate | None, str]:
        """(Estimate, "") or (None, "no estimate: <why>")."""
        from workbench.prefill.latency import load_bench, tile_rates

        rates, source = latency_rates(path, shape)
        if rates is None:
            return None, source
        bench = load_bench(path)
        by_length = {}
        for n in sorted({r["n"] for r in bench.get("rows", []) if "n" in r}):
            try:
                by_length[n] = tile_rates({**bench, "rows": [r for r in bench["rows"] if r.get("n") == n]}, shape)
            except ValueError:  # this length has no rows of the picked shape
                continue
        return cls(bench.get("environment", {}).get("gpu", "GPU"), source, by_length), ""

    def nearest(self, n: int) -> int:
        return min(self.by_length, key=lambda m: (abs(math.log(m / n)), m))

    def head(self, pattern: str, tiles: float, n: int) -> dict[str, Any]:
        """One query head at n tokens: {"kernel_ms", "index_ms", "dense_ms", "measured_n", "index_range"}.
        Raises ValueError for a pattern the benchmark did not time."""
        from workbench.patterns import causal_tiles

        m = self.nearest(n)
        rates = self.by_length[m]
        if pattern not in rates:
            raise ValueError(f"no estimate for {pattern!r}: the benchmark timed {sorted(rates)}")
        index = [r[pattern]["index_ms"] for r in self.by_length.values() if pattern in r]
        return {"kernel_ms": tiles * rates[pattern]["per_tile_ms"], "index_ms": rates[pattern]["index_ms"],
                "dense_ms": causal_tiles(n) * rates["dense"]["per_tile_ms"], "measured_n": m,
                "index_range": (min(index), max(index))}

    def sentence(self, est: dict[str, Any], n: int, what: str = "this head") -> str:
        """Where the numbers come from, and what they say."""
        lo, hi = est["index_range"]
        m = est["measured_n"]
        when = (f"rates of the {m}-token runs, the nearest length timed" if m == n else
                f"rates of the {m}-token runs, the nearest length timed (a {n}-token prompt was not timed)")
        index = (f" The index time is a measured cost per query head, {lo * 1e3:.0f}-{hi * 1e3:.0f} us over the "
                 f"lengths timed ({min(self.by_length)}-{max(self.by_length)} tokens), not a model of length or budget."
                 if hi > 0 else "")
        sparse = est["kernel_ms"] + est["index_ms"]
        if est["index_ms"] == 0 and abs(sparse - est["dense_ms"]) <= 1e-9 * max(sparse, 1e-12):
            take = f"{what} runs dense attention: nothing to gain or lose"
        elif sparse < est["dense_ms"]:
            take = f"on the {self.gpu} sparse attention would pay for {what}: {est['dense_ms'] / sparse:.2f}x dense"
        elif est["index_ms"] >= est["dense_ms"]:
            take = (f"on the {self.gpu} sparse attention does not pay for {what} at {n} tokens: the online index "
                    f"alone costs {est['index_ms'] / max(est['dense_ms'], 1e-12):.0f}x its dense attention")
        else:
            take = (f"on the {self.gpu} sparse attention does not pay for {what} at {n} tokens: "
                    f"{sparse / est['dense_ms']:.2f}x the dense time")
        return f"{self.gpu} estimate, not this machine: {when}; {self.source}.{index} Takeaway: {take}."


def estimate_for(session: Session) -> tuple[Estimate | None, str]:
    """The session's latency estimate (the settings' benchmark: a JSON or a shipped table's GPU; default the table
    shipped for this machine's GPU, `prefill.latency.bench_path`), shared; re-read when the file changes."""
    from workbench.prefill.latency import bench_path

    try:
        path = bench_path(session.settings.bench)
    except ValueError as e:
        return None, f"no estimate: {e}"
    stamp = path.stat().st_mtime_ns if path.exists() else None
    shape = session.shape
    dims = (shape.n_heads, shape.n_kv_heads, shape.head_dim)
    return SHARED.memo(("estimate", str(path.resolve()), stamp, dims), lambda: Estimate.load(path, shape))


# ----------------------------------------------------------------------------- Head tab

class HeadState(Job):
    """The selected head, opened: its exact sums (`search.HeadCache`), its dense attention in memory
    (`headview.HeadView`), its pooled map, and the numbers under its current entry (`result`).
    Follows the session: a new selection, sample or config opens the head again (background)."""

    version = param.Integer(default=0)  # bumped when `result` changes

    def __init__(self, session: Session, **params):
        super().__init__(**params)
        self.session = session
        session.jobs.append(self)
        self.cache = self.view = self.stats = None
        self.result: dict[str, Any] = {}
        self.opened: tuple | None = None  # (capture, config version, layer, head) of `result`
        self.last_edit_ms = self.last_edit_total_ms = float("nan")
        self._lock = threading.Lock()
        session.param.watch(lambda *_: self.follow(), ["busy", "layer", "head", "config_version"])

    def follow(self) -> None:
        """Open the session's selected head if it is not the open one (and nothing else runs)."""
        s = self.session
        with self._lock:
            want = (s.capture_key, s.config_version, s.layer, s.head)
            if s.busy or not s.ready or self.busy or want == self.opened:
                return
            self.opened = want
            job = self.run_job(f"opening layer {s.layer} head {s.head}", self._open)
        job.add_done_callback(lambda _: self.follow())  # the selection may have moved on meanwhile

    def _open(self) -> None:
        from workbench.analysis.stats import layer_stats
        from workbench.search.search import HeadCache
        from workbench.views.headview import HeadView

        s = self.session
        cap, layer, head, key = s.capture, s.layer, s.head, s.capture_key
        self._step(f"opening layer {layer} head {head}: exact sums", 0, 3)
        self.cache = SHARED.memo(("headcache", key, layer, head), lambda: HeadCache.from_captures([cap], layer, head))
        q, k, v = cap.head_qkv(layer, head)
        self._step(f"opening layer {layer} head {head}: dense attention", 1, 3)
        self.view = SHARED.memo(("headview", key, layer, head), lambda: HeadView(q, k, v, cap.scale))
        self._step(f"opening layer {layer} head {head}: map", 2, 3)
        self.stats = SHARED.memo(("stats", key, layer, head), lambda: layer_stats(q[None], k[None], cap.scale, resolution=256))
        self.layer, self.head = layer, head
        self._score()

    def entry(self) -> HeadEntry:
        return self.session.config.entry(self.layer, self.head)

    def edit(self, pattern: str, params: dict[str, int] | None = None) -> dict[str, Any]:
        """Give the open head a new pattern and sizes (default: the kind's `default_params` at this prompt's
        length), re-score it (no capture; the other heads of its KV group too when a kind that shares one index per
        group moved them with it); raises (naming the size and the fix) and keeps the old entries when the config
        would be invalid."""
        from workbench.search.search import Candidate, edit_head

        s = self.session
        if self.busy or self.view is None:
            raise RuntimeError("wait until the head is open")
        if pattern not in PARAMS:
            raise ValueError(f"pattern {pattern!r} is unknown: use one of {list(PARAMS)}")
        params = default_params(pattern, s.capture.n) if params is None else params
        missing = [k for k in PARAMS[pattern] if params.get(k) is None]
        if missing:
            raise ValueError(f"{pattern} needs {', '.join(missing)}: type a whole number")
        t0 = time.perf_counter()
        params = {k: int(params[k]) for k in PARAMS[pattern]}
        n_heads = s.config.model["n_heads"]
        if s.config.entry(self.layer, self.head).fixed:
            raise ValueError(s.config.fixed_reason(self.layer, self.head))
        layer = slice(self.layer * n_heads, (self.layer + 1) * n_heads)
        old = s.config.heads[layer]
        s.config.heads[layer] = [HeadEntry.from_dict(e.to_dict()) for e in old]
        try:  # a kind that shares one index per KV group moves the head's whole group (`HeadConfig.edit`)
            scores = edit_head(s.config, self.layer, self.head, Candidate.from_dict({"pattern": pattern, "params": params}),
                               self._cache_of)
            result = self._score(publish=False, scores=scores.pop(self.head))
        except Exception:
            s.config.heads[layer] = old
            raise
        for h, mate in scores.items():  # the group's other heads, re-scored on their own sums
            s.set_entry(s.config.entry(self.layer, h), mate["mass"][0], mate["oracle"][0])
        s.config.provenance.setdefault("edits", []).append(
            {"layer": self.layer, "head": self.head, "pattern": pattern, "params": params, "sample": s.sample.describe()})
        self.last_edit_ms = (time.perf_counter() - t0) * 1e3  # the numbers; then the views redraw
        self._publish()
        self.last_edit_total_ms = (time.perf_counter() - t0) * 1e3
        return result

    def _cache_of(self, head: int) -> Any:
        """The `HeadCache` of a head of the open layer (the open head's, or a KV-group mate's an edit moved)."""
        from workbench.search.search import HeadCache

        s, cap, layer = self.session, self.session.capture, self.layer
        return SHARED.memo(("headcache", s.capture_key, layer, head), lambda: HeadCache.from_captures([cap], layer, head))

    def _publish(self) -> None:
        self.session.set_entry(self.result["entry"], self.result["mass"], self.result["oracle"])
        self.version += 1

    def _score(self, publish: bool = True, scores: dict[str, Any] | None = None) -> dict[str, Any]:
        """Numbers of the open head under its current entry (`scores`: its `rescore_head` scores, if known)."""
        from workbench.search.search import Candidate, rescore_head
        from workbench.views.headview import head_index

        s = self.session
        e, cap = self.entry(), s.capture
        if scores is None:
            scores = rescore_head(self.cache, Candidate.from_dict(e.to_dict()), s.config.proxy)
        q, k, _ = cap.head_qkv(self.layer, self.head)
        index = head_index(e, q, k, cap.scale, s.config.proxy, s.config.block,
                           group=(self.cache.group_q[0], self.cache.member) if self.cache.group_q else None)
        view = self.view.evaluate(index)
        mass, oracle, tiles = scores["mass"][0], scores["oracle"][0], scores["tiles"][0]
        estimate, why = estimate_for(s)
        try:
            est = None if estimate is None else estimate.head(e.pattern, tiles, cap.n)
            note = why if est is None else estimate.sentence(est, cap.n)
        except ValueError as err:  # a pattern the benchmark did not time
            est, note = None, f"no estimate: {err}"
        entry = HeadEntry(e.layer, e.head, e.pattern, e.params, recall={"mean": round(mass, 6), "worst": round(mass, 6)},
                          density={"logical": round(view["logical"], 6), "physical": round(view["physical"], 6)},
                          oracle=round(oracle, 6), minference=e.minference, fixed=e.fixed)
        s.config.heads[self.layer * s.config.model["n_heads"] + self.head] = entry
        self.result = {
            "entry": entry, "index": index, "mass": mass, "oracle": oracle, "tiles": tiles,
            "segments": view["segments"], "rel_l2": view["rel_l2"], "cosine": view["cosine"],
            "logical": view["logical"], "physical": view["physical"], "estimate": est, "estimate_note": note,
        }
        if publish:
            self._publish()
        return self.result


# ----------------------------------------------------------------------------- Forecast tab

class ForecastState(Job):
    """A `workbench forecast report` (read from a file, or computed on the session's sample)."""

    def __init__(self, session: Session, **params):
        super().__init__(**params)
        self.session = session
        session.jobs.append(self)
        self.report: dict[str, Any] | None = None

    def load(self, path: str | None = None) -> dict[str, Any]:
        """Read a report JSON (the first of FORECAST_REPORTS that exists by default)."""
        import json

        candidates = [path] if path else [self.session.settings.forecast_report, *FORECAST_REPORTS]
        for p in filter(None, candidates):
            if Path(p).exists():
                self.report = {**json.loads(Path(p).read_text()), "source": p}
                return self.report
        raise FileNotFoundError(f"no forecast report at {[p for p in candidates if p]}: run `workbench forecast report` "
                                "or press 'Compute on this sample'")

    def compute(self):
        s = self.session
        if s.sample is None or s.busy:
            raise RuntimeError("no sample loaded yet: wait for 'ready', then compute")
        return self.run_job("forecast report on this sample", self._compute)

    def _compute(self) -> None:
        from workbench.analysis.block_sets import iou_matrix
        from workbench.data import shipped_forecast_heads
        from workbench.decode.forecast.heads import ForecastHeads
        from workbench.decode.forecast.report import build_report, exact_sets
        from workbench.decode.forecast.train import lengths_ok
        from workbench.patterns.infllm import Budget

        s = self.session
        model, tok, shape = SHARED.model(s.settings.model, s.settings.device, s.settings.dtype)
        budget = Budget()
        lengths_ok(s.length, budget)
        spec = (s.task, s.length, s.seed)
        step = lambda what, done, total: self._step(f"forecast: {what}", done, total)  # noqa: E731
        shipped = shipped_forecast_heads(shape.name)
        if shipped is not None:
            heads = ForecastHeads.load(shipped, shape)
            rep = build_report(model, tok, shape, heads, budget, eval_specs=[spec], calib_specs=[], progress=step)
            self.report = {**rep, "source": f"computed on {s.task}/{s.length} with the shipped {shipped.name}"}
        else:
            sets = exact_sets(model, shape, s.sample.input_ids, budget, rows=256, seed=s.seed, progress=step)
            self.report = {"iou_matrix": iou_matrix(sets).tolist(), "layers": None,
                           "source": f"computed on {s.task}/{s.length}; no Forecast heads ship for {shape.name} "
                                     "(`workbench forecast train` makes them), so no per-selector recall"}


# ----------------------------------------------------------------------------- Latency tab

class LatencyState(Job):
    """The selected layer timed on this machine (`latency.time_model_layer`), beside the GPU estimate."""

    def __init__(self, session: Session, **params):
        super().__init__(**params)
        self.session = session
        session.jobs.append(self)
        self.result: dict[str, Any] | None = None

    def time(self):
        s = self.session
        if s.sample is None or s.busy:
            raise RuntimeError("no sample loaded yet: wait for 'ready', then time")
        return self.run_job(f"timing layer {s.layer}", self._time)

    def _time(self) -> None:
        from workbench.patterns import causal_tiles
        from workbench.prefill.latency import time_model_layer

        s = self.session
        cap, cfg, layer = s.capture, s.config, s.layer
        self._step(f"timing layer {layer}: index, sparse and dense attention", 0, 2)
        out = time_model_layer(cap, cfg, layer)
        self._step(f"timing layer {layer}: the estimate", 1, 2)
        q, k, _ = cap.layer_qkv(layer)
        tiles = cfg.layer_index(layer, q, k, cap.scale).tiles(cap.n).tolist()
        estimate, note = estimate_for(s)
        out["estimate"] = None
        if estimate is not None:
            try:
                heads = [estimate.head(e.pattern, t, cap.n) for e, t in zip(cfg.layer(layer), tiles)]
                est = {"kernel_ms": sum(h["kernel_ms"] for h in heads), "index_ms": sum(h["index_ms"] for h in heads),
                       "dense_ms": len(heads) * estimate.head("dense", causal_tiles(cap.n), cap.n)["dense_ms"],
                       "measured_n": heads[0]["measured_n"],
                       "index_range": tuple(len(heads) * x for x in heads[0]["index_range"])}
                if all(e.pattern == "dense" for e in cfg.layer(layer)):
                    est["kernel_ms"], est["index_ms"] = est["dense_ms"], 0.0
                out["estimate"], note = est, estimate.sentence(est, cap.n, f"layer {layer}")
            except ValueError as err:  # a pattern the benchmark did not time
                note = f"no estimate: {err}"
        self.result = {**out, "layer": layer, "estimate_note": note}


# ----------------------------------------------------------------------------- Decode tab

class Stopped(Exception):
    """Raised from the progress callback when the user presses Stop."""


class StoppableJob(Job):
    """A tab's job that the user can stop: `stop()` makes the next progress report raise `Stopped`."""

    _stop = False

    def stop(self) -> None:
        """Stop at the next progress report (the job then fails with 'stopped')."""
        self._stop = True

    def _reporter(self, prefix: str):
        """A library progress callback (what, done, total) that moves this job's bar and honours `stop()`."""
        self._stop = False

        def report(what: str, done: int, total: int) -> None:
            if self._stop:
                raise Stopped("stopped by the user")
            self._step(f"{prefix}: {what}", done, total)

        return report


ONE_AT_A_TIME = threading.Lock()  # sessions decode in turn: a CUDA-graph capture must not meet another thread's work


class DecodeState(StoppableJob):
    """The session's sample decoded in several engine modes (`decode.compare.compare_modes`), with the
    greedy text of every mode and whether it contains the sample's answer."""

    def __init__(self, session: Session, **params):
        super().__init__(**params)
        self.session = session
        session.jobs.append(self)
        self.result = None  # a decode.compare.Comparison
        self.texts: dict[str, str] = {}
        self.answer = ""

    def fitted_budget(self, new_tokens: int) -> dict[str, int]:
        """{"init", "local", "topk"}: the library's default budget cut to the loaded sample decoding
        `new_tokens` (`Budget.fitted`); the default itself before a sample is loaded."""
        from workbench.decode.compare import decode_length
        from workbench.patterns.infllm import Budget

        s = self.session
        if s.sample is None:
            b = Budget()
        else:
            b = Budget.fitted(decode_length(int(s.sample.input_ids.numel()), max(2, int(new_tokens or 2)),
                                            str(s.settings.device).startswith("cuda")))
        return {"init": b.init, "local": b.local, "topk": b.topk}

    def decode(self, modes: list[str], new_tokens: int, budget: dict[str, int], store: str = "model"):
        """Start decoding; raises at once (naming the field) for an empty mode list, a bad budget or an unknown
        host KV store (`store`: every mode but dense-resident keeps its KV as that, `compare.with_store`)."""
        from workbench.decode.compare import with_store
        from workbench.patterns.infllm import Budget

        s = self.session
        if s.sample is None or s.busy:
            raise RuntimeError("no sample loaded yet: wait for 'ready' or press Load sample")
        if not modes:
            raise ValueError("modes is empty: pick at least one mode")
        if new_tokens is None or new_tokens < 2:
            raise ValueError(f"new tokens = {new_tokens}: give at least 2 (the prefill's token and one decode step)")
        missing = [k for k, v in budget.items() if v is None]
        if missing:
            raise ValueError(f"budget {', '.join(missing)} blocks: type a whole number")
        plan = Budget(**budget)  # raises naming a negative count
        specs = with_store(modes, store)
        return self.run_job("decoding", lambda: self._decode(specs, int(new_tokens), plan))

    def _decode(self, modes: list[str], new_tokens: int, budget: Any) -> None:
        from workbench.decode.compare import compare_modes

        s = self.session
        model, tok, _ = SHARED.model(s.settings.model, s.settings.device, s.settings.dtype)

        report = self._reporter("decoding")
        self.status = "decoding: waiting for another session's decode"
        with ONE_AT_A_TIME:
            result = compare_modes(model, s.sample.input_ids, modes=modes, new_tokens=new_tokens, budget=budget,
                                   progress=report)
        self.texts = {spec: tok.decode(run.tokens[0].tolist(), skip_special_tokens=True)
                      for spec, run in result.runs.items()}
        self.answer = s.sample.answer
        self.result = result


# ----------------------------------------------------------------------------- Lengths tab

MAX_PROMPTS = 8  # held-out prompts per length the Lengths tab accepts


class LengthsState(StoppableJob):
    """The session's config (its edits included) at longer prompt lengths, on held-out prompts: every
    evaluated head's captured mass per length as searched and with its budgets scaled to n
    (`prefill.generalize.generalization_report`; its end-to-end check is left to `workbench generalize`)."""

    def __init__(self, session: Session, **params):
        super().__init__(**params)
        self.session = session
        session.jobs.append(self)
        self.report: dict[str, Any] | None = None
        self.report_digest: str | None = None  # `config_digest` of the config the report evaluated

    def stale(self) -> bool:
        """True when the session's config changed (a head edited, another config loaded) after the report."""
        return self.report is not None and self.report_digest != config_digest(self.session.config)

    def searched_at(self) -> tuple[int, str]:
        """(L, where it comes from): the config's calibration length, else the loaded sample's length."""
        from workbench.config import ConfigError
        from workbench.prefill.generalize import searched_length

        try:
            return searched_length(self.session.config), "the length the config was searched at"
        except ConfigError:
            return self.session.length, "the loaded sample's length: the config records no calibration length"

    def default_lengths(self) -> list[int]:
        """L, 2L and 4L capped at the model's positions; L / 4, L / 2 and L when L is the longest it allows."""
        L, _ = self.searched_at()
        top = self.session.shape.max_positions
        scales = (1, 2, 4) if 2 * L <= top else (0.25, 0.5, 1)
        return sorted({min(max(int(m * L), MIN_LENGTH), top) for m in scales})

    def evaluate(self, lengths: str, prompts: int, task: str):
        """Start the evaluation; raises at once naming the field for lengths outside [MIN_LENGTH, the model's positions],
        a prompt count outside 1..MAX_PROMPTS or an unknown task."""
        from workbench.core.corpus import TASKS
        from workbench.core.ranges import parse_counts

        s = self.session
        if s.config is None or s.busy:
            raise RuntimeError("no sample loaded yet: wait for 'ready' or press Load sample")
        L, _ = self.searched_at()
        values = sorted(set(parse_counts(lengths or "", "lengths")))
        top = s.shape.max_positions
        for n in values:
            if n < MIN_LENGTH:
                raise ValueError(f"length {n} is below the minimum of {MIN_LENGTH} tokens: give {MIN_LENGTH} to {top}")
            if n > top:
                raise ValueError(f"length {n} is above the {top} positions {s.shape.name} allows: give at most {top}")
        if prompts is None or not 1 <= prompts <= MAX_PROMPTS:
            raise ValueError(f"prompts per length = {prompts}: give 1 to {MAX_PROMPTS}")
        if task not in TASKS:
            raise ValueError(f"task {task!r} is unknown: choose one of {list(TASKS)}")
        config = copy.deepcopy(s.config)  # later edits do not change a running evaluation
        return self.run_job("evaluating lengths", lambda: self._evaluate(config, values, int(prompts), task, L))

    def _evaluate(self, config: Any, lengths: list[int], prompts: int, task: str, L: int) -> None:
        from workbench.prefill.generalize import generalization_report

        s = self.session
        model, tok, shape = SHARED.model(s.settings.model, s.settings.device, s.settings.dtype)

        report = self._reporter("evaluating lengths")
        digest = config_digest(config)
        key = ("lengths", shape.fingerprint, digest, tuple(lengths), prompts, task, L, s.settings.layers)
        self.report_digest, self.report = digest, SHARED.memo(key, lambda: generalization_report(
            model, tok, shape, config, lengths=lengths, tasks=(task,), samples=prompts, searched_at=L,
            quality_samples=0, layers=s.settings.layers, config_source=s.config_source, progress=report,
            command="workbench dashboard (Lengths tab)"))
