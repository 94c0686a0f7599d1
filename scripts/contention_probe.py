"""Exploratory (H200, issue 26): does a UVA gather running beside decode slow the decode kernels down, and how much
by the gather's programs, warps and rows per step?

Also (`--configs raw/C:W:0`, `tma/C:W:0`, `batch/N:0:0`, N blocks a call, 0: all) the codes alone moved with SM
loads, TMA bulk loads or one `cuMemcpyBatchAsync` of the scattered blocks on the copy engines; `--dma N:T,...`
first times that batch copy's own rate and host cost (N blocks from T host threads, no decode; `--splits ""` then
skips the decode runs).

Sparse-resident decode (random-weight Llama-3-8B shape, `--layers` layers, synthetic KV at `--context`, the bench's
ImposedReuse hook, one CUDA graph per step) is timed alone, then while a high-priority side stream (as the engine's)
runs the gather kernel over a long list of scattered blocks of a pinned INT8-key / INT4-value store, and while the
copy engine runs a plain pinned memcpy (no SMs). Ratios are measured side by side in one process; prints and
writes JSON.

    python scripts/contention_probe.py --out contention.json [--batch 16] [--context 131072]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl
from workbench_benchmarks.decode import PAPER_BUDGET, environment, fill_store
from workbench_benchmarks.shapes import random_llama
from workbench_kernels import gather as gk

from workbench.core.io import write_json
from workbench.decode.engine.decoder import STORE_DTYPES, DecodeEngine, EngineConfig
from workbench.decode.engine.reuse import ImposedReuse
from workbench.decode.engine.store import BLOCK, BlockStore, StoreSpec


def launch_gather(store: BlockStore, dk, dv, src_idx, dst_idx, count, ctas: int, warps: int, rows_k: int) -> None:
    """`gather.gather_blocks` for an INT8-key / INT4-value store, with the warps and K rows per step given (V rows
    per step scaled alike) instead of 4 warps and 8K elements per step."""
    width_k, width_v = (BLOCK * p.codes for p in store.spec.parts)
    blocks = store.k[0].numel() // width_k
    sk, sv = store.sk[0].view(blocks, -1), store.sv[0].view(blocks, -1)
    lk = gk._part_layout(store.k[0].view(-1, width_k), dk, sk, "k")
    lv = gk._part_layout(store.v[0].view(-1, width_v), dv, sv, "v")
    lv["RB"] = lv["R"] * rows_k // lk["R"]
    lk["RB"] = rows_k
    gk._gather_blocks_kernel[(ctas,)](
        store.k[0].view(-1, width_k), store.v[0].view(-1, width_v), dk, dv, src_idx, dst_idx, count, sk, sv, ctas,
        **{f"{key}_K": x for key, x in lk.items()}, **{f"{key}_V": x for key, x in lv.items()},
        STEPS=lk["R"] // rows_k, CH=32, num_warps=warps)


@triton.jit
def _raw_copy_kernel(SrcK, SrcV, DstK, DstV, SrcIdx, DstIdx, Count, NCTA, R: tl.constexpr, WK: tl.constexpr,
                     WV: tl.constexpr, TMA: tl.constexpr, S_ROWS):
    """Move the K and V codes of the listed blocks (R rows of WK / WV bytes) untouched, with SM loads or (TMA) with
    tensor-descriptor bulk loads from the pinned store: which of the two does the decode feel?"""
    pid = tl.program_id(0)
    n = tl.load(Count)
    rows = tl.arange(0, R)
    if TMA:
        kd = tl.make_tensor_descriptor(SrcK, shape=[S_ROWS, WK], strides=[WK, 1], block_shape=[R, WK])
        vd = tl.make_tensor_descriptor(SrcV, shape=[S_ROWS, WV], strides=[WV, 1], block_shape=[R, WV])
    for i in tl.range(pid, n, NCTA, num_stages=3):
        s = tl.load(SrcIdx + i).to(tl.int64)
        d = tl.load(DstIdx + i).to(tl.int64)
        if TMA:
            k = kd.load([(s * R).to(tl.int32), 0])
            v = vd.load([(s * R).to(tl.int32), 0])
        else:
            k = tl.load(SrcK + s * R * WK + rows[:, None] * WK + tl.arange(0, WK)[None, :])
            v = tl.load(SrcV + s * R * WV + rows[:, None] * WV + tl.arange(0, WV)[None, :])
        tl.store(DstK + d * R * WK + rows[:, None] * WK + tl.arange(0, WK)[None, :], k)
        tl.store(DstV + d * R * WV + rows[:, None] * WV + tl.arange(0, WV)[None, :], v)


def launch_raw(store: BlockStore, dk, dv, src_idx, dst_idx, count, ctas: int, warps: int, tma: bool) -> None:
    """`_raw_copy_kernel` over the int8k-int4v store's codes (no scales, no dequantisation)."""
    k, v = store.k[0].view(torch.uint8), store.v[0].view(torch.uint8)
    wk, wv = k.numel() // (store.spec.layer_rows), v.numel() // (store.spec.layer_rows)
    _raw_copy_kernel[(ctas,)](k, v, dk.view(torch.uint8), dv.view(torch.uint8), src_idx, dst_idx, count, ctas,
                              R=BLOCK, WK=wk, WV=wv, TMA=tma, S_ROWS=store.spec.layer_rows, num_warps=warps)


def batch_copier(store: BlockStore, dk, dv, src_idx, dst_idx, m: int):
    """A `cuMemcpyBatchAsync` (CUDA 12.8+ driver API, through ctypes) of the m listed blocks' K and V codes (2m
    copies of 8 KB / 4 KB, copy engines, flag PREFER_OVERLAP_WITH_COMPUTE) -> (launch on the current stream, host
    seconds of the last call)."""
    import ctypes
    import struct
    import time

    import numpy as np

    cuda = ctypes.CDLL("libcuda.so.1")
    v2 = hasattr(cuda, "cuMemcpyBatchAsync_v2")
    fn = cuda.cuMemcpyBatchAsync_v2 if v2 else cuda.cuMemcpyBatchAsync
    fn.restype = ctypes.c_int
    k, v = store.k[0].view(torch.uint8), store.v[0].view(torch.uint8)
    bk, bv = k.numel() // (store.spec.layer_rows // BLOCK), v.numel() // (store.spec.layer_rows // BLOCK)
    s, d = src_idx.cpu().numpy().astype(np.uint64), dst_idx.cpu().numpy().astype(np.uint64)
    srcs = np.concatenate([k.data_ptr() + s * bk, v.data_ptr() + s * bv]).astype(np.uint64)
    dsts = np.concatenate([dk.data_ptr() + d * bk, dv.data_ptr() + d * bv]).astype(np.uint64)
    sizes = np.concatenate([np.full(m, bk), np.full(m, bv)]).astype(np.uint64)
    attrs = ctypes.create_string_buffer(struct.pack("iiiiiI", 1, 0, 0, 0, 0, 1))  # stream order; overlap with compute
    idxs = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)
    host = [0.0]

    def launch() -> None:
        t0 = time.perf_counter()
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        args = [dsts.ctypes.data_as(ctypes.c_void_p), srcs.ctypes.data_as(ctypes.c_void_p),
                sizes.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(2 * m), attrs, idxs, ctypes.c_size_t(1)]
        rc = fn(*args, stream) if v2 else fn(*args, ctypes.byref(fail), stream)
        host[0] = time.perf_counter() - t0
        if rc:
            raise RuntimeError(f"cuMemcpyBatchAsync{'_v2' if v2 else ''} returned {rc}")

    return launch, host


def dma_rate(store: BlockStore, dk, dv, src_idx, dst_idx, m: int, threads: int) -> dict:
    """The copy engines' own rate for m scattered blocks' codes: `batch_copier` calls for m / threads blocks each,
    from `threads` host threads on their own streams, submitted while a sleep kernel holds the GPU (events time the
    copies only), and the host wall time of the submissions."""
    import threading
    import time

    src, dst = src_idx[:m].cpu(), dst_idx[:m].cpu()
    parts = [batch_copier(store, dk, dv, src[i::threads], dst[i::threads], len(range(i, m, threads)))[0]
             for i in range(threads)]
    streams = [torch.cuda.Stream() for _ in range(threads)]
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(threads)]
    torch.cuda._sleep(int(4e8))  # ~0.2 s at 1.98 GHz: every submission lands before the copies may start
    start.record()
    for st in streams:
        st.wait_event(start)

    def submit(i: int) -> None:
        torch.cuda.set_device(0)  # binds the primary context to this thread (the driver call needs one)
        with torch.cuda.stream(streams[i]):
            parts[i]()
            ends[i].record()

    workers = [threading.Thread(target=submit, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    ms = max(start.elapsed_time(e) for e in ends)
    moved = m * BLOCK * sum(p.codes for p in store.spec.parts)
    return {"blocks": m, "threads": threads, "copy_engine_gbps": moved / ms / 1e6, "copy_ms": ms,
            "host_ms": host * 1e3, "host_us_per_copy": host * 1e6 / (2 * m)}


def timed_steps(eng: DecodeEngine, tok: torch.Tensor, steps: int, side=None, main=None) -> float:
    """ms per graph-replayed decode step over `steps` replays (events on the main stream, or on `main`: a green
    context's stream); `side()` enqueues the concurrent work on its own stream first."""
    if side is not None:
        side()
    stream = main or torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            eng._graph_step(tok)
        b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / steps


def green_runs(a, eng, tok, alone, budget_ms, store, dk, dv, src_idx, dst_idx, count, m, block_bytes) -> list:
    """The decode graph replayed in a green context of (SMs - k) SMs, alone and beside the gather in a green context
    of k SMs (k from --green, k or 2k programs): SM partitions instead of sharing SMs."""
    out = []
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError as e:
        return [{"error": repr(e)}]
    total = torch.cuda.get_device_properties(0).multi_processor_count
    for k in [int(x) for x in a.green.split(",") if x]:
        try:
            side_gc, main_gc = (GreenContext.create(num_sms=x, device_id=0) for x in (k, total - k))
            side, main = side_gc.Stream(), main_gc.Stream()
            mine = median([timed_steps(eng, tok, a.steps, main=main) for _ in range(3)])
            row = {"sms_gather": k, "sms_decode": total - k, "decode_alone_ms_per_step": mine,
                   "ratio_to_full_gpu_alone": alone / mine, "beside": []}
            for ctas in (k, 2 * k):
                run = lambda: launch_gather(store, dk, dv, src_idx, dst_idx, count, ctas, 4, 64)  # noqa: E731, B023
                gather_ms, ms = beside(eng, tok, a.steps, budget_ms, run, side, main)
                row["beside"].append({"ctas": ctas, "gbps_alone_in_green": m * block_bytes / gather_ms / 1e6,
                                      "ms_per_step": ms, "ratio_to_full_gpu_alone": alone / ms})
            out.append(row)
        except Exception as e:  # noqa: BLE001 - an experiment: record what failed and go on
            out.append({"sms_gather": k, "error": repr(e)[:400]})
        print(json.dumps(out[-1]), flush=True)
    return out


def beside(eng: DecodeEngine, tok: torch.Tensor, steps: int, budget_ms: float, run, stream, main=None
           ) -> tuple[float, float]:
    """(ms per call of the transfer `run` alone on `stream`, decode ms per step while `stream` repeats it for
    `budget_ms`); `main`: the decode's stream (a green context's), default the current one."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
        ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev[0].record()
        for _ in range(3):
            run()
        ev[1].record()
    torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1]) / 3
    reps = math.ceil(budget_ms / ms) + 1

    def repeat() -> None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(reps):
                run()

    return ms, median([timed_steps(eng, tok, steps, repeat, main) for _ in range(3)])


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reuse", type=float, default=0.79)
    p.add_argument("--configs", default="16:4:64,32:4:64,48:4:64,64:4:64,32:1:64,32:2:64,32:8:64,32:4:16,48:2:32,"
                                        "48:1:16")
    p.add_argument("--splits", default="0,2", help="decode splits multipliers of the default (0: default only; "
                                                    "empty: no decode runs)")
    p.add_argument("--dma", default="", help="blocks:threads,... : `dma_rate` of the batch copy first (no decode)")
    p.add_argument("--green", default="8,16", help="SMs of a green context for the gather (the decode gets the rest)")
    a = p.parse_args()
    result = {"what": f"sparse-resident decode (RANDOM-WEIGHT Llama-3-8B shape, {a.layers} layers, synthetic KV, "
                      f"ImposedReuse {a.reuse}) alone vs beside a continuous int8k-int4v UVA gather / pinned memcpy",
              "environment": environment(), "batch": a.batch, "context": a.context, "runs": []}
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))  # descriptors
    model, shape = random_llama(a.layers, max_positions=a.context + 4096)
    max_tokens = a.context + 2048  # every timed replay advances the positions
    hook = ImposedReuse(PAPER_BUDGET, a.reuse, -(-max_tokens // BLOCK))
    blocks = 65536
    spec = StoreSpec(1, 1, shape.n_kv_heads, blocks // shape.n_kv_heads, shape.head_dim, torch.bfloat16,
                     STORE_DTYPES["int8k-int4v"])
    store = BlockStore(spec)
    fill_store(store)
    m = 8192
    E = BLOCK * shape.head_dim
    dk = torch.empty(m, E, dtype=torch.bfloat16, device="cuda")
    dv = torch.empty_like(dk)
    g = torch.Generator(device="cpu").manual_seed(0)
    src_idx = torch.randperm(blocks, generator=g)[:m].to(torch.int32).cuda()
    dst_idx = torch.arange(m, dtype=torch.int32, device="cuda")
    count = torch.tensor([m], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream(priority=-1)
    raw = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    raw_dst = torch.empty_like(raw, device="cuda")
    lengths = [a.context - (i * 997) % 4096 for i in range(a.batch)]
    result["dma"] = []
    for c in filter(None, a.dma.split(",")):
        m_dma, threads = (int(x) for x in c.split(":"))
        result["dma"].append(dma_rate(store, dk, dv, src_idx, dst_idx, m_dma, threads))
        print(json.dumps(result["dma"][-1]), flush=True)
    write_json(a.out, result)
    for mult in [int(x) for x in a.splits.split(",") if x]:
        from workbench_kernels.decode import default_splits
        splits = None if mult == 0 else default_splits(a.batch, shape.n_kv_heads, PAPER_BUDGET.total) * mult
        cfg = EngineConfig(mode="sparse-resident", budget=PAPER_BUDGET, selector="same-layer", splits=splits)
        eng = DecodeEngine(model, cfg, batch=a.batch, max_tokens=max_tokens, select_hook=hook)
        eng.fill_synthetic(lengths, fill_host=False)
        tok = torch.randint(0, 1000, (a.batch,), device="cuda")
        eng.run(tok, 3, graph=True, progress=False)  # compiles, captures
        alone = median([timed_steps(eng, tok, a.steps) for _ in range(3)])
        budget_ms = alone * a.steps * 1.3
        row = {"splits": splits, "alone_ms_per_step": alone, "alone_tok_s": a.batch * 1e3 / alone, "beside": []}
        print(json.dumps({k: v for k, v in row.items() if k != "beside"}), flush=True)

        memcpy_ms, ms = beside(eng, tok, a.steps, budget_ms, lambda: raw_dst.copy_(raw, non_blocking=True), side)
        row["beside"].append({"what": "pinned memcpy (copy engine)", "gbps_alone": raw.numel() / memcpy_ms / 1e6,
                              "ms_per_step": ms, "ratio_to_alone": alone / ms})
        print(json.dumps(row["beside"][-1]), flush=True)
        for c in a.configs.split(","):
            kind, c = c.split("/") if "/" in c else ("gather", c)
            ctas, warps, rows_k = (int(x) for x in c.split(":"))
            host = None
            if kind == "gather":
                run = lambda: launch_gather(store, dk, dv, src_idx, dst_idx, count, ctas, warps, rows_k)  # noqa: E731
            elif kind == "batch":  # the codes only, on the copy engines
                run, host = batch_copier(store, dk, dv, src_idx[: ctas or m], dst_idx[: ctas or m], ctas or m)
            else:  # raw / tma: the codes only
                run = lambda: launch_raw(store, dk, dv, src_idx, dst_idx, count, ctas, warps, kind == "tma")  # noqa: E731
            try:
                with torch.cuda.stream(side):  # not the legacy default stream, which the batch copy refuses
                    run()
                torch.cuda.synchronize()
                if kind != "gather":  # the first listed block arrived intact
                    d, src = int(dst_idx[0]), int(src_idx[0])
                    got = dk.view(torch.uint8).view(-1)[d * BLOCK * 128:(d + 1) * BLOCK * 128]
                    want = store.k[0].view(torch.uint8).view(-1, BLOCK * 128)[src]
                    assert torch.equal(got.cpu(), want), f"{kind} moved wrong bytes"
            except Exception as e:  # noqa: BLE001 - an experiment: record what failed and go on
                row["beside"].append({"what": kind, "ctas": ctas, "warps": warps, "error": repr(e)[:400]})
                print(json.dumps(row["beside"][-1]), flush=True)
                continue
            gather_ms, ms = beside(eng, tok, a.steps, budget_ms, run, side)
            blocks = (ctas or m) if kind == "batch" else m
            moved = m * spec.block_bytes if kind == "gather" else blocks * BLOCK * sum(p.codes for p in spec.parts)
            row["beside"].append({"what": kind, "ctas": ctas, "warps": warps, "rows_k_per_step": rows_k,
                                  "gbps_alone": moved / gather_ms / 1e6, "ms_per_step": ms,
                                  "ratio_to_alone": alone / ms, "host_ms_per_call": host and host[0] * 1e3})
            print(json.dumps(row["beside"][-1]), flush=True)
        if mult == 0:
            row["green"] = green_runs(a, eng, tok, alone, budget_ms, store, dk, dv, src_idx, dst_idx, count, m,
                                      spec.block_bytes)
        result["runs"].append(row)
        write_json(a.out, result)
        eng.close()
        del eng
        torch.cuda.empty_cache()
    result["triton"] = triton.__version__
    write_json(a.out, result)


if __name__ == "__main__":
    main()
