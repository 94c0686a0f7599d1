"""A-shape: `sink` initial tokens plus a local `window` (MInference's `stream_llm`); needs no online index.

N(i) = {0 .. min(sink, i+1) - 1} U {max(0, i - window + 1) .. i}.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from workbench_kernels import masks
from workbench_kernels.index_ref import VSTiles, ashape_to_tiles, band_tiles
from workbench_kernels.tiling import BLOCK

from workbench.patterns.base import (
    MaskMod,
    PatternBase,
    Reductions,
    Scores,
    Shapes,
    Sweep,
    band_poly,
    causal_rows,
    check_head,
    check_rows,
    column_poly,
    per_head,
    register_pattern,
    search_budgets,
    stack_scores,
    toeplitz_rows,
)


def _per_head(x: int | torch.Tensor, n_heads: int, name: str, low: int) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.long).reshape(-1)
    if t.numel() == 1:
        t = t.expand(n_heads).clone()
    if t.numel() != n_heads:
        raise ValueError(f"AShape {name} has {t.numel()} values for {n_heads} heads: give one int or one per head")
    if (t < low).any():
        raise ValueError(f"AShape {name} must be >= {low} (got {t.tolist()}): "
                         + ("the window includes the diagonal, use window >= 1" if name == "window" else "use sink >= 0"))
    return t


@register_pattern
class AShape(PatternBase):
    """Sink + sliding window for H heads. `sink`, `window`: tokens (an int, or Long `[H]`)."""

    kind = "ashape"
    title = "A-shape"
    params = ("sink", "window")
    order = 10
    bench_kernel = "a_shape"
    minference_name = "stream_llm"
    default_search = True
    static = True
    sweep = Sweep("a-shape", "window", (256, 512, 1024), lambda v: {"sink": 64, "window": int(v)}, online=False)

    def __init__(self, sink: int | torch.Tensor, window: int | torch.Tensor, n_heads: int = 1):
        if isinstance(sink, torch.Tensor) and sink.numel() > 1:
            n_heads = sink.numel()
        elif isinstance(window, torch.Tensor) and window.numel() > 1:
            n_heads = window.numel()
        self.n_heads = n_heads
        self.sink = _per_head(sink, n_heads, "sink", 0)
        self.window = _per_head(window, n_heads, "window", 1)

    @classmethod
    def at_budget(cls, budget: int, n: int) -> dict[str, int]:
        """64 sink tokens and a window of the budget."""
        return {"sink": 64, "window": budget}

    @classmethod
    def minference_sizes(cls, params: dict[str, int]) -> tuple[int, int]:
        """MInference's stream_llm reuses its two sizes as (n_init, n_local)."""
        return params["sink"], params["window"]

    @classmethod
    def from_minference_sizes(cls, vertical: int, slash: int) -> dict[str, int]:
        return {"sink": vertical, "window": max(slash, 1)}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """64 sink tokens + a window of each search budget (n/64 .. n/4)."""
        return [cls.at_budget(b, n) for b in search_budgets(n)]

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        """Closed form from the exact sums: the sink columns plus the window's offsets, minus the pairs
        counted twice (the sink columns' mass at offsets below the window, one `offset_mass` pass for all
        sinks as prefixes of the largest, over the rows where sink and window meet). Nothing is chosen
        online: oracle = mass."""
        hq, n = sums.q.shape[0], sums.n
        sink_of = [min(p["sink"], n) for p in params]
        sinks = sorted(set(sink_of))
        cols = [torch.arange(sinks[-1]).expand(hq, -1)]
        over = sums.offset_mass(cols, prefixes=[sinks], rows=max(p["sink"] + p["window"] for p in params))[0]
        tail_over = sums.offset_mass(cols, prefixes=[sinks], rows=sums.tail_rows)[0]
        index = cls(per_head(params, "sink"), per_head(params, "window"), len(params))  # one "head" per candidate
        tiles, edges = index.tiles(n), index.edges(n)
        parts = []
        for c, (g, p) in enumerate(zip(sink_of, params)):
            level, w = sinks.index(g), p["window"]
            mass = _kept(sums.sums, over[level], g, w)
            parts.append({"mass": mass, "tail": _kept(sums.tail, tail_over[level], g, w), "oracle": mass,
                          "tiles": tiles[c].expand(hq), "edges": edges[c].expand(hq)})
        return stack_scores(parts)

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        pos = torch.arange(n, device=self.sink.device)
        band = toeplitz_rows(masks.local(pos[None, :], self.window[:, None]), r0, r1, n)
        return band.logical_or_(masks.sink(pos[None, :], self.sink[:, None])[:, None, :]
                                & causal_rows(r0, r1, n, pos.device))

    def edges(self, n: int) -> torch.Tensor:
        i = torch.arange(n, device=self.sink.device)[None, :]
        g, w = self.sink[:, None], self.window[:, None]
        sink = torch.minimum(g, i + 1)
        band = torch.minimum(w, i + 1)
        both = (sink - (i - w + 1).clamp(min=0)).clamp(min=0)
        return (sink + band - both).sum(1)

    def tiles(self, n: int, block: int = BLOCK) -> torch.Tensor:
        return self.row_tiles(n, block).sum(1)

    def row_tiles(self, n: int, block: int = BLOCK) -> torch.Tensor:
        """Long `[H, M]`: the tiles each row block computes (its sink columns' strips and its band's pieces)."""
        m = torch.arange(-(-n // block), device=self.sink.device)[None, :]
        start, end = m * block, torch.clamp((m + 1) * block, max=n)
        g, w = self.sink[:, None], self.window[:, None]
        sink_hi = -(-torch.minimum(g, end) // block)  # sink tiles [0, sink_hi)
        band_lo = (start - w + 1).clamp(min=0) // block  # band tiles [band_lo, band_hi)
        band_hi = (end - 1) // block + 1
        both = (torch.minimum(sink_hi, band_hi) - band_lo).clamp(min=0)
        return sink_hi + band_hi - band_lo - both

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        return ashape_to_tiles(self.sink, self.window, n, batch)

    def token_band(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sink, self.window

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        sinks, windows = self.sink.to(device), self.window.to(device)
        return lambda b, h, q_idx, kv_idx: masks.ashape(q_idx, kv_idx, sinks[h], windows[h])

    def shapes(self, head: int, n: int) -> Shapes:
        check_head(self, head)
        g, w = min(int(self.sink[head]), n), min(int(self.window[head]), n)
        return {"window": [band_poly(0, w, n)], **({"sink": [column_poly(0, g, n)]} if g > 0 else {})}

    def head(self, h: int) -> AShape:
        check_head(self, h)
        return AShape(self.sink[h], self.window[h])

    @classmethod
    def for_heads(cls, params, q: Any, k: Any, scale: float, proxy: dict[str, Any], block: int,
                  triton: bool = False) -> AShape:
        return cls(per_head(params, "sink"), per_head(params, "window"), len(params))

    @classmethod
    def layer_tiles(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                    block: int, triton: bool = False) -> tuple[VSTiles, tuple[torch.Tensor, torch.Tensor]]:
        """Tiles on q's device (arange arithmetic, no index) and the band itself, built once per (band,
        length, batch, device) and cached (`band_tiles`): a prefill makes no op and no copy for them."""
        return band_tiles([p["sink"] for p in params], [p["window"] for p in params], q.shape[2], q.shape[0],
                          block, q.device)

    @classmethod
    def layer_attention(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor | None:
        """A Gluon kernel where one takes the layer (`ashape_gluon`, sm_90: at head_dim 128 two heads of one band on one
        K/V ring where each KV group's heads pair up by band, else per-head rings; at 256 the same shared ring where
        they pair up, else row blocks 2j and 2j + 1 of a head where a KV group's heads differ in band), else None.
        H200, Llama 32/8/128, sink 128, window 4096, 64K / 128K, the two paths timed in turn (`scripts/ashape_layer.py`,
        eff4416): 8.41 / 17.01 ms against 10.07 / 20.51 for the one launch over `layer_tiles` (1.20x / 1.21x; 1.15x /
        1.16x with dense SDPA run between them)."""
        from workbench_kernels.prefill import ashape_gluon

        out = ashape_gluon(q, k, v, per_head(params, "sink"), per_head(params, "window"), scale)
        return None if out is None else out[0]

    def __repr__(self) -> str:
        return f"AShape(sink={self.sink.tolist()}, window={self.window.tolist()})"


def _kept(sums: Any, overlap: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """Captured fraction `[H]` of A-shape(sink, window) over the rows of `sums` (`LayerSums`): column
    masses of the sinks + diagonal masses of the window - `overlap` (the sinks' mass per offset) inside it."""
    return ((sums.column_mass[:, :sink].sum(-1) + sums.diag_mass[:, :window].sum(-1)
             - overlap[:, :window].sum(-1)) / sums.n_rows).double()
