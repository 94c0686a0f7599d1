"""Tri-shape (SCBench): A-shape (`sink` initial tokens + a local `window`) plus dense attention for the
last `last` query rows (the question at the end of a prompt). Static: needs no online index.

N(i) = {j <= i} if i >= n - last, else {0 .. min(sink, i+1) - 1} U {max(0, i - window + 1) .. i}.
Physical tiles: the A-shape as Vertical-Slash tiles (sink columns, window offsets) on the row blocks
before the question, every causal key block on the row blocks that hold a question row.
"""
from __future__ import annotations

import torch
from workbench_kernels import masks
from workbench_kernels.index_ref import VSTiles, ashape_to_tiles

from workbench.patterns.ashape import AShape, _per_head
from workbench.patterns.base import (
    BLOCK,
    MaskMod,
    PromptFree,
    Shapes,
    Sweep,
    check_head,
    check_rows,
    default_budget,
    register_pattern,
)
from workbench.patterns.tile_select import repeat_batch


@register_pattern
class TriShape(PromptFree):
    """Sink + window for H heads, dense for the last `last` query rows. All in tokens (int or Long `[H]`)."""

    kind = "trishape"
    title = "Tri-shape"
    params = ("sink", "window", "last")
    order = 50
    bench_kernel = None
    minference_attn_type = "tri_shape"
    sweep = Sweep("tri-shape", "window", (256, 512, 1024), lambda v: {"sink": 64, "window": int(v), "last": 64},
                  online=False)

    @classmethod
    def defaults(cls, n: int) -> dict[str, int]:
        return {"sink": 64, "window": default_budget(n), "last": 64}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """64 sink tokens, a window of n/16 .. n/4, the last 64 rows (the question) dense."""
        return [{"sink": 64, "window": w, "last": 64} for w in sorted({max(64, round(n / f)) for f in (16, 8, 4)})]

    def __init__(self, sink: int | torch.Tensor, window: int | torch.Tensor, last: int | torch.Tensor = 64,
                 n_heads: int = 1):
        self.ashape = AShape(sink, window, n_heads)
        self.n_heads = self.ashape.n_heads
        self.last = _per_head(last, self.n_heads, "last", 0)

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        i = torch.arange(r0, r1, device=self.last.device)[None, :, None]
        j = torch.arange(n, device=self.last.device)[None, None, :]
        question = i >= n - self.last[:, None, None]
        return self.ashape.row_mask(r0, r1, n) | (question & (j <= i))

    def edges(self, n: int) -> torch.Tensor:
        i = torch.arange(n)[None, :]
        g, w = self.ashape.sink[:, None], self.ashape.window[:, None]
        sink, band = torch.minimum(g, i + 1), torch.minimum(w, i + 1)
        ashape = sink + band - (sink - (i - w + 1).clamp(min=0)).clamp(min=0)  # keys per row, overlap once
        return torch.where(i >= n - self.last[:, None], i + 1, ashape).sum(1)

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        """Tiles `[batch, H, M]`: A-shape row blocks as VS pieces / columns (`ashape_to_tiles`), then the question
        row blocks overwritten with every causal key block (their piece lists make the table M wide: `[H, M, M]`
        Int32, 0.5 GB at 128K for 32 heads; built in ~0.2 s on the CPU)."""
        m = -(-n // BLOCK)
        band = ashape_to_tiles(self.ashape.sink, self.ashape.window, n)
        offsets = torch.full((1, self.n_heads, m, max(m, band.block_offset.shape[-1])), -1, dtype=torch.int32)
        offsets[..., :band.block_offset.shape[-1]] = band.block_offset
        count, columns, column_count = band.block_count.clone(), band.column_index.clone(), band.column_count.clone()
        rows = torch.arange(m)
        heads, qrows = (torch.clamp((rows + 1) * BLOCK, max=n)[None, :] > n - self.last[:, None]).nonzero(as_tuple=True)
        t = torch.arange(offsets.shape[-1])
        offsets[0, heads, qrows] = torch.where(t <= qrows[:, None], t * BLOCK, -1).int()
        count[0, heads, qrows] = (qrows + 1).int()
        column_count[0, heads, qrows] = 0
        columns[0, heads, qrows] = -1
        return repeat_batch(VSTiles(count, offsets, column_count, columns, BLOCK), batch)

    def tiles(self, n: int) -> torch.Tensor:
        """Long `[H]`, in closed form (no `[H, M, M]` table): the A-shape's tiles per row block, every causal key
        block on the question row blocks."""
        rows = torch.arange(-(-n // BLOCK))
        question = torch.clamp((rows + 1) * BLOCK, max=n)[None, :] > n - self.last[:, None]
        return torch.where(question, rows + 1, self.ashape.row_tiles(n)).sum(1)

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        g, w, first = (x.to(device) for x in (self.ashape.sink, self.ashape.window, n - self.last))
        return lambda b, h, q_idx, kv_idx: masks.causal(q_idx, kv_idx) & (
            masks.band(q_idx, kv_idx, g[h], w[h]) | (q_idx >= first[h]))

    def shapes(self, head: int, n: int) -> Shapes:
        check_head(self, head)
        out = AShape(self.ashape.sink[head], self.ashape.window[head]).shapes(0, n)
        rows = min(int(self.last[head]), n)
        if rows:
            y0, e = n - rows - 0.5, n - 0.5
            out["question"] = [[(-0.5, y0), (e, y0), (e, e), (-0.5, e)]]
        return out

    def head(self, h: int) -> TriShape:
        check_head(self, h)
        return TriShape(self.ashape.sink[h], self.ashape.window[h], self.last[h])

    def __repr__(self) -> str:
        return (f"TriShape(sink={self.ashape.sink.tolist()}, window={self.ashape.window.tolist()}, "
                f"last={self.last.tolist()})")
