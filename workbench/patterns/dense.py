"""Dense: full causal attention, the search's fallback when no sparse candidate is good enough.

N(i) = {0 .. i}. Its tiles are a window of n (every causal key block), run by the same kernel.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from workbench_kernels import masks
from workbench_kernels.index_ref import VSTiles, ashape_to_tiles, band_tiles

from workbench.patterns.base import (
    MaskMod,
    PatternBase,
    Reductions,
    Scores,
    Shapes,
    causal_edges,
    causal_rows,
    causal_tiles,
    check_head,
    check_rows,
    column_poly,
    register_pattern,
)


@register_pattern
class Dense(PatternBase):
    """Full causal attention for H heads."""

    kind = "dense"
    title = "dense"
    params = ()
    order = 40
    bench_kernel = "dense_sdpa"
    default_search = True
    static = True

    def __init__(self, n_heads: int):
        self.n_heads = n_heads

    @classmethod
    def defaults(cls, n: int) -> dict[str, int]:
        return {}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        return [{}]

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        """Every causal pair: mass, tail and oracle 1, every causal tile and edge."""
        shape, n = (sums.q.shape[0], len(params)), sums.n
        full = lambda value: torch.full(shape, float(value), dtype=torch.float64, device="cpu")  # noqa: E731
        return {"mass": full(1), "tail": full(1), "oracle": full(1), "tiles": full(causal_tiles(n)),
                "edges": full(causal_edges(n))}

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        return causal_rows(r0, r1, n).expand(self.n_heads, -1, -1)

    def edges(self, n: int) -> torch.Tensor:
        return torch.full((self.n_heads,), causal_edges(n), dtype=torch.long)

    def tiles(self, n: int) -> torch.Tensor:
        return torch.full((self.n_heads,), causal_tiles(n), dtype=torch.long)

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        return ashape_to_tiles([0] * self.n_heads, [max(n, 1)] * self.n_heads, n, batch)  # a window of n

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        return lambda b, h, q_idx, kv_idx: masks.causal(q_idx, kv_idx)

    def shapes(self, head: int, n: int) -> Shapes:
        check_head(self, head)
        return {"dense": [column_poly(0, n, n)]}

    def head(self, h: int) -> Dense:
        check_head(self, h)
        return Dense(1)

    @classmethod
    def for_heads(cls, params, q, k, scale, proxy, block, triton=False) -> Dense:
        return cls(len(params))

    @classmethod
    def layer_tiles(cls, params, q, k, scale, proxy, block, triton=False) -> tuple[VSTiles, None]:
        """A window of n on q's device (cached per length): every causal key, no band needed."""
        n, h = q.shape[2], len(params)
        return band_tiles([0] * h, [max(n, 1)] * h, n, q.shape[0], block, q.device)[0], None

    @classmethod
    def layer_attention(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor:
        """Dense causal SDPA (FlashAttention / cuDNN on a GPU), as a model runs a layer of dense heads: what the
        dense heads of a layer of several kinds run (`SparsePrefill.kinds_attention`)."""
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])

    def __repr__(self) -> str:
        return f"Dense(n_heads={self.n_heads})"
