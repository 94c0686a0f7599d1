"""Warp-specialised Hopper (sm_90) tile loop for block-sparse causal prefill, in Gluon (issue 25, head_dim 128).

FA3's structure over `VSTiles` pieces: one program takes CONSUMERS work items (64-row blocks of one query head,
paired in `work_order`'s longest-first order), each served by its own consumer warpgroup with its own piece
list and its own STAGES-deep shared-memory ring of K/V tiles. A 1-warp producer partition (few registers)
issues the TMA loads of Q and of every ring's K/V tiles; `k_ready` / `v_ready` mbarriers (TMA transaction
counts) tell a consumer a tile has landed, its `k_empty` / `v_empty` arrive tells the producer the slot may be
refilled (a K slot once Q K^T has read it, a V slot once P V has). The V ring may be shallower than the K ring
(`v_stages`): V's load for the next step then waits for this step's P V and hides behind the next Q K^T and softmax.
A consumer computes S = Q K^T with an async wgmma (Q and K from shared memory), the online softmax in fp32 with
exp2, and O += P V (P from registers). With two consumers one warpgroup's softmax runs beside the other's
GEMMs (the warp schedulers interleave them); OVERLAP adds FA3's intra-warpgroup overlap: the next piece's
Q K^T is issued before this piece's P V, and the softmax of the next piece runs while P V is in flight.
SHARE: the two consumers take two query heads of one KV head (2j and 2j + 1, or A-shape's heads of one band,
`head_pairs`) at one row block, whose piece lists are equal, and read one ring: each K/V tile is loaded once for 128
query rows.
PERSIST (`persistent=True`): as many programs as the SMs hold instead of one per turn (a turn: a program's
CONSUMERS items); each takes the next turn no program has claimed (an atomic counter), so turns start in the order's
order as on a grid of one program per turn, and its producer loads a turn's Q and first K/V tiles while the consumers
finish the turn before. `ASHAPE_LAUNCH` takes it.

Vertical-Slash (`ws_vertical_slash`, VS=True): sm_90's TMA cannot gather scattered key rows, so each query head's
unique columns are sorted and their K / V rows packed once per call into contiguous kc / vc `[B * Hq * KVP, D]`
(KVP = columns rounded up to BLOCK_N, 64 or 128 keys). Row block m walks first the prefix of its head's packed
columns that are < m * 64 (their number from a searchsorted), BLOCK_N at a time, as "strips" through the same ring
(kc / vc descriptors), then its slash pieces (`index_build.vs_slash_tiles`, BLOCK_N keys each). A strip lane is
masked unless its column lies under none of the row block's pieces (a d-space flag, d = m * 64 - column, the same
for every row block), so the kept keys are exactly `index_ref.vs_to_tiles`' (at the same piece width); covered
columns cost their lanes but nothing else. Those flags are read as bits: one Triton launch beside the packing
(`strip_keep`) writes each row block's keep words, and a strip step loads one uniform word per 32 lanes. The
per-lane gathers of the column, then its flag, that this replaced cost a strip step about three ordinary steps;
without them VS(1000, 512) ran 1.07x / 1.06x faster at 64K / 128K (H200, kernels/NOTES.md, session 45).
Producer and consumer count the same items per work item (strips + pieces) and keep one running index t over
them: the slot / phase arithmetic is the pieces-only one.

A-shape (`ws_ashape`, ASHAPE=True): `index_ref.ashape_to_tiles`' window pieces, and its sink columns (keys
[0, count) below a row block's lowest piece: contiguous) walked as strips read straight from k / v at key 0;
pieces reaching past the window get the per-token mask (key < sink or row - key < window). A-shape also takes
128 keys per step (`width=128`: 128-key pieces and sink strips, m64n128 score tiles; the step's fixed work - barrier
waits, row max / sum, the O rescale - is paid once per 128 keys): on one shared ring that is `ashape_prefill`'s
launch (`ASHAPE_LAUNCH`). Per-head rings of 128-key steps fit the H200's shared memory at head_dim 128 only with a
V ring one deep (`v_stages=1`: 2 x (2 K + 1 V) x 32 KB + Q); Vertical-Slash takes them too (`width=128`).

Tensors are addressed as flattened rows: q/o `[B * Hq * N, D]`, k/v `[B * Hkv * N, D]`. A K/V tile that
crosses N reads the next head's rows (or TMA's zero fill past the tensor): those keys are masked, and their
V rows are finite, so P = 0 cancels them. Output rows past N are not stored.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .index_ref import VSTiles, band_tiles, expand_groups
from .prefill_ref import check_prefill_args
from .schedule import sm_count, work_order
from .tiling import LN2, LOG2E, band_on, ints_on

ROWS = 64  # query rows per consumer warpgroup (= tiles.block)
KEYS = 64  # keys per piece and per column strip (= tiles.piece); ws_ashape / ws_vertical_slash also take 128
DTYPES = (torch.bfloat16, torch.float16)  # q / k / v dtypes the kernel takes
HEAD_DIMS = (64, 128, 256)  # head_dims it takes (256: the launches below, not the default: `prefill.default_program`)
# TMA load global -> shared with an mbarrier: `async_load` from Triton 3.7 (3.9 removed the old name), the old
# name in 3.6 (the H200 image's)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
PRODUCER_REGS = gl.constexpr(24)  # registers per thread of the 1-warp producer (scalar code only)
# `ashape_prefill`'s launch on sm_90 when heads pair (`head_pairs`): two query heads of one band on one ring of 3
# stages, 128 keys per step (H200, Llama 32/8/128, sink 128, window 4096, 64K and 128K: 1.03-1.08x the 64-key shared
# ring with 4 stages in two probes, kernels/NOTES.md)
# on a persistent grid taking turns in order (H100, 64K / 128K: 1.04x / 1.05x one program per turn; session 41)
ASHAPE_LAUNCH = {"stages": 3, "share_kv": True, "width": 128, "persistent": True}
# its launch where a KV group's heads do not pair up by band: per-head rings of 3 stages, 64 keys per step (H100,
# Llama 32/8/128, sink 128, windows 4096 / 2048 in turn, 64K / 128K: 1.09x / 1.14x the loop over per-head tiles,
# 0.72 / 0.81 of dense per tile; 2 stages 1.08x / 1.12x, KV head first slower; kernels/NOTES.md session 38)
ASHAPE_PER_HEAD_LAUNCH = {"stages": 3, "share_kv": False, "width": 64}
# its launch at head_dim 256 where heads pair (128-key slots would take 64 KB each): two heads of one band on one ring
# of 2 stages, 64 keys per step, overlap (197 KB; H100, Gemma-3 4/1/256, sink 128, 64K / 128K: window 4096 on every
# head 1.25x / 1.33x the GQA-packed loop, 0.94 / 0.98 of dense per tile; windows 4096 / 2048 in turn 1.21x / 1.31x
# the row-block pairs, 0.91 / 0.96; without overlap 1.08-1.15x, K 3 / V 2 slots no faster; kernels/NOTES.md session 40)
ASHAPE_LAUNCH_D256 = {"stages": 2, "share_kv": True, "width": 64}
# ... from this many tokens (H100, windows 4096 on every head / 4096 and 2048 in turn against the packed loop / the
# row-block pairs: 1.05x / 0.92x at 16K, 1.14x / 1.11x at 24K; ashape256_short_probe_6226a00_h100.json), so shorter
# prompts keep the packed loop or the pairs
ASHAPE_D256_MIN_TOKENS = 24576
# `sparse_prefill`'s launches on sm_90, two 64-key items per 128-key step (`pair`; H200, session 16,
# scripts/ws_probe.py, kernels/NOTES.md). Per-head tiles at head_dim 128 (Llama 32/8/128, 64K / 128K): block-sparse
# top-100 12.15 / 25.92 ms against the one-item launch's (1 consumer, 2 stages) 13.09 / 27.30, Vertical-Slash
# (1000, 6096) with head columns 57.12 / 174.95 against (1 consumer, 3 stages) 60.07 / 183.67; group-shared
# block-sparse on one ring 11.91 / 24.60. Head_dim 64 (9/3/64): block-sparse 2.32 / 4.61 against the loop's
# 2.37 / 5.06 (VS there: the loop's 9.84 ms beat 11.15 at 64K, so it keeps the loop).
HEAD_LAUNCH = {"consumers": 2, "stages": 2, "v_stages": 1, "overlap": False, "pair": True}
HEAD_LAUNCH_D64 = {"consumers": 1, "stages": 3, "overlap": False, "pair": True}
SHARED_LAUNCH = {"consumers": 2, "stages": 3, "overlap": False, "share_kv": True, "pair": True}
# Head_dim 256 (Gemma-3): K / V slots of 32 KB a 64-key item, so one item per step and shallow rings. Compiled for
# sm_90 on the CPU (tests/kernels/test_prefill_ws.py): per head 2 consumers with rings of 1 slot, 197 KB of shared
# memory (2 slots each: 328 KB, over the 227), 168 registers, no spills; two heads on one shared ring of 2 slots, 197
# KB. `sparse_prefill` takes them only with warp_specialize=True: on the H100 (Gemma-3 shape, 16K-128K) they ran
# 1-40 % slower than the loop's one 4-warp program per SM (225 KB), but per-head VS at 128K 1.13x faster
# (kernels/NOTES.md, session 27).
HEAD_LAUNCH_D256 = {"consumers": 2, "stages": 1, "overlap": False, "pair": False}
SHARED_LAUNCH_D256 = {"consumers": 2, "stages": 2, "overlap": False, "share_kv": True, "pair": False}


@gluon.jit
def _work_item(Order, Pairs, BlockCount, ColCount, it, sub: gl.constexpr, n_work, N, H, G, M, NS,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr, SHARE: gl.constexpr,
               VS: gl.constexpr, ASHAPE: gl.constexpr):
    """Consumer `sub` of a program's turn `it` -> (valid, q row, kv row, piece-list offset, piece count, strip count,
    first query row, bh = b * H + h): rows in the flattened q / k tensors; a slot past n_work has no items. SHARE:
    `Order` lists (b, head pair j, row block) items, consumer `sub` takes query head Pairs[2 j + sub] of item it;
    else consumer `sub` takes (b, head, row block) item it * CONSUMERS + sub. VS / ASHAPE: the item first walks
    ceil(ColCount / BLOCK_N) strips (VS: of its head's packed columns; ASHAPE: of keys from 0, the sinks), then its
    pieces (strips 0 otherwise)."""
    if SHARE:
        slot = it
    else:
        slot = it * CONSUMERS + sub
    valid = slot < n_work
    item = gl.load(Order + gl.minimum(slot, n_work - 1))
    m = item % M
    if SHARE:
        pair = item // M  # b * H / 2 + j
        bh = (pair // (H // 2)) * H + gl.load(Pairs + 2 * (pair % (H // 2)) + sub)
    else:
        bh = item // M  # b * H + h
    tile = bh * M + m
    kvh = (bh // H) * (H // G) + (bh % H) // G  # b * Hkv + h // G
    count = gl.where(valid, gl.load(BlockCount + tile), 0)
    strips = 0
    if VS or ASHAPE:
        strips = gl.where(valid, (gl.load(ColCount + tile) + BLOCK_N - 1) // BLOCK_N, 0)
    return valid, bh * N + m * BLOCK_M, kvh * N, tile.to(gl.int64) * NS, count, strips, m * BLOCK_M, bh


@gluon.jit
def _item_row(t, strips, kv_row, col_row, Offsets, BLOCK_N: gl.constexpr, VS: gl.constexpr, ASHAPE: gl.constexpr):
    """Where item t's BLOCK_N keys start -> (row, packed): VS and t < strips: strip t of the packed columns (row
    col_row + BLOCK_N t of kc / vc, packed); ASHAPE and t < strips: keys [BLOCK_N t, BLOCK_N (t + 1)) of k / v;
    else piece t - strips (row kv_row + its start of k / v)."""
    row = kv_row + gl.load(Offsets + gl.maximum(t - strips, 0))
    packed = t < strips
    if VS:
        if packed:
            row = col_row + t * BLOCK_N
    elif ASHAPE:
        if packed:
            row = kv_row + t * BLOCK_N
    return row, packed


@gluon.jit
def _fill(t, tg, n, strips, kv_row, col_row, Offsets, k_desc, v_desc, kc_desc, vc_desc, k_smem, v_smem, k_ready,
          v_ready, k_empty, v_empty, ring: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
          VS: gl.constexpr, ASHAPE: gl.constexpr, PAIR: gl.constexpr):
    """Producer: step t of ring `ring`'s item (of n items: step t is item t, or with PAIR items 2t and 2t + 1 into the
    two halves of one slot, item 2t again where 2t + 1 = n: its lanes are masked), the ring's step tg counted over
    the program's items (a running index, so the slot / phase arithmetic is the pieces-only one): K into K slot
    tg % STAGES, V into V slot tg % V_STAGES (`_item_row` says where an item's keys are)."""
    ITEMS: gl.constexpr = 2 if PAIR else 1
    if t * ITEMS < n:
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]  # keys per item
        row, packed = _item_row(t * ITEMS, strips, kv_row, col_row, Offsets, BLOCK_N, VS, ASHAPE)
        row_b, packed_b = row, packed
        if PAIR:
            row_b, packed_b = _item_row(gl.minimum(2 * t + 1, n - 1), strips, kv_row, col_row, Offsets, BLOCK_N, VS,
                                        ASHAPE)
        # Fill j = tg // STAGES of a K slot overwrites what the consumer released with its arrive number j - 1 on
        # `k_empty`, which completes that barrier's phase j - 1: wait for parity (j - 1) & 1 = (j & 1) ^ 1. For
        # j = 0 that is parity 1, the phase "before" a fresh barrier's first, which counts as complete: the
        # first STAGES fills do not wait. V slots likewise with V_STAGES and `v_empty`.
        ik = ring * STAGES + tg % STAGES
        mbarrier.wait(k_empty.index(ik), ((tg // STAGES) & 1) ^ 1)
        _load_step(k_desc, kc_desc, packed, row, packed_b, row_b, k_smem.index(ik), k_ready.index(ik), VS, PAIR)
        iv = ring * V_STAGES + tg % V_STAGES
        mbarrier.wait(v_empty.index(iv), ((tg // V_STAGES) & 1) ^ 1)
        _load_step(v_desc, vc_desc, packed, row, packed_b, row_b, v_smem.index(iv), v_ready.index(iv), VS, PAIR)


@gluon.jit
def _load_step(desc, packed_desc, packed, row, packed_b, row_b, slot, ready, VS: gl.constexpr, PAIR: gl.constexpr):
    """TMA loads of one step into `slot`: rows [row, row + BLOCK_N) of desc (VS and packed: of packed_desc, the same
    tile shape and bytes), with PAIR also item b's rows into the slot's second half; the expect (one arrive) plus
    the bytes complete the slot's `ready` phase."""
    BLOCK_N: gl.constexpr = desc.block_type.shape[0]
    if PAIR:
        mbarrier.expect(ready, 2 * desc.block_type.nbytes)
        _load(desc, packed_desc, packed, row, slot.slice(0, BLOCK_N), ready, VS)
        _load(desc, packed_desc, packed_b, row_b, slot.slice(BLOCK_N, BLOCK_N), ready, VS)
    else:
        mbarrier.expect(ready, desc.block_type.nbytes)
        _load(desc, packed_desc, packed, row, slot, ready, VS)


@gluon.jit
def _load(desc, packed_desc, packed, row, dst, ready, VS: gl.constexpr):
    """TMA load of rows [row, row + BLOCK_N) of desc (VS and packed: of packed_desc) into `dst`, its bytes counted
    on `ready`."""
    if VS:
        if packed:
            tma_load(packed_desc, [row, 0], ready, dst)
        else:
            tma_load(desc, [row, 0], ready, dst)
    else:
        tma_load(desc, [row, 0], ready, dst)


@gluon.jit
def _load_q(q_desc, q_smem, q_bar, q_empty, q_row, n, loads, c: gl.constexpr):
    """Producer: consumer c's Q tile (rows q_row) for its next item, its `loads`-th, once the consumer has released
    the one before (q_empty; the first load does not wait: the slot/phase rule of `_fill`); only for an item with
    steps (a consumer without them never waits for a Q, so no TMA is left in flight). Returns the loads so far."""
    mbarrier.wait(q_empty.index(c), (loads & 1) ^ 1, pred=n > 0)
    mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes, pred=n > 0)
    tma_load(q_desc, [q_row, 0], q_bar.index(c), q_smem.index(c), pred=n > 0)
    return loads + (n > 0).to(gl.int32)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_bar, q_empty, turn_smem,
              turn_ready, turn_free, Claimed, k_ready, v_ready, k_empty, v_empty, BlockCount, BlockOffset, ColCount,
              Order, Pairs, n_work, N, H, G, M, NS, KVP, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr,
              STAGES: gl.constexpr, V_STAGES: gl.constexpr, SHARE: gl.constexpr, VS: gl.constexpr,
              ASHAPE: gl.constexpr, PAIR: gl.constexpr, PERSIST: gl.constexpr):
    """1 warp: the loads of each of the program's turns (`_produce`), each ring's step index and each consumer's Q
    loads counted on over them. PERSIST: turn pid first, then the next unclaimed one (`Claimed` Int32 `[1]`, zero
    at launch, counts the turns past the first P taken), posted to the consumers (`_post_turn`) as it starts, and
    past the last turn `turns` itself (the consumers' stop); else the one turn pid."""
    if PERSIST:
        turns = n_work if SHARE else (n_work + CONSUMERS - 1) // CONSUMERS
        tg0, tg1, q0s, q1s = 0, 0, 0, 0
        it = gl.program_id(0)
        k = 0
        while it < turns:
            _post_turn(turn_smem, turn_ready, turn_free, it, k)
            tg0, tg1, q0s, q1s = _produce(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_bar,
                                          q_empty, k_ready, v_ready, k_empty, v_empty, BlockCount, BlockOffset,
                                          ColCount, Order, Pairs, n_work, N, H, G, M, NS, KVP, it, tg0, tg1, q0s, q1s,
                                          BLOCK_M, CONSUMERS, STAGES, V_STAGES, SHARE, VS, ASHAPE, PAIR)
            # claimed once this turn's loads are issued (the round trip hides behind the consumers' last steps)
            it = gl.num_programs(0) + gl.atomic_add(Claimed, 1)
            k += 1
        _post_turn(turn_smem, turn_ready, turn_free, turns, k)
    else:
        _produce(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
                 k_empty, v_empty, BlockCount, BlockOffset, ColCount, Order, Pairs, n_work, N, H, G, M, NS, KVP,
                 gl.program_id(0), 0, 0, 0, 0, BLOCK_M, CONSUMERS, STAGES, V_STAGES, SHARE, VS, ASHAPE, PAIR)


@gluon.jit
def _post_turn(turn_smem, turn_ready, turn_free, it, k):
    """Producer: its k-th turn `it` into slot k % 2 of the turn ring, once every consumer has read the turn the slot
    held before (`turn_free`; the slot / phase rule of `_fill`)."""
    slot = k % 2
    mbarrier.wait(turn_free.index(slot), ((k // 2) & 1) ^ 1)
    turn_smem.index(slot).store(gl.full([1], it, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(turn_ready.index(slot), count=1)


@gluon.jit
def _take_turn(turn_smem, turn_ready, turn_free, k):
    """Consumer: the program's k-th turn from slot k % 2 of the turn ring (`_post_turn`); frees the slot."""
    slot = k % 2
    mbarrier.wait(turn_ready.index(slot), (k // 2) & 1)
    it = gl.max(turn_smem.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), axis=0)
    mbarrier.arrive(turn_free.index(slot), count=1)
    return it


@gluon.jit
def _produce(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
             k_empty, v_empty, BlockCount, BlockOffset, ColCount, Order, Pairs, n_work, N, H, G, M, NS, KVP, it, tg0,
             tg1, q0s, q1s, BLOCK_M: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
             V_STAGES: gl.constexpr, SHARE: gl.constexpr, VS: gl.constexpr, ASHAPE: gl.constexpr,
             PAIR: gl.constexpr):
    """Turn `it`'s loads: Q of each consumer, then the steps over the items (strips, pieces; PAIR: two items a
    step) of the one shared ring (SHARE), else of each consumer's ring, interleaved step by step; rings 0 / 1 have
    taken tg0 / tg1 steps and consumers 0 / 1 q0s / q1s Q loads before it. Returns the four counts after it."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    ITEMS: gl.constexpr = 2 if PAIR else 1
    _, q0, kv0, base0, p0, s0, _, bh0 = _work_item(Order, Pairs, BlockCount, ColCount, it, 0, n_work, N, H, G, M, NS,
                                                   BLOCK_M, BLOCK_N, CONSUMERS, SHARE, VS, ASHAPE)
    n0 = p0 + s0
    steps0 = (n0 + ITEMS - 1) // ITEMS
    q0s = _load_q(q_desc, q_smem, q_bar, q_empty, q0, n0, q0s, 0)
    if CONSUMERS == 1:
        for t in range(steps0):
            _fill(t, tg0 + t, n0, s0, kv0, bh0 * KVP, BlockOffset + base0, k_desc, v_desc, kc_desc, vc_desc, k_smem,
                  v_smem, k_ready, v_ready, k_empty, v_empty, 0, STAGES, V_STAGES, VS, ASHAPE, PAIR)
    else:
        _, q1, kv1, base1, p1, s1, _, bh1 = _work_item(Order, Pairs, BlockCount, ColCount, it, 1, n_work, N, H, G, M,
                                                       NS, BLOCK_M, BLOCK_N, CONSUMERS, SHARE, VS, ASHAPE)
        n1 = p1 + s1
        q1s = _load_q(q_desc, q_smem, q_bar, q_empty, q1, n1, q1s, 1)
        if SHARE:  # both consumers read ring 0 (their items are equal: the entries check)
            for t in range(steps0):
                _fill(t, tg0 + t, n0, s0, kv0, bh0 * KVP, BlockOffset + base0, k_desc, v_desc, kc_desc, vc_desc,
                      k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, 0, STAGES, V_STAGES, VS, ASHAPE, PAIR)
        else:
            steps1 = (n1 + ITEMS - 1) // ITEMS
            for t in range(gl.maximum(steps0, steps1)):
                _fill(t, tg0 + t, n0, s0, kv0, bh0 * KVP, BlockOffset + base0, k_desc, v_desc, kc_desc, vc_desc,
                      k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, 0, STAGES, V_STAGES, VS, ASHAPE, PAIR)
                _fill(t, tg1 + t, n1, s1, kv1, bh1 * KVP, BlockOffset + base1, k_desc, v_desc, kc_desc, vc_desc,
                      k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, 1, STAGES, V_STAGES, VS, ASHAPE, PAIR)
            tg1 += steps1
    return tg0 + steps0, tg1, q0s, q1s


@gluon.jit
def kept_lanes(KeepRow, t, n_cols, lanes, BLOCK_N: gl.constexpr):
    """Bool `[BLOCK_N]`: the kept lanes of step t over the row block's strips, whose lane j holds packed column
    c = BLOCK_N t + j (with PAIR too: items 2t and 2t + 1 are consecutive strips): bit c % 32 of its keep word
    c // 32 (KeepRow: the row block's words, `strip_keep`). BLOCK_N / 32 uniform loads, no per-lane gather; words
    at or past n_cols (the columns it walks) read 0."""
    w = t * (BLOCK_N // 32)
    word = gl.zeros_like(lanes)
    for i in gl.static_range(BLOCK_N // 32):
        word = gl.where(lanes // 32 == i, gl.load(KeepRow + (w + i), mask=(w + i) * 32 < n_cols, other=0), word)
    return ((word >> (lanes % 32)) & 1) != 0


@gluon.jit
def _item_keys(t, strips, Offsets, KeepRow, n_cols, lanes, BLOCK_N: gl.constexpr, VS: gl.constexpr,
               ASHAPE: gl.constexpr):
    """What item t holds, loaded before its scores are waited for (the loads overlap the Q K^T wgmma): (p = the
    first key of piece t - strips; keep Bool `[BLOCK_N]`, VS: `kept_lanes` on a strip (t < strips), no lane on a
    piece; ASHAPE: lane j of strip t holds key 64 t + j iff it is < n_cols (the row block's sinks below its lowest
    piece)."""
    if VS:
        if t < strips:
            keep = kept_lanes(KeepRow, t, n_cols, lanes, BLOCK_N)
        else:
            keep = lanes < 0
        p = gl.load(Offsets + gl.maximum(t - strips, 0))
    elif ASHAPE:
        keep = t * BLOCK_N + lanes < n_cols
        p = gl.load(Offsets + gl.maximum(t - strips, 0))
    else:
        keep = lanes < 0  # (unused)
        p = gl.load(Offsets + t)
    return p, keep


@gluon.jit
def _masked(s, t, strips, p, keep, rows, lanes, N, row_lo, sink, window, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            VS: gl.constexpr, ASHAPE: gl.constexpr):
    """Raw scores s `[BLOCK_M, BLOCK_N]` of item t with the keys it does not hold at -inf (p, keep: `_item_keys`):
    a strip (VS, t < strips) keeps its `keep` lanes, every kept column being < row_lo (strictly causal); a
    piece masks as `_piece_mask`. ASHAPE: a strip keeps its `keep` lanes (sinks, all < row_lo); a piece whose
    lowest key is outside the window of the block's last row also keeps only keys j < sink or i - j < window
    (the head's A-shape token mask; the window pieces hold the band, so a sink inside one is kept by it)."""
    if VS:
        if t < strips:
            s = gl.where(gl.expand_dims(keep, 0), s, float("-inf"))
        else:
            s = _piece_mask(s, p, rows, lanes, N, row_lo, BLOCK_N)
    elif ASHAPE:
        if t < strips:
            s = gl.where(gl.expand_dims(keep, 0), s, float("-inf"))
        else:
            s = _piece_mask(s, p, rows, lanes, N, row_lo, BLOCK_N)
            if row_lo + (BLOCK_M - 1) - p >= window:  # the block's last row sees key p outside its window
                keys = gl.expand_dims(p + lanes, 0)
                band = (keys < sink) | (gl.expand_dims(rows, 1) - keys < window)
                s = gl.where(band, s, float("-inf"))
    else:
        s = _piece_mask(s, p, rows, lanes, N, row_lo, BLOCK_N)
    return s


@gluon.jit
def _piece_mask(s, p, rows, lanes, N, row_lo, BLOCK_N: gl.constexpr):
    """Scores of the piece starting at key p: keys outside [0, N) and above the diagonal at -inf (only on pieces
    that reach them)."""
    if (p < 0) | (p + BLOCK_N - 1 > row_lo) | (p + BLOCK_N > N):
        keys = gl.expand_dims(p + lanes, 0)
        keep = (keys <= gl.expand_dims(rows, 1)) & (keys < N) & (keys >= 0)
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _pair_keys(t, n, strips, Offsets, KeepRow, n_cols, lanes, N, row_lo, PIECE: gl.constexpr, VS: gl.constexpr):
    """Step t of a PAIR launch (block-sparse or VS items) holds items 2t (lanes < PIECE) and 2t + 1 (the other lanes;
    no item where 2t + 1 = n), each a strip or a piece as in `_item_keys` -> (key Int32 `[2 PIECE]`: the key a lane
    holds on a piece; keep Bool: the lanes of strips that hold a kept key (`kept_lanes`: a piece's lanes hold
    columns >= n_cols, so none); on_piece Bool: the lanes of pieces; edge: whether the step needs a mask: a strip
    or an empty half in it, a piece reaching past the diagonal, N or key 0)."""
    half = lanes // PIECE
    item = 2 * t + half
    b = gl.minimum(2 * t + 1, n - 1)
    pa = gl.load(Offsets + gl.maximum(2 * t - strips, 0))
    pb = gl.load(Offsets + gl.maximum(b - strips, 0))
    key = gl.where(half == 0, pa, pb) + lanes % PIECE
    on_piece = (item >= strips) & (item < n)
    keep = lanes < 0
    if VS:
        if 2 * t < strips:
            keep = kept_lanes(KeepRow, t, n_cols, lanes, 2 * PIECE)
    hi = gl.maximum(pa, pb)
    edge = (2 * t < strips) | (2 * t + 1 >= n) | (gl.minimum(pa, pb) < 0) | (hi + PIECE - 1 > row_lo) | (hi + PIECE > N)
    return key, keep, on_piece, edge


@gluon.jit
def _pair_masked(s, key, keep, on_piece, edge, rows, N):
    """Scores s `[BLOCK_M, 2 PIECE]` of a PAIR step with the keys it does not hold at -inf (`_pair_keys`): strip
    lanes keep their `keep` keys, piece lanes the causal keys in [0, N); no mask when not `edge`."""
    if edge:
        k2 = gl.expand_dims(key, 0)
        ok = gl.expand_dims(on_piece, 0) & (k2 <= gl.expand_dims(rows, 1)) & (k2 < N) & (k2 >= 0)
        s = gl.where(ok | gl.expand_dims(keep, 0), s, float("-inf"))
    return s


@gluon.jit
def _step_keys(t, n, strips, Offsets, KeepRow, n_cols, lanes, N, row_lo, BLOCK_N: gl.constexpr,
               VS: gl.constexpr, ASHAPE: gl.constexpr, PAIR: gl.constexpr):
    """What step t holds, loaded before its scores are waited for: `_pair_keys` with PAIR, else `_item_keys` of
    item t (a tuple for `_step_masked`)."""
    if PAIR:
        return _pair_keys(t, n, strips, Offsets, KeepRow, n_cols, lanes, N, row_lo, BLOCK_N // 2, VS)
    else:
        return _item_keys(t, strips, Offsets, KeepRow, n_cols, lanes, BLOCK_N, VS, ASHAPE)


@gluon.jit
def _step_masked(s, keys, t, strips, rows, lanes, N, row_lo, sink, window, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, VS: gl.constexpr, ASHAPE: gl.constexpr, PAIR: gl.constexpr):
    """Raw scores s of step t with the keys it does not hold at -inf (`keys`: `_step_keys`)."""
    if PAIR:
        key, keep, on_piece, edge = keys
        return _pair_masked(s, key, keep, on_piece, edge, rows, N)
    else:
        p, keep = keys
        return _masked(s, t, strips, p, keep, rows, lanes, N, row_lo, sink, window, BLOCK_M, BLOCK_N, VS, ASHAPE)


@gluon.jit
def softmax_step(s, m_i, l_i, qk_scale):
    """Online-softmax step on masked scores s `[BLOCK_M, BLOCK_N]`: returns (probabilities in log2 units,
    alpha = rescale of the old sums, new max, new sum)."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet stays at zero
    alpha = gl.exp2(m_i - m_use)
    prob = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    return prob, alpha, m_new, l_i * alpha + gl.sum(prob, 1)


@gluon.jit
def _issue_pv(acc, alpha, prob, v_smem, v_ready, iv, phase, row_o: gl.constexpr, p_layout: gl.constexpr):
    """O = alpha O + P V: rescales the fp32 accumulator `[BLOCK_M, D]` by alpha `[BLOCK_M]`, waits for V slot iv's
    fill (parity `phase`) and issues the wgmma with P `[BLOCK_M, BLOCK_N]` from registers; returns it unwaited."""
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    mbarrier.wait(v_ready.index(iv), phase)
    return warpgroup_mma(gl.convert_layout(prob.to(v_smem.dtype), p_layout), v_smem.index(iv), acc, is_async=True)


@gluon.jit
def _item(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE, BlockCount,
          BlockOffset, ColCount, Keep, Sink, Window, Order, Pairs, n_work, qk_scale, N, H, G, M, NS, KVP,
          it, tg, qs, sub: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
          CONSUMERS: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, OVERLAP: gl.constexpr,
          SHARE: gl.constexpr, VS: gl.constexpr, ASHAPE: gl.constexpr, PAIR: gl.constexpr):
    """Consumer `sub`'s item of turn `it`: BLOCK_M query rows over their items (VS: column strips, then pieces;
    BLOCK_N keys a step: one item, or two with PAIR) from its ring (SHARE: the one ring both consumers read), whose
    step index has reached tg, with the Q tile of its `qs`-th load; writes O rows and LSE and releases Q (q_empty)
    once its last Q K^T is done. ASHAPE: its head's sink / window (tokens) from Sink / Window Int32 `[H]`. Returns
    the steps taken."""
    PIECE: gl.constexpr = BLOCK_N // 2 if PAIR else BLOCK_N  # keys per item
    valid, q_row, _, base, pieces, strips, row_lo, bh = _work_item(Order, Pairs, BlockCount, ColCount, it, sub,
                                                                   n_work, N, H, G, M, NS, BLOCK_M, PIECE, CONSUMERS,
                                                                   SHARE, VS, ASHAPE)
    items = strips + pieces
    n = (items + 1) // 2 if PAIR else items  # steps
    ring: gl.constexpr = 0 if SHARE else sub
    Offsets = BlockOffset + base
    KeepRow, n_cols, sink, window = Keep, 0, 0, 0
    if VS or ASHAPE:  # the keys its strips hold: VS the first n_cols packed columns, ASHAPE keys [0, n_cols)
        n_cols = gl.where(valid, gl.load(ColCount + bh * M + row_lo // BLOCK_M), 0)
    if VS:
        KeepRow = Keep + (bh * M + row_lo // BLOCK_M).to(gl.int64) * (KVP // 32)  # its strips' keep words
    if ASHAPE:
        sink = gl.load(Sink + bh % H)
        window = gl.load(Window + bh % H)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = row_lo + gl.arange(0, BLOCK_M, layout=row_s)
    lanes = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q = q_smem.index(sub)
    mbarrier.wait(q_bar.index(sub), qs & 1, pred=n > 0)  # the qs-th Q load completes phase qs
    # Step t (item t, or items 2t and 2t + 1 with PAIR: strips, then pieces) is the ring's step tg + t, with its K in
    # K slot ik = ring * STAGES + (tg + t) % STAGES as that slot's fill j = (tg + t) // STAGES (the producer walks
    # the same steps in the same order), which completes phase j of k_ready[ik]: wait for parity j & 1; its V
    # likewise in V slot ring * V_STAGES + (tg + t) % V_STAGES
    # (SHARE: both consumers wait for the same phase; a wait consumes nothing). A K slot is released by an arrive
    # on k_empty once the Q K^T wgmma that read it has completed, a V slot on v_empty once its P V has: the
    # producer refills K while P V still reads V. SHARE: the empty barriers count 2 arrives, one per consumer, so
    # a phase completes when both are done with the slot.
    if OVERLAP:
        prob, alpha = s0, m_i  # (set for every path; only read where n > 0)
        if n > 0:  # prologue: the scores of piece 0
            ik = ring * STAGES + tg % STAGES
            mbarrier.wait(k_ready.index(ik), (tg // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(ik).permute((1, 0)), s0, use_acc=False, is_async=True)
            keys = _step_keys(0, items, strips, Offsets, KeepRow, n_cols, lanes, N, row_lo, BLOCK_N, VS,
                              ASHAPE, PAIR)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(ik), count=1)
            mbarrier.arrive(q_empty.index(sub), count=1, pred=n == 1)
            s = _step_masked(s, keys, 0, strips, rows, lanes, N, row_lo, sink, window, BLOCK_M, BLOCK_N, VS, ASHAPE,
                             PAIR)
            prob, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
        for t in range(n - 1):
            # issue Q K^T of piece t + 1 first, then P V of piece t; wait(1) retires the older group (Q K^T:
            # wgmma groups complete in issue order) and leaves P V running beside the softmax of piece t + 1
            iv = ring * V_STAGES + (tg + t) % V_STAGES
            ik1 = ring * STAGES + (tg + t + 1) % STAGES
            mbarrier.wait(k_ready.index(ik1), ((tg + t + 1) // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(ik1).permute((1, 0)), s0, use_acc=False, is_async=True)
            keys = _step_keys(t + 1, items, strips, Offsets, KeepRow, n_cols, lanes, N, row_lo, BLOCK_N,
                              VS, ASHAPE, PAIR)
            acc = _issue_pv(acc, alpha, prob, v_smem, v_ready, iv, ((tg + t) // V_STAGES) & 1, row_o, p_layout)
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(ik1), count=1)
            mbarrier.arrive(q_empty.index(sub), count=1, pred=t + 2 == n)
            s = _step_masked(s, keys, t + 1, strips, rows, lanes, N, row_lo, sink, window, BLOCK_M, BLOCK_N, VS,
                             ASHAPE, PAIR)
            prob, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(iv), count=1)
        if n > 0:  # epilogue: P V of the last piece
            t = tg + n - 1
            iv = ring * V_STAGES + t % V_STAGES
            acc = _issue_pv(acc, alpha, prob, v_smem, v_ready, iv, (t // V_STAGES) & 1, row_o, p_layout)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(iv), count=1)
    else:
        for t in range(n):
            ik = ring * STAGES + (tg + t) % STAGES
            iv = ring * V_STAGES + (tg + t) % V_STAGES
            mbarrier.wait(k_ready.index(ik), ((tg + t) // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(ik).permute((1, 0)), s0, use_acc=False, is_async=True)
            keys = _step_keys(t, items, strips, Offsets, KeepRow, n_cols, lanes, N, row_lo, BLOCK_N, VS,
                              ASHAPE, PAIR)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(ik), count=1)
            mbarrier.arrive(q_empty.index(sub), count=1, pred=t + 1 == n)
            s = _step_masked(s, keys, t, strips, rows, lanes, N, row_lo, sink, window, BLOCK_M, BLOCK_N, VS, ASHAPE,
                             PAIR)
            prob, alpha, m_i, l_i = softmax_step(s, m_i, l_i, qk_scale)
            acc = _issue_pv(acc, alpha, prob, v_smem, v_ready, iv, ((tg + t) // V_STAGES) & 1, row_o, p_layout)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(iv), count=1)
    if valid:
        r = gl.arange(0, BLOCK_M, layout=row_o)
        dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
        ok = gl.expand_dims(row_lo + r < N, 1) & gl.expand_dims(dims < D, 0)
        ptrs = O + gl.expand_dims((q_row + r).to(gl.int64) * D, 1) + gl.expand_dims(dims, 0)
        gl.store(ptrs, out.to(O.dtype.element_ty), mask=ok)
        lse = (m_i + gl.log2(l_i)) * LN2
        gl.store(LSE + (q_row + gl.arange(0, BLOCK_M, layout=row_s)), lse, mask=rows < N)
    return n


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, q_empty, turn_smem, turn_ready, turn_free, k_ready, v_ready, k_empty,
              v_empty, O, LSE, BlockCount, BlockOffset, ColCount, Keep, Sink, Window, Order, Pairs, n_work,
              qk_scale, N, H, G, M, NS, KVP, sub: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
              OVERLAP: gl.constexpr, SHARE: gl.constexpr, VS: gl.constexpr, ASHAPE: gl.constexpr, PAIR: gl.constexpr,
              PERSIST: gl.constexpr):
    """Consumer warpgroup `sub`: its item of each of the program's turns (`_item`), the ring's step index and its Q
    loads counted on over them as the producer counts them. PERSIST: the turns the producer posts (`_take_turn`)
    until one past the last; else the one turn pid."""
    if PERSIST:
        turns = n_work if SHARE else (n_work + CONSUMERS - 1) // CONSUMERS
        tg, qs, k = 0, 0, 0
        it = _take_turn(turn_smem, turn_ready, turn_free, 0)
        while it < turns:
            steps = _item(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE,
                          BlockCount, BlockOffset, ColCount, Keep, Sink, Window, Order, Pairs, n_work,
                          qk_scale, N, H, G, M, NS, KVP, it, tg, qs, sub, BLOCK_M, BLOCK_N, D, CONSUMERS, STAGES,
                          V_STAGES, OVERLAP, SHARE, VS, ASHAPE, PAIR)
            qs += (steps > 0).to(gl.int32)
            tg += steps
            k += 1
            it = _take_turn(turn_smem, turn_ready, turn_free, k)
    else:
        _item(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE, BlockCount,
              BlockOffset, ColCount, Keep, Sink, Window, Order, Pairs, n_work, qk_scale, N, H, G, M, NS, KVP,
              gl.program_id(0), 0, 0, sub, BLOCK_M, BLOCK_N, D, CONSUMERS, STAGES, V_STAGES, OVERLAP, SHARE, VS,
              ASHAPE, PAIR)


@gluon.jit(do_not_specialize=["n_work", "N", "M", "NS", "KVP"])
def _ws_prefill_kernel(q_desc, k_desc, v_desc, kc_desc, vc_desc, O, LSE, BlockCount, BlockOffset, ColCount, Keep,
                       Sink, Window, Order, Pairs, Claimed, n_work, qk_scale, N, H, G, M, NS, KVP,
                       CONSUMERS: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                       SHARE: gl.constexpr, VS: gl.constexpr, ASHAPE: gl.constexpr, PAIR: gl.constexpr,
                       PERSIST: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Program pid takes turn pid, then (PERSIST) the next turn no program has claimed (`Claimed` Int32 `[1]`, an
    atomic counter zeroed at launch: turns start in `Order`'s order, as a grid of one program per turn starts them),
    until none is left: work slots it * CONSUMERS + c of `Order` (SHARE: slot it, both consumers); the producer
    loads a turn's Q and first K / V tiles while the consumers finish the turn before (its last steps, its stores),
    and posts each turn to the consumers through a ring of two shared-memory slots. VS: kc / vc
    `[B * Hq * KVP, D]` hold each query head's packed columns' K / V rows (ascending keys), ColCount Int32
    `[B, Hq, M]` how many are < the row block's first row, Keep Int32 `[B * Hq * M, KVP / 32]` which of those a row
    block keeps, as bits (`strip_keep`; unused without VS). ASHAPE: ColCount the sink keys [0, ColCount) below
    each row block's lowest piece (`index_ref.ashape_to_tiles`' column_count), Sink / Window Int32 `[Hq]` the token
    mask. SHARE: Pairs Int32 `[Hq]` the query heads in ring order (pair j: heads Pairs[2 j], Pairs[2 j + 1] of one KV
    head; unused otherwise). Shared memory: CONSUMERS Q tiles and RINGS (CONSUMERS, SHARE: 1) rings of STAGES K tiles
    and V_STAGES (<= STAGES) V tiles (BLOCK_N = 64 or 128 keys x D each: k_desc's block, twice it with PAIR (two items
    a slot); bf16, D = 128: 16 or 32 KB a tile)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0] * (2 if PAIR else 1)
    D: gl.constexpr = q_desc.block_type.shape[1]
    RINGS: gl.constexpr = 1 if SHARE else CONSUMERS
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, BLOCK_M, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [RINGS * STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [RINGS * V_STAGES, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    turn_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [RINGS * V_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [RINGS * V_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn_ready.index(i), count=1)
        mbarrier.init(turn_free.index(i), count=CONSUMERS)
    # ready: the producer's expect is the one arrive, TMA bytes the rest; empty: every consumer reading the ring
    # arrives once per slot use, 2 on a shared ring, else 1
    for i in gl.static_range(RINGS * STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS if SHARE else 1)
    for i in gl.static_range(RINGS * V_STAGES):
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=CONSUMERS if SHARE else 1)
    # (the partition lists are written out in the calls: a Gluon tuple cannot hold a function)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, turn_smem, turn_ready, turn_free, k_ready, v_ready,
                         k_empty, v_empty, O, LSE, BlockCount, BlockOffset, ColCount, Keep, Sink, Window,
                         Order, Pairs, n_work, qk_scale, N, H, G, M, NS, KVP, 0, BLOCK_M, BLOCK_N, D, CONSUMERS,
                         STAGES, V_STAGES, OVERLAP, SHARE, VS, ASHAPE, PAIR, PERSIST)),
            (_producer, (q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_bar, q_empty, turn_smem,
                         turn_ready, turn_free, Claimed, k_ready, v_ready, k_empty, v_empty, BlockCount, BlockOffset,
                         ColCount, Order, Pairs, n_work, N, H, G, M, NS, KVP, BLOCK_M, CONSUMERS, STAGES, V_STAGES,
                         SHARE, VS, ASHAPE, PAIR, PERSIST)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, turn_smem, turn_ready, turn_free, k_ready, v_ready,
                         k_empty, v_empty, O, LSE, BlockCount, BlockOffset, ColCount, Keep, Sink, Window,
                         Order, Pairs, n_work, qk_scale, N, H, G, M, NS, KVP, 0, BLOCK_M, BLOCK_N, D, CONSUMERS,
                         STAGES, V_STAGES, OVERLAP, SHARE, VS, ASHAPE, PAIR, PERSIST)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, q_empty, turn_smem, turn_ready, turn_free, k_ready, v_ready,
                         k_empty, v_empty, O, LSE, BlockCount, BlockOffset, ColCount, Keep, Sink, Window,
                         Order, Pairs, n_work, qk_scale, N, H, G, M, NS, KVP, 1, BLOCK_M, BLOCK_N, D, CONSUMERS,
                         STAGES, V_STAGES, OVERLAP, SHARE, VS, ASHAPE, PAIR, PERSIST)),
            (_producer, (q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_bar, q_empty, turn_smem,
                         turn_ready, turn_free, Claimed, k_ready, v_ready, k_empty, v_empty, BlockCount, BlockOffset,
                         ColCount, Order, Pairs, n_work, N, H, G, M, NS, KVP, BLOCK_M, CONSUMERS, STAGES, V_STAGES,
                         SHARE, VS, ASHAPE, PAIR, PERSIST)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def launch_config(consumers: int, head_dim: int = 128) -> dict[str, int]:
    """maxnreg (registers per thread the kernel is compiled for) and the worker consumer's registers.
    Warps are allocated by warpgroup: 2 consumers + producer = 3 warpgroups (384 threads): 168 x 384 fits
    the 64K registers of an SM (one program per SM, 128-224 KB of shared memory); the producer's warpgroup
    runs at 24 and each consumer at 240. One consumer + producer = 2 warpgroups: maxnreg 128 lets two
    programs share an SM (80-112 KB each), the consumer gets 232; at head_dim 256 ptxas needs 158 before the
    registers move (its 64 x 256 accumulator), and a ring of 2 slots takes 131-197 KB, one program per SM: 168 and
    240 as for two consumers (H100, block-sparse at 64K / 128K: 0.95x the loop's speed, kernels/NOTES.md session 29)."""
    if consumers == 2 or head_dim == 256:
        return {"maxnreg": 168, "consumer_regs": 240}
    return {"maxnreg": 128, "consumer_regs": 232}


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stages: int, consumers: int,
                overlap: bool, v_stages: int | None, persistent: bool | int = False) -> tuple[int, int, int, int, int]:
    """The checks both entries share (ValueError naming the field); returns (B, Hq, Hkv, N, D)."""
    B, Hq, Hkv, N, D = check_prefill_args(q, k, v)
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtype must be bf16 or fp16 (all alike) for ws_prefill, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; use sparse_prefill for fp32")
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported by ws_prefill (64, 128 or 256); use sparse_prefill")
    if consumers not in (1, 2) or stages < 1 + overlap:
        raise ValueError(f"consumers must be 1 or 2 and stages >= 2 with overlap (the next piece's K waits in the ring "
                         f"while this piece's slot is held), >= 1 without; got {consumers}, {stages}, overlap={overlap}")
    if v_stages is not None and not 1 <= v_stages <= stages:
        raise ValueError(f"v_stages (the V ring's depth) must be between 1 and stages = {stages}, got {v_stages}")
    if not isinstance(persistent, int) or persistent < 0:
        raise ValueError(f"persistent must be True (one program per SM slot), False (one per turn) or a number of "
                         f"programs >= 1, got {persistent!r}")
    return B, Hq, Hkv, N, D


@functools.lru_cache(maxsize=16)
def sm90(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.0), the one target the kernel compiles for (cached:
    the host's time per call counts where a layer's kernel takes ~1 ms)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


@functools.lru_cache(maxsize=16)
def _smem_layout(rows: int, d: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a `[rows, d]` TMA tile (cached, as `sm90`)."""
    return gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _check_device(q: torch.Tensor) -> None:
    if not sm90(q.device):
        raise ValueError(f"ws_prefill needs a Hopper GPU (sm_90), got device {q.device}; use sparse_prefill")


def ws_takes(q: torch.Tensor, tiles: VSTiles, sink: torch.Tensor | None) -> bool:
    """Whether `ws_prefill` takes these tiles for q `[B, Hq, N, D]` (static facts only, no host sync): an sm_90
    GPU, bf16 / fp16, head_dim 64 / 128 / 256, 64-row tiles of disjoint 64-key pieces, columns only as columns per head
    (`tiles.columns` False, or `tiles.head_columns` given), no A-shape mask, group-shared tiles only with an even
    group (two query heads of a KV head share one K/V ring)."""
    hq, h = q.shape[1], tiles.shape[1]
    return (sm90(q.device) and q.dtype in DTYPES and q.shape[-1] in HEAD_DIMS and tiles.block == ROWS
            and tiles.piece == KEYS and tiles.disjoint and sink is None
            and (not tiles.columns or tiles.head_columns is not None) and (hq == h or hq // h % 2 == 0))


def head_pairs(hq: int, hkv: int, sink: torch.Tensor, window: torch.Tensor) -> tuple[int, ...] | None:
    """The query heads in an order whose pairs (2j, 2j + 1) can share a K/V ring under an A-shape (sink / window
    `[Hq]`): both of one KV head, with one sink and one window. Each KV group's heads stay in place where they pair
    as they are, else they are sorted by band; None where a group is odd or holds a band an odd number of times."""
    g = hq // hkv if hkv and hq % hkv == 0 else 1  # (no whole groups: as an odd group)
    if g % 2 or sink.numel() != hq or window.numel() != hq:
        return None
    bands = list(zip(sink.tolist(), window.tolist()))
    order: list[int] = []
    for start in range(0, hq, g):
        heads = list(range(start, start + g))
        if not _alike(heads, bands):
            heads.sort(key=lambda h: bands[h])
            if not _alike(heads, bands):
                return None
        order += heads
    return tuple(order)


def _alike(heads: list[int], bands: list[tuple[int, int]]) -> bool:
    """Whether heads[2j] and heads[2j + 1] hold one band for every j."""
    return all(bands[a] == bands[b] for a, b in zip(heads[0::2], heads[1::2]))


def ws_ashape_takes(q: torch.Tensor, k: torch.Tensor, sink: torch.Tensor, window: torch.Tensor) -> bool:
    """Whether `ws_ashape` takes this A-shape at `ashape_launch`'s launch (CPU sink / window `[Hq]`, no host sync): an
    sm_90 GPU, bf16 / fp16, one sink and window per query head, head_dim 128, or 256 where each KV group's heads pair
    up by band (per-head rings of 64 KB slots overflow there) and the prompt has `ASHAPE_D256_MIN_TOKENS`."""
    return (sm90(q.device) and q.dtype in DTYPES and sink.numel() == window.numel() == q.shape[1]
            and q.shape[1] % k.shape[1] == 0 and (q.shape[-1] != 256 or q.shape[2] >= ASHAPE_D256_MIN_TOKENS)
            and ashape_launch(q.shape[1], k.shape[1], sink, window, q.shape[-1]) is not None)


def ashape_launch(hq: int, hkv: int, sink: torch.Tensor, window: torch.Tensor, head_dim: int = 128) -> dict | None:
    """`ws_ashape`'s keyword arguments for `prefill.ashape_prefill`: where each KV group's heads pair up by band
    (`head_pairs`) two heads on one ring, `ASHAPE_LAUNCH` (head_dim 128) or `ASHAPE_LAUNCH_D256`; else at head_dim 128
    `ASHAPE_PER_HEAD_LAUNCH`; None where none is set (another head_dim, or 256 without pairs)."""
    paired = head_pairs(hq, hkv, sink, window) is not None
    if head_dim == 128:
        return ASHAPE_LAUNCH if paired else ASHAPE_PER_HEAD_LAUNCH
    return ASHAPE_LAUNCH_D256 if head_dim == 256 and paired else None


def programs_per_sm(consumers: int, share_kv: bool, stages: tuple[int, int], keys: int, head_dim: int) -> int:
    """How many programs of a launch an SM holds: by registers (`launch_config`: 2 at maxnreg 128, else 1) and by
    shared memory (bf16 / fp16 Q tiles of 64 rows and ring slots of `keys` keys, 228 KB an SM on sm_90 less 1 KB
    reserved per program)."""
    tile = 2 * head_dim  # bytes per row
    smem = consumers * ROWS * tile + (1 if share_kv else consumers) * sum(stages) * keys * tile
    by_regs = 2 if launch_config(consumers, head_dim)["maxnreg"] == 128 else 1
    return max(1, min(by_regs, 233472 // (smem + 1024)))


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: VSTiles, scale: float | None,
            stages: tuple[int, int],
            consumers: int, overlap: bool, share_kv: bool,
            packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            band: tuple[torch.Tensor, torch.Tensor] | None = None, kv_major: bool = False, pair: bool = False,
            pairs: Sequence[int] | None = None, persistent: bool | int = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on checked, contiguous inputs, items in `work_order` (by KV head first with `kv_major`); stages: the K
    and V rings' depths; `pair`: two items per step (`ws_prefill`); `pairs` (share_kv): the query heads in ring order,
    heads pairs[2j], pairs[2j + 1] on one ring (`head_pairs`; None: 0, 1, ..., Hq - 1); `persistent`: True as many
    programs as the SMs hold (`programs_per_sm`), an int that many, each taking the next unclaimed turn of the order;
    False one program per turn. `packed`
    (VS): (kc, vc `[B * Hq * KVP, D]`, col_count Int32 `[B, Hq, M]`, keep Int32 `[B, Hq, M, KVP / 32]`:
    `pack_head_columns`); `band` (A-shape, tiles from `ashape_to_tiles`): (sink, window) Int32 `[Hq]` on q's device; see
    `_ws_prefill_kernel`."""
    if pair and band is not None:
        raise ValueError("pair takes block-sparse and Vertical-Slash items; A-shape's contiguous pieces step 128 keys "
                         "with width=128")
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    M = -(-N // ROWS)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    layout, kv_layout = _smem_layout(ROWS, D, q.dtype), _smem_layout(tiles.piece, D, q.dtype)
    q_desc = TensorDescriptor.from_tensor(q.view(B * Hq * N, D), [ROWS, D], layout)
    k_desc = TensorDescriptor.from_tensor(k.view(B * Hkv * N, D), [tiles.piece, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(B * Hkv * N, D), [tiles.piece, D], kv_layout)
    bc, bo = tiles.block_count.contiguous(), tiles.block_offset.contiguous()
    sink, window = band if band is not None else (bc, bc)  # (unused without A-shape)
    if packed is None:  # the VS arguments are unused (VS=False): any tensors of the right kind
        kc_desc, vc_desc, col_count, keep, kvp = k_desc, v_desc, tiles.column_count.contiguous(), bc, 0
        strip_tiles = tiles  # A-shape: column_count = its sink strips' keys
    else:
        kc, vc, col_count, keep = packed
        kvp = 32 * keep.shape[-1]
        kc_desc = TensorDescriptor.from_tensor(kc, [tiles.piece, D], kv_layout)
        vc_desc = TensorDescriptor.from_tensor(vc, [tiles.piece, D], kv_layout)
        strip_tiles = dataclasses.replace(tiles, column_count=col_count)  # work_order counts the strips
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    ring_heads = ints_on(tuple(range(Hq)) if pairs is None else pairs, q.device)  # (cached device copy)
    if share_kv:  # items (b, head pair, row block), ordered by the first head of each pair's pieces and strips
        if pairs is None:
            firsts = bc[:, 0::2], strip_tiles.column_count[:, 0::2]
        else:  # (a cached device index: a host list would be copied from pageable memory every call)
            first = ints_on(tuple(pairs[0::2]), q.device)
            firsts = bc.index_select(1, first), strip_tiles.column_count.index_select(1, first)
        order = work_order(dataclasses.replace(strip_tiles, block_count=firsts[0], column_count=firsts[1]),
                           1, Hq // 2 // Hkv if kv_major else 0)
        n_work = B * Hq // 2 * M
        grid = n_work
    else:
        order = work_order(strip_tiles, 1, Hq // Hkv if kv_major else 0)
        n_work = B * Hq * M
        grid = triton.cdiv(n_work, consumers)
    if persistent is True:
        keys = tiles.piece * (2 if pair else 1)
        grid = min(grid, sm_count(q.device) * programs_per_sm(consumers, share_kv, stages, keys, D))
    elif persistent:
        grid = min(grid, persistent)
    cfg = launch_config(consumers, D)
    claimed = torch.zeros(1, dtype=torch.int32, device=q.device) if persistent else bc  # (unused without)
    _ws_prefill_kernel[(grid,)](
        q_desc, k_desc, v_desc, kc_desc, vc_desc, o, lse, bc, bo, col_count, keep, sink, window, order,
        ring_heads, claimed, n_work, scale * LOG2E, N, Hq, Hq // Hkv, M, bo.shape[-1], kvp,
        CONSUMERS=consumers, STAGES=stages[0], V_STAGES=stages[1], OVERLAP=overlap, SHARE=share_kv, VS=packed is not None,
        ASHAPE=band is not None, PAIR=pair, PERSIST=bool(persistent), CONSUMER_REGS=cfg["consumer_regs"], num_warps=4,
        maxnreg=cfg["maxnreg"])
    return o, lse


def ws_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: VSTiles, scale: float | None = None,
               sink: torch.Tensor | None = None, window: torch.Tensor | None = None, stages: int = 2,
               consumers: int = 2, overlap: bool = True, share_kv: bool = False,
               kv_major: bool = False, v_stages: int | None = None, pair: bool = False,
               persistent: bool | int = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over the pieces of per-head block-sparse `tiles` on an sm_90 GPU (`sparse_prefill`'s
    contract for the tiles it takes).

    q `[B, Hq, N, D]`, k/v `[B, Hkv, N, D]` (bf16 / fp16, D = 64, 128 or 256; copied if not contiguous); query head
    h reads KV head h // (Hq // Hkv). `tiles`: per query head (`[B, Hq, M]`, M = ceil(N / 64)) or, with share_kv,
    per KV head (`[B, Hkv, M]`, group-shared), block 64, 64-key pieces that never overlap (`tiles.disjoint`:
    `block_sparse_to_tiles`, `vs_tiles`; or their 32-key cut, `index_ref.narrow_pieces`: at head_dim 256 rings of 2
    slots then fit per head, not yet timed), vertical columns only as columns per head (`tiles.head_columns`:
    `vs_tiles(head_columns=True)`, merged layers too; each head's are packed here, `pack_columns`, and walked as
    strips before its pieces; `ws_vertical_slash` takes MInference's index itself).
    `stages`: K/V ring depth per ring (`v_stages`: the V ring's, <= stages; None = stages); `consumers`: 64-row
    work items per program (one consumer warpgroup each); `overlap`: the next piece's Q K^T in flight beside this
    piece's P V; `share_kv` (2 consumers): a program takes query heads 2j and 2j + 1 (one KV head: Hq / Hkv even)
    of one row block and both read one K/V ring, so each tile crosses L2 once for 128 query rows (FA3's two
    consumer warpgroups); their piece lists must be equal: group-shared tiles (`[B, Hkv, M]`) are by construction,
    per-head ones are checked (one host sync). `sink` / `window` (A-shape) are not taken here: `ws_ashape` builds
    its own tiles. `kv_major`: programs take every item of one KV head before the next KV head's
    (`schedule.work_order(group=)`), most pieces first within; else most pieces first over all heads. `pair`: two
    64-key items (strips or pieces, in order) per step, loaded by two TMA copies into the halves of one 128-key ring
    slot, so a step's fixed work (barrier waits, row max / sum, the O rescale) is paid once per 128 keys while the
    computed keys stay the 64-key tiles' (a row block's odd last item costs a half-step of masked lanes); 32 KB K / V
    slots at head_dim 128, so per-head rings fit with v_stages=1. `persistent`: True one program per SM slot (an int
    >= 1: that many programs), each taking the next unclaimed turn of the order, so a program loads its next turn's
    Q and first tiles while it finishes the last; False one program per turn.
    Returns (o `[B, Hq, N, D]` in q's dtype, lse Float32 `[B, Hq, N]`, natural log).
    """
    B, Hq, Hkv, N, D = _check_args(q, k, v, stages, consumers, overlap, v_stages, persistent)
    if sink is not None or window is not None:
        raise ValueError("sink / window (A-shape token masks) are not taken by ws_prefill; use "
                         "ws_ashape(q, k, v, sink, window) or sparse_prefill")
    if tiles.block != ROWS or tiles.piece not in (KEYS, KEYS // 2):
        raise ValueError(f"tiles.block and tiles.width must give 64-row tiles of 64-key (or 32-key) pieces for "
                         f"ws_prefill, got block {tiles.block}, piece {tiles.piece}; build them with block=64, width=0 "
                         "(32 keys: index_ref.narrow_pieces)")
    M = -(-N // ROWS)
    grouped = tiles.shape[1] == Hkv != Hq
    if grouped and not (share_kv and Hq // Hkv % 2 == 0):
        raise ValueError(f"group-shared tiles (tiles H = Hkv = {Hkv}) need share_kv=True and an even group (got "
                         f"{Hq // Hkv} query heads per KV head); else expand them to per-query-head tiles with "
                         f"index_ref.expand_groups(tiles, {Hq // Hkv})")
    if grouped:  # per query head, equal for every head of a group by construction: no check needed
        tiles = expand_groups(tiles, Hq // Hkv)
    if tuple(tiles.shape) != (B, Hq, M):
        raise ValueError(f"tiles are for [B, H, M] = {tuple(tiles.shape)} but q needs ({B}, {Hq}, {M}); rebuild them")
    if not tiles.disjoint:
        raise ValueError("tiles.disjoint is False (pieces may overlap): ws_prefill needs non-overlapping pieces, as "
                         "block_sparse_to_tiles builds them")
    tiles = tiles.to(q.device)
    if tiles.head_columns is None and tiles.columns and (tiles.column_index.shape[-1] > 1
                                                         or bool(tiles.column_count.any())):  # (one sync)
        raise ValueError("tiles.column_index / column_count hold vertical columns, which ws_prefill takes only as "
                         "columns per head (no TMA gather on sm_90); build the tiles with "
                         "vs_tiles(..., head_columns=True), or use ws_vertical_slash or sparse_prefill")
    bc, bo = tiles.block_count, tiles.block_offset
    if share_kv and (consumers != 2 or Hq // Hkv % 2 or not grouped and not (torch.equal(bc[:, 0::2], bc[:, 1::2])
                                                                          and torch.equal(bo[:, 0::2], bo[:, 1::2]))):
        raise ValueError("share_kv needs consumers=2, an even number of query heads per KV head and equal piece lists "
                         "for heads 2j and 2j + 1 (tiles.block_count / block_offset); use share_kv=False")
    _check_device(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    packed = pack_head_columns(k, v, tiles, Hq) if tiles.head_columns is not None else None
    return _launch(q, k, v, tiles, scale, (stages, v_stages or stages), consumers, overlap, share_kv, packed,
                   kv_major=kv_major, pair=pair, persistent=persistent)


def pack_columns(k: torch.Tensor, v: torch.Tensor, cols: torch.Tensor, n_q_heads: int,
                 width: int = KEYS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query head's columns' K / V rows, packed once per layer for TMA (sm_90 has no row gather).

    k/v `[B, Hkv, N, D]` contiguous; cols Int32 `[B, Hq, KV]` ascending with invalid entries = N at the end
    (`index_build.vs_slash_tiles`). Returns (kc, vc `[B * Hq * KVP, D]`: row (b * Hq + h) * KVP + i = key
    cols[b, h, i] of KV head h // (Hq / Hkv), a padded / invalid entry reads key N - 1 (finite; the kernel
    masks it); cols padded to Int32 `[B, Hq, KVP]` with N; col_count Int32 `[B, Hq, M]`: how many of a head's
    columns are < m * 64, the prefix of its packed columns row block m walks). KVP = KV rounded up to `width`
    (>= width), the keys of a strip.
    """
    B, Hkv, N, D = k.shape
    M = -(-N // ROWS)
    kvp = max(1, -(-cols.shape[-1] // width)) * width
    cols = torch.nn.functional.pad(cols, (0, kvp - cols.shape[-1]), value=N)
    head = torch.arange(B * n_q_heads, device=k.device).view(B, n_q_heads, 1)
    kv_head = head // n_q_heads * Hkv + head % n_q_heads // (n_q_heads // Hkv)  # b * Hkv + h // G
    rows = (kv_head * N + cols.clamp(max=N - 1)).view(-1)
    kc, vc = (x.view(B * Hkv * N, D).index_select(0, rows) for x in (k, v))
    starts = (torch.arange(M, device=k.device, dtype=torch.int32) * ROWS).expand(B, n_q_heads, M).contiguous()
    col_count = torch.searchsorted(cols, starts, out_int32=True)  # left: columns < m * 64
    return kc, vc, cols, col_count


@triton.jit
def _strip_keep_kernel(Cols, ColCount, Covered, Keep, M, KVP, L, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program (bh, m): row block m's keep words, CHUNK packed columns (CHUNK / 32 words) at a time, up to
    ColCount[bh, m] (`strip_keep`; the words past it stay as zeroed)."""
    bh = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1)
    count = tl.load(ColCount + bh * M + m)
    i = tl.arange(0, CHUNK)
    words = tl.arange(0, CHUNK // 32)
    for s in range(0, count, CHUNK):
        live = s + i < count
        c = tl.load(Cols + bh * KVP + s + i, mask=live, other=0)
        free = tl.load(Covered + bh * L + (m * BLOCK + BLOCK - 1 - c), mask=live, other=1) == 0
        bits = tl.reshape((live & free).to(tl.int32) << (i % 32), [CHUNK // 32, 32])
        tl.store(Keep + (bh * M + m) * (KVP // 32) + s // 32 + words, tl.reduce(bits, 1, _bit_or),
                 mask=s + words * 32 < KVP)


@triton.jit
def _bit_or(a, b):
    return a | b


@torch.no_grad()
def strip_keep(cols: torch.Tensor, col_count: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
    """Which packed columns each row block keeps, as bits, built once per call for the VS strips (one Triton launch).

    cols Int32 `[B, H, KVP]` (`pack_columns`, KVP a multiple of 32), col_count Int32 `[B, H, M]`, covered Int8
    `[B, H, L]` (`index_build.vs_slash_tiles`). Returns Int32 `[B, H, M, KVP / 32]`: bit j of word w of row block
    m is set iff packed column i = 32 w + j is one it walks (i < col_count[m]) and no piece of it covers
    (covered[m * 64 - cols[i] + 63] == 0); the kernel's strip lanes read it (`kept_lanes`) instead of gathering
    cols and covered per lane."""
    B, H, kvp = cols.shape
    M = col_count.shape[-1]
    if kvp % 32:
        raise ValueError(f"cols must be padded to a multiple of 32 packed columns (pack_columns), got {kvp}")
    keep = torch.zeros(B, H, M, kvp // 32, dtype=torch.int32, device=cols.device)
    chunk = min(256, triton.next_power_of_2(kvp))
    _strip_keep_kernel[(B * H, M)](cols.contiguous(), col_count.contiguous(), covered.contiguous(), keep, M, kvp,
                                   covered.shape[-1], BLOCK=ROWS, CHUNK=chunk, num_warps=4 if chunk > 64 else 1)
    return keep


def pack_head_columns(k: torch.Tensor, v: torch.Tensor, tiles: VSTiles, n_q_heads: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernels' strips read, from tiles' columns per head (`tiles.head_columns`, strips of `tiles.piece`
    keys) and their `covered` flags, checked against k `[B, Hkv, N, D]`: (kc, vc, col_count: `pack_columns`; keep
    Int32 `[B, Hq, M, KVP / 32]`: `strip_keep`)."""
    B, _, N, _ = k.shape
    if tiles.covered is None or tuple(tiles.covered.shape) != (B, n_q_heads, N + ROWS - 1):
        raise ValueError(f"tiles.covered must be Int8 [B, H, N + 63] = [{B}, {n_q_heads}, {N + ROWS - 1}] beside "
                         f"tiles.head_columns; build both with vs_tiles(..., head_columns=True)")
    kc, vc, cols, col_count = pack_columns(k, v, tiles.head_columns, n_q_heads, tiles.piece)
    return kc, vc, col_count, strip_keep(cols, col_count, tiles.covered)


def pack_vertical_slash(k: torch.Tensor, v: torch.Tensor, columns: torch.Tensor, offsets: torch.Tensor,
                        n_q_heads: int, width: int = KEYS) -> tuple[VSTiles, tuple[torch.Tensor, ...]]:
    """What `ws_vertical_slash` prepares once per layer from MInference's index (columns / offsets `[B, Hq, K]`):
    the slash pieces (`index_build.vs_slash_tiles`, `width` keys each) and what the strips read (kc, vc, col_count:
    `pack_columns`, strips of `width` keys; keep: `strip_keep`). k / v contiguous `[B, Hkv, N, D]` on the GPU."""
    from .index_build import vs_slash_tiles

    tiles, covered, cols = vs_slash_tiles(columns.to(k.device), offsets.to(k.device), k.shape[2], ROWS,
                                          0 if width == ROWS else width)
    kc, vc, cols, col_count = pack_columns(k, v, cols, n_q_heads, width)
    return tiles, (kc, vc, col_count, strip_keep(cols, col_count, covered))


def ws_vertical_slash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, columns: torch.Tensor,
                      offsets: torch.Tensor, scale: float | None = None, stages: int = 2, consumers: int = 2,
                      overlap: bool = True, packed: tuple[VSTiles, tuple[torch.Tensor, ...]] | None = None,
                      kv_major: bool = True, share_kv: bool | None = None, v_stages: int | None = None,
                      width: int = KEYS, pair: bool = False, persistent: bool | int = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical-Slash prefill on an sm_90 GPU: MInference's index columns Long `[B, Hq, Kv]` (key positions),
    offsets Long `[B, Hq, Ks]` (i - j), any order; -1, repeated, >= N entries ignored, offset 0 always in (as
    `vertical_slash_prefill`, same keys as `index_ref.vs_to_tiles`). q, k, v, stages, v_stages, consumers, overlap,
    kv_major as `ws_prefill` (kv_major by default here: 1.27x / 1.31x faster at 64K / 128K on the H200). The slash
    pieces come from `index_build.vs_slash_tiles`; each query head's unique columns are packed once
    (`pack_columns`) and row block m walks the prefix of them < m*64, `width` at a time, as extra items before its
    pieces (a column under one of its pieces masked), so the kernel reads each column once per row block that
    keeps it. `width`: keys per step, 64 or 128 (128: slash pieces 128 wide, the keys of
    `vs_to_tiles(..., width=128)`, a superset of 64's; 32 KB K / V tiles at head_dim 128, so per-head rings fit
    with v_stages=1); `pair` (width 64): two 64-key strips / pieces per step (`ws_prefill`'s); `persistent` as
    `ws_prefill`'s. `packed`: `pack_vertical_slash(k, v, columns, offsets, Hq, width)` made earlier (this call
    then only launches). Group-shared columns / offsets (`[B, Hkv, K]`, `index_build.vs_index(group_shared=True)`)
    run with `share_kv` (None: for those): query heads 2j and 2j + 1 of a KV head on one K/V ring (`ws_prefill`'s
    share_kv; consumers=2, an even group; per-head lists must then be equal for heads 2j and 2j + 1).
    Returns (o `[B, Hq, N, D]` in q's dtype, lse Float32 `[B, Hq, N]`, natural log)."""
    B, Hq, Hkv, N, D = _check_args(q, k, v, stages, consumers, overlap, v_stages, persistent)
    grouped = columns.dim() == 3 and columns.shape[1] == Hkv != Hq
    for name, x in (("columns", columns), ("offsets", offsets)):
        if x.dim() != 3 or tuple(x.shape[:2]) not in ((B, Hq), (B, Hkv)) or x.shape[-1] < 1 or x.dtype.is_floating_point \
                or x.shape[1] != columns.shape[1]:
            raise ValueError(f"{name} must be an integer tensor [B, H, K] with H = Hq = {Hq} (per query head) or Hkv = "
                             f"{Hkv} (group-shared) for both, B = {B}, K >= 1; got {x.dtype} {tuple(x.shape)}")
    share_kv = grouped if share_kv is None else share_kv
    if grouped:  # every head of a group walks the same lists: expand them
        columns, offsets = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (columns, offsets))
    if share_kv and (consumers != 2 or Hq // Hkv % 2 or not grouped and not (
            torch.equal(columns[:, 0::2], columns[:, 1::2]) and torch.equal(offsets[:, 0::2], offsets[:, 1::2]))):
        raise ValueError("share_kv needs consumers=2, an even number of query heads per KV head and equal columns and "
                         "offsets for heads 2j and 2j + 1 (group-shared indexes have them); use share_kv=False")
    if width not in (KEYS, 2 * KEYS) or packed is not None and packed[0].piece != width or pair and width != KEYS:
        raise ValueError(f"width (keys per step) must be {KEYS} or {2 * KEYS} ({KEYS} with pair) and equal the packed "
                         f"tiles' piece; got {width}{f', packed for {packed[0].piece}' if packed is not None else ''}"
                         f"{', pair' if pair else ''}")
    _check_device(q)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tiles, strips = packed or pack_vertical_slash(k, v, columns, offsets, Hq, width)
    return _launch(q, k, v, tiles, scale, (stages, v_stages or stages), consumers, overlap, share_kv, strips,
                   kv_major=kv_major, pair=pair, persistent=persistent)


def ws_ashape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | list[int],
              window: torch.Tensor | list[int], scale: float | None = None, stages: int = 2, consumers: int = 2,
              overlap: bool = True, tiles: VSTiles | None = None, kv_major: bool = False, share_kv: bool = False,
              width: int = KEYS, v_stages: int | None = None, persistent: bool | int = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A-shape prefill on an sm_90 GPU: per query head `sink` and `window` (tokens, `[Hq]`; window >= 1, sink
    >= 0; `NO_WINDOW` for a head without a band) -> keys j <= i with j < sink or i - j < window (as
    `ashape_prefill`). Tiles: `index_ref.ashape_to_tiles` per query head (window pieces, the sinks below a row
    block's lowest piece as its columns [0, count)); the sinks are contiguous keys, so the kernel walks them as
    strips of k / v from key 0 (lanes >= count masked) before the pieces, and applies the token mask on the
    pieces that reach past the window. q, k, v, stages, v_stages, consumers, overlap, kv_major, persistent as
    `ws_prefill`; `tiles`: those per-head tiles made elsewhere (`ashape_to_tiles(sink, window, N, B, 64,
    width=width)`; None: `index_ref.band_tiles`' cached ones, built at the first call for a band, length and width).
    `share_kv` (consumers=2, each KV group's heads pairing up by band: `head_pairs`): two heads of one band on one
    K/V ring, as `ws_prefill`'s (`ashape_prefill`'s choice on sm_90: `ASHAPE_LAUNCH`). `width`: keys per step, 64 or
    128 (pieces and sink strips; 128: twice the work per ring slot and barrier round trip, 64 KB a slot at head_dim
    128, so at most 3 stages on one shared ring).
    Returns (o `[B, Hq, N, D]` in q's dtype, lse Float32 `[B, Hq, N]`, natural log)."""
    B, Hq, Hkv, N, D = _check_args(q, k, v, stages, consumers, overlap, v_stages, persistent)
    sink_t = torch.as_tensor(sink).reshape(-1)
    window_t = torch.as_tensor(window).reshape(-1)
    if sink_t.numel() != Hq or window_t.numel() != Hq or sink_t.is_floating_point() or window_t.is_floating_point():
        raise ValueError(f"sink and window must be integer token counts, one per query head ([{Hq}]); got "
                         f"{sink_t.dtype} {tuple(sink_t.shape)} and {window_t.dtype} {tuple(window_t.shape)}")
    pairs = head_pairs(Hq, Hkv, sink_t, window_t) if share_kv else None
    if share_kv and (consumers != 2 or pairs is None):
        raise ValueError("share_kv needs consumers=2, an even number of query heads per KV head and every band held "
                         "by an even number of a KV group's heads; use share_kv=False")
    if width not in (KEYS, 2 * KEYS):
        raise ValueError(f"width (keys per step) must be {KEYS} or {2 * KEYS}, got {width}")
    _check_device(q)
    if tiles is None:  # built once per band, length and width, then cached (checks window >= 1, sink >= 0)
        tiles, band = band_tiles(sink_t, window_t, N, B, ROWS, q.device, width)
    elif tuple(tiles.shape) != (B, Hq, -(-N // ROWS)) or tiles.block != ROWS or tiles.piece != width:
        raise ValueError(f"tiles must be ashape_to_tiles(sink, window, {N}, {B}, 64, width={width}) per query head "
                         f"([{B}, {Hq}, {-(-N // ROWS)}], 64 x {width}), got {tuple(tiles.shape)}, "
                         f"{tiles.block} x {tiles.piece}")
    else:
        band = band_on(sink_t, window_t, q.device)
    return _launch(q.contiguous(), k.contiguous(), v.contiguous(), tiles, scale, (stages, v_stages or stages),
                   consumers, overlap, share_kv, band=band, kv_major=kv_major, pairs=pairs, persistent=persistent)
