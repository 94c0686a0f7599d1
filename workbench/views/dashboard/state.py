"""What one dashboard session looks at and edits, and the read-only objects all sessions share.

`SHARED` holds the loaded models, captures and memoised pure results (the dense statistics of a
capture do not depend on anyone's edits), behind a lock. Everything a user changes lives in one
`Session` (a `param.Parameterized` made per browser tab): its HeadConfig copy, the selected head and
the recall of every head under its edits. The analysis itself is library calls: `search` (evaluate,
search, `rescore_head`), `headview` (segments, output error, density of an edited head), `latency`,
`forecast_report`. A job that raises leaves its message in `error` and status "failed"; the latency
estimate is optional: without a usable benchmark it says why instead of failing the job.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import param
import torch

from workbench.config import PARAMS, ConfigError, HeadConfig, HeadEntry
from workbench.core.corpus import TASKS
from workbench.core.ranges import parse_ranges
from workbench.data import file_stem, shipped_config, shipped_forecast_heads
from workbench.patterns import default_params
from workbench.search.search import TARGET

CONFIG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
FORECAST_REPORTS = ("reports/forecast/forecast.json", "assets/benchmarks/forecast_cpu.json")
LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """Server-wide options (from `workbench dashboard` or WORKBENCH_DASHBOARD_* variables)."""

    model: str | None = None
    task: str = "passkey"
    length: int = 4096
    seed: int = 0
    config: str | None = None  # a HeadConfig path, "search" (fit one on the sample), or None: see _default_config
    configs_dir: str = "reports/configs"  # where Save writes
    forecast_report: str | None = None
    layers: tuple[int, ...] | None = None  # capture only these layers (quick looks and UI tests); None = all
    device: str | None = None  # where the model runs (None: cuda when available); views read CPU copies
    dtype: str | None = None  # model dtype (None: float32)
    bench: str | None = None  # kernel benchmark JSON of the latency estimate (None: prefill.latency.BENCH)

    @staticmethod
    def parse_layers(text: str | None) -> tuple[int, ...] | None:
        """"0-3" or "0,5,9" -> layer indices; None or "" -> all layers."""
        return tuple(parse_ranges(text)) if text else None

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        get = lambda key, default=None: env.get(f"WORKBENCH_DASHBOARD_{key}") or default  # noqa: E731
        return cls(model=get("MODEL"), task=get("TASK", "passkey"), length=int(get("LENGTH", 4096)),
                   seed=int(get("SEED", 0)), config=get("CONFIG"), configs_dir=get("CONFIGS_DIR", cls.configs_dir),
                   forecast_report=get("FORECAST_REPORT"), layers=cls.parse_layers(get("LAYERS")),
                   device=get("DEVICE"), dtype=get("DTYPE"), bench=get("BENCH"))


class Shared:
    """Read-only objects shared by every session: models, captures, memoised results (LRU)."""

    def __init__(self, max_items: int = 16):
        self._lock = threading.RLock()
        self._models: dict[str, tuple] = {}
        self._memo: OrderedDict[tuple, Any] = OrderedDict()
        self._pending: dict[tuple, threading.Lock] = {}
        self._max = max_items

    def model(self, name: str | None, device: str | None = None, dtype: str | None = None) -> tuple:
        """(model, tokenizer, ModelShape), loaded once per process and (device, dtype)."""
        from workbench.core.model import load_model

        key = f"{name or 'embedded'}@{device}:{dtype}"
        with self._lock:
            if key not in self._models:
                self._models[key] = load_model(name, device=device, dtype=dtype or torch.float32)
            return self._models[key]

    def memo(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()` once per key: a second session asking for the same key waits for the first one's
        result; different keys are computed concurrently."""
        with self._lock:
            if key in self._memo:
                self._memo.move_to_end(key)
                return self._memo[key]
            pending = self._pending.setdefault(key, threading.Lock())
        with pending:
            with self._lock:
                if key in self._memo:
                    return self._memo[key]
            try:
                value = make()
            except BaseException:  # not cached: the next caller tries again
                with self._lock:
                    self._pending.pop(key, None)
                raise
            with self._lock:
                self._memo[key] = value
                self._pending.pop(key, None)
                while len(self._memo) > self._max:
                    self._memo.popitem(last=False)
            return value


SHARED = Shared()
EXECUTOR = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dashboard")


def config_digest(cfg: HeadConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def config_path(folder: str | Path, name: str) -> Path:
    """Where `name` is saved inside `folder`; refuses names that could leave the folder."""
    name = (name or "").strip()
    if name.endswith(".json"):
        name = name[:-5]
    if not CONFIG_NAME.match(name) or ".." in name:
        raise ValueError(f"config name {name!r} is not allowed: use letters, digits, '.', '_' or '-' "
                         "(no slashes, no '..'), starting with a letter or digit, e.g. my-edit")
    root = Path(folder).resolve()
    path = (root / f"{name}.json").resolve()
    if path.parent != root:
        raise ValueError(f"config name {name!r} would leave {root}: use a plain file name")
    return path


def latency_rates(path: str | Path, shape: Any) -> tuple[dict[str, dict[str, float]] | None, str]:
    """Per-tile rates for a model of `shape` from the kernel benchmark at `path` (`latency.tile_rates` of
    the shape `latency.match_shape` picks) and a sentence naming their source; (None, "no estimate: <why>")
    when the file is missing, unreadable or has no usable rows. The estimate is optional: it never fails a job."""
    from workbench.prefill.latency import load_bench, match_shape, tile_rates

    try:
        bench = load_bench(path)
        _, picked = match_shape(bench, shape)
        rates = tile_rates(bench, shape)
    except (OSError, ValueError, KeyError) as e:
        return None, f"no estimate: {Path(path).name}: {e}"
    gpu = bench.get("environment", {}).get("gpu", "GPU")
    return rates, f"{gpu} per-tile model from {Path(path).name}, {picked}; not measured here"


def parse_config(text: str | bytes, shape: Any, source: str = "uploaded config", fill_missing: bool = False) -> HeadConfig:
    """A HeadConfig (or a MInference list) from JSON text, checked against the schema and `shape`;
    `fill_missing`: see `HeadConfig.from_minference`."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{source} is not valid JSON ({e}): upload a file written by Export or `workbench search`") from e
    cfg = HeadConfig.from_minference(data, shape, source, fill_missing=fill_missing) if isinstance(data, list) \
        else HeadConfig.from_dict(data, source)
    cfg.validate(shape)
    return cfg


class Session(param.Parameterized):
    """One browser tab's state. Long work runs on `EXECUTOR`; `busy`, `progress` and `status` follow it."""

    model_name = param.String(default="embedded")
    task = param.Selector(default="passkey", objects=list(TASKS))
    length = param.Integer(default=4096, bounds=(128, None))
    seed = param.Integer(default=0, bounds=(0, None))
    target = param.Number(default=TARGET, bounds=(0.01, 1.0), doc="captured-mass target of the search (search.choose)")
    layer = param.Integer(default=0, bounds=(0, None))
    head = param.Integer(default=0, bounds=(0, None))

    status = param.String(default="starting")
    error = param.String(default="")
    progress = param.Integer(default=-1, bounds=(-1, 100))
    busy = param.Boolean(default=False)
    ready = param.Boolean(default=False)
    grid_version = param.Integer(default=0)  # bumped when any head's pattern or recall changes
    head_version = param.Integer(default=0)  # bumped when the selected head's numbers change

    def __init__(self, settings: Settings, **params):
        super().__init__(**params)
        self.settings = settings
        self.model_name = settings.model or "embedded"
        self.task, self.length, self.seed = settings.task, settings.length, settings.seed
        self.shape = None
        self.sample = self.capture = self.capture_key = None
        self.config: HeadConfig | None = None
        self.mass = self.oracle = None  # [L, H] float64: captured mass of each head's online index, its oracle
        self.head_cache = self.head_view = self.head_stats = None
        self.head_result: dict[str, Any] = {}
        self.last_edit_ms = self.last_edit_total_ms = float("nan")
        self.forecast: dict[str, Any] | None = None
        self.latency: dict[str, Any] | None = None
        self._job: Future | None = None

    # ---- background jobs -----------------------------------------------------------------------
    def run_job(self, name: str, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the shared executor; errors land in `error`, never kill the page."""
        if self.busy:
            raise RuntimeError(f"busy with {self.status}: wait for it to finish")
        self.busy, self.error, self.progress, self.status = True, "", 0, name

        def work():
            try:
                fn()
                self.status = "ready"
            except Exception as e:  # shown in the UI; the session stays usable
                LOG.exception("dashboard job %r failed", name)
                self.error = f"{name} failed: {e or type(e).__name__}"
                self.status = "failed"
            finally:
                self.progress = -1
                self.busy = False

        self._job = EXECUTOR.submit(work)
        return self._job

    def wait(self, timeout: float | None = None) -> None:
        if self._job is not None:
            self._job.result(timeout)

    def _step(self, text: str, done: int, total: int) -> None:
        self.status, self.progress = text, int(100 * done / max(total, 1))

    def progress_bar(self) -> dict[str, Any]:
        """Settings of a Panel `Progress` that follows the jobs: the job's percentage, an animated
        indeterminate bar (value -1) until it reports one, stopped at 0 when no job runs."""
        if not self.busy:
            return {"value": 0, "active": False}
        return {"value": self.progress if self.progress > 0 else -1, "active": self.progress <= 0}

    # ---- loading a sample ------------------------------------------------------------------------
    def load(self, config: HeadConfig | None = None) -> Future:
        """Capture the sidebar's sample (shared), pick the config, evaluate every head (background)."""
        return self.run_job("loading", lambda: self._load(config))

    def _load(self, config: HeadConfig | None) -> None:
        from workbench.core.capture import capture_attention
        from workbench.core.corpus import make_sample

        self._step("loading the model", 0, 1)
        model, tok, shape = SHARED.model(self.settings.model, self.settings.device, self.settings.dtype)
        shape.check_length(self.length)
        self.shape = shape
        key = ("capture", shape.fingerprint, self.task, self.length, self.seed, self.settings.layers)
        self._step(f"capturing {self.task}, {self.length} tokens", 1, 10)
        self.capture_key = key
        self.sample, self.capture = SHARED.memo(key, lambda: (
            lambda s: (s, _on_cpu(capture_attention(model, shape, s.input_ids, self.settings.layers, progress=False))))(
            make_sample(self.task, tok, self.length, seed=self.seed, max_length=shape.max_positions)))
        cfg = config or self.config or self._default_config()
        self._evaluate(cfg)
        layers = self.capture.layers
        self.param.update(layer=self.layer if self.layer in layers else layers[0], head=min(self.head, shape.n_heads - 1))
        self._select()
        self.ready = True

    def _default_config(self) -> HeadConfig:
        """The settings' config; without one, <configs_dir>/<model>.json (a saved one), else the config
        the package ships for the model, else a search on the sample."""
        choice = self.settings.config
        if choice is None:
            path = Path(self.settings.configs_dir) / f"{file_stem(self.shape.name)}.json"
            choice = str(path if path.exists() else shipped_config(self.shape.name) or "search")
        if choice != "search":
            return HeadConfig.load(choice, self.shape)
        return SHARED.memo(("search", self.capture_key, self.target), self._search)

    def _search(self) -> HeadConfig:
        """The search on this one sample (`search.layer_scores` per captured layer, then `choose`);
        layers that were not captured stay dense and are listed in the provenance."""
        from workbench.search.search import Evidence, build_config, choose, default_candidates, layer_scores

        cap, shape = self.capture, self.shape
        cands = default_candidates(cap.n)
        ev = Evidence.empty(cands, [self.sample.describe()], [cap.n], len(cap.layers), shape.n_heads)
        for i, layer in enumerate(cap.layers):
            self._step(f"searching patterns: layer {layer}", i, len(cap.layers))
            q, k, _ = cap.layer_qkv(layer)
            ev.fill(0, i, layer_scores(q, k, cap.scale, cands))
        skipped = [l for l in range(shape.n_layers) if l not in cap.layers]
        cfg = build_config(ev, choose(ev, self.target), shape.to_dict(), target=self.target, provenance={
            "command": "workbench dashboard (search on the loaded sample)", "dense_not_searched": skipped})
        heads = {(cap.layers[e.layer], e.head): HeadEntry.from_dict({**e.to_dict(), "layer": cap.layers[e.layer]})
                 for e in cfg.heads}
        cfg.heads = [heads.get((l, h)) or HeadEntry(l, h, "dense", {})
                     for l in range(shape.n_layers) for h in range(shape.n_heads)]
        cfg.check("dashboard search")
        return cfg

    def _evaluate(self, cfg: HeadConfig) -> None:
        """Recall and oracle of every head of `cfg` on the capture (shared memo per config digest)."""
        from workbench.search.search import evaluate_config

        cap = self.capture

        def run():
            out = {"mass": torch.full((self.shape.n_layers, self.shape.n_heads), float("nan"), dtype=torch.float64)}
            out["oracle"] = out["mass"].clone()
            for i, layer in enumerate(cap.layers):
                self._step(f"evaluating heads: layer {layer}", i, len(cap.layers))
                r = evaluate_config(cfg, _one_layer(cap, layer))
                out["mass"][layer], out["oracle"][layer] = r["mass"][layer], r["oracle"][layer]
            return out

        res = SHARED.memo(("evaluate", self.capture_key, config_digest(cfg)), run)
        self.config = copy.deepcopy(cfg)
        self.mass, self.oracle = res["mass"].clone(), res["oracle"].clone()
        self.grid_version += 1

    # ---- one head ----------------------------------------------------------------------------------
    def select(self, layer: int, head: int) -> Future:
        """Open a head (background: its exact sums, dense matrix and map, once per head)."""
        self.capture.index(layer)  # raises, naming the captured layers, if this one was not captured
        self.config.entry(layer, head)
        self.layer, self.head = layer, head
        return self.run_job(f"opening layer {layer} head {head}", self._select)

    def _select(self) -> None:
        from workbench.analysis.stats import layer_stats
        from workbench.search.search import HeadCache
        from workbench.views.headview import HeadView

        cap, layer, head = self.capture, self.layer, self.head
        self._step(f"opening layer {layer} head {head}", 0, 3)
        self.head_cache = SHARED.memo(("headcache", self.capture_key, layer, head),
                                      lambda: HeadCache.from_captures([cap], layer, head))
        q, k, v = cap.head_qkv(layer, head)
        self._step(f"opening layer {layer} head {head}", 1, 3)
        self.head_view = SHARED.memo(("headview", self.capture_key, layer, head), lambda: HeadView(q, k, v, cap.scale))
        self._step(f"opening layer {layer} head {head}", 2, 3)
        self.head_stats = SHARED.memo(("stats", self.capture_key, layer, head),
                                      lambda: layer_stats(q[None], k[None], cap.scale, resolution=256))
        self._score_head()

    def entry(self) -> HeadEntry:
        return self.config.entry(self.layer, self.head)

    def edit(self, pattern: str, params: dict[str, int] | None = None) -> dict[str, Any]:
        """Give the selected head a new pattern and sizes (default: the kind's `default_params` at this
        prompt's length), re-score it (no capture, no other head)."""
        if self.busy or self.head_view is None:
            raise RuntimeError("wait until the head is loaded")
        if pattern not in PARAMS:
            raise ValueError(f"pattern {pattern!r} is unknown: use one of {list(PARAMS)}")
        t0 = time.perf_counter()
        params = default_params(pattern, self.capture.n) if params is None else params
        params = {k: int(params[k]) for k in PARAMS[pattern]}
        i = self.layer * self.config.model["n_heads"] + self.head
        old = self.config.heads[i]
        self.config.heads[i] = HeadEntry(old.layer, old.head, pattern, params)
        try:
            self.config.check("edit")
            result = self._score_head(publish=False)
        except Exception:
            self.config.heads[i] = old
            raise
        self.config.provenance.setdefault("edits", []).append(
            {"layer": self.layer, "head": self.head, "pattern": pattern, "params": params, "sample": self.sample.describe()})
        self.last_edit_ms = (time.perf_counter() - t0) * 1e3  # the numbers; then the views redraw
        self._publish()
        self.last_edit_total_ms = (time.perf_counter() - t0) * 1e3
        return result

    def _publish(self) -> None:
        self.grid_version += 1
        self.head_version += 1

    def _score_head(self, publish: bool = True) -> dict[str, Any]:
        """Numbers of the selected head under its current entry; updates the grid row too."""
        from workbench.patterns import causal_tiles
        from workbench.prefill.latency import estimate_ms
        from workbench.search.search import Candidate, rescore_head
        from workbench.views.headview import head_index

        e, cap = self.entry(), self.capture
        cand = Candidate(e.pattern, tuple(e.params[p] for p in PARAMS[e.pattern]))
        scores = rescore_head(self.head_cache, cand, self.config.proxy)
        q, k, _ = cap.head_qkv(self.layer, self.head)
        index = head_index(e, q, k, cap.scale, self.config.proxy, self.config.block)
        view = self.head_view.evaluate(index)
        mass, oracle, tiles = scores["mass"][0], scores["oracle"][0], scores["tiles"][0]
        rates, source = self.latency_rates()
        try:
            estimate = None if rates is None else {
                "estimate_ms": estimate_ms(rates, e.pattern, tiles), "estimate_index_ms": rates[e.pattern]["index_ms"],
                "dense_estimate_ms": estimate_ms(rates, "dense", causal_tiles(cap.n))}
        except ValueError as err:  # a pattern the benchmark did not time
            estimate, source = None, f"no estimate: {err}"
        self.config.heads[self.layer * self.config.model["n_heads"] + self.head] = HeadEntry(
            e.layer, e.head, e.pattern, e.params, recall={"mean": round(mass, 6), "worst": round(mass, 6)},
            density={"logical": round(view["logical"], 6), "physical": round(view["physical"], 6)},
            oracle=round(oracle, 6), minference=e.minference)
        self.mass[self.layer, self.head], self.oracle[self.layer, self.head] = mass, oracle
        self.head_result = {
            "entry": self.entry(), "index": index, "mass": mass, "oracle": oracle, "tiles": tiles,
            "segments": view["segments"], "rel_l2": view["rel_l2"], "cosine": view["cosine"],
            "logical": view["logical"], "physical": view["physical"],
            **(estimate or dict.fromkeys(("estimate_ms", "estimate_index_ms", "dense_estimate_ms"))),
            "estimate_source": source,
        }
        if publish:
            self._publish()
        return self.head_result

    # ---- export / import -----------------------------------------------------------------------------
    def export_text(self) -> str:
        return json.dumps(self.config.to_dict(), indent=1) + "\n"

    def save(self, name: str) -> Path:
        path = config_path(self.settings.configs_dir, name)
        self.config.save(path)
        return path

    def import_text(self, text: str | bytes, source: str = "uploaded config", fill_missing: bool = False) -> Future:
        """Check an uploaded config (raises ConfigError naming the field), then evaluate it (background)."""
        cfg = parse_config(text, self.shape, source, fill_missing)
        return self.run_job("evaluating the imported config", lambda: (self._evaluate(cfg), self._select()))

    # ---- proxy, forecast and latency tabs --------------------------------------------------------------
    def proxy_rows(self) -> list[dict[str, Any]]:
        """Per head: online proxy mass vs same-budget oracle, worst gap first."""
        rows = []
        for e in self.config.heads:
            m, o = float(self.mass[e.layer, e.head]), float(self.oracle[e.layer, e.head])
            if m != m:
                continue
            rows.append({"layer": e.layer, "head": e.head, "pattern": e.label(), "proxy": round(m, 4),
                         "oracle": round(o, 4), "gap": round(max(o - m, 0.0), 4)})
        return sorted(rows, key=lambda r: (-r["gap"], r["proxy"], r["layer"], r["head"]))

    def load_forecast(self, path: str | None = None) -> dict[str, Any]:
        """Read a `workbench forecast report` JSON (the first of FORECAST_REPORTS that exists by default)."""
        candidates = [path] if path else [self.settings.forecast_report, *FORECAST_REPORTS]
        for p in filter(None, candidates):
            if Path(p).exists():
                self.forecast = {**json.loads(Path(p).read_text()), "source": p}
                return self.forecast
        raise FileNotFoundError(f"no forecast report at {[p for p in candidates if p]}: run `workbench forecast report` "
                                "or press 'Compute on this sample'")

    def compute_forecast(self) -> Future:
        return self.run_job("forecast report on this sample", self._compute_forecast)

    def _compute_forecast(self) -> None:
        from workbench.analysis.block_sets import iou_matrix
        from workbench.decode.forecast.heads import ForecastHeads
        from workbench.decode.forecast.report import build_report, exact_sets
        from workbench.decode.forecast.train import lengths_ok
        from workbench.patterns.infllm import Budget

        model, tok, shape = SHARED.model(self.settings.model, self.settings.device, self.settings.dtype)
        budget = Budget()
        lengths_ok(self.length, budget)
        spec = (self.task, self.length, self.seed)
        shipped = shipped_forecast_heads(shape.name)
        if shipped is not None:
            heads = ForecastHeads.load(shipped, shape)
            rep = build_report(model, tok, shape, heads, budget, eval_specs=[spec], calib_specs=[], progress=False)
            self.forecast = {**rep, "source": f"computed on {self.task}/{self.length} with the shipped {shipped.name}"}
        else:
            sets = exact_sets(model, shape, self.sample.input_ids, budget, rows=256, seed=self.seed)
            self.forecast = {"iou_matrix": iou_matrix(sets).tolist(), "layers": None,
                             "source": f"computed on {self.task}/{self.length}; no Forecast heads ship for "
                                       f"{shape.name} (`workbench forecast train` makes them), so no per-selector recall"}

    def time_latency(self) -> Future:
        return self.run_job(f"timing layer {self.layer}", self._time_latency)

    def latency_rates(self) -> tuple[dict[str, dict[str, float]] | None, str]:
        """`latency_rates` of the settings' benchmark (default `prefill.latency.BENCH`) for the loaded
        model, shared; re-read when the file changes."""
        from workbench.prefill.latency import BENCH

        path = Path(self.settings.bench or BENCH)
        stamp = path.stat().st_mtime_ns if path.exists() else None
        dims = (self.shape.n_heads, self.shape.n_kv_heads, self.shape.head_dim)
        return SHARED.memo(("rates", str(path.resolve()), stamp, dims), lambda: latency_rates(path, self.shape))

    def _time_latency(self) -> None:
        from workbench.patterns import causal_tiles
        from workbench.prefill.latency import estimate_ms, time_model_layer

        cap = self.capture
        q, k, v = cap.layer_qkv(self.layer)
        index = self.config.layer_index(self.layer, q, k, cap.scale)
        out = time_model_layer(cap, self.config, self.layer)
        rates, source = self.latency_rates()
        try:
            tiles = index.tiles(cap.n).tolist()
            out["estimate"] = None if rates is None else {
                "dense_ms": len(tiles) * estimate_ms(rates, "dense", causal_tiles(cap.n)),
                "sparse_ms": sum(estimate_ms(rates, e.pattern, t) for e, t in zip(self.config.layer(self.layer), tiles))}
        except ValueError as err:  # a pattern the benchmark did not time
            out["estimate"], source = None, f"no estimate: {err}"
        self.latency = {**out, "layer": self.layer, "estimate_source": source}


def _on_cpu(cap: Any) -> Any:
    """The capture with its tensors on the CPU (a GPU runs the model; the views and editors read CPU tensors)."""
    import dataclasses

    if not cap.q.is_cuda:
        return cap
    return dataclasses.replace(cap, q=cap.q.cpu(), k=cap.k.cpu(), v=cap.v.cpu(),
                               hidden=None if cap.hidden is None else cap.hidden.cpu())


def _one_layer(cap: Any, layer: int) -> Any:
    """A view of one captured layer as its own Capture (no copy)."""
    i = cap.index(layer)
    return type(cap)(q=cap.q[i:i + 1], k=cap.k[i:i + 1], v=cap.v[i:i + 1], layers=(layer,), shape=cap.shape,
                     input_ids=cap.input_ids, scale=cap.scale)
