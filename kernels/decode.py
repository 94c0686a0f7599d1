"""Triton sparse decode attention over 64-token KV blocks (GQA-native, split-K).

Same contract as `decode_ref.sparse_decode_ref` (a selection with slots, a selection in a resident pool, or
every block of a resident layer / a sliding window's ring; the current token written from `k_new` / `v_new`).
One program handles one (sequence, KV head, split): the G query heads of the group are the rows of one tile,
so each K/V block is read once for the whole group; unused entries are skipped, not masked. Splits cut the
entry list into parts (flash-decoding), each writes a partial (max, sum, unnormalised output) and a second
launch merges them with the online-softmax rule (one launch in all when there is one split). Indices and
lengths are read as they are (int64): the call launches nothing but its kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_ref import BLOCK, check_decode_args
from .tiling import LOG2E


@triton.jit
def _sparse_decode_kernel(Q, Kp, Vp, Blocks, Slots, Lengths, Knew, Vnew, Out, Opart, Mpart, Lpart, qk_scale,
                          Hkv, K, per_split, G, row_blocks, window,
                          D: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, SELECTED: tl.constexpr,
                          MAPPED: tl.constexpr, NEW: tl.constexpr, SINGLE: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)  # b * Hkv + kv head
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    b = bh // Hkv
    rows = tl.arange(0, GP)
    cols = tl.arange(0, D)
    toks = tl.arange(0, BLOCK_N)
    row_ok = rows < G
    q = tl.load(Q + (bh * G + rows)[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
    length = tl.load(Lengths + b).to(tl.int64)
    cur = length - 1
    last = cur // BLOCK_N
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # first visible position
    first = lo // BLOCK_N
    if NEW:
        knew = tl.load(Knew + bh * D + cols)
        vnew = tl.load(Vnew + bh * D + cols)
    m_i = tl.full([GP], -1.0e30, tl.float32)  # finite: a split with no key leaves m, l, acc unchanged
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    start = split * per_split
    end = tl.minimum(start + per_split, K)
    for i in range(start, end):
        if SELECTED:
            blk = tl.load(Blocks + bh * K + i).to(tl.int64)
        else:
            blk = first + i
            blk = tl.where(blk <= last, blk, -1)
        if blk >= 0:
            if MAPPED:
                slot = tl.load(Slots + bh * K + i).to(tl.int64)
            else:
                slot = bh * row_blocks + blk % row_blocks
            pos = blk * BLOCK_N + toks
            key_ok = (pos < length) & (pos >= lo)
            off = slot * (BLOCK_N * D) + toks[:, None] * D + cols[None, :]
            if NEW:
                k = tl.load(Kp + off, mask=(key_ok & (pos != cur))[:, None], other=0.0)
                v = tl.load(Vp + off, mask=(key_ok & (pos != cur))[:, None], other=0.0)
                is_cur = (pos == cur)[:, None]
                k = tl.where(is_cur, knew[None, :].to(k.dtype), k)
                v = tl.where(is_cur, vnew[None, :].to(v.dtype), v)
                if blk == last:  # the one entry holding the current block appends the token to the pool
                    row = slot * (BLOCK_N * D) + (cur % BLOCK_N) * D + cols
                    tl.store(Kp + row, knew.to(Kp.dtype.element_ty))
                    tl.store(Vp + row, vnew.to(Vp.dtype.element_ty))
            else:
                k = tl.load(Kp + off, mask=key_ok[:, None], other=0.0)
                v = tl.load(Vp + off, mask=key_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # [GP, BLOCK_N], log2 units
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    if SINGLE:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padded rows have no keys
        tl.store(Out + (bh * G + rows)[:, None] * D + cols[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (bh * nsplit + split) * G + rows
        tl.store(Opart + part[:, None] * D + cols[None, :], acc, mask=row_ok[:, None])
        tl.store(Mpart + part, m_i, mask=row_ok)
        tl.store(Lpart + part, l_i, mask=row_ok)


@triton.jit
def _combine_kernel(Opart, Mpart, Lpart, Out, nsplit, G, D: tl.constexpr, GP: tl.constexpr, SP: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, GP)
    cols = tl.arange(0, D)
    sp = tl.arange(0, SP)
    row_ok = rows < G
    ok = (sp < nsplit)[:, None] & row_ok[None, :]
    m = tl.max(tl.load(Mpart + (bh * nsplit + sp)[:, None] * G + rows[None, :], mask=ok, other=-1.0e30), 0)  # [GP]
    acc = tl.zeros([GP, D], tl.float32)
    den = tl.zeros([GP], tl.float32)
    for s in range(nsplit):
        part = (bh * nsplit + s) * G + rows
        w = tl.math.exp2(tl.load(Mpart + part, mask=row_ok, other=-1.0e30) - m)
        den += w * tl.load(Lpart + part, mask=row_ok, other=0.0)
        acc += w[:, None] * tl.load(Opart + part[:, None] * D + cols[None, :], mask=row_ok[:, None], other=0.0)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(Out + (bh * G + rows)[:, None] * D + cols[None, :], out.to(Out.dtype.element_ty), mask=row_ok[:, None])


def default_splits(B: int, Hkv: int, K: int, target_programs: int = 264) -> int:
    """Enough splits to give ~2 programs per SM of an H100/H200, at least 4 blocks per split."""
    want = max(1, -(-target_programs // (B * Hkv)))
    return max(1, min(want, K // 4 or 1))


def sparse_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, lengths: torch.Tensor, scale: float,
                  *, blocks: torch.Tensor | None = None, slots: torch.Tensor | None = None, kv_heads: int | None = None,
                  row_blocks: int | None = None, window: int = 0, k_new: torch.Tensor | None = None,
                  v_new: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """Triton version of `sparse_decode_ref` (same arguments; `splits` parts of the entry list run in
    parallel, default from `default_splits`). Tensors contiguous. Returns `[B, Hq, D]` in q's dtype."""
    B, Hq, Hkv, K, D = check_decode_args(q, k_pool, v_pool, blocks, slots, lengths, row_blocks, kv_heads)
    if D & (D - 1) or D < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernel, got {D}")
    if (k_new is None) != (v_new is None):
        raise ValueError("give both k_new and v_new, or neither")
    G = Hq // Hkv
    splits = splits or default_splits(B, Hkv, K)
    per_split = -(-K // splits)
    splits = -(-K // per_split)
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    opart = torch.empty(B * Hkv, splits, G, D, device=q.device, dtype=torch.float32) if splits > 1 else out
    mpart = torch.empty(B * Hkv, splits, G, device=q.device, dtype=torch.float32) if splits > 1 else out
    lpart = torch.empty_like(mpart) if splits > 1 else out
    GP = max(16, triton.next_power_of_2(G))
    _sparse_decode_kernel[(B * Hkv, splits)](
        q, k_pool, v_pool, blocks if blocks is not None else lengths, slots if slots is not None else lengths,
        lengths, k_new if k_new is not None else q, v_new if v_new is not None else q, out, opart, mpart, lpart,
        scale * LOG2E, Hkv, K, per_split, G, row_blocks or 0, window,
        D=D, GP=GP, BLOCK_N=BLOCK, SELECTED=blocks is not None, MAPPED=slots is not None, NEW=k_new is not None,
        SINGLE=splits == 1, num_warps=4 if D <= 128 else 8)
    if splits > 1:
        _combine_kernel[(B * Hkv,)](opart, mpart, lpart, out, splits, G, D=D, GP=GP,
                                    SP=triton.next_power_of_2(splits), num_warps=4)
    return out
