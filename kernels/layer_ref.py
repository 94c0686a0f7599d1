"""PyTorch reference for the decode engine's fused Llama layer glue (no Triton): the element-wise pieces
between the GEMMs of one decode step, written as transformers' Llama modules compute them, so that the
fused Triton path (`layer`) rounds where they round.

- `add_rmsnorm_ref`: x + delta (in x's dtype), then LlamaRMSNorm (fp32 statistics, cast back, times weight).
- `rope_split_ref`: one projection row `[B, (Hq + 2 Hkv + Hf) * D]` -> q, k after RoPE, v, and Hf forecast
  queries after RoPE in float32 (`apply_rotary_pos_emb`: x * cos + rotate_half(x) * sin).
- `silu_mul_ref`: act(gate) * up of the gate and up projections.
"""
from __future__ import annotations

import torch

from .cache_plan_ref import append_token_ref


def add_rmsnorm_ref(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta `[B, N]` -> (x + delta, rmsnorm(x + delta) * weight), both in x's dtype."""
    if delta is not None:
        x = x + delta
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rot * sin


def rope_split_ref(qkvf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                   forecast_heads: int, cos_f: torch.Tensor | None = None, sin_f: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, **append
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """qkvf `[B, (heads + 2 kv_heads + forecast_heads) * D]`; cos/sin `[B, D]` in its dtype (cos_f/sin_f float32
    for the forecast queries) -> q `[B, heads, D]`, k, v `[B, kv_heads, D]`, f `[B, forecast_heads, D]` float32.
    `append` (`append_token_ref`'s keywords) with positions `[B]`: the new k, v rows are appended there too."""
    B = qkvf.shape[0]
    x = qkvf.view(B, heads + 2 * kv_heads + forecast_heads, -1)
    c, s = cos[:, None], sin[:, None]
    q = _rotate(x[:, :heads], c, s)
    k = _rotate(x[:, heads:heads + kv_heads], c, s)
    v = x[:, heads + kv_heads:heads + 2 * kv_heads]
    f = _rotate(x[:, heads + 2 * kv_heads:].float(), cos_f[:, None], sin_f[:, None]) if forecast_heads else None
    v = v.contiguous()
    if append:
        append_token_ref(k, v, positions, **append)
    return q, k, v, f


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up `[B, I]` -> silu(gate) * up `[B, I]` in their dtype."""
    return torch.nn.functional.silu(gate) * up
