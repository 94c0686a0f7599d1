"""PyTorch reference for the block gather (host store -> GPU cache).

Pools are 2-D `[S, E]`: S blocks (or token rows) of E contiguous elements. On the GPU the source
of `gather_blocks` is pinned host memory; here both sides are ordinary tensors.
"""
from __future__ import annotations

import torch


def check_gather_args(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                      count: torch.Tensor) -> None:
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"src and dst must be [S, E] pools with the same E and dtype, got {tuple(src.shape)} "
                         f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if src_idx.dim() != 1 or dst_idx.shape != src_idx.shape:
        raise ValueError(f"src_idx and dst_idx must both be [M], got {tuple(src_idx.shape)} and {tuple(dst_idx.shape)}")
    if count.numel() != 1:
        raise ValueError(f"count must hold one integer, got shape {tuple(count.shape)}")


def gather_blocks_ref(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                      src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < count where dst_idx[i] >= 0 (-1: nothing to move), for K and
    V. Pools `[S, E]`, indices `[M]`."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        check_gather_args(src, dst, src_idx, dst_idx, count)
    n = int(count.reshape(()).item())
    move = dst_idx[:n] >= 0
    s, d = src_idx[:n][move].long().cpu(), dst_idx[:n][move].long().to(dst_k.device)
    dst_k[d] = src_k[s].to(dst_k.device)
    dst_v[d] = src_v[s].to(dst_v.device)
