"""Exploratory (issue 25): the lanes the Gluon route computes per unit of `tile_area`, block top-100 against
VS(1000, 512) with columns per head, on the bench's planted inputs at the Llama-3-8B shape:

    python3 scripts/lane_count.py 16384 65536 131072            # on a GPU
    TRITON_INTERPRET=1 python3 scripts/lane_count.py 16384      # on the CPU (fp32; about 10 min at 16K on 2 cores)

`tile_area` counts a row block's kept columns exactly; the route walks every packed head column below the row block
(the covered ones masked) in 64-key strips, and pairs items in 128-key steps (an odd last item adds a masked half).
Prints per length: lanes / `tile_area` for both, and the columns walked and kept per item (kernels/NOTES.md,
session 44)."""
import sys

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import block_index, vs_index, vs_tiles
from workbench_kernels.index_ref import VSTiles, selected_block_tiles, tile_area

dev = "cuda" if torch.cuda.is_available() else "cpu"
hq, hkv, d, theta = SHAPES["llama3-8b"]


def lanes_per_area(tiles: VSTiles, strips: torch.Tensor | int, n: int) -> float:
    """(query, key) lanes of the paired steps over `tile_area`; strips Long `[H, M]` per item (or 0)."""
    M = tiles.block_count.shape[-1]
    rows = torch.full((M,), 64, device=dev)
    rows[-1] = n - (M - 1) * 64
    items = tiles.block_count.long()[0] + strips
    return ((items + 1) // 2 * 128 * rows).sum().item() / tile_area(tiles, n).sum().item()


for n in map(int, sys.argv[1:]):
    q, k, _ = planted_inputs(hq, hkv, d, n, theta, dev=dev, dtype=None if dev == "cuda" else torch.float32)
    block = selected_block_tiles(block_index(q, k, 100))
    vs = vs_tiles(*vs_index(q, k, 1.0 / d ** 0.5, 1000, 512), n, 64, 0, head_columns=True)
    starts = (torch.arange(vs.block_count.shape[-1], device=dev) * 64).expand(hq, -1).contiguous()
    walked = torch.searchsorted(vs.head_columns.long()[0].contiguous(), starts)  # packed columns < row_lo
    print(f"n={n}: lanes / tile_area: block {lanes_per_area(block, 0, n):.4f}, VS(1000, 512) "
          f"{lanes_per_area(vs, (walked + 63) // 64, n):.4f}; VS columns per item walked {walked.float().mean():.1f}, "
          f"kept {vs.column_count.float().mean():.1f}", flush=True)
