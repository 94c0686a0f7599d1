"""Model shapes without weights: from a Hugging Face config.json, a hub id in the local cache, or a name.

`resolve_shape(spec)` gives the `ModelShape` a head config is checked against (layers, query/KV heads,
head_dim, RoPE, max length), the same fields `load_model` reports, without loading any weights:

- a path to a `config.json` (or to a folder holding one);
- a hub id (`org/name`) whose config.json is in the local Hugging Face cache (offline: nothing is
  downloaded);
- a name from `NAMED` (case-insensitive; the hub ids of those models work too, cached or not).

Shapes read this way have no weights fingerprint: `fingerprint` is `SHAPE_ONLY`, so `HeadConfig.validate`
against the real model warns that the weights were not checked. The embedded SmolLM2 shape carries the
embedded weights' fingerprint (it is the model the shipped config was searched on).
Config field names differ by family: Llama/Qwen2/Phi-3/Yi (`num_hidden_layers`, `num_key_value_heads`, ...)
and ChatGLM/GLM-4 (`num_layers`, `multi_query_group_num`, `kv_channels`, `seq_length`, RoPE base =
10000 * `rope_ratio`) are read.

`random_model(spec, n_layers)` builds a model of such a shape with random weights directly on the target
device (`--random-weights SHAPE`): the time and memory of a run at that shape, without the weights.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.core.model import ModelError, ModelShape

SHAPE_ONLY = "shape-only"
EMBEDDED_FINGERPRINT = "fb37f3abe69130ac"  # the embedded SmolLM2-135M-Instruct weights (configs/SmolLM2-135M-Instruct.json)

_LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "rms_norm_eps": 1e-5}
_QWEN_7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "rms_norm_eps": 1e-6}
# The fields of each model's published config.json that the shape needs (name -> (hub id, fields)).
NAMED: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama-3-8B": ("meta-llama/Meta-Llama-3-8B-Instruct",
                   {**_LLAMA_8B, "max_position_embeddings": 8192, "rope_theta": 500000.0}),
    "Llama-3-8B-262k": ("gradientai/Llama-3-8B-Instruct-262k",
                        {**_LLAMA_8B, "max_position_embeddings": 262144, "rope_theta": 283461213.0}),
    "Llama-3-8B-1048k": ("gradientai/Llama-3-8B-Instruct-Gradient-1048k",
                         {**_LLAMA_8B, "max_position_embeddings": 1048576, "rope_theta": 3580165449.0}),
    "Llama-3.1-8B": ("meta-llama/Llama-3.1-8B-Instruct",
                     {**_LLAMA_8B, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    "Qwen2.5-7B": ("Qwen/Qwen2.5-7B-Instruct",
                   {**_QWEN_7B, "max_position_embeddings": 32768, "rope_theta": 1000000.0}),
    "Qwen2.5-7B-1M": ("Qwen/Qwen2.5-7B-Instruct-1M",
                      {**_QWEN_7B, "max_position_embeddings": 1010000, "rope_theta": 10000000.0}),
    "Phi-3-mini": ("microsoft/Phi-3-mini-128k-instruct",
                   {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
                    "max_position_embeddings": 131072, "rope_theta": 10000.0,
                    "rope_scaling": {"type": "longrope"}}),
    "GLM-4-9B": ("THUDM/glm-4-9b-chat",
                 {"model_type": "chatglm", "hidden_size": 4096, "num_layers": 40, "num_attention_heads": 32,
                  "multi_query_attention": True, "multi_query_group_num": 2, "kv_channels": 128,
                  "ffn_hidden_size": 13696, "padded_vocab_size": 151552, "seq_length": 131072, "rope_ratio": 500}),
    "GLM-4-9B-1M": ("THUDM/glm-4-9b-chat-1m",
                    {"model_type": "chatglm", "hidden_size": 4096, "num_layers": 40, "num_attention_heads": 32,
                     "multi_query_attention": True, "multi_query_group_num": 4, "kv_channels": 128,
                     "ffn_hidden_size": 13696, "padded_vocab_size": 151552, "seq_length": 1048576,
                     "rope_ratio": 10000}),
    "Yi-9B": ("01-ai/Yi-9B-200K",
              {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 48, "num_attention_heads": 32,
               "num_key_value_heads": 4, "intermediate_size": 11008, "vocab_size": 64000,
               "max_position_embeddings": 262144, "rope_theta": 10000000.0}),
    "SmolLM2-135M-Instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct",
                              {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
                               "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                               "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
                               "max_position_embeddings": 8192, "rope_theta": 100000.0}),
}
_ALIASES = {"embedded": "SmolLM2-135M-Instruct", "smollm2": "SmolLM2-135M-Instruct"}


def _field(cfg: dict[str, Any], source: str, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is None:
        raise ModelError(f"{source}: no {' / '.join(names)} field: give the model's own config.json")
    return default


def shape_from_hf_config(cfg: dict[str, Any], name: str, source: str = "config.json",
                         fingerprint: str = SHAPE_ONLY) -> ModelShape:
    """A Hugging Face config.json (as a dict) -> ModelShape, with the values `load_model` would report."""
    if not isinstance(cfg, dict):
        raise ModelError(f"{source}: a config.json is a JSON object, got {type(cfg).__name__}")
    text = cfg.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers keep the language model's fields here
        cfg = {**cfg, **text}
    n_heads = int(_field(cfg, source, "num_attention_heads", "n_head"))
    hidden = int(_field(cfg, source, "hidden_size", "n_embd"))
    kv = cfg.get("num_key_value_heads")
    if kv is None and cfg.get("multi_query_attention"):
        kv = cfg.get("multi_query_group_num")
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)  # transformers' name for Phi-3's "su"
    theta = scaling.get("rope_theta") or cfg.get("rope_theta")
    if theta is None and cfg.get("rope_ratio") is not None:  # ChatGLM: base = 10000 * rope_ratio
        theta = 10000.0 * cfg["rope_ratio"]
    return ModelShape(
        name=name,
        architecture=str(cfg.get("model_type", "unknown")),
        n_layers=int(_field(cfg, source, "num_hidden_layers", "num_layers", "n_layer")),
        n_heads=n_heads,
        n_kv_heads=int(kv or n_heads),
        head_dim=int(_field(cfg, source, "head_dim", "kv_channels", default=hidden // n_heads)),
        hidden_size=hidden,
        rope_type=rope_type,
        rope_theta=float(theta or 10000.0),
        max_positions=int(_field(cfg, source, "max_position_embeddings", "seq_length", "n_positions")),
        fingerprint=fingerprint,
    )


def _named(name: str) -> tuple[dict[str, Any], str, str, str]:
    key = _ALIASES.get(name.lower(), name)
    for short, (hub, cfg) in NAMED.items():
        if key.lower() in (short.lower(), hub.lower()):
            fp = EMBEDDED_FINGERPRINT if short == "SmolLM2-135M-Instruct" else SHAPE_ONLY
            return dict(cfg), short, f"named shape {short}", fp
    raise ModelError(f"unknown shape {name!r}: use a config.json path, a hub id in the local Hugging Face cache, "
                     f"or one of {', '.join(NAMED)}")


def named_shape(name: str) -> ModelShape:
    """The shape of a model in `NAMED` (by its name or hub id, case-insensitive)."""
    cfg, short, source, fp = _named(name)
    return shape_from_hf_config(cfg, short, source=source, fingerprint=fp)


def cached_config(hub_id: str) -> Path | None:
    """The config.json of `hub_id` in the local Hugging Face cache, or None (never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    hit = try_to_load_from_cache(hub_id, "config.json")
    return Path(hit) if isinstance(hit, str) else None


def hf_config(spec: str) -> tuple[dict[str, Any], str, str, str]:
    """`spec` (as in `resolve_shape`) -> (config.json fields, model name, where they came from, fingerprint)."""
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ModelError(f"{spec} is a folder without config.json: give the model folder or its config.json")
    if not path.exists() and "/" in spec and not spec.endswith(".json"):
        path = cached_config(spec) or path
    if path.exists():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ModelError(f"{path} is not valid JSON ({e}): give the model's config.json") from e
        name = path.parent.name if path.name == "config.json" else path.stem
        if "/" in spec and not Path(spec).exists():
            name = spec.split("/")[-1]
        return cfg, name, str(path), SHAPE_ONLY
    if spec.endswith(".json"):
        raise ModelError(f"{spec} does not exist: give an existing config.json")
    return _named(spec)


def resolve_shape(spec: str) -> ModelShape:
    """`spec` = config.json path (or its folder), hub id in the local cache, or a `NAMED` shape -> ModelShape."""
    cfg, name, source, fp = hf_config(spec)
    return shape_from_hf_config(cfg, name, source=source, fingerprint=fp)


# ---- random weights of a real shape: time and memory without the weights --------------------------------

RANDOM_WEIGHTS = "random-weights"  # the fingerprint of every random-weight model: its outputs mean nothing
_NOT_CONFIG = ("architectures", "auto_map", "quantization_config", "torch_dtype", "dtype", "_name_or_path",
               "transformers_version", "text_config")
_NEEDS_FACTORS = {"longrope": ("long_factor", "short_factor")}  # RoPE types unusable without their tables


def _random_config(cfg: dict[str, Any], shape: ModelShape, n_layers: int, max_positions: int) -> Any:
    """A transformers config of `shape`'s family (a Llama of the same dimensions for families transformers
    lacks, e.g. ChatGLM) with `n_layers` decoder layers, SDPA attention."""
    from transformers import CONFIG_MAPPING, AutoConfig

    text = cfg.get("text_config")
    cfg = {**cfg, **text} if isinstance(text, dict) else cfg
    intermediate = cfg.get("intermediate_size") or cfg.get("ffn_hidden_size")
    vocab = cfg.get("vocab_size") or cfg.get("padded_vocab_size")
    if not intermediate or not vocab:
        raise ModelError(f"shape {shape.name}: random weights need intermediate_size (or ffn_hidden_size) and "
                         "vocab_size in its config: give the model's full config.json")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict) or not all(isinstance(v, dict) for v in rope.values()) or not rope:
        rope = {k: v for k, v in rope.items() if k not in ("type", "rope_type", "rope_theta")}
        kind = shape.rope_type if all(f in rope for f in _NEEDS_FACTORS.get(shape.rope_type, ())) else "default"
        rope = {"rope_type": kind, "rope_theta": shape.rope_theta, **(rope if kind != "default" else {})}
    family = cfg.get("model_type") if cfg.get("model_type") in CONFIG_MAPPING else "llama"
    fields = {k: v for k, v in cfg.items() if k not in _NOT_CONFIG and k not in ("model_type", "rope_scaling", "rope_theta")}
    if family != cfg.get("model_type"):
        fields = {"rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5)}
    fields.update(hidden_size=shape.hidden_size, num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_kv_heads,
                  head_dim=shape.head_dim, intermediate_size=int(intermediate), vocab_size=int(vocab),
                  num_hidden_layers=n_layers, max_position_embeddings=max_positions, rope_parameters=rope,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None)  # no tokenizer: random ids
    if isinstance(fields.get("layer_types"), list):  # hybrid models: the first n_layers of the real pattern
        fields["layer_types"] = fields["layer_types"][:n_layers]
    return AutoConfig.for_model(family, **fields)


def random_model(spec: str, n_layers: int | None = None, device: str | Any = "cpu", dtype: Any = None, *,
                 seed: int = 0, max_positions: int | None = None,
                 overrides: dict[str, Any] | None = None) -> tuple[Any, ModelShape]:
    """A causal LM of shape `spec` (as in `resolve_shape`) with random weights -> (model in eval mode, ModelShape).

    `n_layers` decoder layers (default: all of the shape's), built directly on `device` in `dtype` (default
    bfloat16 on a GPU, float32 on the CPU): no full-size copy on the CPU. `max_positions` (default: the
    shape's) sets how long a prompt the model accepts; `overrides` replaces config.json fields (e.g. a small
    hidden size for tests). The outputs are meaningless: use such a model for time and memory only. The
    shape is named "<name> (random weights)" and its fingerprint is `RANDOM_WEIGHTS`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.core.device import parse_dtype, resolve_device
    from workbench.core.model import model_shape

    device = resolve_device(device)
    dtype = parse_dtype(dtype) if dtype is not None else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    cfg, name, source, _ = hf_config(spec)
    cfg = {**cfg, **(overrides or {})}
    shape = shape_from_hf_config(cfg, name, source=source)
    n_layers = shape.n_layers if n_layers is None else n_layers
    if not 1 <= n_layers:
        raise ModelError(f"n_layers={n_layers}: a model needs at least one decoder layer")
    config = _random_config(cfg, shape, n_layers, max_positions or shape.max_positions)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the target dtype: an fp32 copy of an 8B model would not fit
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    of = f"{n_layers} of {shape.n_layers} layers, " if n_layers != shape.n_layers else ""
    model.workbench_random = f"random weights ({of}seed {seed}): time and memory only, the outputs mean nothing"
    return model, model_shape(model, f"{name} (random weights)", fp=RANDOM_WEIGHTS)
