"""Capture post-RoPE q, k, v (and optionally the attention input) of every chosen layer in one forward."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench.core.attention import attention_override, dense_attention
from workbench.core.device import model_device
from workbench.core.model import ModelError, ModelShape


@dataclass
class Capture:
    """One prompt's attention inputs (batch 1).

    q `[L, Hq, N, D]`, k and v `[L, Hkv, N, D]` (post-RoPE, as the attention kernel sees them),
    hidden `[L, N, hidden]` (the input-normed hidden state entering attention) or None.
    `layers[i]` is the model layer stored at index i. Query head h reads KV head h // shape.group.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layers: tuple[int, ...]
    shape: ModelShape
    input_ids: torch.Tensor  # [N]
    scale: float  # softmax scale (1/sqrt(D) for Llama)
    hidden: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.q.shape[2]

    def index(self, layer: int) -> int:
        """Position of model layer `layer` in this capture."""
        if layer not in self.layers:
            raise ModelError(f"layer {layer} was not captured: captured layers are {list(self.layers)}")
        return self.layers.index(layer)

    def layer_qkv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[Hq, N, D]`, k and v `[Hkv, N, D]` of one model layer."""
        i = self.index(layer)
        return self.q[i], self.k[i], self.v[i]

    def layer_lse(self, layer: int) -> None:
        """None: a Capture keeps no row log-sum-exps (a `StreamCapture` has the forward's)."""
        self.index(layer)
        return None

    def head_qkv(self, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v `[N, D]` for query head `head` of `layer` (k/v from its KV head)."""
        if not 0 <= head < self.shape.n_heads:
            raise ModelError(f"head {head} is out of range: the model has query heads 0..{self.shape.n_heads - 1}")
        q, k, v = self.layer_qkv(layer)
        kv = self.shape.kv_head(head)
        return q[head], k[kv], v[kv]

    def close(self) -> None:
        """Nothing to end: a Capture holds its tensors (a `StreamCapture` ends its forward here)."""

    def save(self, path: str | Path) -> None:
        """Write as safetensors (atomic: temp file + rename)."""
        import json

        from safetensors.torch import save_file

        from workbench.core.io import atomic_path

        tensors = {"q": self.q, "k": self.k, "v": self.v, "input_ids": self.input_ids}
        if self.hidden is not None:
            tensors["hidden"] = self.hidden
        meta = {"layers": json.dumps(list(self.layers)), "shape": json.dumps(self.shape.to_dict()),
                "scale": repr(self.scale), "meta": json.dumps(self.meta)}
        with atomic_path(path) as tmp:
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Capture:
        import json

        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            t = {k: f.get_tensor(k) for k in f.keys()}
        return cls(q=t["q"], k=t["k"], v=t["v"], hidden=t.get("hidden"), input_ids=t["input_ids"],
                   layers=tuple(json.loads(meta["layers"])), shape=ModelShape.from_dict(json.loads(meta["shape"])),
                   scale=float(meta["scale"]), meta=json.loads(meta["meta"]))


class _Done(Exception):
    """Raised after the last requested layer so the rest of the forward is skipped."""


@torch.no_grad()
def capture_attention(model: torch.nn.Module, shape: ModelShape, input_ids: torch.Tensor,
                      layers: Sequence[int] | None = None, *, dtype: torch.dtype | None = None,
                      hidden: bool = False, progress: bool = True) -> Capture:
    """Run `model` on `input_ids` (`[N]` or `[1, N]`) and keep q/k/v of `layers` (default: all).

    Goes through the attention interface (no n x n matrix is built: the model still runs SDPA), and
    stops the forward after the last requested layer. `dtype` is the storage dtype (default: the
    model's). Everything stays on the model's device (the first GPU under a device map). `hidden=True`
    also keeps the input-normed hidden state entering each attention.
    """
    ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ModelError(f"capture takes one prompt (batch 1), got batch {ids.shape[0]}: capture prompts one by one")
    n = shape.check_length(ids.shape[1])
    layers = tuple(range(shape.n_layers)) if layers is None else tuple(sorted({shape.check_layer(l) for l in layers}))
    if not layers:
        raise ModelError("no layers to capture: give at least one layer index")
    device = model_device(model)
    store_dtype = dtype or next(model.parameters()).dtype
    Hq, Hkv, D = shape.n_heads, shape.n_kv_heads, shape.head_dim
    L = len(layers)
    q = torch.empty(L, Hq, n, D, dtype=store_dtype, device=device)
    k = torch.empty(L, Hkv, n, D, dtype=store_dtype, device=device)
    v = torch.empty_like(k)
    h = torch.empty(L, n, shape.hidden_size, dtype=store_dtype, device=device) if hidden else None
    slot = {layer: i for i, layer in enumerate(layers)}
    scale: list[float] = []
    bar = tqdm(total=L, desc="capture", unit="layer", disable=not progress, leave=False)

    def record(module, query, key, value, attention_mask, **kwargs):
        i = slot.get(module.layer_idx)
        out = dense_attention(module, query, key, value, attention_mask, **kwargs)
        if i is not None:
            q[i].copy_(query[0])
            k[i].copy_(key[0])
            v[i].copy_(value[0])
            scale.append(kwargs.get("scaling") or module.scaling)
            bar.update(1)
            if module.layer_idx == layers[-1]:
                raise _Done
        return out

    def keep_hidden(module, args, kwargs):
        i = slot.get(module.layer_idx)
        if i is not None:
            x = kwargs.get("hidden_states", args[0] if args else None)
            h[i].copy_(x[0])

    handles = []
    if hidden:
        handles = [layer.self_attn.register_forward_pre_hook(keep_hidden, with_kwargs=True)
                   for layer in model.model.layers]
    try:
        with attention_override(model, record):
            model(ids.to(device), use_cache=False)
    except _Done:
        pass
    finally:
        for handle in handles:
            handle.remove()
        bar.close()
    return Capture(q=q, k=k, v=v, hidden=h, layers=layers, shape=shape, input_ids=ids[0].cpu(), scale=scale[0])
