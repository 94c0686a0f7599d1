"""Triton glue of a Llama decoder layer at decode time: the element-wise work between the GEMMs, one launch
each (the module path launches ~35 kernels per layer and the engine's append another; this path 9 with the
GEMMs). Same contracts as `layer_ref`, rounding where transformers' Llama modules round (bf16 products, fp32
norm statistics).

- `add_rmsnorm`: residual add and RMSNorm in one pass over each row.
- `rope_split`: splits one q/k/v/forecast projection into contiguous q, k, v and forecast queries, RoPE on q, k
  (model dtype) and on the forecast queries (float32), and appends the new K/V rows where the engine keeps them
  (host store, quantised or not; compressed keys: `cache_plan.append_token`'s work, in the same launch).
- `silu_mul`: silu(gate) * up.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_plan import append_args, roll_row, row_warps, store_row


@triton.jit
def _add_rmsnorm_kernel(X, Delta, W, Xout, H, N, eps, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(X + row * N + i, mask=ok, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(Delta + row * N + i, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(Xout + row * N + i, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    h = (xf * tl.math.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(W + i, mask=ok, other=0.0)
    tl.store(H + row * N + i, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=ok)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `add_rmsnorm_ref`: x, delta `[B, N]` contiguous -> (x + delta, normed)."""
    B, N = x.shape
    h = torch.empty_like(x)
    xout = torch.empty_like(x) if delta is not None else x
    _add_rmsnorm_kernel[(B,)](x, delta if delta is not None else x, weight, xout, h, N, eps,
                              BLOCK=triton.next_power_of_2(N), ADD=delta is not None,
                              num_warps=4 if N <= 2048 else 8)
    return xout, h


# No FP fusion: with it Triton folds the products' 16-bit rounding below into one fma.rn.f16 per element, a
# different rounding from transformers' rotary embedding (seen in the sm_90 PTX, and on the H200 as 1-ulp
# products that cancel into 64-ulp differences of q).
ROPE_LAUNCH = {"enable_fp_fusion": False}  # num_warps: `cache_plan.row_warps(D)` (one element per thread)


@triton.jit
def _rope_split_kernel(X, Cos, Sin, CosF, SinF, Q, K, V, F, Pos, HostK, HostV, HostSK, HostSV, Kout, Vout, Tail, CKeys,
                       HOST_TOKENS, NC1, STRIDE, QMAX_K, QMAX_V, Hq, Hkv, Htot, D: tl.constexpr,
                       APPEND: tl.constexpr, W: tl.constexpr, HOST: tl.constexpr, QUANT_K: tl.constexpr,
                       INT8_K: tl.constexpr, INT4_K: tl.constexpr, QUANT_V: tl.constexpr, INT8_V: tl.constexpr,
                       INT4_V: tl.constexpr, OUT: tl.constexpr, COMPRESS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    src = (b * Htot + h) * D
    x = tl.load(X + src + d)
    rot = tl.load(X + src + (d + half) % D)
    rot = tl.where(d < half, -rot, rot)
    if h < Hq + Hkv:
        c = tl.load(Cos + b * D + d)
        s = tl.load(Sin + b * D + d)
        dt = x.dtype
        y = ((x.to(tl.float32) * c.to(tl.float32)).to(dt).to(tl.float32)
             + (rot.to(tl.float32) * s.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
        if h < Hq:
            tl.store(Q + (b * Hq + h) * D + d, y)
        else:
            bh = b * Hkv + h - Hq
            tl.store(K + bh * D + d, y)
            if APPEND:  # the new key: host store row (quantised or not) and compressed keys
                pos = tl.load(Pos + b).to(tl.int64)
                store_row(y, bh, pos, d, HostK, HostSK, Kout, HOST_TOKENS, QMAX_K, HOST, QUANT_K, INT8_K, INT4_K, OUT)
                if COMPRESS:
                    roll_row(y, bh, pos, d, Tail, CKeys, NC1, STRIDE, W)
    elif h < Hq + 2 * Hkv:
        bh = b * Hkv + h - Hq - Hkv
        tl.store(V + bh * D + d, x)
        if APPEND:
            pos = tl.load(Pos + b).to(tl.int64)
            store_row(x, bh, pos, d, HostV, HostSV, Vout, HOST_TOKENS, QMAX_V, HOST, QUANT_V, INT8_V, INT4_V, OUT)
    else:
        c = tl.load(CosF + b * D + d)
        s = tl.load(SinF + b * D + d)
        hf = h - Hq - 2 * Hkv
        tl.store(F + (b * (Htot - Hq - 2 * Hkv) + hf) * D + d, x.to(tl.float32) * c + rot.to(tl.float32) * s)


def rope_split(qkvf: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               forecast_heads: int, cos_f: torch.Tensor | None = None, sin_f: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, **append) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor | None]:
    """Triton `rope_split_ref` (same arguments; tensors contiguous, D a power of two). With `append` targets
    (`cache_plan.append_token`'s keywords) and positions, the new K/V rows are appended in the same launch."""
    B, width = qkvf.shape
    htot = heads + 2 * kv_heads + forecast_heads
    D = width // htot
    if D * htot != width or D & (D - 1):
        raise ValueError(f"projection width {width} is not {htot} heads of a power-of-two head_dim")
    dev, dt = qkvf.device, qkvf.dtype
    q = torch.empty(B, heads, D, device=dev, dtype=dt)
    k = torch.empty(B, kv_heads, D, device=dev, dtype=dt)
    v = torch.empty(B, kv_heads, D, device=dev, dtype=dt)
    f = torch.empty(B, forecast_heads, D, device=dev, dtype=torch.float32) if forecast_heads else None
    targets, flags = append_args(k, **append)
    if append and positions is None:
        raise ValueError("appending the token needs its positions")
    _rope_split_kernel[(B, htot)](qkvf, cos, sin, cos_f if forecast_heads else cos, sin_f if forecast_heads else sin,
                                  q, k, v, f if forecast_heads else q, positions if append else q, *targets,
                                  heads, kv_heads, htot, D=D, APPEND=bool(append), **flags, num_warps=row_warps(D),
                                  **ROPE_LAUNCH)
    return q, k, v, f


@triton.jit
def _silu_mul_kernel(Gate, Up, Out, I, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < I
    g = tl.load(Gate + b * I + i, mask=ok, other=0.0)
    u = tl.load(Up + b * I + i, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(Out + b * I + i, (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton `silu_mul_ref`: gate, up `[B, I]` contiguous -> `[B, I]`."""
    B, inter = gate.shape
    out = torch.empty_like(gate)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(B, triton.cdiv(inter, block))](gate, up, out, inter, BLOCK=block, num_warps=4)
    return out
