"""Exploratory (issue 25): K / V tile loads per computed tile on the row-block pairs (`prefill_pair`, head_dim 256),
block top-100 against VS(1000, 512) and VS(1000, 6096) with columns per head, on the bench's planted inputs at the
Gemma-3 shape (4 q / 1 KV head):

    python3 scripts/pair_loads.py 16384 65536 131072            # on a GPU: the Triton index builders, bf16
    python3 scripts/pair_loads.py 8192 16384                    # on the CPU: their torch references, fp32
    python3 scripts/pair_loads.py --shape llama3-8b 131072      # another of the bench's shapes (its head pairs)

A pair loads each union piece once and row block 2j + 1's column strips once for both consumers; each consumer
computes its own pieces and strips. Prints per length and pattern: own pieces and strips per row block, union
pieces and strips per pair, and loads per own tile ((union + strips) / own); beside it the loads per own tile if
query heads 2i and 2i + 1 of one KV group and row block shared a ring instead (the union of their pieces, each
head's strips).
Dense's pairs load 0.5 a tile; where each SM's intake of K / V (64 KB a step at head_dim 256) sets the time, a
kernel runs at about 0.5 / that of dense per tile (kernels/NOTES.md, session 46)."""
import argparse
import dataclasses

import torch
from workbench_benchmarks.kernels_prefill import SHAPES, planted_inputs
from workbench_kernels.index_build import block_index, vs_index, vs_tiles
from workbench_kernels.index_ref import VSTiles, member_union, selected_block_tiles, unique_columns, vs_to_tiles

from workbench.patterns.proxy import block_proxy, vs_proxy

dev = "cuda" if torch.cuda.is_available() else "cpu"
args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
args.add_argument("lengths", type=int, nargs="+")
args.add_argument("--shape", default="gemma3-270m", choices=sorted(SHAPES))
args = args.parse_args()
hq, hkv, d, theta = SHAPES[args.shape]


def strips_per_block(tiles: VSTiles) -> torch.Tensor:
    """Long `[H, M]`: the 64-key strips of its head's packed columns each row block walks (0 without columns)."""
    H, M = tiles.block_count.shape[1:]
    if tiles.head_columns is None:
        return torch.zeros(H, M, dtype=torch.long, device=tiles.block_count.device)
    starts = (torch.arange(M, device=tiles.block_count.device) * 64).expand(H, -1).contiguous()
    return (torch.searchsorted(tiles.head_columns.long()[0].contiguous(), starts) + 63) // 64


def union_pieces(offsets: torch.Tensor, counts: torch.Tensor) -> int:
    """Pieces in the unions of member pairs: offsets `[items, 2, NS]` (each member's live starts first), counts
    `[items, 2]`."""
    live = torch.arange(offsets.shape[-1], device=offsets.device) < counts.unsqueeze(-1)
    return member_union(offsets, live)[2].long().sum().item()


def head_pair_loads(tiles: VSTiles) -> float:
    """Loads per own tile with query heads 2i and 2i + 1 of one KV group and row block on one ring (their union of
    pieces, each head's own strips); a group's odd last head keeps its own ring (NaN at one query head a group)."""
    g = hq // hkv
    if g < 2:
        return float("nan")
    heads = torch.arange(hq).view(hkv, g)[:, : g // 2 * 2].reshape(-1)  # the paired heads, partners adjacent
    bc, bo = tiles.block_count.long()[0, heads], tiles.block_offset.long()[0, heads]
    H, M, NS = bo.shape
    union = union_pieces(bo.view(H // 2, 2, M, NS).transpose(1, 2).reshape(-1, 2, NS),
                         bc.view(H // 2, 2, M).transpose(1, 2).reshape(-1, 2))
    strips = strips_per_block(tiles)[heads].sum().item()
    return (union + strips) / (bc.sum().item() + strips)


def pair_loads(tiles: VSTiles) -> dict[str, float]:
    """Per row block own pieces / strips, per pair union pieces / strips, and loads per own tile (whole pairs)."""
    bc, bo = tiles.block_count.long()[0], tiles.block_offset.long()[0]  # [H, M], [H, M, NS]
    H, M, NS = bo.shape
    mp = M // 2 * 2
    union = union_pieces(bo[:, :mp].reshape(-1, 2, NS), bc[:, :mp].reshape(-1, 2))
    own = bc[:, :mp].sum().item()
    strips = strips_per_block(tiles)[:, :mp]
    own_strips, pair_strips = strips.sum().item(), strips[:, 1::2].sum().item()
    pairs, blocks = H * mp // 2, H * mp
    return {"own_pieces": own / blocks, "own_strips": own_strips / blocks, "union_pieces": union / pairs,
            "pair_strips": pair_strips / pairs, "loads_per_own_tile": (union + pair_strips) / (own + own_strips)}


def index_tiles(q: torch.Tensor, k: torch.Tensor, n: int) -> dict[str, VSTiles]:
    """The three patterns' tiles: the Triton builders on a GPU, on the CPU the torch references they are tested
    against (the Triton interpreter takes hours at the Llama shape)."""
    gpu = q.is_cuda
    patterns = {"block top-100": selected_block_tiles(block_index(q, k, 100) if gpu else block_proxy(q, k, 100))}
    for slash in (512, 6096):
        if gpu:
            cols, offs = vs_index(q, k, 1.0 / d ** 0.5, 1000, min(slash, n))
            tiles = vs_tiles(cols, offs, n, 64, 0, head_columns=True)
        else:
            cols, offs = vs_proxy(q, k, 1.0 / d ** 0.5, 1000, min(slash, n))
            tiles = dataclasses.replace(vs_to_tiles(cols, offs, n, 64), head_columns=unique_columns(cols, n))
        patterns[f"VS(1000, {slash})"] = tiles
    return patterns


for n in args.lengths:
    q, k, _ = planted_inputs(hq, hkv, d, n, theta, dev=dev, dtype=None if dev == "cuda" else torch.float32)
    patterns = index_tiles(q, k, n)
    del q, k
    for name, tiles in patterns.items():
        s = pair_loads(tiles)
        print(f"n={n} {name}: own {s['own_pieces']:.1f} pieces + {s['own_strips']:.1f} strips per row block; "
              f"union {s['union_pieces']:.1f} pieces + {s['pair_strips']:.1f} strips per pair; "
              f"loads per own tile {s['loads_per_own_tile']:.3f} (dense 0.5); head pairs instead "
              f"{head_pair_loads(tiles):.3f}", flush=True)
