"""Exploratory (H200, issue 25): one launch each of the sparse prefill kernels inside a cudaProfilerStart / Stop
window, for Nsight Compute to read their counters side by side:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --csv --page details python scripts/ncu_prefill.py 65536

Planted inputs at the Llama-3-8B shape (the bench's); in order: Vertical-Slash(1000, 6096) through the Gluon kernel
(`ws_vertical_slash`, packed beforehand) and through the Triton loop (`sparse_prefill(warp_specialize=False)` on
`vs_tiles`), block-sparse top-100 per head through both. Prints the physical densities first.

`python scripts/ncu_prefill.py 65536 keys128` instead: the per-head 128-key Gluon layout (2 K + 1 V stages, no
intra-warpgroup overlap) on Vertical-Slash (`ws_vertical_slash(width=128)`) and on dense causal tiles of the same
kernel (`ws_ashape` without sinks or band), then the 64-key Gluon Vertical-Slash: why 128 keys gain 9 % on dense tiles
and nothing on Vertical-Slash (kernels/NOTES.md, session 13).

`python scripts/ncu_prefill.py 65536 gemma`: at Gemma-3-270M's shape (4 / 1 heads, head_dim 256) dense SDPA, then the
Triton loop on per-head Vertical-Slash, per-head block-sparse and group-shared Vertical-Slash (GQA-packed): what
holds the head_dim-256 loop under dense SDPA (kernels/NOTES.md, session 27).

`python scripts/ncu_prefill.py 65536 vs512`: at the Llama shape dense SDPA, then the deployed Gluon route
(`sparse_prefill`, per-head tiles) on Vertical-Slash (1000, 512) with columns per head and on block-sparse top-100:
why VS(1000, 512) reads 10-15 % below block-sparse per tile (kernels/NOTES.md, session 43)."""
import sys

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import block_index, vs_index, vs_tiles
from workbench_kernels.index_ref import selected_block_tiles, tile_area
from workbench_kernels.prefill import sparse_prefill
from workbench_kernels.prefill_ws import pack_vertical_slash, ws_ashape, ws_prefill, ws_vertical_slash
from workbench_kernels.tiling import NO_WINDOW

n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
mode = sys.argv[2] if len(sys.argv) > 2 else ""
hq, hkv, d, theta = SHAPES["gemma3-270m" if mode == "gemma" else "llama3-8b"]
q, k, v = planted_inputs(hq, hkv, d, n, theta)
cols, offs = vs_index(q, k, 1.0 / d ** 0.5, 1000, min(6096, n))
tiles = vs_tiles(cols, offs, n)
block = selected_block_tiles(block_index(q, k, 100))
pairs = hq * n * (n + 1) // 2
print("vs density", tile_area(tiles, n).sum().item() / pairs,
      "block density", tile_area(block, n).sum().item() / pairs, flush=True)
packed = pack_vertical_slash(k, v, cols, offs, hq) if mode in ("", "keys128") else None
if packed is not None:
    print("ws area", ((packed[0].block_count.long() + (packed[1][2].long() + 63) // 64) * 64 * 64).sum().item() / pairs)
runs = [lambda: ws_vertical_slash(q, k, v, cols, offs, packed=packed),
        lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False),
        lambda: ws_prefill(q, k, v, block),
        lambda: sparse_prefill(q, k, v, block, warp_specialize=False)]
if mode == "gemma":
    group = vs_tiles(*vs_index(q, k, 1.0 / d ** 0.5, 1000, min(6096, n), group_shared=True), n)
    runs = [lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            lambda: sparse_prefill(q, k, v, tiles), lambda: sparse_prefill(q, k, v, block),
            lambda: sparse_prefill(q, k, v, group)]
if mode == "vs512":
    small = vs_tiles(*vs_index(q, k, 1.0 / d ** 0.5, 1000, 512), n, 64, 0, head_columns=True)
    print("vs512 density", tile_area(small, n).sum().item() / pairs, flush=True)
    runs = [lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            lambda: sparse_prefill(q, k, v, small), lambda: sparse_prefill(q, k, v, block)]
if mode == "keys128":
    per_head128 = {"stages": 2, "v_stages": 1, "overlap": False, "width": 128}
    packed128 = pack_vertical_slash(k, v, cols, offs, hq, width=128)
    runs = [lambda: ws_vertical_slash(q, k, v, cols, offs, packed=packed128, **per_head128),
            lambda: ws_ashape(q, k, v, [0] * hq, [NO_WINDOW] * hq, **per_head128),
            lambda: ws_vertical_slash(q, k, v, cols, offs, packed=packed)]
for run in runs:  # compile and warm outside the window
    run()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for run in runs:
    run()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
