"""PyTorch reference for the block gather (host store -> GPU cache), and the KV store's row quantisation.

Pools are 2-D `[S, E]`: S blocks (or token rows) of E contiguous elements. On the GPU the source
of `gather_blocks` is pinned host memory; here both sides are ordinary tensors.

A quantised store keeps each token's key (and value) row of one head as FP8 (e4m3) or INT8 codes with one
float32 scale: scale = max |x| / QMAX, code = x / scale (FP8: round to nearest even; INT8: floor(x / scale + 0.5),
so that every implementation rounds alike), value = code * scale in the model's dtype. The gather dequantises
while it copies, so the GPU cache holds model-dtype values, and the decoder attends to exactly
`dequantize_rows(*quantize_rows(x))` whether a block came from the host or was appended on the GPU.
The forecast heads' files hold their weight as the same INT8 rows with fp16 scales (`scale_dtype`).
"""
from __future__ import annotations

import torch

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def gather_ctas(quantised: bool) -> int:
    """Programs of the UVA gather kernel by default: 32 for a model-dtype store, 64 for FP8 / INT8 codes (their
    per-row dequantisation keeps fewer bytes in flight per program). On the H200 in the decode engine at 128K
    (kernels/NOTES.md): bf16 offload-forecast 1717 / 1852 tok/s at 32 vs 1405 / 1690 at 64 (batch 8 / 16),
    FP8 2172 / 2490 at 32 vs 2317 / 3058 at 64; 16 starved beside the other kernels."""
    return 64 if quantised else 32


def quantize_rows(x: torch.Tensor, dtype: torch.dtype,
                  scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., D]` -> codes `[..., D]` in `dtype` (float8_e4m3fn or int8) and scales `[...]` in `scale_dtype`.
    The scale is computed in float32, rounded to `scale_dtype`, and x is divided by the rounded scale, so that
    quantising `dequantize_rows` of the result gives the same codes and scales back."""
    if dtype not in QMAX:
        raise ValueError(f"quantised store dtype must be float8_e4m3fn or int8, got {dtype}")
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = (amax / torch.full_like(amax, QMAX[dtype])).to(scale_dtype)  # a true division: CUDA's `tensor /
    # scalar` multiplies by the rounded reciprocal, one ulp away from the kernels' div_rn on some rows (H200)
    s = scale.float()
    y = torch.where(s[..., None] > 0, xf / s.clamp(min=torch.finfo(torch.float32).tiny)[..., None], 0.0)
    y = y.clamp(-QMAX[dtype], QMAX[dtype])  # a scale rounded down (fp16) can put |y| just past QMAX
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.to(dtype), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes `[..., D]`, scales `[...]` (any float dtype) -> values `[..., D]` in `dtype`."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


def check_gather_args(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                      count: torch.Tensor, quantised: bool = False) -> None:
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or (src.dtype != dst.dtype and not quantised):
        raise ValueError(f"src and dst must be [S, E] pools with the same E and dtype, got {tuple(src.shape)} "
                         f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if quantised and src.dtype not in QMAX:
        raise ValueError(f"scales are given, so src must hold float8_e4m3fn or int8 codes, got {src.dtype}")
    if src_idx.dim() != 1 or dst_idx.shape != src_idx.shape:
        raise ValueError(f"src_idx and dst_idx must both be [M], got {tuple(src_idx.shape)} and {tuple(dst_idx.shape)}")
    if count.numel() != 1:
        raise ValueError(f"count must hold one integer, got shape {tuple(count.shape)}")


def gather_blocks_ref(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                      src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor,
                      scale_k: torch.Tensor | None = None, scale_v: torch.Tensor | None = None) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < count where dst_idx[i] >= 0 (-1: nothing to move), for K and
    V. Pools `[S, E]`, indices `[M]`. With scales `[S, R]` float32 (R rows of E / R elements per block) the source
    holds codes and each row is dequantised into dst's dtype."""
    quantised = scale_k is not None
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        check_gather_args(src, dst, src_idx, dst_idx, count, quantised)
    n = int(count.reshape(()).item())
    move = dst_idx[:n] >= 0
    s, d = src_idx[:n][move].long().cpu(), dst_idx[:n][move].long().to(dst_k.device)
    for src, dst, scale in ((src_k, dst_k, scale_k), (src_v, dst_v, scale_v)):
        block = src[s]
        if quantised:
            rows = scale.shape[1]
            block = dequantize_rows(block.view(len(s), rows, src.shape[1] // rows), scale[s], dst.dtype)
            block = block.view(len(s), src.shape[1])
        dst[d] = block.to(dst.device)
