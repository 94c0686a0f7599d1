"""Exploratory (Hopper, Triton >= 3.9 for the cluster rows): TMA multicast of K/V tiles to a cluster of the G query
heads of one KV head, for per-head block-sparse prefill at head_dim 256 (issue 25's head_dim-256 lead, way 3 in
kernels/NOTES.md; measured and closed in session 32), beside the library's row-block pairs (`prefill_pair`).

One cluster of G CTAs (one per query head of the KV head, the same 64-row block) walks the union of the G heads' key
blocks in ascending order; rank 0 TMA-loads each K/V tile once and multicasts it into all G CTAs' rings; each CTA
computes only the pieces its own head selected (a per-piece bit mask) and skips the rest. L2 reads fall to
union / (G x own); each SM's intake does not.

Kernel: a 1-warp loader partition (TMA, a ring of STAGES K + V slots) and a 4-warp consumer (Q K^T and P V by
wgmma, online softmax in fp32 with exp2; `overlap`: FA3's intra-warpgroup overlap over runs of own pieces). Slot
release: each consumer arrives on its CTA's `local_empty` (its own loader's next expect waits for it) and on the
cluster's `shared_empty` (a barrier living in rank 0, count G; the loader waits on it, which the compiler emits in
rank 0 only, before the multicast refill). `CLUSTER=1` is the same kernel without a cluster: each program walks its
own head's pieces and loads them itself (the A/B baseline). The `pair` row is `prefill_pair.pair_prefill`, which
runs on the GPU image's Triton 3.6 (as do `dense_sdpa` and `loop`).

Run (GPU; Triton >= 3.9 first on PYTHONPATH for the cluster rows, `scripts/device_triton.sh`):
  python3 scripts/multicast_probe.py --lengths 16384,65536,131072 --out multicast_probe.json
  python3 scripts/multicast_probe.py --variants dense_sdpa,loop,pair --rounds 5 --out pair_probe.json
  python3 scripts/multicast_probe.py --variants dense_sdpa,loop,pair,pair/heads,pair/longest --lengths 65536,131072
Launch orders of the pairs (the same kernel and items): `pair` the library's (`PairItems.ordered`: one head after
another, each head's pairs last first), `pair/heads` pair j descending with the query heads of one KV head side by
side, `pair/longest` longest union first (the library's order until session 37).
Steps: a bf16 check of the kernels against the loop on the same tiles at 4K; then, per length, the rows timed in
interleaved rounds on the bench's planted inputs (Gemma-3 shape 4/1/256, `block_index(q, k, --topk)`), efficiency
per computed tile = density x SDPA ms / ms.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from workbench_kernels.index_ref import member_union
from workbench_kernels.prefill_pair import attend_piece, causal, load_kv, wait_slot
from workbench_kernels.prefill_ws import softmax_step
from workbench_kernels.tiling import LOG2E

ROWS = 64  # query rows per CTA (one head's row block)
KEYS = 64  # keys per piece
tma_multicast = getattr(tma, "async_load", None)  # multicast=True: Triton >= 3.9 (None in 3.6: cluster kernels only)


@gluon.jit
def wait_piece(Union, Bits, at, i, bit, k_ready, v_ready, STAGES: gl.constexpr):
    """Step i of a union walk (lists of the item at offset `at` of Union / Bits): wait until its K and V tiles are in
    ring slot i % STAGES; returns (slot, the piece's first key, 1 where bit `bit` says this consumer computes it)."""
    start = gl.load(Union + at + i)
    mine = (gl.load(Bits + at + i) >> bit) & 1
    return wait_slot(i, k_ready, v_ready, STAGES), start, mine


@gluon.jit
def causal_softmax_step(sc, keys, pos, m_i, l_i, qk_scale):
    """`prefill_ws.softmax_step` on raw scores sc `[R, K]` of keys `[K]` for rows at query positions pos `[R]`, each
    row's later keys masked: (P in exp2 units, the rescale alpha, new row max, new row sum)."""
    return softmax_step(gl.where(causal(keys, pos), sc, float("-inf")), m_i, l_i, qk_scale)


@gluon.jit
def _cta_rank():
    """This CTA's rank in its cluster (0 without a cluster)."""
    return gl.inline_asm("mov.u32 $0, %cluster_ctarank;", "=r", [], gl.int32, is_pure=True)


@gluon.jit
def _loader(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, local_empty, shared_empty, Union, Count, Order, U, N,
            MI, KV_DIV, CLUSTER: gl.constexpr, STAGES: gl.constexpr):
    """Loads the union's K/V tiles of work item Order[program] into the ring (multicast with a cluster). Item
    (group, j): group = item // MI (b * Hq / CLUSTER + g), KV head group // KV_DIV."""
    item = gl.load(Order + gl.program_id(0))
    n = gl.load(Count + item)
    kv_row = (item // MI // KV_DIV) * N  # its KV head's first row in [B * Hkv * N, D] (TMA: int32)
    for i in range(n):
        s = i % STAGES
        if i >= STAGES:
            ph = (i // STAGES - 1) & 1
            if CLUSTER > 1:
                mbarrier.wait(local_empty.index(s), ph)
            mbarrier.wait(shared_empty.index(s), ph)
        row = kv_row + gl.load(Union + item * U + i) * 64
        if CLUSTER > 1:
            mbarrier.expect(k_ready.index(s), k_desc.nbytes_per_cta)
            tma_multicast(k_desc, [row, 0], k_ready.index(s), k_smem.index(s), multicast=True)
            mbarrier.expect(v_ready.index(s), v_desc.nbytes_per_cta)
            tma_multicast(v_desc, [row, 0], v_ready.index(s), v_smem.index(s), multicast=True)
        else:
            load_kv(k_desc, v_desc, row, k_smem.index(s), v_smem.index(s), k_ready.index(s), v_ready.index(s))


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, k_ready, v_ready, local_empty, shared_empty, Q, O, Union, Bits, Count, Order,
              U, N, MI, qk_scale, D: gl.constexpr, CLUSTER: gl.constexpr, STAGES: gl.constexpr,
              Q_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, OVERLAP: gl.constexpr):
    """CLUSTER heads' 64-row blocks (rows r of the cluster tile: head r // 64 of the group) over the union's pieces,
    each CTA computing its own head's; writes O."""
    item = gl.load(Order + gl.program_id(0))
    n = gl.load(Count + item)
    group = item // MI  # b * Hkv + kv head (CLUSTER 1: b * Hq + head)
    m = item % MI
    rank = _cta_rank()
    R: gl.constexpr = CLUSTER * 64
    # Q rows of the cluster tile: (group * CLUSTER + r // 64) heads, query rows m * 64 + r % 64
    qr = gl.arange(0, R, layout=gl.SliceLayout(1, Q_LAYOUT))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, Q_LAYOUT))
    q_rows = (group * CLUSTER + qr // 64).to(gl.int64) * N + m * 64 + qr % 64
    q_ok = gl.expand_dims(m * 64 + qr % 64 < N, 1)
    q = gl.load(Q + gl.expand_dims(q_rows * D, 1) + gl.expand_dims(qd, 0), mask=q_ok, other=0.0)
    q_smem.store(q)
    fence_async_shared()
    row_s: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    row_o: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    pos = m * 64 + gl.arange(0, R, layout=row_s) % 64  # query positions of the tile's rows
    lanes = gl.arange(0, 64, layout=gl.SliceLayout(0, S_LAYOUT))
    m_i = gl.full([R], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([R], gl.float32, row_s)
    acc = gl.zeros([R, D], gl.float32, O_LAYOUT)
    s0 = gl.zeros([R, 64], gl.float32, S_LAYOUT)
    if OVERLAP:
        # FA3's intra-warpgroup overlap over runs of this CTA's own pieces: at own piece i, Q K^T(i) is issued, then
        # P V of the pending own piece j, and the softmax of i runs while P V(j) is in flight; slot j is released
        # once P V(j) completes. A skipped piece first flushes the pending one (so a slot is never held across a
        # skip: the loader, walking the union in order, may need it).
        pend = -1  # union position of the pending own piece (its slot still held), else -1
        prob = gl.zeros([R, 64], gl.float32, S_LAYOUT).to(k_smem.dtype)
        alpha = l_i
        for i in range(n):
            s, piece, mine = wait_piece(Union, Bits, item * U, i, rank, k_ready, v_ready, STAGES)
            if mine != 0:
                sc = warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), s0, use_acc=False, is_async=True)
                if pend >= 0:  # P V of the pending piece runs beside this piece's softmax
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    acc = warpgroup_mma(gl.convert_layout(prob, p_layout), v_smem.index(pend % STAGES), acc,
                                        is_async=True)
                    scores = warpgroup_mma_wait(1, deps=(sc,))  # Q K^T done (groups retire in order), P V in flight
                    p32, alpha, m_i, l_i = causal_softmax_step(scores, piece + lanes, pos, m_i, l_i, qk_scale)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                else:
                    scores = warpgroup_mma_wait(0, deps=(sc,))
                    p32, alpha, m_i, l_i = causal_softmax_step(scores, piece + lanes, pos, m_i, l_i, qk_scale)
                prob = p32.to(k_smem.dtype)
                if pend >= 0:
                    if CLUSTER > 1:
                        mbarrier.arrive(local_empty.index(pend % STAGES))
                    mbarrier.arrive(shared_empty.index(pend % STAGES))
                pend = i
            else:
                if pend >= 0:
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                    acc = warpgroup_mma(gl.convert_layout(prob, p_layout), v_smem.index(pend % STAGES), acc,
                                        is_async=True)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    if CLUSTER > 1:
                        mbarrier.arrive(local_empty.index(pend % STAGES))
                    mbarrier.arrive(shared_empty.index(pend % STAGES))
                    pend = -1
                if CLUSTER > 1:
                    mbarrier.arrive(local_empty.index(s))
                mbarrier.arrive(shared_empty.index(s))
        if pend >= 0:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            acc = warpgroup_mma(gl.convert_layout(prob, p_layout), v_smem.index(pend % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if CLUSTER > 1:
                mbarrier.arrive(local_empty.index(pend % STAGES))
            mbarrier.arrive(shared_empty.index(pend % STAGES))
    else:
        for i in range(n):
            s, piece, mine = wait_piece(Union, Bits, item * U, i, rank, k_ready, v_ready, STAGES)
            if mine != 0:
                m_i, l_i, acc = attend_piece(q_smem, k_smem.index(s), v_smem.index(s), causal(piece + lanes, pos), m_i,
                                             l_i, acc, s0, qk_scale, O_LAYOUT)
            if CLUSTER > 1:
                mbarrier.arrive(local_empty.index(s))
            mbarrier.arrive(shared_empty.index(s))
    orow = gl.arange(0, R, layout=row_o)
    od = gl.arange(0, D, layout=gl.SliceLayout(0, O_LAYOUT))
    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    o_rows = (group * CLUSTER + orow // 64).to(gl.int64) * N + m * 64 + orow % 64
    ok = gl.expand_dims(m * 64 + orow % 64 < N, 1) & gl.expand_dims(od < D, 0)
    gl.store(O + gl.expand_dims(o_rows * D, 1) + gl.expand_dims(od, 0), out.to(O.dtype.element_ty), mask=ok)


@gluon.jit(do_not_specialize=["U", "N"])
def _cluster_kernel(k_desc, v_desc, Q, O, Union, Bits, Count, Order, U, N, MI, KV_DIV, qk_scale, D: gl.constexpr,
                    CLUSTER: gl.constexpr, STAGES: gl.constexpr, Q_SMEM: gl.constexpr, Q_LAYOUT: gl.constexpr,
                    S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, BAR: gl.constexpr, SHARED_BAR: gl.constexpr,
                    OVERLAP: gl.constexpr):
    q_smem = gl.allocate_shared_memory(k_desc.dtype, [CLUSTER * 64, D], Q_SMEM)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 64, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 64, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, CLUSTER], BAR)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, CLUSTER], BAR)
    local_empty = gl.allocate_shared_memory(gl.int64, [STAGES, CLUSTER], BAR)
    shared_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], SHARED_BAR)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(local_empty.index(i), count=1)
        mbarrier.init(shared_empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, k_ready, v_ready, local_empty, shared_empty, Q, O, Union, Bits, Count,
                     Order, U, N, MI, qk_scale, D, CLUSTER, STAGES, Q_LAYOUT, S_LAYOUT, O_LAYOUT, OVERLAP)),
        (_loader, (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, local_empty, shared_empty, Union, Count, Order,
                   U, N, MI, KV_DIV, CLUSTER, STAGES)),
    ], [1], [24])



def layouts(cluster: int, d: int) -> dict:
    """The kernel's layouts for a cluster of `cluster` CTAs (rows sharded by CTA; K / V tiles broadcast); without
    a cluster, plain layouts (any Triton with Gluon)."""
    bf16 = gl.bfloat16
    if cluster == 1:
        return {"Q_SMEM": gl.NVMMASharedLayout.get_default_for([64, d], bf16),
                "Q_LAYOUT": gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]),
                "S_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]),
                "O_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d, 16]),
                "BAR": mbarrier.MBarrierLayout(), "SHARED_BAR": mbarrier.MBarrierLayout(),
                "KV_SMEM": gl.NVMMASharedLayout.get_default_for([64, d], bf16)}
    bits = cluster.bit_length() - 1
    rows = [[1 << j, 0] for j in range(bits)]  # CTA j of the cluster holds rows [64 j, 64 j + 64)
    return {
        "Q_SMEM": gl.NVMMASharedLayout.get_default_for([cluster * 64, d], bf16, cga_layout=rows),
        "Q_LAYOUT": gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=rows),
        "S_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16],
                                              cga_layout=rows),
        "O_LAYOUT": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, d, 16],
                                              cga_layout=rows),
        "BAR": mbarrier.MBarrierLayout.multicta(cluster),
        "SHARED_BAR": mbarrier.MBarrierLayout(cga_layout=[[0] for _ in range(bits)]),
        "KV_SMEM": gl.NVMMASharedLayout.get_default_for([64, d], bf16, cga_layout=[[0, 0] for _ in range(bits)]),
    }


def union_index(bidx: torch.Tensor, cluster: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """`index_ref.member_union` per (b, KV-group of `cluster` heads, row block), items in that order, cut to the
    largest union U. bidx Int32 `[B, Hq, M, K]` ascending, -1 padded. Returns Union / Bits Int32 `[items, U]`, Count
    Int32 `[items]`, U."""
    B, H, M, K = bidx.shape
    lists = bidx.view(B, H // cluster, cluster, M, K).transpose(2, 3).reshape(-1, cluster, K)
    union, bits, count = member_union(lists, lists >= 0)
    U = int(count.max())
    return union[:, :U].contiguous(), bits[:, :U].contiguous(), count, U


def cluster_items(bidx: torch.Tensor, cluster: int) -> tuple[torch.Tensor, ...]:
    """`union_index` and the launch order (longest union first): (Union, Bits, Count, Order, U)."""
    union, bits, count, U = union_index(bidx, cluster)
    order = torch.argsort(count, descending=True, stable=True).to(torch.int32)
    return union, bits, count, order, U


def cluster_prefill(q, k, v, items, cluster: int, stages: int = 3, overlap: bool = False):
    """Block-sparse causal attention (per query head selections, as `cluster_items(bidx, cluster)` holds them) with
    K/V tiles multicast to `cluster` query heads of a KV head (cluster 1: each head loads its own). q `[B, Hq, N, D]`,
    k / v `[B, Hkv, N, D]` bf16, contiguous; cluster 1 or Hq / Hkv. Returns o `[B, Hq, N, D]`."""
    B, Hq, N, D = q.shape
    G = Hq // k.shape[1]
    if cluster not in (1, G):
        raise ValueError(f"cluster must be 1 or the group size {G}, got {cluster}")
    lay = layouts(cluster, D)
    k_desc = TensorDescriptor.from_tensor(k.view(-1, D), [64, D], lay["KV_SMEM"])
    v_desc = TensorDescriptor.from_tensor(v.view(-1, D), [64, D], lay["KV_SMEM"])
    union, bits, count, order, U = items
    o = torch.empty_like(q)
    _cluster_kernel[(order.numel(),)](
        k_desc, v_desc, q, o, union, bits, count, order, U, N, -(-N // 64), G // cluster, LOG2E / math.sqrt(D), D=D,
        CLUSTER=cluster, STAGES=stages, Q_SMEM=lay["Q_SMEM"], Q_LAYOUT=lay["Q_LAYOUT"], S_LAYOUT=lay["S_LAYOUT"],
        O_LAYOUT=lay["O_LAYOUT"], BAR=lay["BAR"], SHARED_BAR=lay["SHARED_BAR"], OVERLAP=overlap, num_warps=4,
        num_ctas=cluster)
    return o


def compile_only(cluster: int, d: int = 256, stages: int = 3, overlap: bool = False):
    """The kernel compiled for sm_90a on any machine (no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    lay = layouts(cluster, d)
    fn = _cluster_kernel
    desc = f"tensordesc<bf16[64, {d}],{lay['KV_SMEM']!r}>"
    constants = dict(D=d, STAGES=stages, Q_SMEM=lay["Q_SMEM"], Q_LAYOUT=lay["Q_LAYOUT"], S_LAYOUT=lay["S_LAYOUT"],
                     O_LAYOUT=lay["O_LAYOUT"], OVERLAP=overlap, CLUSTER=cluster, BAR=lay["BAR"],
                     SHARED_BAR=lay["SHARED_BAR"])
    types = {"k_desc": desc, "v_desc": desc, "Q": "*bf16", "O": "*bf16", "Union": "*i32", "Bits": "*i32",
             "Count": "*i32", "Order": "*i32", "qk_scale": "fp32"}
    signature = {a: "constexpr" if a in constants else types.get(a, "i32") for a in fn.arg_names}
    src = GluonASTSource(fn, signature, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_ctas": cluster})


@contextlib.contextmanager
def launch_order(name: str):
    """`prefill_pair`'s items in the launch order `name` (module docstring) while the block runs."""
    from workbench_kernels import prefill_pair

    real = prefill_pair.pair_items
    if name == "pair":
        yield
        return

    def reordered(tiles):
        items = real(tiles)
        if name == "pair/longest":
            return dataclasses.replace(items, order=torch.argsort(items.count, descending=True, stable=True).int())
        bh, mp = tiles.shape[0] * tiles.shape[1], -(-tiles.shape[2] // 2)
        heads = torch.arange(bh * mp, device=items.count.device, dtype=torch.int32).view(bh, mp).flip(1).t()
        return dataclasses.replace(items, order=heads.reshape(-1).contiguous())

    prefill_pair.pair_items = reordered
    try:
        yield
    finally:
        prefill_pair.pair_items = real


def _timed(fn, reps: int = 5) -> float:
    from workbench.core.timing import time_ms
    return time_ms(fn, cuda=True, min_reps=reps, max_reps=reps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="16384,65536,131072")
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--selection", choices=("per_head", "group_shared"), default="per_head",
                   help="per_head: each query head its own top-k; group_shared: one top-k per KV head "
                        "(`block_index(group_shared=True)`) given to all its query heads, so union = own: the loop "
                        "then runs its GQA-packed route on the KV head's tiles")
    p.add_argument("--variants", default="",
                   help="comma-separated subset of the timed rows (dense_sdpa, loop, cluster1, cluster4, "
                        "cluster1/overlap, cluster4/overlap, pair; pair_items / pair_items_ref: the pair route's "
                        "union alone, one launch / the torch reference, checked equal per length); given without "
                        "cluster rows, the check is skipped "
                        "and the probe runs on any Triton (the loop beside dense SDPA)")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--out", default="multicast_probe.json")
    a = p.parse_args()
    if a.compile_only:
        for c in (1, 4):
            for ov in (False, True):
                k = compile_only(c, stages=a.stages, overlap=ov)
                print(f"cluster {c} overlap {ov}: {k.metadata.shared} B of shared memory")
        return 0
    from workbench_benchmarks.kernels_prefill import planted_inputs
    from workbench_kernels.index_build import block_index
    from workbench_kernels.index_ref import pair_items_ref, selected_block_tiles
    from workbench_kernels.prefill import sparse_prefill
    from workbench_kernels.prefill_pair import pair_items, pair_prefill

    from workbench.core.timing import environment

    t0 = time.time()
    env = environment()
    env["command"] = "python3 scripts/multicast_probe.py " + " ".join(sys.argv[1:])
    out = {"environment": env, "check": {}, "rows": []}
    hq, hkv, d, theta = 4, 1, 256, 1e6  # Gemma-3-270M's global layers
    q, k, v = planted_inputs(hq, hkv, d, 4096, theta)
    bidx = block_index(q, k, 16)
    ref = sparse_prefill(q, k, v, selected_block_tiles(bidx), warp_specialize=False)[0]
    G = hq // hkv
    kernels = {"cluster1": (1, False), f"cluster{G}": (G, False), "cluster1/overlap": (1, True),
               f"cluster{G}/overlap": (G, True), "pair": (0, False), "pair/heads": (0, False),
               "pair/longest": (0, False)}
    wanted = [v for v in a.variants.split(",") if v] or ["dense_sdpa", "loop", *kernels]

    def launch(name, q, k, v, items):
        c, ov = kernels[name]
        if c == 0:  # the library's row-block pairs (`prefill_pair`), on the per-head tiles, in a launch order
            with launch_order(name):
                return pair_prefill(q, k, v, items[0])[0]
        return cluster_prefill(q, k, v, items[c], c, a.stages, ov)

    def items_of(bidx):
        return {c: selected_block_tiles(bidx) if c == 0 else cluster_items(bidx, c)
                for c in {kernels[w][0] for w in wanted if w in kernels}}

    items = items_of(bidx)
    for name in [w for w in wanted if w in kernels]:
        o = launch(name, q, k, v, items)
        torch.cuda.synchronize()
        out["check"][name] = float((o.float() - ref.float()).abs().max())
        print(f"check {name}: max |o - loop| = {out['check'][name]:.4f}", flush=True)
    if any(not e < 0.05 for e in out["check"].values()):
        print("check failed: no timings", flush=True)
        json.dump(out, open(a.out, "w"), indent=1)
        return 1
    for n in [int(x) for x in a.lengths.split(",")]:
        q, k, v = planted_inputs(hq, hkv, d, n, theta)
        if a.selection == "group_shared":
            shared = block_index(q, k, a.topk, group_shared=True)
            bidx, tiles = shared.repeat_interleave(G, 1).contiguous(), selected_block_tiles(shared)
        else:
            bidx = block_index(q, k, a.topk)
            tiles = selected_block_tiles(bidx)
        M = -(-n // 64)
        own = int((bidx >= 0).sum())
        items = items_of(bidx)
        density = own / (hq * M * (M + 1) / 2)
        kx, vx = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        fns = {"dense_sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True),
               "loop": lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False),
               **{name: functools.partial(launch, name, q, k, v, items) for name in kernels},
               "pair_items": lambda: pair_items(tiles), "pair_items_ref": lambda: pair_items_ref(tiles)}
        fns = {name: f for name, f in fns.items() if name in wanted}
        for f in fns.values():
            f()
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        for r in range(a.rounds):  # each round starts one row later: no row always follows the same one
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(_timed(fns[name]))
        ms = {name: statistics.median(t) for name, t in times.items()}
        if "pair_items" in wanted:  # the one-launch union against its reference: every field equal
            got, want = pair_items(tiles), pair_items_ref(tiles)
            live = torch.arange(got.union.shape[1], device=got.count.device) < got.count[:, None]
            out["check"][f"pair_items_equal_{n}"] = bool(
                torch.equal(got.count, want.count) and torch.equal(got.order, want.order)
                and torch.equal(got.union[live], want.union[live]) and torch.equal(got.bits[live], want.bits[live]))
            print(f"pair_items == pair_items_ref at {n}: {out['check'][f'pair_items_equal_{n}']}", flush=True)
        row = {"n": n, "topk": a.topk, "selection": a.selection, "stages": a.stages, "density": density,
               "union_over_own": {c: int(it[2].sum()) * c / own for c, it in items.items() if c},
               "pair_union_over_own": float(pair_items(tiles).count.sum()) * 2 / own,
               "ms": ms, "rounds": times,
               "eff_per_tile": {name: density * ms["dense_sdpa"] / t for name, t in ms.items()
                                if name not in ("dense_sdpa", "pair_items", "pair_items_ref")}}
        out["rows"].append(row)
        print(json.dumps({k2: row[k2] for k2 in ("n", "density", "union_over_own", "ms", "eff_per_tile")}), flush=True)
        json.dump(out, open(a.out, "w"), indent=1)
    out["elapsed_s"] = time.time() - t0
    json.dump(out, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
