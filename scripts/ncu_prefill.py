"""Exploratory (H200, issue 25): one launch each of the sparse prefill kernels inside a cudaProfilerStart / Stop
window, for Nsight Compute to read their counters side by side:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --csv --page details python scripts/ncu_prefill.py 65536

Planted inputs at the Llama-3-8B shape (the bench's); in order: Vertical-Slash(1000, 6096) through the Gluon kernel
(`ws_vertical_slash`, packed beforehand) and through the Triton loop (`sparse_prefill(warp_specialize=False)` on
`vs_tiles`), block-sparse top-100 per head through both. Prints the physical densities first."""
import sys

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import block_index, vs_index, vs_tiles
from workbench_kernels.index_ref import selected_block_tiles, tile_area
from workbench_kernels.prefill import sparse_prefill
from workbench_kernels.prefill_ws import pack_vertical_slash, ws_prefill, ws_vertical_slash

n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
hq, hkv, d, theta = SHAPES["llama3-8b"]
q, k, v = planted_inputs(hq, hkv, d, n, theta)
cols, offs = vs_index(q, k, 1.0 / d ** 0.5, 1000, min(6096, n))
tiles = vs_tiles(cols, offs, n)
packed = pack_vertical_slash(k, v, cols, offs, hq)
block = selected_block_tiles(block_index(q, k, 100))
pairs = hq * n * (n + 1) // 2
strips = (packed[1][3].long() + 63) // 64
print("vs density", tile_area(tiles, n).sum().item() / pairs,
      "ws area", ((packed[0].block_count.long() + strips) * 64 * 64).sum().item() / pairs,
      "block density", tile_area(block, n).sum().item() / pairs, flush=True)
runs = [lambda: ws_vertical_slash(q, k, v, cols, offs, packed=packed),
        lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False),
        lambda: ws_prefill(q, k, v, block),
        lambda: sparse_prefill(q, k, v, block, warp_specialize=False)]
for run in runs:  # compile and warm outside the window
    run()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for run in runs:
    run()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
