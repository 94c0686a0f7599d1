"""Triton kernel that moves KV blocks from pinned host memory to the GPU through UVA, dequantising on the way.

`gather_blocks` is a persistent kernel: `ctas` programs stride over the copy list, each moving whole
blocks with wide loads straight from pinned host memory (a pinned CPU tensor's pointer is valid on
the GPU under unified addressing), so a gather of scattered blocks is one launch with no CPU work.
The number of copies is read from device memory, so the caller never synchronises to count misses.
Few CTAs leave SMs to the attention and FFN kernels running beside the copy; more CTAs copy faster.
With scales the source holds FP8 / INT8 codes (half the bytes over PCIe of bf16) and each token row is
dequantised into the cache's dtype (`gather_ref.dequantize_rows`). Same contracts as `gather_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gather_ref import check_gather_args


@triton.jit
def _gather_blocks_kernel(SrcK, SrcV, DstK, DstV, SrcIdx, DstIdx, Count, ScaleK, ScaleV, NCTA,
                          E: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.load(Count)
    offs = tl.arange(0, CHUNK)
    R: tl.constexpr = E // (CHUNK // ROWS)  # token rows per block when quantised (CHUNK covers ROWS of them)
    for i in range(pid, n, NCTA):
        d = tl.load(DstIdx + i).to(tl.int64)
        if d >= 0:  # -1: a cache hit, nothing to move
            s = tl.load(SrcIdx + i).to(tl.int64)
            for c in range(0, E, CHUNK):
                if QUANT:  # CHUNK elements = ROWS token rows; one scale per row
                    row = s * R + (c + offs) // (CHUNK // ROWS)
                    k = tl.load(SrcK + s * E + c + offs).to(tl.float32) * tl.load(ScaleK + row)
                    v = tl.load(SrcV + s * E + c + offs).to(tl.float32) * tl.load(ScaleV + row)
                    tl.store(DstK + d * E + c + offs, k.to(DstK.dtype.element_ty))
                    tl.store(DstV + d * E + c + offs, v.to(DstV.dtype.element_ty))
                else:
                    tl.store(DstK + d * E + c + offs, tl.load(SrcK + s * E + c + offs))
                    tl.store(DstV + d * E + c + offs, tl.load(SrcV + s * E + c + offs))


def gather_blocks(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                  src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor, ctas: int = 16,
                  scale_k: torch.Tensor | None = None, scale_v: torch.Tensor | None = None) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < count where dst_idx[i] >= 0 (K and V) with `ctas`
    persistent programs.

    src pools `[S, E]` (pinned host memory on the GPU path), dst pools `[S', E]`, indices `[M]` int,
    count a 1-element int tensor on the GPU. E must be a multiple of 1024 (one 64-token block of
    D >= 16 is). With scales `[S, R]` float32 (pinned too) src holds codes, dequantised per row of E / R.
    """
    quantised = scale_k is not None
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        check_gather_args(src, dst, src_idx, dst_idx, count, quantised)
    E = src_k.shape[1]
    if E % 1024:
        raise ValueError(f"block size in elements must be a multiple of 1024, got {E}")
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    chunk, rows = min(E, 4096), 1
    if quantised:
        R = scale_k.shape[1]
        if scale_k.shape != (src_k.shape[0], R) or scale_v.shape != scale_k.shape or E % R or (E // R) & (E // R - 1):
            raise ValueError(f"scales must be [S={src_k.shape[0]}, R] float32 with E / R a power of two, got "
                             f"{tuple(scale_k.shape)} and {tuple(scale_v.shape)}")
        rows = max(1, chunk // (E // R))
        chunk = rows * (E // R)
    _gather_blocks_kernel[(ctas,)](src_k, src_v, dst_k, dst_v, src_idx, dst_idx, count,
                                   scale_k if quantised else src_k, scale_v if quantised else src_v, ctas,
                                   E=E, CHUNK=chunk, ROWS=rows, QUANT=quantised, num_warps=4)
