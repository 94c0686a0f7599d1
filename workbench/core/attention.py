"""Swap a transformers model's attention function for one of ours, for the length of a `with` block.

Everything that hooks attention (capture, sparse prefill) goes through `attention_override`, so the
model keeps its own projections, RoPE and KV cache and only the attention kernel changes.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

AttentionFn = Callable[..., tuple[torch.Tensor, Any]]
_names = itertools.count()


def dense_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The model's ordinary SDPA attention. q `[B, Hq, N, D]`, k/v `[B, Hkv, Nk, D]` -> `[B, N, Hq, D]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def attention_override(model: torch.nn.Module, fn: AttentionFn, mask: Callable[..., Any] | None = None) -> Iterator[None]:
    """Run `model` with `fn` as its attention function (same signature as `dense_attention`); `mask` builds
    the masks `fn` receives (transformers' mask-interface signature; default: SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"workbench_{next(_names)}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, mask or ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
