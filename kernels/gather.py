"""Triton kernels that move KV blocks between pinned host memory and the GPU through UVA.

`gather_blocks` is a persistent kernel: `ctas` programs stride over the copy list, each moving whole
blocks with wide loads straight from pinned host memory (a pinned CPU tensor's pointer is valid on
the GPU under unified addressing), so a gather of scattered blocks is one launch with no CPU work.
The number of copies is read from device memory, so the caller never synchronises to count misses.
Few CTAs leave SMs to the attention and FFN kernels running beside the copy; more CTAs copy faster.
Same contracts as `gather_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gather_ref import check_gather_args


@triton.jit
def _gather_blocks_kernel(SrcK, SrcV, DstK, DstV, SrcIdx, DstIdx, Count, NCTA,
                          E: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.load(Count)
    offs = tl.arange(0, CHUNK)
    for i in range(pid, n, NCTA):
        d = tl.load(DstIdx + i).to(tl.int64)
        if d >= 0:  # -1: a cache hit, nothing to move
            s = tl.load(SrcIdx + i).to(tl.int64) * E
            d = d * E
            for c in range(0, E, CHUNK):
                tl.store(DstK + d + c + offs, tl.load(SrcK + s + c + offs))
                tl.store(DstV + d + c + offs, tl.load(SrcV + s + c + offs))


def gather_blocks(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                  src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor, ctas: int = 16) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < count where dst_idx[i] >= 0 (K and V) with `ctas`
    persistent programs.

    src pools `[S, E]` (pinned host memory on the GPU path), dst pools `[S', E]`, indices `[M]` int,
    count a 1-element int tensor on the GPU. E must be a multiple of 1024 (one 64-token block of
    D >= 16 is).
    """
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        check_gather_args(src, dst, src_idx, dst_idx, count)
    E = src_k.shape[1]
    if E % 1024:
        raise ValueError(f"block size in elements must be a multiple of 1024, got {E}")
    if ctas < 1:
        raise ValueError(f"ctas must be >= 1, got {ctas}")
    _gather_blocks_kernel[(ctas,)](src_k, src_v, dst_k, dst_v, src_idx, dst_idx, count, ctas,
                                   E=E, CHUNK=min(E, 4096), num_warps=4)
