"""A-shape: `sink` initial tokens plus a local `window` (MInference's `stream_llm`); needs no online index.

N(i) = {0 .. min(sink, i+1) - 1} U {max(0, i - window + 1) .. i}.
"""
from __future__ import annotations

import torch

from workbench.patterns.base import BLOCK, check_rows, to_mask


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


class AShape:
    """Sink + sliding window for H heads. `sink`, `window`: tokens (an int, or Long `[H]`)."""

    def __init__(self, sink: int | torch.Tensor, window: int | torch.Tensor, n_heads: int = 1):
        if isinstance(sink, torch.Tensor) and sink.numel() > 1:
            n_heads = sink.numel()
        elif isinstance(window, torch.Tensor) and window.numel() > 1:
            n_heads = window.numel()
        self.n_heads = n_heads
        self.sink = _per_head(sink, n_heads, "sink", 0)
        self.window = _per_head(window, n_heads, "window", 1)

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        i = torch.arange(r0, r1)[None, :, None]
        j = torch.arange(n)[None, None, :]
        g, w = self.sink[:, None, None], self.window[:, None, None]
        return (j <= i) & ((j < g) | (j > i - w))

    def to_mask(self, n: int) -> torch.Tensor:
        return to_mask(self, n)

    def edges(self, n: int) -> torch.Tensor:
        i = torch.arange(n)[None, :]
        g, w = self.sink[:, None], self.window[:, None]
        sink = torch.minimum(g, i + 1)
        band = torch.minimum(w, i + 1)
        both = (sink - (i - w + 1).clamp(min=0)).clamp(min=0)
        return (sink + band - both).sum(1)

    def tiles(self, n: int, block: int = BLOCK) -> torch.Tensor:
        m = torch.arange(-(-n // block))[None, :]
        start, end = m * block, torch.clamp((m + 1) * block, max=n)
        g, w = self.sink[:, None], self.window[:, None]
        sink_hi = -(-torch.minimum(g, end) // block)  # sink tiles [0, sink_hi)
        band_lo = (start - w + 1).clamp(min=0) // block  # band tiles [band_lo, band_hi)
        band_hi = (end - 1) // block + 1
        both = (torch.minimum(sink_hi, band_hi) - band_lo).clamp(min=0)
        return (sink_hi + band_hi - band_lo - both).sum(1)

    def __repr__(self) -> str:
        return f"AShape(sink={self.sink.tolist()}, window={self.window.tolist()})"
