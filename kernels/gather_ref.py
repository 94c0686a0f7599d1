"""PyTorch reference for the block gather (host store -> GPU cache), and the KV store's row quantisation.

Pools are 2-D `[S, E]`: S blocks (or token rows) of E contiguous elements. On the GPU the source
of `gather_blocks` is pinned host memory; here both sides are ordinary tensors.

A quantised store keeps each token's key (and value) row of one head as FP8 (e4m3) or INT8 codes with one
float32 scale: scale = max |x| / QMAX, code = x / scale (FP8: round to nearest even; INT8: floor(x / scale + 0.5),
so that every implementation rounds alike), value = code * scale in the model's dtype. The "int4" store
(`INT4`, issue 26) keeps 4-bit codes with one float16 scale per group of 32 elements of a row (`GROUP`), rounded
like INT8 and packed two to a byte: 64 + 8 bytes per 128-dim row, against 128 + 4 (FP8) and 256 (bf16). The gather
dequantises while it copies, so the GPU cache holds model-dtype values, and the decoder attends to exactly
`dequantize_rows(*quantize_rows(x))` whether a block came from the host or was appended on the GPU.
INT4 costs clearly more quality than FP8 (SmolLM2-135M, 4K passkey prompt, fp32, CPU: dense@int4 top-1 0.857, KL
0.072 vs dense@fp8 0.952, 0.0057; kernels/NOTES.md "INT4 host store"): an option, never the default.
A store format (`kv_quant`) may round keys and values differently: "int8k-int4v" keeps INT8 keys and INT4 values
(KL 0.0070 against FP8's 0.0079 on the real model at 0.77x FP8's bytes, where INT4 keys cost 0.092: kernels/NOTES.md
"Which 4-bit KV to build next").
The forecast heads' files hold their weight as the same INT8 rows with fp16 scales (`scale_dtype`).
"""
from __future__ import annotations

import torch

INT4 = torch.uint8  # the "int4" store's code dtype: two 4-bit codes per byte (`quantize_rows`)
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0, INT4: 7.0}
GROUP = 32  # elements of a row per INT4 scale
# float16 INT4 scales: 8 bytes per 128-dim row instead of 16 (72 bytes a row, not 80: 10 % less over PCIe); the
# scale is a max / 7, far inside float16's range for KV, and x is divided by the rounded scale anyway
SCALE_DTYPE = {torch.float8_e4m3fn: torch.float32, torch.int8: torch.float32, INT4: torch.float16}


def kv_quant(quant: torch.dtype | tuple | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """A store format -> (key codes dtype, value codes dtype), each None (the model's dtype), FP8, INT8 or `INT4`: one
    dtype rounds both alike (the "fp8" / "int8" / "int4" stores), a pair (k, v) each its own ("int8k-int4v")."""
    if isinstance(quant, tuple):
        if len(quant) != 2:
            raise ValueError(f"a store format is one code dtype or a (key, value) pair, got {quant}")
        return quant
    return quant, quant


GATHER_WARPS = (1, 2, 4, 8)  # warps per program the gather kernel takes


def gather_ctas(quantised: bool) -> int:
    """Programs of the UVA gather kernel by default: 32 for a model-dtype store, 64 for FP8 / INT8 / INT4 codes
    (their dequantisation keeps fewer bytes in flight per program). On the H200 in the decode engine at 128K
    (kernels/NOTES.md): bf16 offload-forecast 1717 / 1852 tok/s at 32 vs 1405 / 1690 at 64 (batch 8 / 16),
    FP8 2172 / 2490 at 32 vs 2317 / 3058 at 64; 16 starved beside the other kernels. INT4 alone moves 33 GB/s at
    32 programs and 46-48 at 64-128; in the engine forecast ran 3602 / 3091 / 2879 tok/s at 64 / 96 / 128."""
    return 64 if quantised else 32


def row_layout(quant: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(code elements, scales) per token row of `head_dim` in a `quant` store: (D, 1) for FP8 / INT8, (D / 2 bytes,
    D / GROUP) for INT4. Raises ValueError for a head_dim INT4 cannot group."""
    if quant != INT4:
        return head_dim, 1
    if head_dim < GROUP or head_dim & (head_dim - 1):
        raise ValueError(f"store_dtype 'int4' needs head_dim to be a power of two >= {GROUP} (one scale per group of "
                         f"{GROUP} elements), got head_dim={head_dim}: use store_dtype 'fp8' or 'int8' for this model")
    return head_dim // 2, head_dim // GROUP


def quantize_rows(x: torch.Tensor, dtype: torch.dtype,
                  scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., D]` -> (codes, scales in `scale_dtype`, default `SCALE_DTYPE[dtype]`). FP8 / INT8: codes `[..., D]` in
    `dtype`, one scale per row `[...]`. INT4 (`dtype` = `INT4`): codes `[..., D / 2]` uint8, 16 bytes per group of
    32 elements, byte j of a group holding its element j in the low nibble and element j + 16 in the high one,
    each nibble code + 8 (1..15: the gather unpacks a group with a mask, a shift and one subtraction into its two
    contiguous halves, no interleave), one scale per group of 32 elements `[..., D / 32]`.
    The scale = max |x| / QMAX over the row (group) is computed in float32 and rounded to `scale_dtype`, x is divided
    by the rounded scale and clamped to +-QMAX, so that quantising `dequantize_rows` of the result gives the same
    codes and scales back; then rounded (FP8: to nearest even; INT8 and INT4: floor(y + 0.5)). INT4's error is at
    most scale / 2 per element (a float16 scale below 2^-14 is subnormal: then at most 2.1e-7 more)."""
    if dtype not in QMAX:
        raise ValueError(f"quantised store dtype must be float8_e4m3fn, int8 or uint8 (INT4), got {dtype}")
    xf = x.float()
    if dtype == INT4:
        row_layout(INT4, x.shape[-1])
        xf = xf.unflatten(-1, (-1, GROUP))  # [..., G, 32]
    amax = xf.abs().amax(-1)
    scale = (amax / torch.full_like(amax, QMAX[dtype])).to(scale_dtype or SCALE_DTYPE[dtype])  # a true division:
    # CUDA's `tensor / scalar` multiplies by the rounded reciprocal, one ulp away from the kernels' div_rn on some rows
    s = scale.float()
    y = torch.where(s[..., None] > 0, xf / s.clamp(min=torch.finfo(torch.float32).tiny)[..., None], 0.0)
    y = y.clamp(-QMAX[dtype], QMAX[dtype])  # a scale rounded down (fp16) can put |y| just past QMAX
    if dtype == torch.float8_e4m3fn:
        return y.to(dtype), scale
    y = torch.floor(y + 0.5)
    if dtype == torch.int8:
        return y.to(dtype), scale
    nibbles = (y + 8).to(torch.uint8)  # [..., G, 32]
    return (nibbles[..., : GROUP // 2] | (nibbles[..., GROUP // 2:] << 4)).flatten(-2), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 / INT8 codes `[..., D]` with scales `[...]`, or INT4 codes `[..., D / 2]` uint8 with scales `[..., D / 32]`
    (any float dtype) -> values `[..., D]` in `dtype`."""
    if codes.dtype == INT4:
        b = codes.unflatten(-1, (-1, GROUP // 2))  # [..., G, 16]
        c = torch.cat((b & 15, b >> 4), -1).float() - 8  # [..., G, 32]
        return (c * scale.float()[..., None]).flatten(-2).to(dtype)
    return (codes.float() * scale.float()[..., None]).to(dtype)


def check_gather_args(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                      count: torch.Tensor, quantised: bool = False) -> None:
    """One part's (K's or V's) pools, `quantised` when its scales are given, and the copy list."""
    packed = 2 if quantised and src.dtype == INT4 else 1  # INT4: E / 2 bytes of codes per block
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] * packed != dst.shape[1] or (src.dtype != dst.dtype and not quantised):
        raise ValueError(f"src and dst must be [S, E] pools with the same E (INT4 codes: E / 2 bytes) and dtype, got "
                         f"{tuple(src.shape)} {src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if quantised and src.dtype not in QMAX:
        raise ValueError(f"scales are given, so src must hold float8_e4m3fn, int8 or uint8 (INT4) codes, got {src.dtype}")
    if src_idx.dim() != 1 or dst_idx.shape != src_idx.shape:
        raise ValueError(f"src_idx and dst_idx must both be [M], got {tuple(src_idx.shape)} and {tuple(dst_idx.shape)}")
    if count.numel() != 1:
        raise ValueError(f"count must hold one integer, got shape {tuple(count.shape)}")


def gather_blocks_ref(src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                      src_idx: torch.Tensor, dst_idx: torch.Tensor, count: torch.Tensor,
                      scale_k: torch.Tensor | None = None, scale_v: torch.Tensor | None = None) -> None:
    """dst[dst_idx[i]] = src[src_idx[i]] for i < count where dst_idx[i] >= 0 (-1: nothing to move), for K and
    V. Pools `[S, E]`, indices `[M]`. With scales the source holds codes, dequantised into dst's dtype: FP8 / INT8
    `[S, E]` with scales `[S, R]` float32 (R rows of E / R elements per block), or INT4 `[S, E / 2]` uint8 with
    scales `[S, E / 32]` float16 (the block's groups of 32 in order: a group never straddles two rows). K and V
    each have their own format (a part without scales holds values: "int8k-int4v" gives INT8 K, INT4 V)."""
    for src, dst, scale in ((src_k, dst_k, scale_k), (src_v, dst_v, scale_v)):
        check_gather_args(src, dst, src_idx, dst_idx, count, scale is not None)
    n = int(count.reshape(()).item())
    move = dst_idx[:n] >= 0
    s, d = src_idx[:n][move].long().cpu(), dst_idx[:n][move].long().to(dst_k.device)
    for src, dst, scale in ((src_k, dst_k, scale_k), (src_v, dst_v, scale_v)):
        block = src[s]
        if scale is not None and src.dtype == INT4:
            block = dequantize_rows(block, scale[s], dst.dtype)
        elif scale is not None:
            rows = scale.shape[1]
            block = dequantize_rows(block.view(len(s), rows, src.shape[1] // rows), scale[s], dst.dtype)
            block = block.view(len(s), src.shape[1])
        dst[d] = block.to(dst.device)
