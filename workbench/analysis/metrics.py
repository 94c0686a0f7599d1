"""How good is a sparse index? Captured mass, output error, density and overlap, and the exact reductions
of one layer's attention (`LayerSums`, `column_offset_mass`, bundled per layer as `LayerReductions`) from
which each pattern class computes its own evidence and oracle (`PatternBase.evidence`).

Everything is exact dense attention, computed in row chunks by `workbench.analysis.stats` (no n x n matrix per
head). Masses are fractions of each head's attention: 1.0 means the index keeps every probability.
q `[Hq, N, D]`, k/v `[Hkv, N, D]`; query head h reads KV head h // (Hq // Hkv).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from workbench_kernels import attn_stats_ref as ref
from workbench_kernels.attn_stats_ref import LayerSums

from workbench.analysis.stats import attention_rows, captured_mass, use_triton
from workbench.patterns import BLOCK, Pattern, causal_edges, causal_tiles, membership

SEGMENTS = ("all", "first", "middle", "last", "last64")
TAIL_ROWS = 64  # the answer rows: the last 64 query rows, where a retrieval prompt asks its question

__all__ = ["SEGMENTS", "TAIL_ROWS", "LayerReductions", "LayerSums", "layer_sums", "captured_mass", "segment_mass",
           "sparse_attention", "output_error", "density", "index_iou", "column_offset_mass"]


def segment_mass(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row captured mass `[H, N]` -> mean per head `[H]` over all rows, the first / middle / last
    third of the query rows, and the last 64 rows (where the VS proxy samples)."""
    n = rows.shape[-1]
    a, b = n // 3, 2 * n // 3
    parts = {"all": rows, "first": rows[..., :max(a, 1)], "middle": rows[..., a:max(b, a + 1)],
             "last": rows[..., b:], "last64": rows[..., -64:]}
    return {name: part.mean(-1) for name, part in parts.items()}


def _grouped(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p `[Hq, C, W]` @ v `[Hkv, W, D]` -> `[Hq, C, D]` (GQA without repeating v)."""
    hq, c, w = p.shape
    hkv = v.shape[0]
    return (p.reshape(hkv, (hq // hkv) * c, w) @ v).reshape(hq, c, v.shape[-1])


def _outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, index: Pattern, chunk: int):
    """Yield (r0, r1, sparse `[Hq, C, D]`, dense `[Hq, C, D]`) over row chunks.

    The sparse output is the dense softmax restricted to the index and renormalised, which equals the
    softmax over the kept keys (every pattern keeps the diagonal, so no row is empty)."""
    n = q.shape[1]
    vf = v.float()
    for r0, r1, p, _ in attention_rows(q, k, scale, chunk=chunk):
        kept = p * index.row_mask(r0, r1, n)[:, :, :r1]
        yield r0, r1, _grouped(kept / kept.sum(-1, keepdim=True), vf[:, :r1]), _grouped(p, vf[:, :r1])


@torch.no_grad()
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, index: Pattern,
                     chunk: int = 256) -> torch.Tensor:
    """Exact attention over the keys the index keeps -> `[Hq, N, D]` fp32 (a reference, not a kernel)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    for r0, r1, sparse, _ in _outputs(q, k, v, scale, index, chunk):
        out[:, r0:r1] = sparse
    return out


@torch.no_grad()
def output_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, index: Pattern,
                 chunk: int = 256) -> dict[str, torch.Tensor]:
    """Sparse vs dense attention output per head: relative L2 error over all rows and the mean cosine
    similarity of the rows. Returns {"rel_l2": `[Hq]`, "cosine": `[Hq]`}."""
    hq, n, _ = q.shape
    err2, ref2, cos = (torch.zeros(hq, dtype=torch.float64) for _ in range(3))
    for _, _, sparse, dense in _outputs(q, k, v, scale, index, chunk):
        err2 += (sparse - dense).square().sum((1, 2)).double()
        ref2 += dense.square().sum((1, 2)).double()
        cos += torch.nn.functional.cosine_similarity(sparse, dense, dim=-1).sum(-1).double()
    return {"rel_l2": (err2 / ref2.clamp(min=1e-30)).sqrt().float(), "cosine": (cos / n).float()}


def density(index: Pattern, n: int) -> dict[str, torch.Tensor]:
    """Logical density (edges / causal edges) and physical density (64x64 tiles / causal tiles), `[H]`."""
    return {"logical": index.edges(n).double() / causal_edges(n),
            "physical": index.tiles(n).double() / causal_tiles(n)}


def index_iou(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """IoU per head of two indexes of the same kind: positions `[H, ..., K]` (columns, offsets, or
    key-block ids with n = number of blocks), -1 padded -> `[H]`."""
    ma, mb = membership(a.long(), n), membership(b.long(), n)
    dims = tuple(range(1, ma.dim()))
    inter = (ma & mb).sum(dims).double()
    union = (ma | mb).sum(dims).double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


@torch.no_grad()
def layer_sums(q: torch.Tensor, k: torch.Tensor, scale: float, block: int = BLOCK, chunk: int = 256,
               rows: tuple[int, int] | None = None, lse: torch.Tensor | None = None) -> LayerSums:
    """One exact pass over the query rows `rows` (default all): the sums the search needs (a lean
    `workbench.analysis.stats.layer_stats` plus lse) -> `LayerSums`. `rows=(n - 64, n)` gives the answer
    rows' sums (their tile masses: `[Hq, m1 - m0, M]`, `LayerSums.block_rows`). Triton on CUDA tensors
    (two passes over q.k; `lse` `[Hq, N]` of those rows, e.g. of an earlier call over all rows, saves
    the first), the reference (`chunk` rows at a time, lse from the same pass) otherwise; see
    `workbench.analysis.stats.backend`."""
    if use_triton(q):
        from workbench_kernels import attn_stats

        if attn_stats.pooling_supported(block):
            return attn_stats.layer_sums(q, k, scale, block, rows, lse)
    return ref.layer_sums(q, k, scale, block, chunk, rows)


@torch.no_grad()
def column_offset_mass(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor,
                       column_sets: list[torch.Tensor], prefixes: list[list[int]] | None = None,
                       rows: int | tuple[int, int] | None = None, chunk: int | None = None) -> list[torch.Tensor]:
    """Mass that sets of columns `[Hq, V]` hold at each offset d, `[Hq, N]` (or `[P, Hq, N]` per prefix budget),
    units: rows; the contract is `workbench_kernels.attn_stats_ref.column_offset_mass`'s. Triton on CUDA
    tensors, the reference (`chunk` rows at a time) otherwise."""
    if use_triton(q):
        from workbench_kernels import attn_stats

        return attn_stats.column_offset_mass(q, k, scale, lse, column_sets, prefixes, rows)
    return ref.column_offset_mass(q, k, scale, lse, column_sets, prefixes, rows, chunk)


@dataclass
class LayerReductions:
    """One layer of one prompt and the exact reductions a pattern's `evidence` reads
    (`workbench.patterns.Reductions`), each computed once, when first read.

    q `[Hq, N, D]`, k `[Hkv, N, D]`; `proxy`: the online proxy settings (config `proxy`, complete). `sums`:
    `layer_sums` of all rows (pass one already computed to reuse it); `tail`: of the answer rows
    `tail_rows` (the last `TAIL_ROWS`), O(n) sums like the others, from the row log-normalisers of
    `sums` (one pass 1 per layer serves the sums, the answer rows and every `offset_mass`)."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    proxy: dict[str, Any] = field(default_factory=dict)
    all_rows: LayerSums | None = None
    answer_rows: LayerSums | None = None
    lse: torch.Tensor | None = None  # [Hq, N] the rows' log-sum-exps when known (the streamed forward's)

    @property
    def n(self) -> int:
        return self.q.shape[1]

    @property
    def tail_rows(self) -> tuple[int, int]:
        return max(0, self.n - TAIL_ROWS), self.n

    @property
    def sums(self) -> LayerSums:
        if self.all_rows is None:
            self.all_rows = layer_sums(self.q, self.k, self.scale, lse=self.lse)
        return self.all_rows

    @property
    def tail(self) -> LayerSums:
        if self.answer_rows is None:
            self.answer_rows = layer_sums(self.q, self.k, self.scale, rows=self.tail_rows, lse=self.sums.lse)
        return self.answer_rows

    def offset_mass(self, column_sets: list[torch.Tensor], prefixes: list[list[int]] | None = None,
                    rows: int | tuple[int, int] | None = None) -> list[torch.Tensor]:
        """`column_offset_mass` of this layer (its lse from `sums`)."""
        return column_offset_mass(self.q, self.k, self.scale, self.sums.lse, column_sets, prefixes, rows)

    def captured(self, pattern: Pattern) -> torch.Tensor:
        """`[Hq, N]`: `captured_mass` of `pattern` per query row (from the row log-normalisers of `sums`
        when those are already computed)."""
        lse = None if self.all_rows is None else self.all_rows.lse
        return captured_mass(self.q, self.k, self.scale, pattern, lse=lse)
