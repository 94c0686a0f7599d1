"""Where a `vs_group` layer at Gemma-3's shape (4 query heads on 1 KV head, head_dim 256, n = 190) spends its first
call on the GPU, per dtype and tile route: the Triton index, then the prefill kernel GQA-packed (the group's four
heads in one 128-row program) or expanded per head (`index_ref.expand_groups`). Each case runs in its own process
under a time limit, so a compile that does not finish is reported as such and the others still run. fp32 dots
compile as TRITON_F32_DEFAULT says (unset: TF32; the tests set "ieee", whose fp32 programs took ~100 s a compile
on the H200's host against ~2-10 s: set it to time what the GPU lane compiles).

    python scripts/compile_probe.py --out $OUT/compile_probe.json [--limit 300]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CASES = {  # name: (dtype, route, num_stages or None for the library's step-down from 3)
    "fp32_packed": ("float32", "packed", None),
    "fp32_packed_1stage": ("float32", "packed", 1),
    "fp32_per_head": ("float32", "per_head", None),
    "bf16_packed": ("bfloat16", "packed", None),
}


def one_case(name: str) -> None:
    """Run one case, printing one JSON line per finished step (seconds since the start)."""
    import torch
    from workbench_kernels import prefill
    from workbench_kernels.index_ref import expand_groups

    from workbench.config import HeadConfig, HeadEntry
    from workbench.core.model import ModelShape
    from workbench.prefill.sparse import SparsePrefill

    dtype, route, stages = CASES[name]
    t0 = time.perf_counter()

    def step(what: str, **extra) -> None:
        torch.cuda.synchronize()
        print(json.dumps({"case": name, "step": what, "s": round(time.perf_counter() - t0, 2), **extra}), flush=True)

    hq, hkv, d, n = 4, 1, 256, 190
    shape = ModelShape("toy", "llama", 1, hq, hkv, d, 64, "default", 10000.0, 4096, "toy")
    config = HeadConfig(model=shape.to_dict(), heads=[HeadEntry(0, h, "vs_group", {"vertical": 10, "slash": 16})
                                                      for h in range(hq)])
    config.proxy.update(sink=2, local=3)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, d, generator=g).to("cuda", getattr(torch, dtype)) for h in (hq, hkv, hkv))
    sp = SparsePrefill(None, shape, config, min_length=0)
    for i in range(2):
        index = sp.layer_index(0, q, k, 0.25, "triton")
        step(f"index_{i}")
    tiles = index[0]
    if route == "per_head":
        tiles = expand_groups(tiles, hq // tiles.shape[1])
    else:
        prefill.PACKED_Q_BYTES = 1 << 40  # pack whatever the tile size (the route before the limit)
    for i in range(2):
        o, _ = prefill.sparse_prefill(q, k, v, tiles, scale=0.25, num_stages=stages)
        step(f"kernel_{i}", tiles_heads=int(tiles.shape[1]))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                           scale=0.25, enable_gqa=True)
    step("done", finite=bool(o.isfinite().all()), max_abs_vs_dense=float((o.double() - ref).abs().max()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(CASES), help="run one case in this process")
    p.add_argument("--out", default="compile_probe.json")
    p.add_argument("--limit", type=float, default=300.0, help="seconds per case")
    args = p.parse_args()
    if args.case:
        one_case(args.case)
        return 0
    procs = {name: subprocess.Popen([sys.executable, __file__, "--case", name], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for name in CASES}
    result = {"command": " ".join(sys.argv), "limit_s": args.limit, "cases": {}}
    start = time.time()
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, args.limit - (time.time() - start)))
            status = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            status = f"stopped at {args.limit:.0f} s"
        steps = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        result["cases"][name] = {"status": status, "steps": steps, "log_tail": out[-1500:]}
        print(name, status, steps, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
