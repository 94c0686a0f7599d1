"""Block-sparse: each 64-row query block m reads a few 64-wide key blocks.

`block_index` Int `[H, M, K]` lists key-block ids per query block (ascending, -1 padded). The diagonal
block is always read (under the causal triangle); ids after m (future blocks), negative ids and
duplicates are ignored.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from workbench_kernels import masks
from workbench_kernels.index_ref import VSTiles, block_sparse_to_tiles
from workbench_kernels.tiling import BLOCK

from workbench.patterns.base import (
    EVIDENCE,
    MaskMod,
    PatternBase,
    Reductions,
    Scores,
    Shapes,
    Sweep,
    budgets_on,
    causal_rows,
    check_head,
    check_rows,
    per_head,
    register_pattern,
    runs,
    search_budgets,
)
from workbench.patterns.proxy import block_proxy, head_groups
from workbench.patterns.vertical_slash import membership


@register_pattern
class BlockSparse(PatternBase):
    """Block table for H heads; `block` is the tile size in tokens (64)."""

    kind = "block"
    title = "Block-Sparse"
    params = ("topk",)
    order = 30
    bench_kernel = "block_sparse"
    minference_name = "block_sparse"
    default_search = True
    sweep = Sweep("block-sparse", "topk", (8, 16, 32), lambda v: {"topk": int(v)})

    def __init__(self, block_index: torch.Tensor, block: int = BLOCK):
        if block_index.dim() != 3:
            raise ValueError(f"BlockSparse wants block_index [H, M, K], got {tuple(block_index.shape)}: "
                             "index one layer's heads")
        self.block_index = block_index
        self.block = block
        self.n_heads = block_index.shape[0]

    @classmethod
    def at_budget(cls, budget: int, n: int) -> dict[str, int]:
        """b keys per query -> b / 64 blocks (rounded, >= 2)."""
        return {"topk": max(2, round(budget / BLOCK))}

    @classmethod
    def minference_sizes(cls, params: dict[str, int]) -> tuple[int, int]:
        """[topk, 0] (MInference's block_sparse kernel runs top-100 whatever the sizes)."""
        return params["topk"], 0

    @classmethod
    def from_minference_sizes(cls, vertical: int, slash: int) -> dict[str, int]:
        return {"topk": max(vertical, 1)}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """Each search budget b as b / 64 blocks (>= 2), once each, ascending."""
        return [{"topk": t} for t in sorted({cls.at_budget(b, n)["topk"] for b in search_budgets(n)})]

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        """Closed form from the exact 64x64 tile masses: the `block_proxy` table this prompt gets, ranked
        once at the largest budget so that each candidate's table is a prefix (`ranked_table_sums`: its
        mass over all rows and the answer rows, tiles and edges); its oracle is the exact best table of
        the same budget (`block_oracle`). Heads go in groups (`head_groups`), so beside the sums the
        memory is one group's `[M, M]` block scores and `[M, topk]` tables."""
        st, tail = sums.sums, sums.tail
        hq, m = sums.q.shape[0], st.block_mass.shape[-1]
        width = min(max(p["topk"] for p in params), m)
        parts = []
        for hs, ks in head_groups(hq, sums.k.shape[0], m * max(m, 4 * width)):
            table = block_proxy(sums.q[hs], sums.k[ks], width, ranked=True)
            parts.append({**ranked_table_sums(table, st.block_mass[hs], tail.block_mass[hs], tail.block_rows, sums.n),
                          "oracle": block_oracle(st.block_mass[hs], width)})
        prefix = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}  # [Hq, width] each
        at = torch.tensor([min(p["topk"], m) - 1 for p in params], device=prefix["mass"].device)
        rows = {"mass": st.n_rows, "tail": tail.n_rows, "oracle": st.n_rows, "tiles": 1, "edges": 1}
        return {name: (prefix[name][:, at] / rows[name]).double().cpu() for name in EVIDENCE}

    def n_blocks(self, n: int) -> int:
        m = -(-n // self.block)
        if self.block_index.shape[1] != m:
            raise ValueError(f"block_index has {self.block_index.shape[1]} query blocks but n={n} needs {m} "
                             f"(block {self.block}): build the index for this prompt length")
        return m

    def block_set(self, n: int) -> torch.Tensor:
        """Bool `[H, M, M]`: key blocks read by each query block (causal blocks only, diagonal always)."""
        m = self.n_blocks(n)
        s = membership(self.block_index.long(), m)
        s |= torch.eye(m, dtype=torch.bool, device=s.device)
        return s & torch.ones(m, m, dtype=torch.bool, device=s.device).tril()

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        b = self.block
        m0, m1 = r0 // b, -(-r1 // b)
        s = self.block_set(n)[:, m0:m1].repeat_interleave(b, 1)[:, r0 - m0 * b:r1 - m0 * b]
        return s.repeat_interleave(b, 2)[:, :, :n].logical_and_(causal_rows(r0, r1, n, s.device))

    def edges(self, n: int) -> torch.Tensor:
        s = self.block_set(n).long()
        m = s.shape[1]
        size = torch.clamp(n - torch.arange(m, device=s.device) * self.block, max=self.block)  # rows (= cols) per block
        area = size[:, None] * size[None, :]
        area.diagonal().copy_(size * (size + 1) // 2)  # the diagonal tile is a triangle
        return (s * area).sum((1, 2))

    def tiles(self, n: int) -> torch.Tensor:
        return self.block_set(n).sum((1, 2))

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        if self.block != BLOCK:
            raise ValueError(f"the kernels tile {BLOCK}-token blocks: this index has block={self.block}, "
                             f"build it with block={BLOCK} to run it")
        return block_sparse_to_tiles(self.block_index.expand(batch, -1, -1, -1), n)

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        s, b = self.block_set(n).to(device), self.block
        return lambda bi, h, q_idx, kv_idx: masks.causal(q_idx, kv_idx) & masks.tile(s, q_idx, kv_idx, b, b, head=h)

    def shapes(self, head: int, n: int) -> Shapes:
        """{"blocks": tiles}; a diagonal tile is drawn whole (causality is the map's own)."""
        check_head(self, head)
        s, b = self.block_set(n)[head], self.block
        blocks = []
        for m in range(s.shape[0]):
            y0, y1 = m * b - 0.5, min(n, (m + 1) * b) - 0.5
            for a, e in runs(s[m]):
                x0, x1 = a * b - 0.5, min(n, e * b) - 0.5
                blocks.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
        return {"blocks": blocks}

    def head(self, h: int) -> BlockSparse:
        check_head(self, h)
        return type(self)(self.block_index[h:h + 1], self.block)

    @classmethod
    def for_heads(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                  block: int, triton: bool = False) -> BlockSparse:
        return cls(block_proxy(q, k, per_head(params, "topk"), block), block)

    @classmethod
    def layer_tiles(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                    block: int, triton: bool = False) -> tuple[VSTiles, None]:
        """Pooled top-k on all heads of the batch at once (`triton`: the Triton block index; on 64-row tiles
        written by its selection, `block_tiles`)."""
        if triton:
            from workbench_kernels.index_build import block_index, block_tiles

            if block == BLOCK:
                return block_tiles(q, k, *budgets_on(params, "topk", q.device)), None
            table = block_index(q, k, per_head(params, "topk"), block)
        else:
            table = block_proxy(q, k, per_head(params, "topk"), block)
        return block_sparse_to_tiles(table, q.shape[2], block), None

    def __repr__(self) -> str:
        return f"BlockSparse(block_index {tuple(self.block_index.shape)}, block={self.block})"


def block_oracle(block_mass: torch.Tensor, width: int) -> torch.Tensor:
    """Mass of the best block tables of budgets 1..width: Float64 `[H, width]`, entry t - 1 = the
    diagonal plus the t - 1 heaviest causal tiles of every query block, summed (units of rows; exactly
    optimal for budget t). block_mass `[H, M, M]` (all rows)."""
    m = block_mass.shape[-1]
    diagonal = block_mass.diagonal(dim1=-2, dim2=-1).double().sum(-1, keepdim=True)
    if width == 1:
        return diagonal
    below = torch.ones(m, m, dtype=torch.bool, device=block_mass.device).tril(-1)
    heavy = block_mass.masked_fill(~below, -1.0).topk(width - 1, dim=-1).values.clamp_(min=0)  # masses >= 0
    return torch.cat([diagonal, diagonal + heavy.sum(-2, dtype=torch.float64).cumsum(-1)], -1)


def ranked_table_sums(table: torch.Tensor, block_mass: torch.Tensor, tail_mass: torch.Tensor,
                      tail_blocks: tuple[int, int], n: int) -> dict[str, torch.Tensor]:
    """What the tables of budgets 1..width keep, from one ranked table (`block_proxy(..., ranked=True)`,
    Int `[H, M, width]`: key-block ids in preference order, diagonal first, -1 last): Float64 `[H, width]`
    each, entry t - 1 for the table of its first t ids: "mass" (units of rows) over all rows
    (`block_mass` `[H, M, M]`) and "tail" over the answer rows (`tail_mass` `[H, m1 - m0, M]` of the row
    blocks `tail_blocks` = (m0, m1)), "tiles" and "edges" (causal pairs)."""
    m = table.shape[1]
    live = table >= 0
    ids = table.long().clamp(min=0)
    m0, m1 = tail_blocks
    size = torch.clamp(n - torch.arange(m, device=ids.device) * BLOCK, max=BLOCK)  # rows (= keys) per block
    own = torch.arange(m, device=ids.device)[:, None]
    area = torch.where(ids == own, (size * (size + 1) // 2)[:, None], size[:, None] * size[ids])  # the diagonal: a triangle
    kept = {"mass": block_mass.gather(-1, ids), "tail": tail_mass.gather(-1, ids[:, m0:m1]), "tiles": live,
            "edges": area}
    live_of = {"tail": live[:, m0:m1]}
    return {name: torch.where(live_of.get(name, live), x, 0).sum(1, dtype=torch.float64).cumsum(-1)
            for name, x in kept.items()}
