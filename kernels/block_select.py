"""Triton InfLLM-V2 decode selection: group scores, max-pool to blocks, top-k (and the cache plan) in two launches.

The PyTorch reference is `workbench.patterns.infllm` (`group_scores` -> `pool_to_blocks` -> `topk_blocks`,
as `workbench.decode.engine.select.select_decode` chains them); this leaf imports nothing from it.

1. `_scores_kernel`, grid (B * Hkv, splits): each program scores one chunk of the compressed keys with the
   G query heads of its group (fp32 keys: IEEE dot; bf16/fp16 keys: tensor-core dot, fp32 accumulation),
   writes the logits (-inf where not yet visible) and its per-head running max and sum of exponentials.
2. `_pool_topk_kernel`, one program per (sequence, KV head): merges the partial softmax statistics, sums
   the G probabilities per compressed key, max-pools them onto blocks (kernel (block + window) / stride - 1,
   stride block / stride, padding window / stride - 1), forces init and local blocks (+inf), drops future
   ones (-inf) and keeps the top K by bisection on the scores' order-preserving integer keys (ties: lower
   block id first). Output: block ids ascending, -1 padded, like `topk_blocks`. Given a GPU block cache it
   also admits the selection there (`cache_plan.plan_row`: slots and copy list), saving a launch per layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cache_plan import check_plan_args, plan_row
from .order import order_key


@triton.jit
def _scores_kernel(Q, CK, Visible, Logits, Mpart, Lpart, scale, H, G, NC, CK_ROWS, per_split, window, stride,
                   D: tl.constexpr, GP: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    b = bh // H
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(Q + (bh * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0).to(CK.dtype.element_ty)
    upto = tl.load(Visible + b)
    n_vis = tl.minimum(tl.maximum((upto - (window - 1) + stride) // stride, 0), NC)  # keys with j*s + w - 1 <= upto
    m_i = tl.full([GP], -1.0e30, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    start = split * per_split
    end = tl.minimum(start + per_split, NC)
    for t0 in range(start, end, TILE):
        j = t0 + tl.arange(0, TILE)
        ck = tl.load(CK + (bh * CK_ROWS + j)[:, None] * D + d[None, :], mask=(j < n_vis)[:, None], other=0.0)
        if IEEE:  # fp32 keys: exact fp32 products and sums, as the reference
            s = tl.dot(q, tl.trans(ck), input_precision="ieee") * scale  # [GP, TILE]
        else:  # bf16 / fp16 keys: tensor cores (exact products, fp32 accumulation); an FMA dot here cost 2 ms/layer
            s = tl.dot(q, tl.trans(ck)) * scale
        s = tl.where((j < n_vis)[None, :], s, float("-inf"))
        tl.store(Logits + (bh * G + g)[:, None] * NC + j[None, :], s, mask=(g < G)[:, None] & (j < end)[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    part = (bh * nsplit + split) * GP + g
    tl.store(Mpart + part, m_i)
    tl.store(Lpart + part, l_i)


@triton.jit
def _pool_topk_kernel(Logits, Mpart, Lpart, Positions, Out, H, G, NC, NB, K, KEEP, init, local, nsplit,
                      SlotOf, BlockIn, Slots, Src, Dst, Hits, Misses, C, NBC,
                      GP: tl.constexpr, SP: tl.constexpr, NBP: tl.constexpr, KP: tl.constexpr,
                      STEP: tl.constexpr, PAD: tl.constexpr, KERNEL: tl.constexpr, BLOCK_N: tl.constexpr,
                      PLAN: tl.constexpr, CP: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP)
    sp = tl.arange(0, SP)
    pm = tl.load(Mpart + (bh * nsplit + sp)[:, None] * GP + g[None, :], mask=(sp < nsplit)[:, None], other=-1.0e30)
    pl = tl.load(Lpart + (bh * nsplit + sp)[:, None] * GP + g[None, :], mask=(sp < nsplit)[:, None], other=0.0)
    m = tl.max(pm, 0)  # [GP]
    l = tl.sum(pl * tl.exp(pm - m[None, :]), 0)
    blocks = tl.arange(0, NBP)
    real = blocks < NB
    best = tl.full([NBP], float("-inf"), tl.float32)
    for o in tl.static_range(KERNEL):
        j = blocks * STEP - PAD + o
        ok = (j >= 0) & (j < NC) & real
        p = tl.zeros([NBP], tl.float32)
        for h in range(G):
            mh = tl.sum(tl.where(g == h, m, 0.0), 0)
            lh = tl.sum(tl.where(g == h, l, 0.0), 0)
            x = tl.load(Logits + (bh * G + h) * NC + j, mask=ok, other=float("-inf"))
            p += tl.where(lh > 0, tl.exp(x - mh) / tl.where(lh > 0, lh, 1.0), 0.0)
        best = tl.where(ok, tl.maximum(best, p), best)
    qb = tl.load(Positions + bh // H).to(tl.int32) // BLOCK_N
    future = blocks > qb
    forced = ((blocks < init) | ((blocks > qb - local) & (blocks <= qb))) & ~future
    score = tl.where(future, float("-inf"), tl.where(forced, float("inf"), best))
    key = order_key(score).to(tl.int64)
    key = tl.where(real, key, -(2 ** 40))  # padding below everything
    lo = tl.min(tl.where(real, key, 2 ** 40), 0)
    hi = tl.max(key, 0)
    for _ in range(34):  # the largest t with count(key >= t) >= KEEP: the KEEP-th largest key
        mid = (lo + hi + 1) // 2
        enough = tl.sum((key >= mid).to(tl.int32), 0) >= KEEP
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo
    tie = key == lo
    chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= KEEP - tl.sum(above.to(tl.int32), 0)))
    chosen = chosen & real & (score != float("-inf"))
    rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(Out + bh * K + rank, blocks.to(tl.int64), mask=chosen)
    r = tl.arange(0, KP)
    tl.store(Out + bh * K + r, tl.full([KP], -1, tl.int64), mask=(r >= tl.sum(chosen.to(tl.int32), 0)) & (r < K))
    if PLAN:  # admit the selection into the layer's block cache in the same launch
        tl.debug_barrier()  # the row's ids were written by every thread of the program
        blk = tl.load(Out + bh * K + r, mask=r < K, other=-1)
        plan_row(bh, blk, r < K, SlotOf, BlockIn, Slots, Src, Dst, Hits, Misses, K, C, NBC, CP)


def select_blocks(q_group: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, visible_upto: torch.Tensor,
                  n_blocks: int, *, init: int, local: int, topk: int, block: int = 64, window: int = 32,
                  stride: int = 16, scale: float | None = None, splits: int | None = None,
                  cache: tuple[torch.Tensor, ...] | None = None):
    """InfLLM-V2 selection for one new token per sequence, as `select_decode` computes it.

    q_group `[B, Hkv, G, D]`; keys `[B, Hkv, Nc(+sink), D]` compressed keys (at most
    (n_blocks * block - window) // stride + 1 columns are read); positions `[B]` (the query's token: its
    block and the `local` before it are forced); visible_upto `[B]` (last token whose key may be scored).
    -> ids `[B, Hkv, init + local + topk]` int64, ascending, -1 padded.
    With `cache` = (slot_of, block_in, hits, misses) of a GPU block cache, the selection is also admitted into
    it in the same launch (`cache_plan.plan_blocks`): -> (ids, slots, src, dst).
    """
    B, Hkv, G, D = q_group.shape
    if keys.dim() != 4 or keys.shape[:2] != (B, Hkv) or keys.shape[3] != D:
        raise ValueError(f"keys must be [B={B}, Hkv={Hkv}, Nc, D={D}], got {tuple(keys.shape)}")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton selection, got {D}")
    if block % stride or window % stride or window > block:
        raise ValueError(f"block ({block}) and window ({window}) must be multiples of stride ({stride}), window <= block")
    K = init + local + topk
    nbp = triton.next_power_of_2(max(n_blocks, 16))
    if nbp > 8192:
        raise ValueError(f"{n_blocks} blocks per sequence exceed the Triton selection's 8192: use kernels='torch'")
    nc = min(keys.shape[2], max(0, (n_blocks * block - window) // stride + 1))
    scale = D ** -0.5 if scale is None else scale
    TILE = 64
    if splits is None:
        splits = max(1, min(-(-264 // (B * Hkv)), -(-nc // (4 * TILE))))
    per_split = max(TILE, -(-max(nc, 1) // splits // TILE) * TILE)
    splits = max(1, -(-nc // per_split))
    GP = max(16, triton.next_power_of_2(G))
    dev = q_group.device
    keys = keys if keys.is_contiguous() else keys.contiguous()
    logits = torch.empty(B * Hkv * G * max(nc, 1), device=dev, dtype=torch.float32)
    mpart = torch.empty(B * Hkv * splits * GP, device=dev, dtype=torch.float32)
    lpart = torch.empty_like(mpart)
    out = torch.empty(B, Hkv, K, device=dev, dtype=torch.int64)
    if cache is not None:
        slot_of, block_in, hits, misses = cache
        check_plan_args(out, slot_of, block_in, hits, misses)
        slots = torch.empty_like(out)
        src = torch.empty(B * Hkv * K, dtype=torch.int64, device=dev)
        dst = torch.empty_like(src)
        plan = (slot_of, block_in, slots, src, dst, hits, misses, block_in.shape[2] - 1, slot_of.shape[2] - 1)
    else:
        plan = (out,) * 7 + (0, 0)
    _scores_kernel[(B * Hkv, splits)](q_group.contiguous(), keys, visible_upto, logits, mpart, lpart, scale, Hkv, G,
                                      nc, keys.shape[2], per_split, window, stride, D=D, GP=GP, TILE=TILE,
                                      IEEE=keys.dtype == torch.float32, num_warps=4)
    _pool_topk_kernel[(B * Hkv,)](logits, mpart, lpart, positions, out, Hkv, G, nc, n_blocks, K, min(K, n_blocks),
                                  init, local, splits, *plan, GP=GP, SP=triton.next_power_of_2(splits), NBP=nbp,
                                  KP=triton.next_power_of_2(K), STEP=block // stride, PAD=window // stride - 1,
                                  KERNEL=(block + window) // stride - 1, BLOCK_N=block, PLAN=cache is not None,
                                  CP=triton.next_power_of_2(max(plan[7], 1)), num_warps=8)
    return out if cache is None else (out, slots, src, dst)
