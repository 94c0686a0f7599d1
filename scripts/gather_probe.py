"""Exploratory (H200): the UVA gather's rate per store dtype at engine-sized launches, and an INT4 kernel that
moves the codes and scales without unpacking them (is the unpacking or the loading the bound?)."""
import json
import sys

import torch
import triton
import triton.language as tl
from workbench_kernels.gather import gather_blocks

from workbench.core.timing import time_ms


@triton.jit
def _raw_kernel(SrcK, SrcV, DstK, DstV, ScK, ScV, DsK, DsV, SrcIdx, DstIdx, Count, NCTA,
                B: tl.constexpr, SB: tl.constexpr):
    """Move B bytes of codes and SB scale elements per block, untouched."""
    pid = tl.program_id(0)
    n = tl.load(Count)
    o = tl.arange(0, B)
    so = tl.arange(0, SB)
    for i in range(pid, n, NCTA):
        d = tl.load(DstIdx + i).to(tl.int64)
        s = tl.load(SrcIdx + i).to(tl.int64)
        k = tl.load(SrcK + s * B + o)
        v = tl.load(SrcV + s * B + o)
        sk = tl.load(ScK + s * SB + so)
        sv = tl.load(ScV + s * SB + so)
        tl.store(DstK + d * B + o, k)
        tl.store(DstV + d * B + o, v)
        tl.store(DsK + d * SB + so, sk)
        tl.store(DsV + d * SB + so, sv)


def timed(fn, reps=20):
    """Median ms of `reps` calls after 3 warm-up calls, CUDA events (`workbench.core.timing.time_ms`)."""
    return time_ms(fn, cuda=True, warmup=3, min_reps=reps, max_reps=reps)


S, E, CACHE = 16 * 8 * 2048, 64 * 128, 16 * 8 * 104
out = {}
dev = "cuda"
g = torch.Generator(device="cpu").manual_seed(0)
for store in sys.argv[1].split(","):
    if store == "bf16":
        src = [torch.empty(S, E, dtype=torch.bfloat16, pin_memory=True) for _ in range(2)]
        sc = [None, None]
        nbytes = E * 2
    elif store == "fp8":
        src = [torch.empty(S, E, dtype=torch.float8_e4m3fn, pin_memory=True) for _ in range(2)]
        sc = [torch.ones(S, 64, dtype=torch.float32).pin_memory() for _ in range(2)]
        nbytes = E + 64 * 4
    else:
        src = [torch.randint(0, 255, (S, E // 2), dtype=torch.uint8).pin_memory() for _ in range(2)]
        sc = [torch.ones(S, E // 32, dtype=torch.float16).pin_memory() for _ in range(2)]
        nbytes = E // 2 + E // 32 * 2
    dst = [torch.empty(CACHE * 4, E, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    for m in (1792, 8192):
        srci = torch.randperm(S, generator=g)[:m].to(torch.int32).to(dev)
        dsti = torch.randperm(CACHE * 4, generator=g)[:m].to(torch.int32).to(dev)
        cnt = torch.tensor([m], dtype=torch.int32, device=dev)
        for ctas in (32, 64, 128):
            ms = timed(lambda: gather_blocks(src[0], src[1], dst[0], dst[1], srci, dsti, cnt, ctas, sc[0], sc[1]))
            out[f"{store}/{m}/{ctas}"] = {"ms": ms, "gbps": 2 * m * nbytes / ms / 1e6}
            print(store, m, ctas, f"{ms:.3f} ms {2 * m * nbytes / ms / 1e6:.1f} GB/s", flush=True)
            if store == "int4":
                rk = [torch.empty(CACHE * 4, E // 2, dtype=torch.uint8, device=dev) for _ in range(2)]
                rs = [torch.empty(CACHE * 4, E // 32, dtype=torch.float16, device=dev) for _ in range(2)]
                for nw in (4, 8):
                    ms = timed(lambda: _raw_kernel[(ctas,)](src[0], src[1], rk[0], rk[1], sc[0], sc[1], rs[0], rs[1],
                                                             srci, dsti, cnt, ctas, B=E // 2, SB=E // 32, num_warps=nw))
                    out[f"int4-raw-w{nw}/{m}/{ctas}"] = {"ms": ms, "gbps": 2 * m * nbytes / ms / 1e6}
                    print("int4 raw", nw, m, ctas, f"{ms:.3f} ms {2 * m * nbytes / ms / 1e6:.1f} GB/s", flush=True)
a = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
b = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
ms = timed(lambda: b.copy_(a, non_blocking=True), 5)
out["pinned_memcpy_gbps"] = (1 << 30) / ms / 1e6
print("memcpy", out["pinned_memcpy_gbps"])
json.dump(out, open(sys.argv[2], "w"), indent=1)
