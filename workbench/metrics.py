"""How good is a sparse index? Captured mass, output error, the geometry oracle, density and overlap.

Everything is exact dense attention, computed in row chunks by `workbench.stats` (no n x n matrix per
head). Masses are fractions of each head's attention: 1.0 means the index keeps every probability.
q `[Hq, N, D]`, k/v `[Hkv, N, D]`; query head h reads KV head h // (Hq // Hkv).
"""
from __future__ import annotations

import torch

from .patterns import Pattern, causal_edges, causal_tiles, membership
from .patterns.proxy import top_blocks, top_positions
from .stats import attention_rows, captured_mass

SEGMENTS = ("all", "first", "middle", "last", "last64")

__all__ = ["SEGMENTS", "captured_mass", "segment_mass", "sparse_attention", "output_error", "density", "index_iou",
           "offset_column_mass", "vs_mass", "vs_oracle", "block_oracle", "block_mass_of"]


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
def offset_column_mass(q: torch.Tensor, k: torch.Tensor, scale: float, offset_sets: list[torch.Tensor],
                       chunk: int = 256) -> list[torch.Tensor]:
    """For each offsets tensor `[Hq, S]` (-1 padded, no duplicates): `[Hq, N]` mass each key j receives
    along those slashes, i.e. sum over d of p[j + d, j], summed over rows (units: rows). One pass."""
    hq, n, _ = q.shape
    out = [torch.zeros(hq, n + 1) for _ in offset_sets]
    for r0, r1, p, _ in attention_rows(q, k, scale, chunk=chunk):
        i = torch.arange(r0, r1)[None, :, None]
        for acc, offs in zip(out, offset_sets):
            j = i - offs[:, None, :]  # [Hq, C, S]
            valid = (offs[:, None, :] >= 0) & (j >= 0)
            j = torch.where(valid, j, n)
            vals = torch.gather(p, 2, j.clamp(max=r1 - 1)) * valid
            acc.scatter_add_(1, j.reshape(hq, -1), vals.reshape(hq, -1))
    return [acc[:, :n] for acc in out]


def vs_mass(column_mass: torch.Tensor, diag_mass: torch.Tensor, cross: torch.Tensor,
            columns: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Captured mass `[H]` (fraction) of a VS index from exact sums (all `[H, N]`, units: rows):
    column sums + slash sums - the pairs counted twice (`cross` = `offset_column_mass` of `offsets`)."""
    n = column_mass.shape[-1]
    c = membership(columns.long(), n)
    d = membership(offsets.long(), n)
    d[:, 0] = True
    total = (column_mass * c).sum(-1) + (diag_mass * d).sum(-1) - (cross * c).sum(-1)
    return total / n


def vs_oracle(column_mass: torch.Tensor, diag_mass: torch.Tensor, vertical: int, slash: int,
              cross_of=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best-known VS index of the same budget from the full attention: the `slash` offsets with the
    most mass (0 always), then the `vertical` columns with the most mass not already on those slashes.

    `cross_of(offsets) -> [H, N]` supplies `offset_column_mass` for the chosen offsets (one pass);
    without it columns rank by their whole mass. Returns (columns `[H, vertical]`, offsets `[H, slash]`).
    """
    offsets = top_positions(diag_mass, 1, slash, None)
    residual = column_mass - (cross_of(offsets) if cross_of is not None else 0)
    return top_positions(residual, 0, vertical, None), offsets


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
