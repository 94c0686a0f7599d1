"""Triton versions of the decode engine's per-layer bookkeeping: one launch for the cache plan (also fused
into the selection: `plan_row`), one for writing the new token (host store, quantised or not, and compressed
keys). Same contracts as `cache_plan_ref`.

`plan_blocks`: one program per (sequence, KV head) row holds the row's selection `[K]` and slot map
`[C]` in registers: hits are found by a gather from the block map, the free slots are ranked with a
prefix sum and matched to the misses' ranks (the reference's assignment exactly), the maps are updated
in place and the copy list is written into the row's own segment (no compaction; atomics only for the
two counters).
`append_token`: one program per row writes K and V into pinned host memory through UVA (FP8 / INT8 / INT4 codes
and their scales for a quantised store, and the dequantised values the decoder attends to) and rolls the
compressed-key window.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gather_ref import INT4, QMAX, kv_quant, row_layout


@triton.jit
def plan_row(bh, blk, kin, SlotOf, BlockIn, Slots, Src, Dst, Hits, Misses, K, C, NB, CP: tl.constexpr):
    """Admit row bh's selection `blk` `[KP]` (int64, -1 unused; `kin` = entries < K) into its cache maps and
    write its slots and copy list (the body of `_plan_kernel`, shared with the fused selection)."""
    cc = tl.arange(0, CP)
    valid = blk >= 0
    cur = tl.load(SlotOf + bh * (NB + 1) + tl.where(valid, blk, 0), mask=valid, other=-1).to(tl.int64)
    hit = valid & (cur >= 0)
    miss = valid & (cur < 0)
    held = tl.max(tl.where(hit[:, None] & (cur[:, None] == cc[None, :]), 1, 0), 0)  # [CP]
    free = (held == 0) & (cc < C)
    free_rank = tl.cumsum(free.to(tl.int32), 0) - 1
    miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    match = miss[:, None] & free[None, :] & (miss_rank[:, None] == free_rank[None, :])
    new = tl.sum(tl.where(match, cc[None, :], 0), 1).to(tl.int64)  # [KP]
    old = tl.load(BlockIn + bh * (C + 1) + new, mask=miss, other=-1).to(tl.int64)
    # evicted blocks, missed blocks and new slots are disjoint address sets: no ordering needed
    tl.store(SlotOf + bh * (NB + 1) + tl.where(old >= 0, old, NB), -1, mask=miss & (old >= 0))
    tl.store(SlotOf + bh * (NB + 1) + tl.where(valid, blk, NB), new, mask=miss)
    tl.store(BlockIn + bh * (C + 1) + new, blk, mask=miss)
    slot = tl.where(hit, cur, new) + bh * C
    kk = tl.arange(0, blk.shape[0])
    tl.store(Slots + bh * K + kk, tl.where(valid, slot, -1), mask=kin)
    tl.store(Src + bh * K + kk, tl.where(valid, blk, 0) + bh * NB, mask=kin)
    tl.store(Dst + bh * K + kk, tl.where(miss, slot, -1), mask=kin)
    tl.atomic_add(Hits, tl.sum(hit.to(tl.int64), 0))
    tl.atomic_add(Misses, tl.sum(miss.to(tl.int64), 0))


@triton.jit
def _plan_kernel(Blocks, SlotOf, BlockIn, Slots, Src, Dst, Hits, Misses, K, C, NB,
                 KP: tl.constexpr, CP: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, KP)
    kin = kk < K
    blk = tl.load(Blocks + bh * K + kk, mask=kin, other=-1).to(tl.int64)
    plan_row(bh, blk, kin, SlotOf, BlockIn, Slots, Src, Dst, Hits, Misses, K, C, NB, CP)


def check_plan_args(blocks: torch.Tensor, slot_of: torch.Tensor, block_in: torch.Tensor, hits: torch.Tensor,
                    misses: torch.Tensor) -> None:
    K, C = blocks.shape[2], block_in.shape[2] - 1
    if K > C:
        raise ValueError(f"a selection of {K} blocks does not fit a cache of {C} slots: raise the capacity")
    for name, t in (("blocks", blocks), ("slot_of", slot_of), ("block_in", block_in), ("hits", hits), ("misses", misses)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor, got {t.dtype}")


def plan_blocks(blocks: torch.Tensor, slot_of: torch.Tensor, block_in: torch.Tensor, hits: torch.Tensor,
                misses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `plan_blocks_ref` (same arguments and results; maps and counters int64, contiguous)."""
    check_plan_args(blocks, slot_of, block_in, hits, misses)
    B, H, K = blocks.shape
    NB, C = slot_of.shape[2] - 1, block_in.shape[2] - 1
    slots = torch.empty_like(blocks)
    src = torch.empty(B * H * K, dtype=torch.int64, device=blocks.device)
    dst = torch.empty_like(src)
    _plan_kernel[(B * H,)](blocks, slot_of, block_in, slots, src, dst, hits, misses, K, C, NB,
                           KP=triton.next_power_of_2(K), CP=triton.next_power_of_2(C), num_warps=4)
    return slots, src, dst


def row_warps(d: int) -> int:
    """Warps of a program that holds D-wide rows for `store_row`: one element per thread. With two or more per
    thread the FP8 codes of `y.to(tl.float8e4nv)` came out right in the store but wrong in the in-register
    dequantised value (H200, Triton 3.6: head_dim 64 at 1 warp, 128 at 2, 256 at 4; right at one per thread;
    INT8 right at any count)."""
    return max(1, d // 32)


@triton.jit
def store_row(x, bh, pos, d, Host, HostS, Out, HOST_TOKENS, QMAX, HOST: tl.constexpr, QUANT: tl.constexpr,
              INT8: tl.constexpr, INT4: tl.constexpr, OUT: tl.constexpr):
    """The new token's K (or V) row x `[D]` of head row bh at position pos: into the host store (values, or codes
    and the row's scale = max |x| / QMAX, rounded like `gather_ref.quantize_rows`; INT4: D / 2 packed bytes and a
    float16 scale per group of 32) and its dequantised value into Out (what the decoder attends to). Shared by
    `append_token` and `layer.rope_split`."""
    hrow = bh * HOST_TOKENS + pos
    D: tl.constexpr = d.shape[0]
    if QUANT and INT4:  # integer work only: the FP8 conversion issue of `row_warps` does not arise
        G: tl.constexpr = D // 32
        xg = tl.reshape(x.to(tl.float32), (G, 32))
        scale = tl.math.div_rn(tl.max(tl.abs(xg), 1), QMAX).to(tl.float16).to(tl.float32)  # [G]
        div = tl.broadcast_to(tl.where(scale > 0, scale, 1.0)[:, None], (G, 32))
        y = tl.where(scale[:, None] > 0, tl.math.div_rn(xg, div), 0.0)
        codes = tl.minimum(tl.maximum(tl.math.floor(y + 0.5), -QMAX), QMAX)  # [G, 32]
        if OUT:
            tl.store(Out + bh * D + d, tl.reshape(codes * scale[:, None], (D,)).to(Out.dtype.element_ty))
        if HOST:
            halves = tl.permute(tl.reshape(codes.to(tl.int32) + 8, (G, 2, 16)), (0, 2, 1))  # [G, 16, 2]
            lo, hi = tl.split(halves)  # elements j and j + 16 of each group
            tl.store(Host + hrow * (D // 2) + tl.arange(0, D // 2), tl.reshape(lo + (hi << 4), (D // 2,)).to(tl.uint8))
            tl.store(HostS + hrow * G + tl.arange(0, G), scale.to(tl.float16))
    elif QUANT:
        xf = x.to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(xf), 0), QMAX)
        y = tl.where(scale > 0, tl.math.div_rn(xf, tl.where(scale > 0, scale, 1.0)), 0.0)
        if INT8:  # the codes' own type: without a host store Host points at x, whose type rounds nothing
            codes = tl.minimum(tl.maximum(tl.math.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
        else:
            codes = y.to(tl.float8e4nv)
        if OUT:
            tl.store(Out + bh * D + d, (codes.to(tl.float32) * scale).to(Out.dtype.element_ty))
        if HOST:
            tl.store(Host + hrow * D + d, codes)
            tl.store(HostS + hrow, scale)
    elif HOST:
        tl.store(Host + hrow * D + d, x.to(Host.dtype.element_ty))


@triton.jit
def roll_row(k, bh, pos, d, Tail, CKeys, NC1, STRIDE, W: tl.constexpr):
    """The new key k `[D]` enters head row bh's W-row ring; completing a window writes its mean as a compressed
    key (`cache_plan_ref.roll_compressed_ref`)."""
    D: tl.constexpr = d.shape[0]
    kf = k.to(tl.float32)
    tl.store(Tail + (bh * W + pos % W) * D + d, kf)
    if ((pos + 1) % STRIDE == 0) & (pos >= W - 1):
        tok = pos - (W - 1) + tl.arange(0, W)  # the window's tokens; the newest comes from registers
        others = tl.load(Tail + (bh * W + tok % W)[:, None] * D + d[None, :], mask=(tok != pos)[:, None], other=0.0)
        mean = (tl.sum(others, 0) + kf) / W
        j = (pos - (W - 1)) // STRIDE
        tl.store(CKeys + (bh * NC1 + j) * D + d, mean.to(CKeys.dtype.element_ty))


@triton.jit
def _append_token_kernel(K, V, Pos, HostK, HostV, HostSK, HostSV, Kout, Vout, Tail, CKeys,
                         H, HOST_TOKENS, NC1, STRIDE, QMAX_K, QMAX_V,
                         D: tl.constexpr, W: tl.constexpr, HOST: tl.constexpr, QUANT_K: tl.constexpr,
                         INT8_K: tl.constexpr, INT4_K: tl.constexpr, QUANT_V: tl.constexpr, INT8_V: tl.constexpr,
                         INT4_V: tl.constexpr, OUT: tl.constexpr, COMPRESS: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    pos = tl.load(Pos + bh // H).to(tl.int64)
    k = tl.load(K + bh * D + d)
    store_row(k, bh, pos, d, HostK, HostSK, Kout, HOST_TOKENS, QMAX_K, HOST, QUANT_K, INT8_K, INT4_K, OUT)
    store_row(tl.load(V + bh * D + d), bh, pos, d, HostV, HostSV, Vout, HOST_TOKENS, QMAX_V, HOST, QUANT_V, INT8_V,
              INT4_V, OUT)
    if COMPRESS:
        roll_row(k, bh, pos, d, Tail, CKeys, NC1, STRIDE, W)


def append_args(k: torch.Tensor, *, host_k: torch.Tensor | None = None, host_v: torch.Tensor | None = None,
                host_scale_k: torch.Tensor | None = None, host_scale_v: torch.Tensor | None = None,
                quant: torch.dtype | tuple | None = None, k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
                tail: torch.Tensor | None = None, ckeys: torch.Tensor | None = None, stride: int = 16
                ) -> tuple[tuple, dict]:
    """Check `append_token`'s keyword arguments -> (pointer and integer arguments, constexprs) of `store_row` and
    `roll_row` (unused pointers point at k). `quant`: the store format (`gather_ref.kv_quant`: one dtype for K and
    V, or a (K, V) pair), so each part has its own QMAX_* and QUANT_* / INT8_* / INT4_* flags. Shared with
    `layer.rope_split`."""
    D = k.shape[-1]
    if D & (D - 1) or (tail is not None and tail.shape[2] & (tail.shape[2] - 1)):
        raise ValueError(f"head_dim ({D}) and the compression window must be powers of two for the Triton kernel")
    ints = (host_k.shape[2] if host_k is not None else 0, ckeys.shape[2] if ckeys is not None else 0, stride)
    flags = dict(W=tail.shape[2] if tail is not None else 1, HOST=host_k is not None, OUT=k_out is not None,
                 COMPRESS=tail is not None)
    qk, qv = kv_quant(quant)
    for part, q, host, scale in (("K", qk, host_k, host_scale_k), ("V", qv, host_v, host_scale_v)):
        if host is not None and (host.dtype in QMAX) != (q is not None):
            raise ValueError(f"a {host.dtype} host store needs quant={host.dtype} and its scales")
        if q is not None and q not in QMAX:
            raise ValueError(f"quant must be float8_e4m3fn, int8 or uint8 (INT4), got {q}")
        if q is not None:
            row_layout(q, D)  # INT4: head_dim a power of two >= 32
        if q is not None and host is not None and scale is None:
            raise ValueError("a quantised host store needs host_scale_k and host_scale_v")
        ints += (QMAX.get(q, 1.0),)
        flags.update({f"QUANT_{part}": q is not None, f"INT8_{part}": q == torch.int8, f"INT4_{part}": q == INT4})
    ptrs = tuple(t if t is not None else k for t in (host_k, host_v, host_scale_k, host_scale_v, k_out, v_out, tail,
                                                      ckeys))
    return ptrs + ints, flags


def append_token(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, **targets) -> None:
    """Triton `append_token_ref` (same arguments). Tensors contiguous; host tensors may be pinned host memory
    (written through UVA); D and the window W must be powers of two."""
    B, H, D = k.shape
    (hk, hv, sk, sv, ko, vo, tail, ck, *ints), flags = append_args(k, **targets)
    _append_token_kernel[(B * H,)](k, v.contiguous(), positions, hk, hv, sk, sv, ko, vo, tail, ck, H, *ints, D=D,
                                   **flags, num_warps=row_warps(D))
