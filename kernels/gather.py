"""Triton kernel that moves KV blocks from pinned host memory to the GPU through UVA, dequantising on the way.

`gather_blocks` is a persistent kernel: `ctas` programs stride over the copy list, each moving whole
blocks with wide loads straight from pinned host memory (a pinned CPU tensor's pointer is valid on
the GPU under unified addressing), so a gather of scattered blocks is one launch with no CPU work.
The number of copies is read from device memory, so the caller never synchronises to count misses.
Few CTAs leave SMs to the attention and FFN kernels running beside the copy, but PCIe reads are long:
too few programs keep too few bytes in flight once other kernels share the SMs (`gather_ctas`).
With scales the source holds FP8 / INT8 codes (half the bytes over PCIe of bf16) and each token row is
dequantised into the cache's dtype (`gather_ref.dequantize_rows`), or INT4 codes (a quarter, plus a float16 scale
per 32 elements), unpacked and dequantised per group. Same contracts as `gather_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gather_ref import INT4, check_gather_args, gather_ctas


@triton.jit
def _store_int4(Dst, b, scale, half, SW: tl.constexpr):
    """INT4 bytes `b` `[RB, 16]` of RB groups (byte j: element j in the low nibble, j + 16 in the high one, each
    code + 8) times their scales `[RB, 1]` -> the groups' two halves at Dst + half and Dst + half + 16."""
    lo = ((b & 15).to(tl.int32) - 8).to(tl.float32) * scale
    hi = ((b >> 4).to(tl.int32) - 8).to(tl.float32) * scale
    tl.store(Dst + half, lo.to(Dst.dtype.element_ty))
    tl.store(Dst + SW + half, hi.to(Dst.dtype.element_ty))


@triton.jit
def _gather_blocks_kernel(SrcK, SrcV, DstK, DstV, SrcIdx, DstIdx, Count, ScaleK, ScaleV, NCTA,
                          R: tl.constexpr, W: tl.constexpr, RB: tl.constexpr, QUANT: tl.constexpr,
                          INT4: tl.constexpr, CH: tl.constexpr):
    """Blocks of R rows x W elements, RB rows per step: the K and V rows of a step are both loaded
    before either is stored, so each program keeps two PCIe reads in flight. A program reads CH entries of
    the list at once (programs interleaved) and loops over their misses only (dst >= 0): the engine's list
    holds every selected block, ~85 % of them cache hits, which then cost nothing (they cost a masked pass of
    the whole block loop before). INT4: a "row" is a group of W = 32 elements, W / 2 bytes in the source."""
    pid = tl.program_id(0)
    n = tl.load(Count)
    E: tl.constexpr = R * W
    SW: tl.constexpr = W // 2 if INT4 else W  # source elements per row
    rows = tl.arange(0, RB)
    offs = rows[:, None] * W + tl.arange(0, W)[None, :]  # [RB, W]
    src_offs = rows[:, None] * SW + tl.arange(0, SW)[None, :]  # [RB, SW]
    half = rows[:, None] * W + tl.arange(0, SW)[None, :]  # INT4: the low half of each group in the destination
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
            for r0 in tl.static_range(0, R, RB):
                k = tl.load(SrcK + s * (R * SW) + r0 * SW + src_offs)
                v = tl.load(SrcV + s * (R * SW) + r0 * SW + src_offs)
                if QUANT:  # one scale per token row (INT4: per group), float32 or float16
                    sk = tl.load(ScaleK + s * R + r0 + rows).to(tl.float32)[:, None]
                    sv = tl.load(ScaleV + s * R + r0 + rows).to(tl.float32)[:, None]
                if INT4:  # two contiguous half-groups per group, no interleave
                    _store_int4(DstK + d * E + r0 * W, k, sk, half, SW)
                    _store_int4(DstV + d * E + r0 * W, v, sv, half, SW)
                else:
                    if QUANT:
                        k, v = k.to(tl.float32) * sk, v.to(tl.float32) * sv
                    tl.store(DstK + d * E + r0 * W + offs, k.to(DstK.dtype.element_ty))
                    tl.store(DstV + d * E + r0 * W + offs, v.to(DstV.dtype.element_ty))


def gather_blocks(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                  src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor, ctas: int | None = None,
                  scale_k: torch.Tensor | None = None, scale_v: torch.Tensor | None = None) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < count where dst_idx[i] >= 0 (K and V) with `ctas`
    persistent programs (None: `gather_ctas`, by whether the store is quantised).

    src pools `[S, E]` (pinned host memory on the GPU path), dst pools `[S', E]`, indices `[M]` int,
    count a 1-element int tensor on the GPU. E = 64 rows x a power of two >= 16 elements (a 64-token
    block of any power-of-two head_dim >= 16). With scales (pinned too) src holds codes: FP8 / INT8 with
    scales `[S, R]` float32, dequantised per row of E / R (a power of two); INT4 (uint8 src `[S, E / 2]`) with
    scales `[S, E / 32]` float16, per group of 32. On the H200 beside decode-sized GEMMs 16 programs
    moved 41 GB/s (bf16) / 31 (FP8), 32-64 moved 46-49 of the 54 GB/s pinned memcpy (kernels/NOTES.md).
    """
    quantised = scale_k is not None
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        check_gather_args(src, dst, src_idx, dst_idx, count, quantised)
    E = dst_k.shape[1]
    int4 = quantised and src_k.dtype == INT4
    ctas = gather_ctas(quantised) if ctas is None else ctas
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    R = scale_k.shape[1] if quantised else 64
    W = E // R
    if E % R or W < 16 or W & (W - 1):
        raise ValueError(f"block size in elements must be 64 rows x a power of two >= 16 (the scales' R rows "
                         f"when quantised), got E = {E}" + (f", R = {R}" if quantised else ""))
    if quantised and (scale_k.shape != (src_k.shape[0], R) or scale_v.shape != scale_k.shape):
        raise ValueError(f"scales must be [S={src_k.shape[0]}, R] (INT4: R = E / 32), got {tuple(scale_k.shape)} and "
                         f"{tuple(scale_v.shape)}")
    if int4 and W != 32:
        raise ValueError(f"INT4 codes need one scale per 32 elements: scales [S, {E // 32}], got {tuple(scale_k.shape)}")
    rb = min(R, max(1, 8192 // W))  # rows per step: 8K elements of K and of V in flight per program
    _gather_blocks_kernel[(ctas,)](src_k, src_v, dst_k, dst_v, src_idx, dst_idx, count,
                                   scale_k if quantised else src_k, scale_v if quantised else src_v, ctas,
                                   R=R, W=W, RB=rb, QUANT=quantised, INT4=int4, CH=32, num_warps=4)
