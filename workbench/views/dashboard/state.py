"""What one dashboard session shares with its tabs, and the read-only objects all sessions share.

`SHARED` holds the loaded models, captures and memoised pure results (the dense statistics of a capture
do not depend on anyone's edits), behind a lock. A `Session` (one per browser tab) keeps only what every
tab reads: the sample (and its capture), the HeadConfig with each head's captured mass under it, and the
selected head. Each dashboard tab that computes owns its own state and background `Job`
(`tab_state.py`). The analysis itself is library calls (`search`, `prefill.latency`, ...). A job that
raises leaves its message in `error` and status "failed".
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import param
import torch

from workbench.config import ConfigError, HeadConfig, HeadEntry, model_heads
from workbench.core.corpus import TASKS
from workbench.core.ranges import parse_ranges
from workbench.data import file_stem, shipped_config
from workbench.search.search import TARGET

CONFIG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
MIN_LENGTH = 128  # shortest prompt the dashboard loads (two 64-token blocks)
SEARCH = "search on this sample"  # the config choice that fits a config to the loaded sample
LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """Server-wide options (from `workbench dashboard` or WORKBENCH_DASHBOARD_* variables)."""

    model: str | None = None
    task: str = "passkey"
    length: int = 4096
    seed: int = 0
    config: str | None = None  # a HeadConfig path, "search", or None: the first of `default_config_choice`
    configs_dir: str = "reports/configs"  # where Save writes (and a saved config of the model is looked for)
    forecast_report: str | None = None
    layers: tuple[int, ...] | None = None  # capture only these layers (quick looks and UI tests); None = all
    device: str | None = None  # where the model runs (None: cuda when available); views read CPU copies
    dtype: str | None = None  # model dtype (None: float32)
    bench: str | None = None  # the latency estimate's kernel benchmark: a JSON or a shipped table's GPU (None: the
    # table shipped for this machine's GPU, else the H200's: `prefill.latency.bench_path`)

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


def model_config_path(configs_dir: str | Path, model_name: str) -> Path:
    """`<configs_dir>/<model name>.json`: where Save puts this model's config."""
    return Path(configs_dir) / f"{file_stem(model_name)}.json"


def default_config_choice(configs_dir: str | Path, model_name: str) -> tuple[str, str]:
    """(choice, note) of a session without --config: the model's config saved in `configs_dir`, else the
    config the package ships for it, else a search on the sample; the note says which and why."""
    own = model_config_path(configs_dir, model_name)
    if own.exists():
        return str(own), f"default: {own}, this model's config saved in --out"
    shipped = shipped_config(model_name)
    if shipped is not None:
        return str(shipped), f"default: the config the package ships for {model_name} (no {own.name} in {configs_dir}/)"
    return SEARCH, (f"no {own.name} in {configs_dir}/ and no shipped config for {model_name}, so the default is "
                    "a search on this sample")


def latency_rates(path: str | Path, shape: Any) -> tuple[dict[str, dict[str, float]] | None, str]:
    """Per-tile rates for a model of `shape` from the kernel benchmark at `path` (`latency.tile_rates` of
    the shape `latency.match_shape` picks, median over lengths) and a sentence naming their source;
    (None, "no estimate: <why>") when the file is missing, unreadable or has no usable rows. The estimate is
    optional: it never fails a job."""
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


class Job(param.Parameterized):
    """A background job's visible state: the session's (loading a sample, importing a config) or one tab's.
    Work runs on `EXECUTOR`; `busy`, `progress` (-1: not known yet) and `status` follow it; a job that
    raises leaves its message in `error` and status "failed", and the page stays usable."""

    status = param.String(default="idle")
    error = param.String(default="")
    progress = param.Integer(default=-1, bounds=(-1, 100))
    busy = param.Boolean(default=False)

    def __init__(self, **params):
        super().__init__(**params)
        self._job: Future | None = None

    def run_job(self, name: str, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the shared executor; errors land in `error`, never kill the page."""
        self.check_free()
        self.param.update(busy=True, error="", progress=-1, status=name)

        def work():
            try:
                fn()
                self.status = "ready"
            except Exception as e:  # shown in the UI; the session stays usable
                if isinstance(e, (ValueError, RuntimeError)):  # bad input or a refusal: its message says it all
                    LOG.warning("dashboard job %r failed: %s", name, e)
                else:
                    LOG.exception("dashboard job %r failed", name)
                self.param.update(error=f"{name} failed: {e or type(e).__name__}", status="failed")
            finally:
                self.param.update(progress=-1, busy=False)

        self._job = EXECUTOR.submit(work)
        return self._job

    def check_free(self) -> None:
        if self.busy:
            raise RuntimeError(f"busy with {self.status}: wait for it to finish")

    def wait(self, timeout: float | None = None) -> None:
        if self._job is not None:
            self._job.result(timeout)

    def _step(self, text: str, done: int, total: int) -> None:
        """Report a step: `done` of `total` parts finished (shown as at least 1 %, so the bar is determinate)."""
        self.param.update(status=text, progress=min(100, max(1, int(100 * done / max(total, 1)))))

    def progress_bar(self) -> dict[str, Any]:
        """Settings of a Panel `Progress` that follows the job: its percentage, an animated indeterminate
        bar (value -1) until it reports one, stopped at 0 when no job runs."""
        if not self.busy:
            return {"value": 0, "active": False}
        return {"value": self.progress if self.progress > 0 else -1, "active": self.progress <= 0}


class Session(Job):
    """One browser tab's shared state: the sample (and its capture), the HeadConfig with every head's
    captured mass under it (`mass`, `oracle` `[L, H]`), and the selected head (`layer`, `head`).

    The sidebar's inputs go through `configure`, which applies them or raises naming the field; `load`
    then captures the sample and picks the config (`config_choice`: a HeadConfig file, or SEARCH)."""

    model_name = param.String(default="embedded")
    task = param.Selector(default="passkey", objects=list(TASKS))
    length = param.Integer(default=4096)
    seed = param.Integer(default=0)
    target = param.Number(default=TARGET, doc="captured-mass target of the search (search.choose)")
    config_choice = param.String(default=SEARCH, doc="a HeadConfig path, or SEARCH")
    layer = param.Integer(default=0)
    head = param.Integer(default=0)

    ready = param.Boolean(default=False)
    sample_version = param.Integer(default=0)  # bumped when a new sample is loaded
    config_version = param.Integer(default=0)  # bumped when a new config is evaluated (load, import)
    grid_version = param.Integer(default=0)  # bumped when any head's pattern or captured mass changes
    saved_version = param.Integer(default=0)  # bumped when a config is saved into the configs folder

    def __init__(self, settings: Settings, **params):
        super().__init__(**params)
        self.settings = settings
        self.model_name = settings.model or "embedded"
        self.task, self.length, self.seed = settings.task, settings.length, settings.seed
        self.shape = self.tokenizer = None
        self.sample = self.capture = self.capture_key = None
        self.tokens: list[str] = []  # the sample's tokens as text (hover and axes of the maps)
        self.config: HeadConfig | None = None
        self.config_source = ""  # one sentence: where the config came from
        self._applied: tuple | None = None  # (choice, target) the current config was built from
        self.mass = self.oracle = None  # [L, H] float64: captured mass of each head's online index, its oracle
        self.jobs: list[Job] = []  # the tabs' jobs: a new sample waits until they finish
        # "" until the first load resolves the default: <configs_dir>/<model>.json if it exists, else SEARCH
        self.config_choice = "" if settings.config is None else SEARCH if settings.config == "search" else settings.config
        self.config_note = ""  # why the session started from its config (shown under the config choice)

    # ---- the sidebar's inputs ------------------------------------------------------------------------
    def config_choices(self) -> list[str]:
        """The configs a session can start from: the model's file in --configs-dir (if any), the --config file,
        the current choice ("" before the first load: the default, decided once the model is known), SEARCH."""
        out = []
        if self.shape is not None:
            own = model_config_path(self.settings.configs_dir, self.shape.name)
            if own.exists():
                out.append(str(own))
        if self.settings.config not in (None, "search"):
            out.append(self.settings.config)
        out.append(self.config_choice)  # "" until the first load resolves the default
        return [c for c in dict.fromkeys([*out, SEARCH]) if c or not self.config_choice]

    def configure(self, *, task: str, length: int, seed: int, target: float, config_choice: str) -> None:
        """Apply the sidebar's inputs for the next `load`, or raise ValueError naming the field and the fix
        (nothing is applied then)."""
        if task not in TASKS:
            raise ValueError(f"task {task!r} is unknown: choose one of {list(TASKS)}")
        if length is None or length < MIN_LENGTH:
            raise ValueError(f"length {length} is below the minimum of {MIN_LENGTH} tokens: give at least {MIN_LENGTH}")
        if self.shape is not None and length > self.shape.max_positions:
            raise ValueError(f"length {length} is above the {self.shape.max_positions} positions {self.shape.name} "
                             f"allows: give at most {self.shape.max_positions}")
        if seed is None or seed < 0:
            raise ValueError(f"seed {seed} is negative: give 0 or more")
        if target is None or not 0 < target <= 1:
            raise ValueError(f"search target {target} must be in (0, 1]: the share of the attention mass to keep")
        if config_choice not in ("", SEARCH) and not Path(config_choice).exists():
            raise ValueError(f"config {config_choice!r} does not exist: choose one of {self.config_choices()}")
        if config_choice not in ("", SEARCH) and self._applied and target != self.target:
            raise ValueError(f"search target {target} is not used: the config comes from {config_choice}; choose "
                             f"'{SEARCH}' under 'config' to search at this target")
        self.param.update(task=task, length=int(length), seed=int(seed), target=float(target),
                          config_choice=config_choice)

    # ---- loading a sample ------------------------------------------------------------------------
    def load(self, config: HeadConfig | None = None) -> Future:
        """Capture the sidebar's sample (shared), pick the config, evaluate every head (background)."""
        busy = [j.status for j in self.jobs if j.busy]
        if busy:
            raise RuntimeError(f"a tab is busy ({busy[0]}): wait for it to finish, then load")
        return self.run_job("loading", lambda: self._load(config))

    def _load(self, config: HeadConfig | None) -> None:
        from workbench.core.capture import capture_attention
        from workbench.core.corpus import make_sample

        self.ready = False
        self._step("loading the model", 0, 10)
        model, tok, shape = SHARED.model(self.settings.model, self.settings.device, self.settings.dtype)
        shape.check_length(self.length)
        self.shape, self.tokenizer = shape, tok
        key = ("capture", shape.fingerprint, self.task, self.length, self.seed, self.settings.layers)
        self._step(f"capturing {self.task}, {self.length} tokens", 1, 10)
        self.capture_key = key
        self.sample, self.capture = SHARED.memo(key, lambda: (
            lambda s: (s, _on_cpu(capture_attention(model, shape, s.input_ids, self.settings.layers, progress=False))))(
            make_sample(self.task, tok, self.length, seed=self.seed, max_length=shape.max_positions)))
        self.tokens = SHARED.memo(("tokens", key), lambda: [tok.decode([i]) for i in self.sample.input_ids.tolist()])
        if config is not None:
            cfg, self.config_source = config, "given config"
        else:
            cfg = self._pick_config()
        self._evaluate(cfg)
        layers = self.capture.layers
        self.param.update(layer=self.layer if self.layer in layers else layers[0], head=min(self.head, shape.n_heads - 1))
        self.ready = True
        self.sample_version += 1

    def _pick_config(self) -> HeadConfig:
        """The config of `config_choice` (kept with its edits while the choice and target stay the same)."""
        if not self.config_choice:
            self.config_choice, self.config_note = default_config_choice(self.settings.configs_dir, self.shape.name)
        want = (self.config_choice, self.target if self.config_choice == SEARCH else None)
        if self.config is not None and want == self._applied:
            return self.config
        if self.config_choice == SEARCH:
            cfg = SHARED.memo(("search", self.capture_key, self.target), self._search)
            self.config_source = f"searched on {self.task}/{self.length} (seed {self.seed}) at target {self.target}"
        else:
            cfg = HeadConfig.load(self.config_choice, self.shape)
            self.config_source = f"loaded from {self.config_choice}"
        self._applied = want
        return cfg

    def _search(self) -> HeadConfig:
        """The search on this one sample (`search.layer_scores` per captured layer, then `choose`);
        layers that were not captured stay dense and are listed in the provenance; layers the model fixes
        (sliding window) keep the model's own entry."""
        from workbench.search.search import Evidence, build_config, choose, default_candidates, layer_scores

        cap, shape = self.capture, self.shape
        cands = default_candidates(cap.n)
        ev = Evidence.empty(cands, [self.sample.describe()], [cap.n], len(cap.layers), shape.n_heads,
                            shape.n_heads // shape.n_kv_heads)
        for i, layer in enumerate(cap.layers):
            self._step(f"searching patterns: layer {layer}", i, len(cap.layers))
            if shape.window(layer) is not None:  # the model fixes this layer: nothing to search
                ev.done[0, i] = 1
                continue
            q, k, _ = cap.layer_qkv(layer)
            ev.fill(0, i, layer_scores(q, k, cap.scale, cands))
        skipped = [l for l in range(shape.n_layers) if l not in cap.layers]
        cfg = build_config(ev, choose(ev, self.target), shape.to_dict(), target=self.target, provenance={
            "command": "workbench dashboard (search on the loaded sample)", "dense_not_searched": skipped})
        heads = {(cap.layers[e.layer], e.head): HeadEntry.from_dict({**e.to_dict(), "layer": cap.layers[e.layer]})
                 for e in cfg.heads}
        cfg.heads = model_heads(shape, lambda l, h: heads.get((l, h)) or HeadEntry(l, h, "dense", {}))
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
        self.config_version += 1
        self.grid_version += 1

    # ---- the selection and the config's heads ------------------------------------------------------------
    def select(self, layer: int, head: int) -> None:
        """Select a head (the Head tab opens it); raises naming the captured layers / the head range."""
        if self.capture is None:
            raise RuntimeError("no sample loaded yet: wait for 'ready' or press Load sample")
        self.capture.index(layer)  # raises, naming the captured layers, if this one was not captured
        self.config.entry(layer, head)
        self.param.update(layer=layer, head=head)

    def set_entry(self, entry: HeadEntry, mass: float, oracle: float) -> None:
        """Replace one head's config entry and its captured mass (an edit, or its re-scoring)."""
        self.config.heads[entry.layer * self.config.model["n_heads"] + entry.head] = entry
        self.mass[entry.layer, entry.head], self.oracle[entry.layer, entry.head] = mass, oracle
        self.grid_version += 1

    def captured_layers(self) -> list[int]:
        return list(self.capture.layers) if self.capture is not None else []

    # ---- export / import -----------------------------------------------------------------------------
    def export_text(self) -> str:
        return json.dumps(self.config.to_dict(), indent=1) + "\n"

    def export_minference_text(self) -> str:
        """The config in MInference's per-layer format (what `workbench export --format minference` writes)."""
        return json.dumps(self.config.to_minference(), indent=1) + "\n"

    def save(self, name: str) -> Path:
        path = config_path(self.settings.configs_dir, name)
        self.config.save(path)
        self.saved_version += 1
        return path

    def import_text(self, text: str | bytes, source: str = "uploaded config", fill_missing: bool = False) -> Future:
        """Check an uploaded config (raises ConfigError naming the field), then evaluate it (background)."""
        cfg = parse_config(text, self.shape, source, fill_missing)

        def run():
            self._evaluate(cfg)
            self.config_source = f"imported {source}"

        return self.run_job("evaluating the imported config", run)

    # ---- the Proxy tab reads -------------------------------------------------------------------------
    def proxy_rows(self) -> list[dict[str, Any]]:
        """Per captured head: online proxy mass vs same-budget oracle, worst gap first."""
        rows = []
        for e in self.config.heads:
            m, o = float(self.mass[e.layer, e.head]), float(self.oracle[e.layer, e.head])
            if m != m:
                continue
            rows.append({"layer": e.layer, "head": e.head, "pattern": e.label(), "proxy": round(m, 4),
                         "oracle": round(o, 4), "gap": round(max(o - m, 0.0), 4)})
        return sorted(rows, key=lambda r: (-r["gap"], r["proxy"], r["layer"], r["head"]))


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
