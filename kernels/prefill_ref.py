"""PyTorch reference for sparse prefill: exact causal attention under an explicit Bool mask (no Triton).

Query head h reads KV head h // (Hq // Hkv) through a grouped view (repeat_kv is never materialised).
Rows are processed in chunks so small tests stay fast and memory stays bounded.
"""
from __future__ import annotations

import math

import torch


def check_prefill_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Validate q `[B, Hq, N, D]`, k/v `[B, Hkv, N, D]`; returns (B, Hq, Hkv, N, D)."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q must be [B, Hq, N, D] and k, v [B, Hkv, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    B, Hq, N, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (N, D):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B={B}, Hkv, N={N}, D={D}]")
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    return B, Hq, Hkv, N, D


def masked_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float | None = None, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to `mask` Bool `[B or 1, Hq, N, N]` (True = key attended), fp32 math.

    Returns (o `[B, Hq, N, D]` in q's dtype, lse Float32 `[B, Hq, N]` natural-log sum of exp of the
    scaled scores). Every row must keep at least one key.
    """
    B, Hq, Hkv, N, D = check_prefill_args(q, k, v)
    G = Hq // Hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    kf, vf = k.float(), v.float()
    out = torch.empty(B, Hq, N, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    for r0 in range(0, N, chunk):
        r1 = min(r0 + chunk, N)
        qc = q[:, :, r0:r1].float().view(B, Hkv, G, r1 - r0, D)
        s = torch.einsum("bhgrd,bhnd->bhgrn", qc, kf) * scale
        mc = mask[:, :, r0:r1].reshape(mask.shape[0], Hkv, G, r1 - r0, N)
        s = s.masked_fill(~mc, float("-inf"))
        lse_c = torch.logsumexp(s, -1)
        p = torch.exp(s - lse_c.unsqueeze(-1))
        out[:, :, r0:r1] = torch.einsum("bhgrn,bhnd->bhgrd", p, vf).reshape(B, Hq, r1 - r0, D)
        lse[:, :, r0:r1] = lse_c.reshape(B, Hq, r1 - r0)
    return out.to(q.dtype), lse


def last_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, scale: float | None = None,
                        chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention of the last `rows` query rows over every key they may read (the dense rows of
    `VSTiles`, e.g. Tri-shape's question): online softmax over key chunks of `chunk` keys, so nothing of size
    rows x N is held. Scores, softmax and sums in fp32; on a GPU the two products take q's fp16 / bf16 with fp32
    results (tensor cores, as the kernels' dots), elsewhere fp32. q `[B, Hq, N, D]`, k/v `[B, Hkv, N, D]` -> (o
    `[B, Hq, rows, D]` in q's dtype, lse Float32 `[B, Hq, rows]`), rows N - rows .. N - 1."""
    B, Hq, Hkv, N, D = check_prefill_args(q, k, v)
    rows = min(rows, N)
    G, first = Hq // Hkv, N - rows
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    half = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a.to(q.dtype), b, out_dtype=torch.float32) if half else a.float() @ b.float()

    qr = q[:, :, first:].reshape(B * Hkv, G * rows, D)  # the G heads of a KV head, their rows one after another
    i = torch.arange(first, N, device=q.device).repeat(G)[:, None]  # each packed row's position
    m = torch.full((B * Hkv, G * rows), float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(B * Hkv, G * rows, D, device=q.device)
    for c0 in range(0, N, chunk):  # key 0 lies in the first chunk: every row's max is finite from there on
        c1 = min(c0 + chunk, N)
        s = mm(qr, k[:, :, c0:c1].reshape(B * Hkv, c1 - c0, D).transpose(1, 2)) * scale
        if c1 - 1 > first:
            s.masked_fill_(torch.arange(c0, c1, device=q.device)[None, :] > i, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp(s - m_new[..., None])
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + mm(p, v[:, :, c0:c1].reshape(B * Hkv, c1 - c0, D))
        m = m_new
    o = (acc / l[..., None]).view(B, Hq, rows, D)
    return o.to(q.dtype), (m + torch.log(l)).view(B, Hq, rows)
