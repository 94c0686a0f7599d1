"""XAttention's antidiagonal block scores in Triton: each query block's estimated attention share per key block,
with no `[N / S, N / S]` score matrix in memory.

Stride S: query group a = rows aS .. aS+S-1, key group c = keys cS .. cS+S-1, their score the sum of the S logits on
the group's antidiagonal, sum_s q_{aS+s} . k_{cS+S-1-s} = qs_a . ks_c with qs = q viewed `[N / S, S D]` and ks = k
with each group's rows reversed, viewed likewise. One program per (query head, `TILE[0]` query groups; the longest
causal rows first) walks the causal key groups `TILE[1]` at a time twice: pass 1 keeps each row's running max and
sum of exp2 (the softmax over the causal key groups, logits scaled by scale / S), pass 2 recomputes the scores and
sums the probabilities into 64-token blocks (64 / S groups each). Reference:
`workbench.patterns.xattention.antidiagonal_block_scores` (same result, fp32 accumulation; bf16 / fp16 inputs enter
the dot as they are, fp32 ones in full precision).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiling import BLOCK, LOG2E

TILE = (128, 128, 8, 3)  # query groups per program, key groups per step, warps, pipeline stages (H200: NOTES.md)


@triton.jit
def _scores(QS, KS, a, c, G, SD: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """fp32 `[len(a), len(c)]`: qs_a . ks_c over SD = S * D in chunks of BK (rows / columns past G read 0)."""
    acc = tl.zeros((a.shape[0], c.shape[0]), dtype=tl.float32)
    for k0 in range(0, SD, BK):
        kk = k0 + tl.arange(0, BK)
        qt = tl.load(QS + a[:, None] * SD + kk[None, :], mask=a[:, None] < G, other=0.0)
        kt = tl.load(KS + c[None, :] * SD + kk[:, None], mask=c[None, :] < G, other=0.0)
        if IEEE:
            acc += tl.dot(qt, kt, input_precision="ieee")
        else:
            acc += tl.dot(qt, kt)
    return acc


@triton.jit
def _antidiagonal_kernel(QS, KS, Out, n, G, M, qk_scale, GROUP: tl.constexpr, SD: tl.constexpr,
                         STRIDE: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, BQ: tl.constexpr,
                         BC: tl.constexpr):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest causal rows first
    h = tl.program_id(1)
    PER: tl.constexpr = 64 // STRIDE  # groups per 64-token block
    QS = QS + h.to(tl.int64) * G * SD
    KS = KS + (h // GROUP).to(tl.int64) * G * SD
    a = pid * BQ + tl.arange(0, BQ)  # query groups
    hi = tl.minimum((pid + 1) * BQ, G)  # causal: key groups [0, hi)
    m_i = tl.full((BQ,), float("-inf"), tl.float32)
    l_i = tl.zeros((BQ,), tl.float32)
    for c0 in range(0, hi, BC):
        c = c0 + tl.arange(0, BC)
        s = _scores(QS, KS, a, c, G, SD, BK, IEEE) * qk_scale
        s = tl.where((c[None, :] <= a[:, None]) & (c[None, :] * STRIDE < n), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    inv = tl.where((a < G) & (a * STRIDE < n), 1.0 / l_i, 0.0)  # padded query groups count for nothing
    rows = pid * (BQ // PER) + tl.arange(0, BQ // PER)  # query blocks
    for c0 in range(0, hi, BC):
        c = c0 + tl.arange(0, BC)
        s = _scores(QS, KS, a, c, G, SD, BK, IEEE) * qk_scale
        live = (c[None, :] <= a[:, None]) & (c[None, :] * STRIDE < n)
        p = tl.where(live, tl.math.exp2(s - m_i[:, None]), 0.0) * inv[:, None]
        b = tl.sum(tl.sum(tl.reshape(p, (BQ // PER, PER, BC // PER, PER)), 3), 1)  # [query blocks, key blocks]
        cols = c0 // PER + tl.arange(0, BC // PER)
        tl.store(Out + h.to(tl.int64) * M * M + rows[:, None] * M + cols[None, :], b,
                 mask=(rows[:, None] < M) & (cols[None, :] < M))


def antidiagonal_scores(q: torch.Tensor, k: torch.Tensor, scale: float, stride: int = 8, block: int = BLOCK,
                        tile: tuple[int, int, int, int] = TILE) -> torch.Tensor:
    """Float `[Hq, M, M]` (M = ceil(N / 64)): each query block's estimated attention share per key block, rows
    summing to 1 over the causal blocks, 0 above the diagonal. q `[Hq, N, D]`, k `[Hkv, N, D]` (query head h reads
    KV head h // (Hq / Hkv)); D * stride a multiple of 16. `tile`: (query groups per program, key groups per step,
    warps, stages), powers of two >= 64 / stride for the groups (`TILE`: measured on the H200)."""
    if block != BLOCK or stride < 1 or stride > BLOCK or BLOCK % stride:
        raise ValueError(f"stride={stride} must divide the {BLOCK}-token block (and block must be {BLOCK}, got {block})")
    hq, n, d = q.shape
    hkv = k.shape[0]
    if hq % hkv or k.shape[1:] != q.shape[1:] or (d * stride) % 16:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [Hq, N, D] / [Hkv, N, D] with Hkv "
                         f"dividing Hq and D * stride a multiple of 16")
    bq, bc, warps, stages = tile
    if bq % bc or min(bq, bc) < BLOCK // stride:
        raise ValueError(f"tile={tile}: query groups a multiple of key groups, both >= {BLOCK // stride} (a block)")
    m = -(-n // block)
    g = m * block // stride
    pad = m * block - n
    qs = torch.nn.functional.pad(q, (0, 0, 0, pad)).reshape(hq, g, stride * d).contiguous()
    ks = torch.nn.functional.pad(k, (0, 0, 0, pad)).reshape(hkv, g, stride, d).flip(-2).reshape(hkv, g, stride * d)
    out = torch.zeros(hq, m, m, dtype=torch.float32, device=q.device)
    sd = stride * d
    _antidiagonal_kernel[(triton.cdiv(g, bq), hq)](
        qs, ks.contiguous(), out, n, g, m, scale / stride * LOG2E, GROUP=hq // hkv, SD=sd, STRIDE=stride,
        BK=64 if sd % 64 == 0 else 32 if sd % 32 == 0 else 16, IEEE=q.dtype == torch.float32, BQ=bq, BC=bc,
        num_warps=warps, num_stages=stages)
    return out / out.sum(-1, keepdim=True).clamp(min=1e-30)
