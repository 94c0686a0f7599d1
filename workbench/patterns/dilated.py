"""Static diagonal baselines as Vertical-Slash indexes with no columns (they run on the VS tiles).

- Dilated sliding window (Longformer): N(i) = {i - t*dilation : 0 <= t < window, i - t*dilation >= 0}.
- Strided (Sparse Transformer): N(i) = {i - window + 1 .. i} U {j <= i : (i - j) % stride == 0}.

Both are defined for any prompt length: `index(n)` gives the VS index of an n-token prompt.
"""
from __future__ import annotations

import torch
from workbench_kernels.index_ref import VSTiles, vs_to_tiles

from workbench.patterns.ashape import _per_head
from workbench.patterns.base import (
    BLOCK,
    MaskMod,
    PromptFree,
    Shapes,
    Sweep,
    check_head,
    register_pattern,
)
from workbench.patterns.tile_select import repeat_batch
from workbench.patterns.vertical_slash import VerticalSlash


class _Offsets(PromptFree):
    """A pattern given by per-head slash offsets that depend only on n."""

    def offsets(self, n: int) -> torch.Tensor:  # Long [H, K], -1 padded
        raise NotImplementedError

    def index(self, n: int) -> VerticalSlash:
        return VerticalSlash(torch.full((self.n_heads, 1), -1, dtype=torch.long), self.offsets(n))

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        return self.index(n).row_mask(r0, r1, n)

    def edges(self, n: int) -> torch.Tensor:
        return self.index(n).edges(n)

    def tiles(self, n: int) -> torch.Tensor:
        return self.index(n).tiles(n)

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        vs = self.index(n)
        return repeat_batch(vs_to_tiles(vs.columns[None], vs.offsets[None], n, BLOCK), batch)

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        return self.index(n).mask_mod(n, device)

    def shapes(self, head: int, n: int) -> Shapes:
        return {"slashes": self.index(n).shapes(head, n)["slashes"]}

    def head(self, h: int) -> _Offsets:
        check_head(self, h)
        return type(self)(*(getattr(self, name)[h] for name in self.params))


@register_pattern
class Dilated(_Offsets):
    """`window` taps spaced `dilation` tokens apart, ending at the diagonal (int or Long `[H]` each)."""

    kind = "dilated"
    title = "dilated"
    params = ("window", "dilation")
    order = 60
    sweep = Sweep("dilated", "taps", (128, 256, 512), lambda v: {"window": int(v), "dilation": 2}, online=False)

    @classmethod
    def at_budget(cls, budget: int, n: int) -> dict[str, int]:
        """The budget's keys as taps, every second token."""
        return {"window": budget, "dilation": 2}

    def __init__(self, window: int | torch.Tensor, dilation: int | torch.Tensor, n_heads: int = 1):
        self.n_heads = max([n_heads] + [x.numel() for x in (window, dilation) if isinstance(x, torch.Tensor)])
        self.window = _per_head(window, self.n_heads, "window", 1)
        self.dilation = _per_head(dilation, self.n_heads, "dilation", 1)

    def offsets(self, n: int) -> torch.Tensor:
        t = torch.arange(max(1, min(int(self.window.max()), n)))
        offs = t[None, :] * self.dilation[:, None]
        return torch.where((t[None, :] < self.window[:, None]) & (offs < n), offs, -1)

    def __repr__(self) -> str:
        return f"Dilated(window={self.window.tolist()}, dilation={self.dilation.tolist()})"


@register_pattern
class Strided(_Offsets):
    """A local `window` plus every `stride`-th earlier token (int or Long `[H]` each)."""

    kind = "strided"
    title = "strided"
    params = ("window", "stride")
    order = 70
    sweep = Sweep("strided", "stride", (256, 128, 64), lambda v: {"window": 128, "stride": int(v)}, online=False)

    @classmethod
    def at_budget(cls, budget: int, n: int) -> dict[str, int]:
        """A window of the budget b plus about b / 2 strided keys (stride 2n / b)."""
        return {"window": budget, "stride": max(1, 2 * n // budget)}

    def __init__(self, window: int | torch.Tensor, stride: int | torch.Tensor, n_heads: int = 1):
        self.n_heads = max([n_heads] + [x.numel() for x in (window, stride) if isinstance(x, torch.Tensor)])
        self.window = _per_head(window, self.n_heads, "window", 1)
        self.stride = _per_head(stride, self.n_heads, "stride", 1)

    def offsets(self, n: int) -> torch.Tensor:
        d = torch.arange(n)[None, :]
        keep = (d < self.window[:, None]) | (d % self.stride[:, None] == 0)
        return torch.where(keep, d, -1)

    def __repr__(self) -> str:
        return f"Strided(window={self.window.tolist()}, stride={self.stride.tolist()})"
