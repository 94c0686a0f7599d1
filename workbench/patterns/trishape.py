"""Tri-shape (SCBench): A-shape (`sink` initial tokens + a local `window`) plus dense attention for the
last `last` query rows (the question at the end of a prompt). Static: needs no online index.

N(i) = {j <= i} if i >= n - last, else {0 .. min(sink, i+1) - 1} U {max(0, i - window + 1) .. i}.
Physical tiles: the A-shape as Vertical-Slash tiles (sink columns, window offsets) on every row block; the
question rows are dense rows of the tiles (`VSTiles.dense_from`), computed after the lists over every key.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from workbench_kernels import masks
from workbench_kernels.index_ref import VSTiles, ashape_to_tiles
from workbench_kernels.tiling import NO_WINDOW

from workbench.patterns.ashape import AShape, _per_head
from workbench.patterns.base import (
    BLOCK,
    MaskMod,
    PromptFree,
    Shapes,
    Sweep,
    check_head,
    check_rows,
    per_head,
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
    static = True  # its mask: the A-shape's band plus the question's dense rows
    bench_kernel = None
    minference_attn_type = "tri_shape"
    sweep = Sweep("tri-shape", "window", (256, 512, 1024), lambda v: {"sink": 64, "window": int(v), "last": 64},
                  online=False)

    @classmethod
    def at_budget(cls, budget: int, n: int) -> dict[str, int]:
        """64 sink tokens, a window of the budget, the last 64 rows dense."""
        return {"sink": 64, "window": budget, "last": 64}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """64 sink tokens, a window of n/16 .. n/4, the last 64 rows (the question) dense."""
        return [cls.at_budget(w, n) for w in sorted({max(64, round(n / f)) for f in (16, 8, 4)})]

    def __init__(self, sink: int | torch.Tensor, window: int | torch.Tensor, last: int | torch.Tensor = 64,
                 n_heads: int = 1):
        self.ashape = AShape(sink, window, n_heads)
        self.n_heads = self.ashape.n_heads
        self.last = _per_head(last, self.n_heads, "last", 0)

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        i = torch.arange(r0, r1, device=self.last.device)[None, :, None]
        j = torch.arange(n, device=self.last.device)[None, None, :]
        return self.ashape.row_mask(r0, r1, n) | masks.dense_rows(i, j, n - self.last[:, None, None])

    def edges(self, n: int) -> torch.Tensor:
        i = torch.arange(n, device=self.last.device)[None, :]
        g, w = self.ashape.sink[:, None], self.ashape.window[:, None]
        sink, band = torch.minimum(g, i + 1), torch.minimum(w, i + 1)
        ashape = sink + band - (sink - (i - w + 1).clamp(min=0)).clamp(min=0)  # keys per row, overlap once
        return torch.where(i >= n - self.last[:, None], i + 1, ashape).sum(1)

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        """Tiles `[batch, H, M]`: the A-shape's (`ashape_to_tiles`: window pieces, sink columns) on every row block,
        and the question as dense rows from n - last on (`VSTiles.dense_from`, computed after the lists by exact
        attention over every key), so the lists stay as wide as the band at any length (1M, window 4096: 65
        pieces a row block, where whole question row blocks would make them M = 16384 wide)."""
        band = ashape_to_tiles(self.ashape.sink, self.ashape.window, n)
        rows = int(self.last.clamp(max=n).max())
        if rows == 0:  # no question on any head: the A-shape's tiles
            return repeat_batch(band, batch)
        start = (n - self.last.clamp(max=n)).where(self.last > 0, NO_WINDOW).to(band.block_count.device, torch.int32)
        return repeat_batch(dataclasses.replace(band, dense_from=start[None], dense_rows=rows), batch)

    @classmethod
    def layer_attention(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor | None:
        """A-shape's Gluon kernel over the band (`ashape_gluon`: sm_90; head_dim 128, or 256 where a KV group's heads
        pair up by band or differ in band), then the question's dense rows (`write_dense_rows`, from the layer's
        cached tiles); else None."""
        from workbench_kernels.prefill import ashape_gluon, write_dense_rows

        out = ashape_gluon(q, k, v, per_head(params, "sink"), per_head(params, "window"), scale)
        if out is None:
            return None
        tiles, _ = cls.layer_tiles(params, q, k, scale, {}, BLOCK)
        return write_dense_rows(*out, q, k, v, tiles, scale)[0]

    def tiles(self, n: int) -> torch.Tensor:
        """Long `[H]`, in closed form (`tile_count` of `to_tiles`): the A-shape's tiles per row block, every causal key
        block on the row blocks that hold a question row."""
        rows = torch.arange(-(-n // BLOCK), device=self.last.device)
        question = torch.clamp((rows + 1) * BLOCK, max=n)[None, :] > n - self.last[:, None]
        return torch.where(question, rows + 1, self.ashape.row_tiles(n)).sum(1)

    def token_band(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The A-shape's (sink, window): exact on the lists' rows; the dense rows read every key after them."""
        return self.ashape.sink, self.ashape.window

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        g, w, first = (x.to(device) for x in (self.ashape.sink, self.ashape.window, n - self.last))
        return lambda b, h, q_idx, kv_idx: (masks.ashape(q_idx, kv_idx, g[h], w[h])
                                            | masks.dense_rows(q_idx, kv_idx, first[h]))

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
