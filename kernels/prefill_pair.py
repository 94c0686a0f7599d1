"""Row-block pairs on one K/V ring: per-head block-sparse, Vertical-Slash and A-shape prefill at head_dim 256 on
sm_90, in Gluon (issue 25). `sparse_prefill`'s default for the tiles `pair_takes` takes (`prefill.default_program`: "pair").

At head_dim 256 a 64-row program takes in 64 KB of K / V per 64-key step (64 flop per byte). Every
64-rows-per-load kernel measured there sits at 0.62-0.83 of dense SDPA per computed tile: the loop, the Gluon
launches, and TMA multicast to a cluster, which cuts L2 reads but not each SM's intake (kernels/NOTES.md, session
32). Here one program takes row blocks 2j and 2j + 1 of one head. Two consumer warpgroups read one ring over the
union of their pieces (ascending). Each consumer computes only its own pieces (a bit per consumer and piece) and
waits through the other's. A 1-warp loader TMA-loads each union piece once and refills a slot once both consumers
have released it. A piece both row blocks hold is loaded once for 128 rows.

A-shape (`pair_ashape`): a head's sinks below a row block's lowest piece are keys [0, count), walked as strips of k /
v from key 0 before the window's pieces (2j's are a prefix of 2j + 1's); the pieces take the token mask j < sink or
i - j < window.

Vertical-Slash: each query head's columns are packed once per call into contiguous kc / vc rows
(`prefill_ws.pack_columns`). A pair walks row block 2j + 1's 64-key column strips first (2j's columns are a prefix
of them), then the union of slash pieces. Each consumer keeps a strip lane iff the column is one of its row block's
and no piece of that row block covers it (`VSTiles.covered`, read as `prefill_ws.strip_keep`'s bits), so the keys
are exactly `vs_to_tiles`'.

Measured (H100, Gemma-3 shape 4/1/256, block top-100 from `block_index` on the bench's planted inputs, union / own
1.14-1.23):
- the kernel on a prebuilt union, rows in a fixed order after the loop: 1.04-1.24x the loop at 16K-128K;
- with the order rotated each round and the union built per call by torch ops (~0.8 ms): 0.77x / 0.95x / 0.92x at
  32K / 64K / 128K (`pair_probe_*_h100.json`);
- with the union in one launch (`pair_items`: its merge by binary search, 2.5-9.5 us on the GPU; 0.11-0.18 ms a call
  at 16K-128K, mostly the host's launches, against the reference's 0.59-0.88), rotated rounds: 1.01x / 1.04x /
  1.11x / 1.03x the loop at 16K / 32K / 64K / 128K; `bench kernels` block row 0.77 / 0.74 of dense per tile at 64K /
  128K (`pair_probe_ec4693a_h100.json`, `kernels_gemma_ec4693a_h100.json`; 0.77 / 0.70 in session 37's run);
- per-head VS(1000, 6096) in `bench kernels`: 0.83 / 0.77 of dense per tile at 64K / 128K, 1.10x / 1.17x the loop
  on the same tiles in the same rounds; VS(1000, 512), a few slash pieces per row block, 1.01x / 0.92x
  (`kernels_gemma_4a2e9b6_h100.json`);
- A-shape (`pair_ashape`), windows 4096 / 2048 in turn per head: 1.12x / 1.08x the per-head loop; one band per KV
  group: 0.89x / 0.90x the GQA-packed loop, which keeps it (`prefill.groups_share_band`;
  `kernels_gemma_bec2fe3_h100.json`, `kernels_gemma_47458e3_h100.json`);
- the launch order (`PairItems.ordered`): head by head, each head's pairs last first, 1.09x / 1.24x faster at 64K /
  128K than longest union first (`pair_order_probe_0f9a382_h100.json`); with it `bench kernels` reads block
  0.79 / 0.81, per-head VS 0.83 / 0.79, per-head A-shape 0.77 / 0.75 of dense per tile
  (`kernels_gemma_3e71286_h100.json`);
- at head_dim 128 (`RING[128]`, Llama 32 / 8 / 128, `scripts/pair_probe.py`, 3-5 slots): 0.76-0.97x the deployed
  `prefill_ws` (VS, block) and the loop (A-shape in per-head bands) at 64K / 128K (`pair_probe_d128_8a7157e_h100.json`),
  so `pair_runs` keeps the pairs to head_dim 256.

Tensors are addressed as flattened rows: q / o `[B * Hq * N, D]`, k / v `[B * Hkv * N, D]`. A K / V tile that
crosses N reads the next head's rows (or TMA's zero fill past the tensor); those keys lie past every stored row's
position, so the causal mask drops them. A Vertical-Slash slash piece may start below key 0; its keys there are
masked on the VS walk.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .index_ref import PairItems, VSTiles, band_tiles
from .prefill_ref import check_prefill_args
from .prefill_ws import DTYPES, kept_lanes, launch_config, pack_head_columns, sm90, softmax_step, tma_load
from .tiling import LN2, LOG2E

ROWS = gl.constexpr(64)  # query rows per consumer (= tiles.block; host code reads ROWS.value)
KEYS = gl.constexpr(64)  # keys per piece (= tiles.piece)
# what a pair walks before its pieces (host code reads .value): nothing, packed columns, keys [0, count)
NO_STRIPS, PACKED, SINKS = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)
HEAD_DIM = 256  # the head_dim it runs at (`pair_runs`): K + V slots of 64 KB, two slots and two Q tiles in 192 KB
RING = {128: 4, 256: 2}  # ring slots per head_dim: 2 x 64 rows of Q + slots x 64 keys of K and V within 227 KB
LAUNCH = launch_config(2, HEAD_DIM)  # 3 warpgroups a program: two consumers and the loader, as two consumers there


@triton.jit
def _rank(List, n, x, STEPS: tl.constexpr):
    """Per entry of x: how many of List's first n entries (ascending) lie below it, by STEPS halvings (a lower
    bound: STEPS >= bit length of n)."""
    lo = tl.zeros_like(x)
    hi = lo + n
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        below = (mid < hi) & (tl.load(List + mid, mask=mid < hi, other=0) < x)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _pair_union_kernel(Count, Offset, Union, Bits, Total, M, NS, U, NSP: tl.constexpr, STEPS: tl.constexpr):
    """Program item = (b * H + h) * ceil(M / 2) + j: the ascending union of row blocks 2j and 2j + 1's piece starts
    (Offset `[B * H * M, NS]`, the first Count `[B * H * M]` valid, ascending, distinct) into Union `[items, U]`,
    Bits (1: 2j holds it, 2: 2j + 1, 3: both; 0 past Total) and Total `[items]`; Union past Total is left as it was.
    An entry's union position is its own index, plus the other list's entries below it (a binary search), less the
    entries of both lists below it (a prefix sum of the shared flags)."""
    item = tl.program_id(0)
    mp = (M + 1) // 2
    row_a = (item // mp) * M + (item % mp) * 2  # row block 2j of head item // mp
    has_b = ((item % mp) * 2 + 1 < M).to(tl.int32)  # an odd M's last pair: row block 2j alone
    r = tl.arange(0, NSP)
    na = tl.load(Count + row_a)
    nb = tl.load(Count + row_a + has_b) * has_b
    list_a = Offset + row_a.to(tl.int64) * NS
    list_b = list_a + NS
    a_live, b_live = r < na, r < nb
    a = tl.load(list_a + r, mask=a_live, other=-1)
    b = tl.load(list_b + r, mask=b_live, other=-1)
    b_below_a = _rank(list_b, nb, a, STEPS)  # [NSP] over a
    a_below_b = _rank(list_a, na, b, STEPS)  # [NSP] over b
    a_in_b = a_live & (tl.load(list_b + b_below_a, mask=a_live & (b_below_a < nb), other=-1) == a)
    b_in_a = b_live & (tl.load(list_a + a_below_b, mask=b_live & (a_below_b < na), other=-1) == b)
    shared_a, shared_b = a_in_b.to(tl.int32), b_in_a.to(tl.int32)
    pos_a = r + b_below_a - (tl.cumsum(shared_a, 0) - shared_a)
    pos_b = r + a_below_b - (tl.cumsum(shared_b, 0) - shared_b)
    base = item.to(tl.int64) * U
    tl.store(Union + base + pos_a, a, mask=a_live)
    tl.store(Bits + base + pos_a, 1 + 2 * shared_a, mask=a_live)
    b_own = b_live & ~b_in_a
    tl.store(Union + base + pos_b, b, mask=b_own)
    tl.store(Bits + base + pos_b, tl.full([NSP], 2, tl.int32), mask=b_own)
    total = na + tl.sum(b_own.to(tl.int32), 0)
    rest = tl.arange(0, 2 * NSP)
    tl.store(Bits + base + rest, tl.zeros([2 * NSP], tl.int32), mask=(rest >= total) & (rest < U))
    tl.store(Total + item, total)


def merge_warps(nsp: int) -> int:
    """Warps of a `_pair_union_kernel` program over lists nsp wide (a power of two): one per 256 entries, at least 4
    and at most 32 (ptxas sm_90, no spills: 28 registers at nsp 128, 123 at 1024 on 4 warps, 128 at 4096 on 16)."""
    return min(32, max(4, nsp // 256))


def pair_items(tiles: VSTiles) -> PairItems:
    """`PairItems` of per-head tiles `[B, H, M]` (piece starts ascending and distinct per row block), on the tiles'
    device with no host sync: one merge program per pair (`_pair_union_kernel`, O(NS log NS) each); the launch order
    `PairItems.ordered`'s head runs."""
    B, H, M, NS = tiles.block_offset.shape
    items = B * H * (-(-M // 2))
    dev = tiles.block_offset.device
    union = torch.empty(items, 2 * NS, dtype=torch.int32, device=dev)
    bits = torch.empty(items, 2 * NS, dtype=torch.int32, device=dev)
    count = torch.empty(items, dtype=torch.int32, device=dev)
    NSP = triton.next_power_of_2(max(NS, 16))
    _pair_union_kernel[(items,)](tiles.block_count.contiguous(), tiles.block_offset.contiguous(), union, bits, count, M,
                                 NS, 2 * NS, NSP=NSP, STEPS=NSP.bit_length(), num_warps=merge_warps(NSP))
    return PairItems.ordered(union, bits, count, B * H)


@gluon.jit
def pair_strips(ColCount, head, j, M):
    """How many 64-key strips of its head's packed columns pair j walks: row block 2j + 1's (2j's columns are a
    prefix of them; an odd M's last pair, 2j's)."""
    return gl.cdiv(gl.load(ColCount + head * M + gl.minimum(2 * j + 1, M - 1)), KEYS)


@gluon.jit
def load_kv(k_desc, v_desc, row, k_slot, v_slot, k_ready, v_ready):
    """TMA: rows [row, row + 64) of K and V into k_slot / v_slot, each slot's bytes expected on its ready barrier."""
    mbarrier.expect(k_ready, k_desc.block_type.nbytes)
    tma_load(k_desc, [row, 0], k_ready, k_slot)
    mbarrier.expect(v_ready, v_desc.block_type.nbytes)
    tma_load(v_desc, [row, 0], v_ready, v_slot)


@gluon.jit
def _fill(k_desc, v_desc, row, step, k_smem, v_smem, k_ready, v_ready, empty, STAGES: gl.constexpr):
    """Ring step `step`: K / V rows [row, row + 64) of the descriptors into slot step % STAGES, once both consumers
    released its previous fill (`empty` counts 2; fill 0 waits on the phase before the first, which passes)."""
    s = step % STAGES
    mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)
    load_kv(k_desc, v_desc, row, k_smem.index(s), v_smem.index(s), k_ready.index(s), v_ready.index(s))


@gluon.jit
def _loader(k_desc, v_desc, kc_desc, vc_desc, k_smem, v_smem, k_ready, v_ready, empty, Union, Count, ColCount, Order,
            U, N, M, MP, G, KVP, STRIPS: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: item Order[program]'s ring steps: first its `pair_strips` strips (PACKED: kc / vc rows head x KVP + 64 t;
    SINKS: the KV head's keys from 0, through kc / vc = k / v), then the union's K / V tiles."""
    item = gl.load(Order + gl.program_id(0))
    n = gl.load(Count + item)
    head = item // MP  # b * Hq + h
    kv_row = (head // G) * N  # the KV head's first row in [B * Hkv * N, D] (TMA coordinates: int32)
    strips = 0
    if STRIPS != NO_STRIPS:
        strips = pair_strips(ColCount, head, item % MP, M)
        first = kv_row
        if STRIPS == PACKED:
            first = head * KVP
        for t in range(strips):
            _fill(kc_desc, vc_desc, first + t * KEYS, t, k_smem, v_smem, k_ready, v_ready, empty, STAGES)
    for i in range(n):
        _fill(k_desc, v_desc, kv_row + gl.load(Union + item * U + i), strips + i, k_smem, v_smem, k_ready, v_ready,
              empty, STAGES)


@gluon.jit
def wait_slot(step, k_ready, v_ready, STAGES: gl.constexpr):
    """Wait until ring step `step`'s K and V tiles are in slot step % STAGES; returns the slot."""
    s = step % STAGES
    ph = (step // STAGES) & 1
    mbarrier.wait(k_ready.index(s), ph)
    mbarrier.wait(v_ready.index(s), ph)
    return s


@gluon.jit
def causal(keys, pos):
    """Bool `[R, K]`: row i (query position pos[i]) may read key keys[j]."""
    return gl.expand_dims(keys, 0) <= gl.expand_dims(pos, 1)


@gluon.jit
def attend_piece(q_tile, k_tile, v_tile, keep, m_i, l_i, acc, s0, qk_scale, O_LAYOUT: gl.constexpr):
    """One piece: S = Q K^T (wgmma, Q and K from shared memory), `softmax_step` on the scores `keep` (Bool,
    broadcast to `[R, K]`) holds, O = alpha O + P V (P from registers); returns (m_i, l_i, acc)."""
    sc = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s0, use_acc=False, is_async=True)
    sc = warpgroup_mma_wait(0, deps=(sc,))
    p, alpha, m_i, l_i = softmax_step(gl.where(keep, sc, float("-inf")), m_i, l_i, qk_scale)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT)), 1)
    p_op = gl.convert_layout(p.to(k_tile.dtype), gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2))
    acc = warpgroup_mma(p_op, v_tile, acc, is_async=True)
    return m_i, l_i, warpgroup_mma_wait(0, deps=(acc,))


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, k_ready, v_ready, empty, Q, O, LSE, Union, Bits, Count, ColCount, Keep, Sink,
              Window, Order, U, N, M, MP, KVP, HQ, qk_scale, SUB: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, STRIPS: gl.constexpr, BAND: gl.constexpr, Q_LAYOUT: gl.constexpr,
              S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr):
    """Consumer SUB: row block m = 2j + SUB of item Order[program]'s head, over the item's ring steps (`attend_piece`:
    fp32 online softmax in exp2 units); writes its O rows and LSE. First the pair's strips, computing the lanes of
    m's own ColCount[m] columns (PACKED: those no piece of m covers, Keep's bits: `prefill_ws.kept_lanes`) and waiting through
    the rest; then the union's pieces whose bit SUB is set (BAND: keys j of row i with j < Sink[h] or i - j < Window[h],
    h the query head)."""
    item = gl.load(Order + gl.program_id(0))
    n = gl.load(Count + item)
    m = (item % MP) * 2 + SUB
    head = item // MP  # b * Hq + h
    q_tile = q_smem.index(SUB)
    qr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_LAYOUT))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, Q_LAYOUT))
    q_rows = head.to(gl.int64) * N + m * ROWS + qr
    q = gl.load(Q + gl.expand_dims(q_rows * D, 1) + gl.expand_dims(qd, 0),
                mask=gl.expand_dims(m * ROWS + qr < N, 1), other=0.0)
    q_tile.store(q)
    fence_async_shared()  # the stores visible to the wgmma's (async proxy) reads
    row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    row_o: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    pos = m * ROWS + gl.arange(0, ROWS, layout=row_s)  # query positions
    lanes = gl.arange(0, KEYS, layout=gl.SliceLayout(0, S_LAYOUT))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    acc = gl.zeros([ROWS, D], gl.float32, O_LAYOUT)
    s0 = gl.zeros([ROWS, KEYS], gl.float32, S_LAYOUT)
    strips = 0
    if STRIPS != NO_STRIPS:
        strips = pair_strips(ColCount, head, item % MP, M)
        n_cols = gl.where(m < M, gl.load(ColCount + head * M + gl.minimum(m, M - 1)), 0)  # m's columns: < 64 m
        keep_row = Keep + (head * M + gl.minimum(m, M - 1)).to(gl.int64) * (KVP // 32)  # PACKED: m's keep words
        for t in range(strips):
            if STRIPS == PACKED:
                keep = kept_lanes(keep_row, t, n_cols, lanes, KEYS)
            else:
                keep = t * KEYS + lanes < n_cols
            s = wait_slot(t, k_ready, v_ready, STAGES)
            if t * KEYS < n_cols:
                m_i, l_i, acc = attend_piece(q_tile, k_smem.index(s), v_smem.index(s), gl.expand_dims(keep, 0), m_i,
                                             l_i, acc, s0, qk_scale, O_LAYOUT)
            mbarrier.arrive(empty.index(s), count=1)
    if BAND:
        sink = gl.load(Sink + head % HQ)
        window = gl.load(Window + head % HQ)
    for i in range(n):
        start = gl.load(Union + item * U + i)
        mine = (gl.load(Bits + item * U + i) >> SUB) & 1
        keep = causal(start + lanes, pos)
        if STRIPS == PACKED:  # a slash piece may start below key 0 (it would read another head's rows, or TMA's zeros)
            keep = keep & gl.expand_dims(start + lanes >= 0, 0)
        if BAND:
            keys = gl.expand_dims(start + lanes, 0)
            keep = keep & ((keys < sink) | (gl.expand_dims(pos, 1) - keys < window))
        s = wait_slot(strips + i, k_ready, v_ready, STAGES)
        if mine != 0:
            m_i, l_i, acc = attend_piece(q_tile, k_smem.index(s), v_smem.index(s), keep, m_i, l_i, acc, s0, qk_scale,
                                         O_LAYOUT)
        mbarrier.arrive(empty.index(s), count=1)
    orow = gl.arange(0, ROWS, layout=row_o)
    od = gl.arange(0, D, layout=gl.SliceLayout(0, O_LAYOUT))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    o_rows = head.to(gl.int64) * N + m * ROWS + orow
    ok = gl.expand_dims(m * ROWS + orow < N, 1) & gl.expand_dims(od < D, 0)
    gl.store(O + gl.expand_dims(o_rows * D, 1) + gl.expand_dims(od, 0), out.to(O.dtype.element_ty), mask=ok)
    lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(LSE + head.to(gl.int64) * N + pos, lse, mask=pos < N)


@gluon.jit(do_not_specialize=["U", "N", "M", "MP", "KVP", "HQ"])
def _pair_kernel(k_desc, v_desc, kc_desc, vc_desc, Q, O, LSE, Union, Bits, Count, ColCount, Keep, Sink, Window,
                 Order, U, N, M, MP, G, KVP, HQ, qk_scale, D: gl.constexpr, STAGES: gl.constexpr,
                 STRIPS: gl.constexpr, BAND: gl.constexpr,
                 Q_SMEM: gl.constexpr, Q_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr,
                 CONSUMER_REGS: gl.constexpr):
    """Program: item Order[pid] (b, head, row-block pair; MP pairs per head, G query heads per KV head). Shared
    memory: two Q tiles and STAGES K and V slots of 64 keys x D. ColCount Int32 `[B * Hq, M]`: how many columns lie
    below each row block. PACKED: kc / vc `[B * Hq * KVP, D]` the heads' packed columns, Keep Int32 `[B * Hq * M,
    KVP / 32]` which of them each row block keeps (`prefill_ws.strip_keep`). SINKS: the columns are keys [0,
    ColCount), read through kc / vc = k / v. BAND: Sink / Window Int32 `[HQ]` per query head. Arguments a mode does
    not read are placeholders."""
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [2, ROWS, D], Q_SMEM)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, KEYS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, KEYS, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)  # the loader's expect, then the TMA bytes
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers, once per fill
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, k_ready, v_ready, empty, Q, O, LSE, Union, Bits, Count, ColCount, Keep,
                     Sink, Window, Order, U, N, M, MP, KVP, HQ, qk_scale, 0, D, STAGES, STRIPS, BAND,
                     Q_LAYOUT, S_LAYOUT, O_LAYOUT)),
        (_consumer, (q_smem, k_smem, v_smem, k_ready, v_ready, empty, Q, O, LSE, Union, Bits, Count, ColCount, Keep,
                     Sink, Window, Order, U, N, M, MP, KVP, HQ, qk_scale, 1, D, STAGES, STRIPS, BAND,
                     Q_LAYOUT, S_LAYOUT, O_LAYOUT)),
        (_loader, (k_desc, v_desc, kc_desc, vc_desc, k_smem, v_smem, k_ready, v_ready, empty, Union, Count, ColCount,
                   Order, U, N, M, MP, G, KVP, STRIPS, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


@functools.lru_cache(maxsize=4)
def layouts(d: int, dtype: torch.dtype) -> dict:
    """The kernel's layouts (cached: built once per head_dim and dtype)."""
    t = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return {"Q_SMEM": gl.NVMMASharedLayout.get_default_for([ROWS.value, d], t),
            "Q_LAYOUT": gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]),
            "S_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KEYS.value, 16]),
            "O_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d, 16]),
            "KV_SMEM": gl.NVMMASharedLayout.get_default_for([KEYS.value, d], t)}


def pair_takes(q: torch.Tensor, tiles: VSTiles, sink: torch.Tensor | None) -> bool:
    """Whether `pair_prefill` takes these tiles (static facts only, no host sync): `pair_runs` q, per-query-head tiles
    of 64 rows over disjoint 64-key pieces, columns only as `head_columns` (Vertical-Slash's deployed tiles), no A-shape
    mask (A-shape alone: `pair_ashape`). Group-shared tiles are not taken: the GQA-packed loop already loads each tile
    for 128 rows (0.93 of dense)."""
    return (pair_runs(q) and tiles.shape[1] == q.shape[1] and tiles.block == ROWS.value and tiles.piece == KEYS.value
            and tiles.disjoint and (not tiles.columns or tiles.head_columns is not None) and sink is None)


def pair_runs(q: torch.Tensor) -> bool:
    """Whether the pair kernel runs for q `[B, Hq, N, D]`: an sm_90 GPU, bf16 / fp16, head_dim 256."""
    return sm90(q.device) and q.dtype in DTYPES and q.shape[-1] == HEAD_DIM


def pair_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: VSTiles, scale: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over per-head tiles (`pair_takes`), row blocks paired on one K/V ring; Vertical-Slash's
    columns (`tiles.head_columns`, `covered`) packed once per call (`prefill_ws.pack_head_columns`) and walked as strips
    before the pieces. q `[B, Hq, N, 256]`, k / v `[B, Hkv, N, 256]` (bf16 / fp16; copied if not contiguous); query
    head h reads KV head h // (Hq / Hkv); tiles `[B, Hq, ceil(N / 64)]`. Returns (o `[B, Hq, N, D]` in q's dtype,
    lse Float32 `[B, Hq, N]`, natural log)."""
    check_prefill_args(q, k, v)
    if not pair_takes(q, tiles, None):
        raise ValueError(f"pair_prefill takes bf16 / fp16 q of head_dim {HEAD_DIM} on an sm_90 GPU and per-head tiles "
                         f"[B, Hq, M] of 64-row blocks over disjoint 64-key pieces, columns only as head_columns; got "
                         f"{q.dtype}, head_dim {q.shape[-1]}, device {q.device}, tiles {tuple(tiles.shape)} (block "
                         f"{tiles.block}, piece {tiles.piece}, columns {tiles.columns}, head_columns "
                         f"{tiles.head_columns is not None}); use sparse_prefill")
    return _launch(q, k, v, tiles, scale, None)


def pair_ashape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, window: torch.Tensor,
                scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A-shape prefill on the pairs (as `prefill.ashape_prefill`: per query head keys j <= i with j < sink or
    i - j < window; sink / window CPU Int `[Hq]`, tokens): `index_ref.band_tiles`' cached tiles, each head's sinks below
    a row block's lowest piece walked as strips of k / v from key 0, the token mask on the window's pieces. q, k, v as
    `pair_prefill` (`pair_runs` q). Returns (o, lse)."""
    B, Hq, _, N, _ = check_prefill_args(q, k, v)
    if not pair_runs(q):
        raise ValueError(f"pair_ashape takes bf16 / fp16 q of head_dim {HEAD_DIM} on an sm_90 GPU; got {q.dtype}, "
                         f"head_dim {q.shape[-1]}, device {q.device}; use prefill.ashape_prefill")
    tiles, band = band_tiles(sink, window, N, B, ROWS.value, q.device)
    if tiles.shape[1] != Hq:
        raise ValueError(f"sink and window hold {tiles.shape[1]} heads but q has {Hq}; give one per query head")
    return _launch(q, k, v, tiles, scale, band)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: VSTiles, scale: float | None,
            band: tuple[torch.Tensor, torch.Tensor] | None, stages: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair kernel over checked per-head tiles: their columns as PACKED strips (`head_columns`) or, under an
    A-shape `band` (sink, window Int32 `[Hq]` on q's device), as SINKS strips; `stages` ring slots (None: `RING`'s
    for the head_dim; head_dim 128 runs only here, for `scripts/pair_probe.py`)."""
    B, Hq, Hkv, N, D = check_prefill_args(q, k, v)
    M = -(-N // ROWS.value)
    if tuple(tiles.shape) != (B, Hq, M):
        raise ValueError(f"tiles are for [B, H, M] = {tuple(tiles.shape)} but q needs ({B}, {Hq}, {M}); rebuild them")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tiles = tiles.to(q.device)
    items = pair_items(tiles)
    lay = layouts(D, q.dtype)
    k_desc = TensorDescriptor.from_tensor(k.view(-1, D), [KEYS.value, D], lay["KV_SMEM"])
    v_desc = TensorDescriptor.from_tensor(v.view(-1, D), [KEYS.value, D], lay["KV_SMEM"])
    strips = (NO_STRIPS if not tiles.columns else SINKS if band is not None else PACKED).value
    packed = strips == PACKED.value
    unused = items.count
    kc_desc, vc_desc, col_count, keep = k_desc, v_desc, unused, unused
    if packed:
        kc, vc, col_count, keep = pack_head_columns(k, v, tiles, Hq)
        kc_desc, vc_desc = (TensorDescriptor.from_tensor(x, [KEYS.value, D], lay["KV_SMEM"]) for x in (kc, vc))
    elif strips == SINKS.value:
        col_count = tiles.column_count.contiguous()
    sink, window = band if band is not None else (unused, unused)
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    _pair_kernel[(items.order.numel(),)](
        k_desc, v_desc, kc_desc, vc_desc, q, o, lse, items.union, items.bits, items.count, col_count, keep, sink,
        window, items.order, items.union.shape[1], N, M, -(-M // 2), Hq // Hkv, 32 * keep.shape[-1] if packed else 0, Hq,
        scale * LOG2E, D=D, STAGES=stages or RING[D], STRIPS=strips, BAND=band is not None, Q_SMEM=lay["Q_SMEM"],
        Q_LAYOUT=lay["Q_LAYOUT"], S_LAYOUT=lay["S_LAYOUT"], O_LAYOUT=lay["O_LAYOUT"],
        CONSUMER_REGS=LAUNCH["consumer_regs"], num_warps=4, maxnreg=LAUNCH["maxnreg"])
    return o, lse
