"""Triton kernel that moves KV blocks from pinned host memory to the GPU through UVA, dequantising on the way.

`gather_blocks` is a persistent kernel: `ctas` programs stride over the copy list, each moving whole
blocks with wide loads straight from pinned host memory (a pinned CPU tensor's pointer is valid on
the GPU under unified addressing), so a gather of scattered blocks is one launch with no CPU work.
The number of copies is read from device memory, so the caller never synchronises to count misses.
Few CTAs leave SMs to the attention and FFN kernels running beside the copy, but PCIe reads are long:
too few programs keep too few bytes in flight once other kernels share the SMs (`gather_ctas`).
With scales the source holds FP8 / INT8 codes (half the bytes over PCIe of bf16) and each token row is
dequantised into the cache's dtype (`gather_ref.dequantize_rows`), or INT4 codes (a quarter, plus a float16 scale
per 32 elements), unpacked and dequantised per group; K and V each have their own format (constexprs `*_K`,
`*_V`: "int8k-int4v" keeps INT8 keys and INT4 values). Same contracts as `gather_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gather_ref import GATHER_WARPS, INT4, check_gather_args, gather_ctas


@triton.jit
def _store_int4(Dst, b, scale, half, SW: tl.constexpr):
    """INT4 bytes `b` `[RB, 16]` of RB groups (byte j: element j in the low nibble, j + 16 in the high one, each
    code + 8) times their scales `[RB, 1]` -> the groups' two halves at Dst + half and Dst + half + 16."""
    lo = ((b & 15).to(tl.int32) - 8).to(tl.float32) * scale
    hi = ((b >> 4).to(tl.int32) - 8).to(tl.float32) * scale
    tl.store(Dst + half, lo.to(Dst.dtype.element_ty))
    tl.store(Dst + SW + half, hi.to(Dst.dtype.element_ty))


@triton.jit
def _load_rows(Src, Scale, s, r0, R: tl.constexpr, W: tl.constexpr, RB: tl.constexpr, QUANT: tl.constexpr,
               INT4: tl.constexpr):
    """Rows r0 .. r0 + RB of source block s (R rows of W destination elements; INT4: W / 2 bytes) and their scales
    `[RB, 1]` float32 (float32 or float16 in memory; 1 without scales)."""
    SW: tl.constexpr = W // 2 if INT4 else W  # source elements per row
    rows = tl.arange(0, RB)
    x = tl.load(Src + s * (R * SW) + r0 * SW + rows[:, None] * SW + tl.arange(0, SW)[None, :])
    if QUANT:  # one scale per token row (INT4: per group)
        sc = tl.load(Scale + s * R + r0 + rows).to(tl.float32)[:, None]
    else:
        sc = tl.full((RB, 1), 1.0, tl.float32)
    return x, sc


@triton.jit
def _store_rows(Dst, x, sc, d, r0, R: tl.constexpr, W: tl.constexpr, RB: tl.constexpr, QUANT: tl.constexpr,
                INT4: tl.constexpr):
    """`_load_rows`' rows, dequantised, into rows r0 .. r0 + RB of destination block d (R * W elements)."""
    rows = tl.arange(0, RB)
    base = Dst + d * (R * W) + r0 * W
    if INT4:  # two contiguous half-groups per group, no interleave
        SW: tl.constexpr = W // 2
        _store_int4(base, x, sc, rows[:, None] * W + tl.arange(0, SW)[None, :], SW)
    else:
        if QUANT:
            x = x.to(tl.float32) * sc
        tl.store(base + rows[:, None] * W + tl.arange(0, W)[None, :], x.to(Dst.dtype.element_ty))


@triton.jit
def _gather_blocks_kernel(SrcK, SrcV, DstK, DstV, SrcIdx, DstIdx, Count, ScaleK, ScaleV, NCTA,
                          R_K: tl.constexpr, W_K: tl.constexpr, RB_K: tl.constexpr, QUANT_K: tl.constexpr,
                          INT4_K: tl.constexpr, R_V: tl.constexpr, W_V: tl.constexpr, RB_V: tl.constexpr,
                          QUANT_V: tl.constexpr, INT4_V: tl.constexpr, STEPS: tl.constexpr, CH: tl.constexpr):
    """Blocks of R rows x W elements (K: R_K x W_K, V: R_V x W_V: each part its own format), moved in STEPS steps of
    RB rows: the K and V rows of a step are both loaded before either is stored, so each program keeps two PCIe
    reads in flight. A program reads CH entries of the list at once (programs interleaved) and loops over their
    misses only (dst >= 0): the engine's list holds every selected block, ~85 % of them cache hits, which then
    cost nothing (they cost a masked pass of the whole block loop before). INT4: a "row" is a group of W = 32
    elements, W / 2 bytes in the source."""
    pid = tl.program_id(0)
    n = tl.load(Count)
    lanes = tl.arange(0, CH)
    for c0 in range(pid * CH, n, NCTA * CH):
        e = c0 + lanes
        dst = tl.load(DstIdx + e, mask=e < n, other=-1)
        src = tl.load(SrcIdx + e, mask=e < n, other=0)
        miss = dst >= 0
        rank = tl.cumsum(miss.to(tl.int32), 0) - 1
        for j in range(tl.sum(miss.to(tl.int32), 0)):
            pick = miss & (rank == j)
            d = tl.sum(tl.where(pick, dst, 0), 0).to(tl.int64)
            s = tl.sum(tl.where(pick, src, 0), 0).to(tl.int64)
            for st in tl.static_range(STEPS):
                k, sk = _load_rows(SrcK, ScaleK, s, st * RB_K, R_K, W_K, RB_K, QUANT_K, INT4_K)
                v, sv = _load_rows(SrcV, ScaleV, s, st * RB_V, R_V, W_V, RB_V, QUANT_V, INT4_V)
                _store_rows(DstK, k, sk, d, st * RB_K, R_K, W_K, RB_K, QUANT_K, INT4_K)
                _store_rows(DstV, v, sv, d, st * RB_V, R_V, W_V, RB_V, QUANT_V, INT4_V)


def _part_layout(src: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor | None, name: str) -> dict:
    """One part's (K's or V's) constexprs: R rows of W elements per block (64 token rows without scales, the scales'
    R with them), RB rows per step (8K elements in flight), the format flags."""
    E = dst.shape[1]
    R = scale.shape[1] if scale is not None else 64
    W = E // R
    if E % R or W < 16 or W & (W - 1):
        raise ValueError(f"block size in elements must be 64 rows x a power of two >= 16 (the scales' R rows "
                         f"when quantised), got E = {E}" + (f", R = {R}" if scale is not None else "") + f" ({name})")
    if scale is not None and scale.shape != (src.shape[0], R):
        raise ValueError(f"scale_{name} must be [S={src.shape[0]}, R] (INT4: R = E / 32), got {tuple(scale.shape)}")
    int4 = scale is not None and src.dtype == INT4
    if int4 and W != 32:
        raise ValueError(f"INT4 codes need one scale per 32 elements: scale_{name} [S, {E // 32}], got "
                         f"{tuple(scale.shape)}")
    return dict(R=R, W=W, RB=min(R, max(1, 8192 // W)), QUANT=scale is not None, INT4=int4)


def gather_blocks(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                  src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor, ctas: int | None = None,
                  scale_k: torch.Tensor | None = None, scale_v: torch.Tensor | None = None, warps: int = 4) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < count where dst_idx[i] >= 0 (K and V) with `ctas`
    persistent programs (None: `gather_ctas`, by whether the store is quantised) of `warps` warps each.

    src pools `[S, E]` (pinned host memory on the GPU path), dst pools `[S', E]`, indices `[M]` int,
    count a 1-element int tensor on the GPU. E = 64 rows x a power of two >= 16 elements (a 64-token
    block of any power-of-two head_dim >= 16). With scales (pinned too) src holds codes: FP8 / INT8 with
    scales `[S, R]` float32, dequantised per row of E / R (a power of two); INT4 (uint8 src `[S, E / 2]`) with
    scales `[S, E / 32]` float16, per group of 32; K and V each in their own format (scale_k and scale_v alone
    say which part is quantised: "int8k-int4v" gives INT8 K with `[S, 64]`, INT4 V with `[S, E / 32]`). On the
    H200 beside decode-sized GEMMs 16 programs moved 41 GB/s (bf16) / 31 (FP8), 32-64 moved 46-49 of the 54 GB/s
    pinned memcpy (kernels/NOTES.md).
    """
    for src, dst, scale in ((src_k, dst_k, scale_k), (src_v, dst_v, scale_v)):
        check_gather_args(src, dst, src_idx, dst_idx, count, scale is not None)
    if dst_v.shape[1] != dst_k.shape[1]:
        raise ValueError(f"K and V blocks must have the same E, got {dst_k.shape[1]} and {dst_v.shape[1]}")
    ctas = gather_ctas(scale_k is not None or scale_v is not None) if ctas is None else ctas
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    if warps not in GATHER_WARPS:
        raise ValueError(f"warps must be 1, 2, 4 or 8 (warps per gather program), got {warps}")
    lk, lv = _part_layout(src_k, dst_k, scale_k, "k"), _part_layout(src_v, dst_v, scale_v, "v")
    steps = lk["R"] // lk["RB"]  # = max(1, E / 8192): the same for both parts (R x W = E, RB x W = 8K)
    assert steps == lv["R"] // lv["RB"]
    _gather_blocks_kernel[(ctas,)](src_k, src_v, dst_k, dst_v, src_idx, dst_idx, count,
                                   src_k if scale_k is None else scale_k, src_v if scale_v is None else scale_v, ctas,
                                   **{f"{key}_K": x for key, x in lk.items()}, **{f"{key}_V": x for key, x in lv.items()},
                                   STEPS=steps, CH=32, num_warps=warps)
