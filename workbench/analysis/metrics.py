"""How good is a sparse index? Captured mass, output error, the geometry oracle, density and overlap.

Everything is exact dense attention, computed in row chunks by `workbench.analysis.stats` (no n x n matrix per
head). Masses are fractions of each head's attention: 1.0 means the index keeps every probability.
q `[Hq, N, D]`, k/v `[Hkv, N, D]`; query head h reads KV head h // (Hq // Hkv).
"""
from __future__ import annotations

import torch
from workbench_kernels import attn_stats_ref as ref
from workbench_kernels.attn_stats_ref import LayerSums

from workbench.analysis.stats import attention_rows, captured_mass, use_triton
from workbench.patterns import BLOCK, Pattern, causal_edges, causal_tiles, membership
from workbench.patterns.proxy import top_blocks, top_positions

SEGMENTS = ("all", "first", "middle", "last", "last64")

__all__ = ["SEGMENTS", "LayerSums", "layer_sums", "captured_mass", "segment_mass", "sparse_attention", "output_error",
           "density", "index_iou", "column_offset_mass", "vs_mass", "best_offsets", "vs_oracle", "block_oracle", "block_mass_of"]


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
               rows: tuple[int, int] | None = None) -> LayerSums:
    """One exact pass over the query rows `rows` (default all): the sums the search needs (a lean
    `workbench.analysis.stats.layer_stats` plus lse) -> `LayerSums`. `rows=(n - 64, n)` gives the answer
    rows' sums. Triton on CUDA tensors (two passes over q.k), the reference (`chunk` rows at a time)
    otherwise; see `workbench.analysis.stats.backend`."""
    if use_triton(q):
        from workbench_kernels import attn_stats

        if attn_stats.pooling_supported(block):
            return attn_stats.layer_sums(q, k, scale, block, rows)
    return ref.layer_sums(q, k, scale, block, chunk, rows)


@torch.no_grad()
def column_offset_mass(q: torch.Tensor, k: torch.Tensor, scale: float, lse: torch.Tensor,
                       column_sets: list[torch.Tensor], prefixes: list[list[int]] | None = None,
                       rows: int | tuple[int, int] | None = None, chunk: int | None = None) -> list[torch.Tensor]:
    """Mass that sets of columns hold at each offset: for columns `[Hq, V]` (-1 padded, no duplicates)
    `[Hq, N]` = sum over j in the set of p[j + d, j] (units: rows), with p recomputed only at those
    columns from the row log-normalisers `lse` `[Hq, N]` (`layer_sums`). `rows` limits the sum to query rows
    < rows (an int) or to rows [r0, r1) (a pair; `lse` must hold those rows).

    With `prefixes[i]` (ascending budgets), set i is read in preference order and its result is
    `[P, Hq, N]`: the sums of its first prefixes[i][0], [1], ... columns (nested budgets at the cost of
    the largest). Triton on CUDA tensors, the reference (`chunk` rows at a time) otherwise."""
    if use_triton(q):
        from workbench_kernels import attn_stats

        return attn_stats.column_offset_mass(q, k, scale, lse, column_sets, prefixes, rows)
    return ref.column_offset_mass(q, k, scale, lse, column_sets, prefixes, rows, chunk)


def vs_mass(column_mass: torch.Tensor, diag_mass: torch.Tensor, overlap: torch.Tensor,
            columns: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Captured mass `[H]` (fraction) of a VS index from exact sums (all `[H, N]`, units: rows):
    column sums + slash sums - the pairs counted twice (`overlap` = `column_offset_mass` of `columns`)."""
    n = column_mass.shape[-1]
    c = membership(columns.long(), n)
    d = membership(offsets.long(), n)
    d[:, 0] = True
    total = (column_mass * c).sum(-1) + (diag_mass * d).sum(-1) - (overlap * d).sum(-1)
    return total / n


def best_offsets(diag_mass: torch.Tensor, overlap: torch.Tensor, slash: int) -> torch.Tensor:
    """The `slash` offsets (0 always) holding the most mass not already on the chosen columns."""
    return top_positions(diag_mass - overlap, 1, slash, None)


def vs_oracle(q: torch.Tensor, k: torch.Tensor, scale: float, sums: LayerSums, vertical: int, slash: int,
              proxy: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-known VS index of a budget from the full attention -> (columns, offsets, mass `[H]`).

    Greedy: the `vertical` columns with the most mass, then the `slash` offsets with the most mass not
    already on those columns. With `proxy` = (columns, offsets) of a proxy index, the proxy's columns
    with their best offsets are tried too, so the oracle is never below the proxy at equal budget."""
    starts = [top_positions(sums.column_mass, 0, vertical)]
    if proxy is not None:
        starts.append(proxy[0])
    best = None
    for cols, overlap in zip(starts, column_offset_mass(q, k, scale, sums.lse, starts)):
        offs = best_offsets(sums.diag_mass, overlap, slash)
        mass = vs_mass(sums.column_mass, sums.diag_mass, overlap, cols, offs)
        if best is None:
            best = (cols, offs, mass)
        else:
            better = (mass > best[2])[:, None]
            best = (torch.where(better, cols, best[0]), torch.where(better, offs, best[1]), torch.maximum(mass, best[2]))
    return best


def block_oracle(block_mass: torch.Tensor, topk: int) -> torch.Tensor:
    """Best block table of the same budget: per query block the diagonal plus the key blocks with the
    most exact mass (`block_mass` `[H, M, M]`) -> Int `[H, M, topk]`. Exactly optimal for the budget."""
    return top_blocks(block_mass, topk)


def block_mass_of(block_mass: torch.Tensor, block_index: torch.Tensor, n: int) -> torch.Tensor:
    """Captured mass `[H]` (fraction) of a block table from exact tile masses `[H, M, M]` (units: rows)."""
    m = block_mass.shape[-1]
    s = membership(block_index.long(), m)
    s |= torch.eye(m, dtype=torch.bool)
    return (block_mass * s).sum((1, 2)) / n
