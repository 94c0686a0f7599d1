"""HeadConfig: the per-(layer, head) sparse pattern choice, as a versioned JSON file.

One entry per (layer, query head): the pattern ("vs", "ashape", "block" or "dense"), its sizes (in
tokens, or blocks for "block"), the captured mass measured on the calibration samples (mean and worst),
the density, and the evidence behind the choice. The file also records the model it was made for
(`validate(model_shape)` refuses another one), the online proxy settings, and provenance (weights
fingerprint, calibration samples, candidates, target, tool version, date, hardware).

`SCHEMA` is the JSON Schema of the file (also shipped as workbench/data/configs/head_config.schema.json).
Numbers follow one rule in every format: sizes are JSON integers (16, never 16.0 or "16") from 0 up to the
model's max length (`model.max_positions`; `*_milli` thresholds up to 1000), and no number is NaN or
infinite. MInference's format (one dict per layer: head -> [pattern, vertical_size, slash_size, score]) is
imported strictly (every layer and head, canonical keys, integer sizes; `fill_missing` accepts what
MInference would default) and exported; MInference's score is kept as an opaque field (`HeadEntry.minference`),
never read as a recall. MInference runs every `block_sparse` head at top-100 blocks whatever its sizes say
(`MINFERENCE_BLOCK_TOPK`): import and export warn, and an imported config records it
(`provenance.minference_block_topk`). Tensor-parallel helpers map global heads to (rank, local head), with
KV heads replicated when the TP size exceeds their number (as vLLM does); a rank's view (`for_rank`)
records that it is one (`provenance.tensor_parallel`: size, rank, the global ids of its heads, the whole
model's head counts), so it is never split again as if it were a whole model.
"""
from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.core.io import read_json, write_json
from workbench.core.model import ModelShape
from workbench.core.ranges import format_ranges
from workbench.patterns import PATTERNS, Stack, pattern_class

FORMAT = "workbench.head_config"
VERSION = 1
PARAMS = {kind: cls.params for kind, cls in PATTERNS.items()}  # kind -> its per-head sizes (the pattern registry)
MINFERENCE_NAMES = {kind: cls.minference_name for kind, cls in PATTERNS.items() if cls.minference_name}
# MInference runs these model-wide (its `attn_type`), not per head: its per-head file has no entry for them
MINFERENCE_ATTN_TYPES = {kind: cls.minference_attn_type for kind, cls in PATTERNS.items() if cls.minference_attn_type}
MINFERENCE_DEFAULT = (1000, 6096)  # what MInference uses for a head its file does not list
_MINFERENCE_FIELDS = ("pattern", "vertical_size", "slash_size", "score")
PROXY_DEFAULTS = {"last_rows": 64, "aggregate": "sum", "diag_norm": "sum", "sink": 30, "local": 100, "prior": 16.0}
_SHAPE_FIELDS = {  # ModelShape field -> (what to call it, how to fix a mismatch)
    "n_layers": "layers", "n_heads": "query heads", "n_kv_heads": "KV heads", "head_dim": "head_dim",
    "rope_type": "RoPE type", "rope_theta": "RoPE theta", "max_positions": "max length (max_position_embeddings)",
    "layer_types": "attention type per layer", "sliding_window": "sliding window",
    "sliding_rope_theta": "RoPE theta of the sliding layers",
}

MINFERENCE_BLOCK_TOPK = 100  # MInference's block_sparse kernel runs top-100 blocks whatever the entry's sizes
MAX_TOKENS = 1 << 26  # no length (max_positions) above this: sizes stay far from integer overflow

_int = {"type": "integer"}
_num = {"type": "number"}
_nullable_num = {"type": ["number", "null"]}
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://github.com/sparse-attention-workbench/configs/head_config.schema.json",
    "title": "Sparse Attention Workbench head config",
    "type": "object",
    "required": ["format", "version", "model", "block", "proxy", "provenance", "heads"],
    "additionalProperties": False,
    "properties": {
        "format": {"const": FORMAT},
        "version": {"const": VERSION},
        "model": {
            "type": "object",
            "required": ["name", "architecture", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size",
                         "rope_type", "rope_theta", "max_positions", "fingerprint"],
            "properties": {"name": {"type": "string"}, "architecture": {"type": "string"},
                           "n_layers": {"type": "integer", "minimum": 1}, "n_heads": {"type": "integer", "minimum": 1},
                           "n_kv_heads": {"type": "integer", "minimum": 1},
                           "head_dim": {"type": "integer", "minimum": 1}, "hidden_size": {"type": "integer", "minimum": 1},
                           "rope_type": {"type": "string"}, "rope_theta": _num,
                           "max_positions": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
                           "fingerprint": {"type": "string"}},
        },
        "block": {"const": 64},
        "proxy": {
            "type": "object",
            "required": list(PROXY_DEFAULTS),
            "additionalProperties": False,
            "properties": {"last_rows": {"type": "integer", "minimum": 1},
                           "aggregate": {"enum": ["sum", "max", "logits"]},
                           "diag_norm": {"enum": ["sum", "mean", "prior"]},
                           "sink": {"type": "integer", "minimum": 0}, "local": {"type": "integer", "minimum": 1},
                           "prior": {"type": "number", "minimum": 0}},
        },
        "provenance": {"type": "object"},
        "heads": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["layer", "head", "pattern", "params"],
                "additionalProperties": False,
                "properties": {
                    "layer": {"type": "integer", "minimum": 0},
                    "head": {"type": "integer", "minimum": 0},
                    "pattern": {"enum": list(PARAMS)},
                    "params": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
                    "recall": {"type": "object", "properties": {"mean": _num, "worst": _num}},
                    "density": {"type": "object", "properties": {"logical": _num, "physical": _num}},
                    "oracle": _nullable_num,
                    "evidence": {"type": "object"},
                    "minference": {"type": "array", "minItems": 4, "maxItems": 4},
                    "fixed": {"type": "boolean"},
                },
            },
        },
    },
}


class ConfigError(ValueError):
    """A head config that does not fit; the message names the field and the fix."""


@dataclass
class HeadEntry:
    """The choice for one (layer, query head). `params` sizes are tokens ("block": topk in blocks).

    recall: captured mass {"mean", "worst"} over calibration samples; density: {"logical",
    "physical"}; oracle: mean captured mass of the best same-budget index; evidence: per-candidate
    scores; minference: the raw MInference entry this head was imported from, exported verbatim while
    the head keeps that pattern and those sizes; its score (`minference[3]`) is MInference's opaque value,
    never a recall. Change a head with `HeadConfig.edit`, which says whether that score stays.
    fixed: the model itself fixes this head's attention (a sliding-window layer): the entry is
    ashape(sink=0, window=the model's window), never searched or edited, and runs exactly as the model does.
    """

    layer: int
    head: int
    pattern: str
    params: dict[str, int]
    recall: dict[str, float] | None = None
    density: dict[str, float] | None = None
    oracle: float | None = None
    evidence: dict[str, Any] | None = None
    minference: list | None = None
    fixed: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layer": self.layer, "head": self.head, "pattern": self.pattern, "params": dict(self.params)}
        for name in ("recall", "density", "oracle", "evidence", "minference"):
            value = getattr(self, name)
            if value is not None:
                d[name] = copy.deepcopy(value)
        if self.fixed:
            d["fixed"] = True
        return d

    @classmethod
    def model_fixed(cls, layer: int, head: int, window: int) -> HeadEntry:
        """The entry of a head on a sliding-window layer: what the model runs (keys i - window < j <= i)."""
        return cls(layer, head, "ashape", {"sink": 0, "window": window}, fixed=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadEntry:
        return cls(**copy.deepcopy(d))

    def restore(self, d: dict[str, Any]) -> None:
        """Set every field back to `d` (this entry's earlier `to_dict()`), in place: undoes a refused edit."""
        self.__dict__.update(vars(HeadEntry.from_dict(d)))

    def label(self) -> str:
        return self.pattern + "(" + ", ".join(f"{k}={v}" for k, v in self.params.items()) + ")"


def model_heads(shape: ModelShape, free: Callable[[int, int], HeadEntry]) -> list[HeadEntry]:
    """Every head of the model in config order: on a sliding-window layer the model's own entry
    (`HeadEntry.model_fixed`), elsewhere `free(layer, head)`."""
    return [HeadEntry.model_fixed(l, h, shape.window(l)) if shape.window(l) is not None else free(l, h)
            for l in range(shape.n_layers) for h in range(shape.n_heads)]


@dataclass
class HeadConfig:
    """Per-head pattern choices for one model. `heads` is sorted by (layer, head)."""

    model: dict[str, Any]
    heads: list[HeadEntry]
    provenance: dict[str, Any] = field(default_factory=dict)
    proxy: dict[str, Any] = field(default_factory=lambda: dict(PROXY_DEFAULTS))
    block: int = 64

    @classmethod
    def every_head(cls, shape: ModelShape, pattern: str, params: dict[str, int], **provenance: Any) -> HeadConfig:
        """`pattern(params)` on every head the model leaves free; a sliding-window layer's heads as the model
        runs them (fixed)."""
        heads = model_heads(shape, lambda l, h: HeadEntry(l, h, pattern, dict(params)))
        cfg = cls(model=shape.to_dict(), heads=heads, provenance=dict(provenance))
        cfg.check("every_head")
        return cfg

    # ---- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": copy.deepcopy(self.model), "block": self.block,
                "proxy": dict(self.proxy), "provenance": copy.deepcopy(self.provenance),
                "heads": [h.to_dict() for h in self.heads]}

    @classmethod
    def from_dict(cls, d: Any, source: str = "config") -> HeadConfig:
        """Check `d` against `SCHEMA` and the per-head rules, then build the config."""
        check_schema(d, source)
        cfg = cls(model=copy.deepcopy(d["model"]), heads=[HeadEntry.from_dict(h) for h in d["heads"]],
                  provenance=copy.deepcopy(d["provenance"]), proxy=dict(d["proxy"]), block=d["block"])
        cfg.check(source)
        return cfg

    def save(self, path: str | Path) -> Path:
        """Write atomically (a reader sees the old file or the whole new one)."""
        self.check("config")
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path, model_shape: ModelShape | None = None) -> HeadConfig:
        """Read and check a config; with `model_shape`, also `validate` it against that model."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"head config {path} does not exist: run `workbench search` to make one")
        try:
            data = read_json(path, "head config")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if isinstance(data, list):
            raise ConfigError(f"{path} is a list, which looks like a MInference config: convert it with "
                              f"`workbench export {path} --from minference --shape MODEL --format workbench --out OUT` "
                              "(MODEL: a config.json, a cached hub id or a named shape) or load it with "
                              "HeadConfig.load_minference(path, shape)")
        cfg = cls.from_dict(data, source=str(path))
        if model_shape is not None:
            cfg.validate(model_shape)
        return cfg

    # ---- checks --------------------------------------------------------------------------------
    def check(self, source: str = "config") -> None:
        """Every (layer, head) of the model exactly once, in order, with the parameters its pattern needs,
        each an integer in [low, model.max_positions] (`*_milli` thresholds: <= 1000); a rank view's
        `provenance.tensor_parallel` consistent with its heads."""
        n_layers, n_heads = self.model["n_layers"], self.model["n_heads"]
        total = n_layers * n_heads
        got = [(e.layer, e.head) for e in self.heads]
        if len(got) != total or got != [divmod(i, n_heads) for i in range(total)]:
            if total > 8 * len(got) + 4096:  # do not list the heads of an absurd model section
                what = f"{len(got)} entries, but model says {n_layers} layers x {n_heads} heads"
            else:
                expected = {divmod(i, n_heads) for i in range(total)}
                missing, extra = sorted(expected - set(got)), sorted(set(got) - expected)
                dup = len(got) - len(set(got))
                what = (f"missing (layer, head) {missing[:5]}" if missing else
                        f"(layer, head) {extra[:5]} outside the model's {n_layers} layers x {n_heads} heads" if extra
                        else f"{dup} duplicate entries" if dup else "entries out of (layer, head) order")
            raise ConfigError(f"{source}: heads has {what}: list each of the {total} heads once, "
                              "sorted by layer then head")
        limit = self.model["max_positions"]
        for i, e in enumerate(self.heads):
            want = PARAMS.get(e.pattern)
            if want is None:
                raise ConfigError(f"{source}: heads[{i}] (layer {e.layer}, head {e.head}) pattern {e.pattern!r} is "
                                  f"unknown: use one of {list(PARAMS)}")
            if set(e.params) != set(want):
                raise ConfigError(f"{source}: heads[{i}] (layer {e.layer}, head {e.head}) pattern {e.pattern!r} "
                                  f"needs params {list(want)}, got {sorted(e.params)}: set exactly those")
            for k, v in e.params.items():
                low, high = (0 if k in ("sink", "vertical") else 1), (1000 if k.endswith("_milli") else limit)
                where = f"{source}: heads[{i}].params.{k} = {v!r} (layer {e.layer}, head {e.head})"
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ConfigError(f"{where} is not a whole number: write an integer such as {low + 1} "
                                      "(no decimals, quotes or booleans)")
                if v < low:
                    raise ConfigError(f"{where} must be >= {low}: use a value from {low} to {high}")
                if v > high:
                    unit = ("thousandths (1000 = 1.0)" if k.endswith("_milli") else
                            f"the model's max length model.max_positions = {limit}")
                    raise ConfigError(f"{where} is outside [{low}, {high}]: sizes cannot exceed {unit}; "
                                      f"use a value from {low} to {high}")
            score = e.minference[3] if e.minference and len(e.minference) == 4 else None
            if isinstance(score, float) and not math.isfinite(score):
                raise ConfigError(f"{source}: heads[{i}].minference score is {score} (layer {e.layer}, head "
                                  f"{e.head}): JSON has no such number; write null")
        self._rank_view(source)
        for i, e in enumerate(self.heads):
            if pattern_class(e.pattern).kv_shared:
                mates = [self.heads[e.layer * n_heads + h] for h in self.kv_group(e.head)]
                odd = next((m for m in mates if (m.pattern, m.params) != (e.pattern, e.params)), None)
                if odd is not None:
                    first, last = mates[0].head, mates[-1].head
                    raise ConfigError(f"{source}: heads[{i}] (layer {e.layer}, head {e.head}) is {e.label()}, one index "
                                      f"shared by the query heads {first}..{last} of its KV head, but head {odd.head} is "
                                      f"{odd.label()}: give all of heads {first}..{last} the same {e.pattern!r} entry "
                                      "(`HeadConfig.edit` moves the whole group) or none of them")
        for i, e in enumerate(self.heads):
            window = self.window(e.layer)
            if window is not None and not (e.fixed and e.pattern == "ashape" and e.params == {"sink": 0, "window": window}):
                raise ConfigError(f"{source}: heads[{i}]: {self.fixed_reason(e.layer, e.head)}; write it as "
                                  f'{{"pattern": "ashape", "params": {{"sink": 0, "window": {window}}}, "fixed": true}} '
                                  "(what `workbench search` writes)")
            if window is None and e.fixed:
                raise ConfigError(f"{source}: heads[{i}] (layer {e.layer}, head {e.head}) is marked fixed but layer "
                                  f"{e.layer} has full attention: drop \"fixed\" from that entry")

    def window(self, layer: int) -> int | None:
        """The model's sliding window on `layer` (its heads are fixed), None for a full-attention layer."""
        types = self.model.get("layer_types") or ()
        return self.model.get("sliding_window") if layer < len(types) and types[layer] == "sliding_attention" else None

    def fixed_reason(self, layer: int, head: int) -> str:
        """Why (layer, head) is not a choice: the model fixes its attention to a sliding window."""
        free = [l for l, t in enumerate(self.model.get("layer_types") or ()) if t != "sliding_attention"]
        return (f"(layer {layer}, head {head}) is fixed by the model: layer {layer} of {self.model.get('name')} is a "
                f"sliding_attention layer that always attends its last {self.window(layer)} tokens, so it has no "
                f"pattern to choose; choose patterns for the full_attention layers {free}")

    def validate(self, shape: ModelShape, strict_weights: bool = False) -> None:
        """Raise ConfigError naming the first mismatch between this config and `shape` (layers, heads, KV
        heads, head_dim, RoPE, max length). Different weights of the same shape only warn, unless
        `strict_weights`."""
        view = self.rank_view
        if view and (shape.n_heads, shape.n_kv_heads) == (view["n_heads"], view["n_kv_heads"]) \
                and shape.n_heads != self.model["n_heads"]:
            raise ConfigError(f"head config is {self.describe_rank_view()}, not a config of the whole {shape.name}: "
                              f"use it on that rank only (its shape has {self.model['n_heads']} query heads), or load "
                              "the whole model's config")
        model = ModelShape.from_dict(self.model)  # fields older configs lack take their defaults
        for key, what in _SHAPE_FIELDS.items():
            mine, theirs = getattr(model, key), getattr(shape, key)
            if mine != theirs:
                raise ConfigError(
                    f"head config does not match the model: model.{key} ({what}) is {mine!r} in the config but "
                    f"{theirs!r} in {shape.name}: run `workbench search --model <this model>` to make a config "
                    "for it, or load the config that was made for it")
        if self.model.get("fingerprint") != shape.fingerprint:
            msg = (f"model.fingerprint {self.model.get('fingerprint')!r} differs from {shape.name}'s "
                   f"{shape.fingerprint!r}: the config was calibrated on other weights of the same shape")
            if strict_weights:
                raise ConfigError(msg + ": re-run `workbench search` for these weights")
            warnings.warn(msg, stacklevel=2)

    # ---- access --------------------------------------------------------------------------------
    def entry(self, layer: int, head: int) -> HeadEntry:
        n = self.model["n_heads"]
        if not (0 <= layer < self.model["n_layers"] and 0 <= head < n):
            raise ConfigError(f"(layer {layer}, head {head}) is outside the config's "
                              f"{self.model['n_layers']} layers x {n} heads")
        return self.heads[layer * n + head]

    def layer(self, layer: int) -> list[HeadEntry]:
        n = self.model["n_heads"]
        self.entry(layer, 0)
        return self.heads[layer * n:(layer + 1) * n]

    def kv_group(self, head: int) -> range:
        """The query heads that share `head`'s KV head (consecutive, `n_heads / n_kv_heads` of them)."""
        group = max(1, self.model["n_heads"] // self.model["n_kv_heads"])
        return range(head - head % group, head - head % group + group)

    def edit(self, layer: int, head: int, pattern: str, params: dict[str, int], *, keep_score: bool) -> HeadEntry:
        """Give one head another pattern / sizes, and its whole KV group (`kv_group`) when the new or the old
        kind shares one index per KV head (`PatternBase.kv_shared`). `keep_score`: keep MInference's opaque
        score of an imported head with the new entry (True) or drop it (False: the export writes null). Our
        recall, density, oracle and evidence described the old choice and are cleared. Returns (layer, head)'s
        entry."""
        e = self.entry(layer, head)
        if e.fixed:
            raise ConfigError(self.fixed_reason(layer, head))
        if pattern not in PARAMS or set(params) != set(PARAMS[pattern]):
            raise ConfigError(f"(layer {layer}, head {head}): pattern {pattern!r} with params {sorted(params)} is not "
                              f"valid: use one of {list(PARAMS)} with exactly its params {PARAMS}")
        shared = pattern_class(pattern).kv_shared or pattern_class(e.pattern).kv_shared
        group = [self.entry(layer, h) for h in (self.kv_group(head) if shared else (head,))]
        before = [m.to_dict() for m in group]
        try:
            for m in group:
                score = m.minference[3] if keep_score and m.minference is not None else None
                m.pattern, m.params = pattern, {k: int(v) for k, v in params.items()}
                m.recall = m.density = m.oracle = m.evidence = None
                m.minference = (_to_minference(m, self.model["max_positions"], score) if keep_score and m.minference
                                else None)
            self.check()
        except Exception:  # a refused edit leaves the config as it was
            for m, d in zip(group, before):
                m.restore(d)
            raise
        return e

    def summary(self) -> dict[str, int]:
        """How many heads use each pattern."""
        out = {p: 0 for p in PARAMS}
        for e in self.heads:
            out[e.pattern] += 1
        return out

    @torch.no_grad()
    def layer_index(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> Stack:
        """Build the index this config prescribes for one layer of one prompt: q `[Hq, N, D]`,
        k `[Hkv, N, D]` -> a Stack of one pattern per query head (proxies run once for all heads)."""
        entries = self.layer(layer)
        hq = q.shape[0]
        if hq != len(entries):
            what = f" ({self.describe_rank_view()})" if self.rank_view else ""
            raise ConfigError(f"q has {hq} heads but the config's layer {layer} has {len(entries)}{what}: "
                              "use the config made for this model")
        parts: dict[int, Any] = {}
        for kind in dict.fromkeys(e.pattern for e in entries):  # each kind's online index, once for all its heads
            parts.update(pattern_class(kind).build([e.params if e.pattern == kind else None for e in entries],
                                                   q, k, scale, self.proxy, self.block))
        return Stack([parts[h] for h in range(hq)])

    # ---- MInference ----------------------------------------------------------------------------
    def to_minference(self) -> list[dict[str, list]]:
        """MInference's format: one dict per layer, head id (str) -> [pattern, vertical, slash, score].

        A-shape -> stream_llm [sink, window]; block -> block_sparse [topk, 0] (MInference itself runs
        top-100 whatever the sizes: a warning names block heads whose topk differs); dense ->
        vertical_and_slash with both sizes = max length. Imported
        heads that still have their imported pattern and sizes are written back verbatim (score included);
        other heads get as score our worst calibration recall, or null when there is none (an imported head
        changed without `HeadEntry.edit(..., keep_score=True)`). Heads fixed by the model (sliding-window
        layers) are written as stream_llm [0, window]: MInference's HF patch would run every head of such a
        layer through its streaming kernel with no sink and that window, which is the model's own mask;
        importing the file for the same model marks them fixed again.

        Head ids are global: a tensor-parallel rank's view (`for_rank(r, T)`) writes, in every layer, the
        keys str(r * H/T + h) for its local heads h = 0..H/T-1. That is what MInference's vLLM forward
        looks up on rank r: it reads `{int(key): entry}` of `config[layer_idx]` and asks for
        `head + get_tensor_model_parallel_rank() * q.size(-2)` (local head plus rank times local heads).
        """
        view = self.rank_view
        global_ids = view["heads"] if view else range(self.model["n_heads"])
        if str(self.model.get("architecture", "")).startswith("gemma"):
            warnings.warn(f"{self.model.get('name')}: MInference's Hugging Face patch swaps every attention and "
                          "decoder-layer forward for its Llama ones, which skip Gemma's QK-norm and its extra norms: "
                          "MInference cannot run this model from the file as is (its sliding-window layers are "
                          "written as stream_llm [0, window])", stacklevel=2)
        out: list[dict[str, list]] = [{} for _ in range(self.model["n_layers"])]
        for e in self.heads:
            raw = e.minference
            where = f"heads[{e.layer * self.model['n_heads'] + e.head}].minference"
            if raw is not None and _parse_minference_entry(raw, self.model["max_positions"], where) == (e.pattern, e.params):
                entry = copy.deepcopy(raw)
            else:
                score = e.recall.get("worst") if e.recall and raw is None else None
                entry = _to_minference(e, self.model["max_positions"], score)
            out[e.layer][str(global_ids[e.head])] = entry
        _warn_block_topk([e for e in self.heads if e.pattern == "block"], "the export")
        return out

    @classmethod
    def load_minference(cls, path: str | Path, shape: ModelShape, fill_missing: bool = False) -> HeadConfig:
        """Read a MInference config file for `shape` (see `from_minference`); errors name the file."""
        return cls.from_minference(read_minference(path), shape, source=str(path), fill_missing=fill_missing,
                                   provenance={"path": str(path)})

    @classmethod
    def from_minference(cls, data: Any, shape: ModelShape, source: str = "minference config",
                        provenance: dict[str, Any] | None = None, fill_missing: bool = False) -> HeadConfig:
        """Import a MInference config for `shape` (only its shape is needed: `workbench.core.shapes`).

        Strict by default: one dict per layer, every head of the shape present once under its canonical
        key ("4", not "04"), known pattern names, integer sizes >= 0. `fill_missing=True` accepts what
        MInference itself would run: a missing head (or an empty layer) gets its default
        vertical_and_slash (1000, 6096), and keys are read with int() as its vLLM path does; a warning
        names each filled head and `provenance.filled` lists them. stream_llm sizes become (sink, window);
        sizes above the shape's max length are refused. block_sparse heads keep the file's vertical_size as
        topk, with a warning that MInference runs them at top-100 (`provenance.minference_block_topk`).
        The score (4th field) is kept verbatim in `HeadEntry.minference` and never read; a NaN or infinite
        score (which is not JSON) becomes null, with a warning.
        """
        where = f"{source}:"
        if isinstance(data, dict):
            hint = ("it is a workbench head config: drop `--from minference`" if data.get("format") == FORMAT else
                    "a MInference config is a JSON list with one {head: [pattern, vertical_size, slash_size, score]} "
                    "dict per layer: give the file MInference loads")
            raise ConfigError(f"{where} top level is an object, not a list of layers: {hint}")
        if not isinstance(data, list):
            raise ConfigError(f"{where} top level is {type(data).__name__}, not a list of layers: a MInference config "
                              "is a JSON list with one {head: [pattern, vertical_size, slash_size, score]} dict per layer")
        if len(data) != shape.n_layers:
            raise ConfigError(f"{where} has {len(data)} layers but {shape.name} has {shape.n_layers}: give the --shape "
                              "of the model this file was made for")
        heads, filled, renamed, nonfinite = [], [], [], []
        for l, layer in enumerate(data):
            if not isinstance(layer, dict):
                raise ConfigError(f"{where} layer {l} is {type(layer).__name__}, not a {{head: entry}} dict: write "
                                  "each layer as an object keyed by head id")
            for key in getattr(layer, "duplicates", ()):
                raise ConfigError(f"{where} layer {l}: head key {key!r} appears twice (JSON keeps only the last): "
                                  "keep one entry per head")
            entries: dict[int, HeadEntry] = {}
            for key, raw in layer.items():
                h = _head_key(key, l, shape, where, fill_missing)
                if h in entries:
                    raise ConfigError(f"{where} layer {l}: keys for head {h} appear twice (e.g. {key!r}): keep one "
                                      "entry per head, keyed by its plain number")
                if key != str(h):
                    renamed.append((l, key))
                pattern, params = _parse_minference_entry(raw, shape.max_positions, f"{where} layer {l}, head {h}")
                raw = list(raw)
                if isinstance(raw[3], float) and not math.isfinite(raw[3]):
                    nonfinite.append((l, h, raw[3]))
                    raw[3] = None
                entries[h] = HeadEntry(l, h, pattern, params, minference=raw)
            missing = [h for h in range(shape.n_heads) if h not in entries]
            if missing and not fill_missing:
                what = "is empty" if not entries else f"lacks heads {format_ranges(missing)}"
                raise ConfigError(f"{where} layer {l} {what} ({shape.name} has heads 0..{shape.n_heads - 1}): MInference "
                                  f"would run them as vertical_and_slash {MINFERENCE_DEFAULT}; add them to the file, or "
                                  "pass --fill-missing (fill_missing=True) to accept that default")
            for h in range(shape.n_heads):
                if h not in entries:
                    filled.append([l, h])
                    sizes = (min(x, shape.max_positions) for x in MINFERENCE_DEFAULT)  # no prompt is longer
                    heads.append(HeadEntry(l, h, "vs", dict(zip(PARAMS["vs"], sizes))))
                    continue
                heads.append(entries[h])
        if filled:
            listed = ", ".join(f"layer {l} head {h}" for l, h in filled[:40]) + (" ..." if len(filled) > 40 else "")
            warnings.warn(f"{source}: {len(filled)} heads missing from the file got MInference's default "
                          f"vertical_and_slash {MINFERENCE_DEFAULT}: {listed}", stacklevel=2)
        if renamed:
            warnings.warn(f"{source}: read {len(renamed)} non-canonical head keys with int() as MInference's vLLM "
                          f"path does (e.g. layer {renamed[0][0]} key {renamed[0][1]!r}); the export writes plain numbers",
                          stacklevel=2)
        if nonfinite:
            l, h, v = nonfinite[0]
            warnings.warn(f"{source}: {len(nonfinite)} scores are NaN or infinite (e.g. layer {l} head {h}: {v}), "
                          "which JSON has no number for: kept as null (MInference never reads the score)", stacklevel=2)
        blocks = [e for e in heads if e.pattern == "block"]
        _warn_block_topk(blocks, f"{source} (import)")
        for e in heads:  # a sliding layer's stream_llm [0, window] is the model's own attention
            if (e.pattern, e.params) == ("ashape", {"sink": 0, "window": shape.window(e.layer)}):
                e.fixed = True
        prov = {"source": "minference", **(provenance or {})}
        if blocks:
            prov["minference_block_topk"] = MINFERENCE_BLOCK_TOPK
        if filled:
            prov["filled"] = filled
        cfg = cls(model=shape.to_dict(), heads=heads, provenance=prov)
        cfg.check(source)
        return cfg

    # ---- tensor parallelism --------------------------------------------------------------------
    @property
    def rank_view(self) -> dict[str, Any] | None:
        """`provenance.tensor_parallel` of a rank's view (`for_rank`): {"size", "rank", "heads" (the global
        query head of each local head), "head_offset", "kv_heads" (global), "kv_replicas", "n_heads",
        "n_kv_heads" (the whole model's)}; None for a whole model's config."""
        return self._rank_view("config")

    def describe_rank_view(self) -> str:
        v = self.rank_view
        if v is None:
            return "the whole model's config"
        return (f"the view of tensor-parallel rank {v['rank']} of {v['size']} (global heads "
                f"{format_ranges(v['heads'])} of the model's {v['n_heads']})")

    def _rank_view(self, source: str) -> dict[str, Any] | None:
        """The normalised rank record, completing one written before it listed its global heads and the
        model's head counts; ConfigError when it does not fit the heads."""
        tp = self.provenance.get("tensor_parallel")
        if tp is None:
            return None
        where = f"{source}: provenance.tensor_parallel"
        if not isinstance(tp, dict) or not all(_is_int(tp.get(k)) for k in ("size", "rank")):
            raise ConfigError(f"{where} must be an object with integer size and rank (a rank's view records them): "
                              "make the view again with `workbench export FULL_CONFIG --tp T --rank R`")
        size, rank, h_local, kv_local = tp["size"], tp["rank"], self.model["n_heads"], self.model["n_kv_heads"]
        replicas = tp.get("kv_replicas", 1)
        full = {"n_heads": tp.get("n_heads", h_local * size),
                "n_kv_heads": tp.get("n_kv_heads", size // replicas if replicas > 1 else kv_local * size)}
        try:
            if tp_split(full["n_heads"], full["n_kv_heads"], size) != (h_local, kv_local) or not 0 <= rank < size:
                raise ConfigError("inconsistent")
        except (ConfigError, TypeError, ZeroDivisionError):
            raise ConfigError(f"{where} (size {size}, rank {rank}, model heads {full['n_heads']} / KV heads "
                              f"{full['n_kv_heads']}) does not fit the view's {h_local} query / {kv_local} KV heads: "
                              "make the view again with `workbench export FULL_CONFIG --tp T --rank R`") from None
        heads = list(range(rank * h_local, (rank + 1) * h_local))
        kv = list(rank_kv_heads(rank, full["n_kv_heads"], size))
        view = {"size": size, "rank": rank, "heads": heads, "head_offset": heads[0], "kv_heads": kv,
                "kv_replicas": max(1, size // full["n_kv_heads"]), **full}
        for key in ("heads", "head_offset", "kv_heads"):
            if key in tp and tp[key] != view[key]:
                raise ConfigError(f"{where}.{key} is {tp[key]} but rank {rank} of {size} holds {view[key]}: the "
                                  "view was edited by hand; make it again with `workbench export FULL_CONFIG --tp "
                                  f"{size} --rank {rank}`")
        return view

    def for_rank(self, rank: int, tp_size: int) -> HeadConfig:
        """The config one tensor-parallel rank sees: its H / tp query heads, numbered locally from 0
        (global head = rank * H_local + local head), with the model shape of one rank (KV heads
        replicated when tp exceeds their number). `provenance.tensor_parallel` records the size, rank,
        the global id of every local head, the rank's global KV heads and the whole model's head counts;
        `to_minference()` of the view writes global keys.

        A view can be split again only into heads it holds (the same rank, or a rank of a larger tp
        size inside it): it maps through its global ids, and refuses other ranks naming the heads they need."""
        view = self.rank_view
        n_heads, n_kv = (view["n_heads"], view["n_kv_heads"]) if view else (self.model["n_heads"], self.model["n_kv_heads"])
        if not (_is_int(tp_size) and tp_size >= 1):
            raise ConfigError(f"tensor-parallel size {tp_size!r} must be an integer >= 1: use a size that divides "
                              f"the model's {n_heads} query heads")
        h_local, kv_local = tp_split(n_heads, n_kv, tp_size)
        if not (_is_int(rank) and 0 <= rank < tp_size):
            raise ConfigError(f"rank {rank} is outside tensor-parallel size {tp_size}: use 0..{tp_size - 1}")
        global_ids = view["heads"] if view else list(range(n_heads))
        wanted = range(rank * h_local, (rank + 1) * h_local)
        lacking = [g for g in wanted if g not in global_ids]
        if lacking:
            which = "none of them" if len(lacking) == len(wanted) else f"not {format_ranges(lacking)}"
            raise ConfigError(f"this head config is {self.describe_rank_view()}: rank {rank} of {tp_size} needs "
                              f"global heads {format_ranges(list(wanted))}, and it holds {which}: split the whole "
                              f"model's config instead (`workbench export FULL_CONFIG --tp {tp_size} --rank {rank}`)")
        model = dict(self.model, n_heads=h_local, n_kv_heads=kv_local)
        kv0 = rank_kv_heads(rank, n_kv, tp_size).start
        heads = [HeadEntry.from_dict({**e.to_dict(), "head": global_ids[e.head] - wanted.start})
                 for e in self.heads if global_ids[e.head] in wanted]
        prov = dict(self.provenance, tensor_parallel={
            "size": tp_size, "rank": rank, "heads": list(wanted), "head_offset": wanted.start,
            "kv_heads": list(range(kv0, kv0 + kv_local)), "kv_replicas": max(1, tp_size // n_kv),
            "n_heads": n_heads, "n_kv_heads": n_kv})
        return HeadConfig(model=model, heads=heads, provenance=prov, proxy=dict(self.proxy), block=self.block)


def check_schema(d: Any, source: str = "config") -> None:
    """Raise ConfigError naming the first field that breaks `SCHEMA`. Integers are strict (16, not 16.0, as
    in the MInference import) and numbers finite (NaN is not JSON)."""
    errors = sorted(_validator().iter_errors(d), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path).lstrip(".") or "top level"
        raise ConfigError(f"{source}: field {where}: {e.message}: fix that field "
                          "(`workbench export --format schema` prints the schema)")


def _validator() -> Any:
    import jsonschema

    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many({
        "integer": lambda _, v: _is_int(v),
        "number": lambda _, v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)})
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)(SCHEMA)


def tp_split(n_heads: int, n_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank. Query heads must split evenly; KV heads either split evenly or,
    when tp_size exceeds their number and is a multiple of it, are replicated: each rank holds one KV
    head (the one its query heads read), shared by tp_size / n_kv_heads ranks (vLLM's rule)."""
    if not (_is_int(tp_size) and tp_size >= 1):
        raise ConfigError(f"tensor-parallel size {tp_size!r} must be an integer >= 1: use a size that divides "
                          f"{n_heads} query heads, e.g. 1, 2 or 4")
    kv_ok = n_kv_heads % tp_size == 0 if n_kv_heads >= tp_size else tp_size % n_kv_heads == 0
    if n_heads % tp_size or not kv_ok:
        raise ConfigError(f"tensor-parallel size {tp_size} does not split {n_heads} query heads and {n_kv_heads} "
                          f"KV heads: use a size that divides {n_heads} and either divides {n_kv_heads} or is a "
                          f"multiple of it (KV heads are then replicated)")
    return n_heads // tp_size, max(1, n_kv_heads // tp_size)


def rank_kv_heads(rank: int, n_kv_heads: int, tp_size: int) -> range:
    """The global KV heads rank `rank` holds: a contiguous slice, or the one replicated head
    rank * n_kv_heads // tp_size when tp_size > n_kv_heads."""
    if n_kv_heads >= tp_size:
        per = n_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    kv = rank * n_kv_heads // tp_size
    return range(kv, kv + 1)


def global_head(rank: int, local: int, tp_size: int, n_heads: int) -> int:
    """Rank `rank`'s local head `local` -> global head rank * H_local + local."""
    h_local = n_heads // tp_size
    if not (0 <= rank < tp_size and 0 <= local < h_local) or n_heads % tp_size:
        raise ConfigError(f"(rank {rank}, local head {local}) is invalid for {n_heads} heads over {tp_size} ranks")
    return rank * h_local + local


def local_head(head: int, tp_size: int, n_heads: int) -> tuple[int, int]:
    """Global head -> (rank, local head)."""
    if n_heads % tp_size or not 0 <= head < n_heads:
        raise ConfigError(f"head {head} cannot be placed: {n_heads} heads over {tp_size} ranks")
    return divmod(head, n_heads // tp_size)


def _to_minference(e: HeadEntry, max_positions: int, score: Any = None) -> list:
    """[pattern, vertical, slash, score] of one head: the kind's `minference_sizes` (dense: both sizes =
    max length, as MInference writes a dense head)."""
    cls = pattern_class(e.pattern)
    if cls.minference_name:
        return [cls.minference_name, *cls.minference_sizes(e.params), score]
    if e.pattern != "dense":
        hint = (f"MInference runs it model-wide as attn_type={MINFERENCE_ATTN_TYPES[e.pattern]!r}"
                if e.pattern in MINFERENCE_ATTN_TYPES else "MInference has no equivalent")
        raise ConfigError(f"layer {e.layer}, head {e.head}: pattern {e.pattern!r} has no entry in MInference's per-head "
                          f"format ({hint}): export the workbench format, or re-search without {e.pattern!r} candidates")
    return [MINFERENCE_NAMES["vs"], max_positions, max_positions, score]


def _from_minference_entry(raw: Any, max_positions: int) -> tuple[str, dict[str, int]]:
    """(pattern, params) of a checked entry (see `_parse_minference_entry`): the kind of its name, sizes through
    the kind's `from_minference_sizes`; a vertical_and_slash entry with both sizes >= max length is dense."""
    name, v, s = raw[0], raw[1], raw[2]
    kind = next(k for k, n in MINFERENCE_NAMES.items() if n == name)
    if kind == "vs" and v >= max_positions and s >= max_positions:
        return "dense", {}
    return kind, PATTERNS[kind].from_minference_sizes(v, s)


def _parse_minference_entry(raw: Any, max_positions: int, where: str) -> tuple[str, dict[str, int]]:
    """Check one MInference entry; errors say where, which field and how to fix it."""
    if not isinstance(raw, list) or len(raw) != 4:
        raise ConfigError(f"{where}: entry {json.dumps(raw)} is not [pattern, vertical_size, slash_size, score]: write "
                          'four fields, e.g. ["vertical_and_slash", 1000, 6096, 0.9]')
    if raw[0] not in MINFERENCE_NAMES.values():
        raise ConfigError(f"{where}: field pattern is {raw[0]!r}: use one of MInference's names "
                          f"{sorted(MINFERENCE_NAMES.values())}")
    for i in (1, 2):
        value = raw[i]
        if not _is_int(value) or value < 0:
            raise ConfigError(f"{where}: field {_MINFERENCE_FIELDS[i]} is {json.dumps(value)}: write a whole number "
                              "of tokens >= 0 (no quotes, booleans or decimals), e.g. 1000")
        if value > max_positions:
            raise ConfigError(f"{where}: field {_MINFERENCE_FIELDS[i]} is {value}, above the model's max length "
                              f"{max_positions}: use at most {max_positions} (both sizes = {max_positions} is a "
                              "dense head), or give the --shape of the model this file was made for")
    return _from_minference_entry(raw, max_positions)


def _head_key(key: str, layer: int, shape: ModelShape, where: str, lenient: bool) -> int:
    """The head id of a layer dict's key; refuses non-numbers, out-of-range heads and (unless
    `lenient`, which reads keys with int() like MInference's vLLM path) non-canonical spellings."""
    try:
        h = int(key)
    except ValueError:
        raise ConfigError(f"{where} layer {layer}: head key {key!r} is not a head number: key each entry by its "
                          f"head id 0..{shape.n_heads - 1}") from None
    if not 0 <= h < shape.n_heads:
        raise ConfigError(f"{where} layer {layer}: head key {key!r} is outside {shape.name}'s heads "
                          f"0..{shape.n_heads - 1}: give the --shape of the model this file was made for")
    if key != str(h) and not lenient:
        raise ConfigError(f"{where} layer {layer}: head key {key!r} is not canonical: write it as \"{h}\" "
                          f"(MInference's vLLM path reads it as head {h} but its Hugging Face path looks up "
                          f"\"{h}\" and misses it), or pass --fill-missing to read keys with int()")
    return h


def _warn_block_topk(blocks: list[HeadEntry], what: str) -> None:
    """Say that MInference runs block_sparse heads at top-100 blocks when some of `blocks` ask otherwise."""
    other = [e for e in blocks if e.params["topk"] != MINFERENCE_BLOCK_TOPK]
    if other:
        e = other[0]
        warnings.warn(f"{what}: {len(other)} block_sparse heads (e.g. layer {e.layer} head {e.head}: topk "
                      f"{e.params['topk']}) run at top-{MINFERENCE_BLOCK_TOPK} blocks in MInference, whose "
                      "block_sparse kernel ignores the entry's sizes; the workbench runs the topk written there",
                      stacklevel=3)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Layer(dict):
    """A JSON object that remembers keys it saw twice (json.loads keeps only the last)."""

    duplicates: tuple[str, ...] = ()


def _pairs(pairs: list[tuple[str, Any]]) -> _Layer:
    d = _Layer(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        d.duplicates = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return d


def read_minference(path: str | Path) -> Any:
    """The JSON of a MInference config file (duplicate keys remembered); errors name the file and the fix."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give an existing MInference config file")
    try:
        return read_json(path, "MInference config", object_pairs_hook=_pairs)
    except ValueError as e:
        raise ConfigError(f"{e} (a MInference config is a JSON list of per-layer dicts)") from None
