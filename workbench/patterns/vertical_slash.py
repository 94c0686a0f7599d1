"""Vertical-Slash: columns C (absolute key positions) and slash offsets D (i - j = offset).

N(i) = {j in C : j <= i} U {i - d : d in D, i - d >= 0}. Padding -1 and other negative positions are
ignored, positions >= n are ignored, duplicates count once and offset 0 is always included (it keeps
the diagonal block, so every remaining column is strictly causal for its whole 64-row block).
The physical tiling (slash ranges merged per 64-row block, columns inside them dropped, the rest
packed 64 at a time) is `workbench_kernels.index_ref.vs_to_tiles`, the same one the kernels run on.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from workbench_kernels import masks
from workbench_kernels.index_ref import VSTiles, vs_tile_count, vs_to_tiles
from workbench_kernels.tiling import BLOCK

from workbench.patterns.base import (
    MaskMod,
    PatternBase,
    Reductions,
    Scores,
    Shapes,
    Sweep,
    band_poly,
    budgets_on,
    causal_rows,
    check_head,
    check_rows,
    column_poly,
    per_head,
    register_pattern,
    runs,
    search_budgets,
    stack_scores,
    toeplitz_rows,
)
from workbench.patterns.proxy import top_positions, vs_proxy

TRITON_PROXY = {"last_rows": 64, "aggregate": "sum", "diag_norm": "sum"}  # what the Triton VS builder computes


def membership(positions: torch.Tensor, n: int) -> torch.Tensor:
    """Bool `[..., n]` from Long `[..., K]` positions: True at each valid position (0 <= p < n)."""
    valid = (positions >= 0) & (positions < n)
    out = torch.zeros(*positions.shape[:-1], n + 1, dtype=torch.bool, device=positions.device)
    out.scatter_(-1, torch.where(valid, positions, n).long(), True)  # invalid ones land in the spare slot
    return out[..., :n]


@register_pattern
class VerticalSlash(PatternBase):
    """VS index for H heads: `columns` Long `[H, Kv]`, `offsets` Long `[H, Ks]` (-1 = padding)."""

    kind = "vs"
    title = "Vertical-Slash"
    params = ("vertical", "slash")
    order = 20
    bench_kernel = "vertical_slash"
    minference_name = "vertical_and_slash"
    default_search = True
    sweep = Sweep("vertical-slash", "vertical", (256, 512, 1024), lambda v: {"vertical": int(v), "slash": 2 * int(v)})

    def __init__(self, columns: torch.Tensor, offsets: torch.Tensor):
        if columns.dim() != 2 or offsets.dim() != 2 or columns.shape[0] != offsets.shape[0]:
            raise ValueError(f"VerticalSlash wants columns [H, Kv] and offsets [H, Ks] with the same H, got "
                             f"{tuple(columns.shape)} and {tuple(offsets.shape)}: index one layer's heads")
        self.columns = columns.long()
        self.offsets = offsets.long()
        self.n_heads = columns.shape[0]

    @classmethod
    def at_budget(cls, budget: int, n: int) -> dict[str, int]:
        """b keys per query -> b / 2 columns (>= 30) and b slashes (>= 50), as MInference clamps them."""
        return {"vertical": max(30, budget // 2), "slash": max(50, budget)}

    @classmethod
    def minference_sizes(cls, params: dict[str, int]) -> tuple[int, int]:
        return params["vertical"], params["slash"]

    @classmethod
    def from_minference_sizes(cls, vertical: int, slash: int) -> dict[str, int]:
        return {"vertical": vertical, "slash": max(slash, 1)}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """The search budgets up to n/8 (larger VS budgets already cost about as many tiles as dense)."""
        return [cls.at_budget(b, n) for b in search_budgets(n)[:-1]]

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        return vs_evidence(cls, params, sums)

    def column_set(self, n: int) -> torch.Tensor:
        """Bool `[H, n]`: which keys are columns."""
        return membership(self.columns, n)

    def offset_set(self, n: int) -> torch.Tensor:
        """Bool `[H, n]`: which offsets are slashes (offset 0 always)."""
        d = membership(self.offsets, n)
        d[:, 0] = True
        return d

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        causal = causal_rows(r0, r1, n, self.columns.device)
        return toeplitz_rows(self.offset_set(n), r0, r1, n).logical_or_(self.column_set(n)[:, None, :] & causal)

    def edges(self, n: int) -> torch.Tensor:
        c, d = self.column_set(n).long(), self.offset_set(n).long()
        rows_left = n - torch.arange(n, device=c.device)  # key j is read by n - j rows; offset d by n - d
        # a column j and an offset d meet at row j + d when j + d < n: count those pairs once
        offsets_below = d.cumsum(1).flip(1)  # [h, j] = #offsets <= n - 1 - j
        overlap = (c * offsets_below).sum(1)
        return (c * rows_left).sum(1) + (d * rows_left).sum(1) - overlap

    def tiles(self, n: int, block: int = BLOCK) -> torch.Tensor:
        return vs_tile_count(self.columns[None], self.offsets[None], n, block)[0]

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        return vs_to_tiles(self.columns.expand(batch, -1, -1), self.offsets.expand(batch, -1, -1), n)

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        cols, offs = self.column_set(n).to(device), self.offset_set(n).to(device)
        return lambda b, h, q_idx, kv_idx: masks.causal(q_idx, kv_idx) & (
            cols[h, kv_idx] | offs[h, (q_idx - kv_idx).clamp(min=0)])

    def shapes(self, head: int, n: int) -> Shapes:
        check_head(self, head)
        return {"columns": [column_poly(a, b, n) for a, b in runs(self.column_set(n)[head])],
                "slashes": [band_poly(a, b, n) for a, b in runs(self.offset_set(n)[head])]}

    def head(self, h: int) -> VerticalSlash:
        check_head(self, h)
        return type(self)(self.columns[h:h + 1], self.offsets[h:h + 1])

    @classmethod
    def for_heads(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                  block: int, triton: bool = False) -> VerticalSlash:
        """Per head: k `[H, N, D]` each query head's KV head. A kind that shares one index per KV head
        (`kv_shared`): q of whole KV groups in order, k `[H / G, N, D]` their KV heads (per-head k: each head its
        own group), params equal within a group; each head gets its group's index."""
        group = q.shape[0] // k.shape[0] if cls.kv_shared else 1
        cols, offs = vs_proxy(q, k, scale, per_head(params[::group], "vertical"), per_head(params[::group], "slash"),
                              group_shared=cls.kv_shared, **proxy)
        return cls(*(x.repeat_interleave(group, 0) for x in (cols, offs)) if group > 1 else (cols, offs))

    @classmethod
    def layer_tiles(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                    block: int, triton: bool = False) -> tuple[VSTiles, None]:
        """The proxy on all heads of the batch at once; with `triton` (and proxy settings the Triton
        builder computes) the Triton index (`vs_index`) and tile expansion, with the columns per head too
        (`VSTiles.head_columns`: the form the sm_90 Gluon kernels take, row-block pairs at head_dim 256 too). A
        `kv_shared` kind: q `[B, H, N, D]` of whole KV groups, k `[B, H / G, N, D]` their KV heads, and tiles per KV
        head `[B, H / G, M]` (group-shared: `sparse_prefill` runs them on one K/V ring or GQA-packed;
        `index_ref.expand_groups` gives per-head ones)."""
        n, shared = q.shape[2], cls.kv_shared
        params = params[::q.shape[1] // k.shape[1]] if shared else params  # one budget per index
        if triton and all(proxy.get(key, value) == value for key, value in TRITON_PROXY.items()):
            from workbench_kernels.index_build import vs_index

            (vertical, per_v), (slash, per_s) = (budgets_on(params, key, q.device) for key in ("vertical", "slash"))
            cols, offs = vs_index(q, k, scale, vertical, slash, proxy["sink"], proxy["local"], group_shared=shared,
                                  per_head=(per_v, per_s))
        else:
            vertical, slash = per_head(params, "vertical"), per_head(params, "slash")  # host ints: no sync
            cols, offs = vs_proxy(q, k, scale, vertical, slash, group_shared=shared, **proxy)
        if triton:
            from workbench_kernels.index_build import vs_tiles

            return vs_tiles(cols, offs, n, block, head_columns=True), None
        return vs_to_tiles(cols, offs, n, block), None

    def __repr__(self) -> str:
        return f"VerticalSlash(columns {tuple(self.columns.shape)}, offsets {tuple(self.offsets.shape)})"


def group_sum(x: torch.Tensor, group: int) -> torch.Tensor:
    """`[H, ...]` per query head -> `[H / group, ...]` summed over each KV group's consecutive heads."""
    return x.unflatten(0, (-1, group)).sum(1) if group > 1 else x


def vs_evidence(cls: type, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
    """`evidence` of a VS kind in closed form from the exact sums (`vs_mass`): the index the online proxy
    (`vs_proxy`) picks for this prompt, i.e. what the kernel runs; its oracle is the best known same-budget index
    (`vs_oracle`'s greedy choice from the proxy's and the heaviest columns, each with the heaviest remaining
    offsets). Budgets are nested: one ranked proxy (and one ranked column list) at the largest budget serves every
    candidate as a prefix, and one `offset_mass` pass over all rows (one over the answer rows) gives all their
    overlaps. A `kv_shared` kind: each KV group's shared index (every head of the layer in the kind), its oracle
    for each head the better of that index and the group's best known shared index (columns and offsets chosen
    by the group's summed mass, whichever of the two holds more of it)."""
    n, st = sums.n, sums.sums
    group = sums.q.shape[0] // sums.k.shape[0] if cls.kv_shared else 1
    sizes = [(p["vertical"], p["slash"]) for p in params]
    levels = sorted({v for v, _ in sizes})
    cols_all, offs_all = vs_proxy(sums.q, sums.k, sums.scale, levels[-1], max(s for _, s in sizes), ranked=True,
                                  group_shared=cls.kv_shared, **sums.proxy)
    best_all = top_positions(group_sum(st.column_mass, group), 0, levels[-1], None, ranked=True)

    def heads(x: torch.Tensor) -> torch.Tensor:  # one row per index -> one per query head
        return x.repeat_interleave(group, 0) if group > 1 else x

    proxy_ov, best_ov = sums.offset_mass([heads(cols_all), heads(best_all)], prefixes=[levels, levels])
    tail_ov = sums.offset_mass([heads(cols_all)], prefixes=[levels], rows=sums.tail_rows)[0]
    diag = group_sum(st.diag_mass, group)
    parts = []
    for v, s in sizes:
        li = levels.index(v)
        cols, offs = heads(cols_all[:, :v]), heads(offs_all[:, :s])
        mass = vs_mass(st, proxy_ov[li], cols, offs)
        best = mass
        for c, ov in ((cols, proxy_ov[li]), (heads(best_all[:, :v]), best_ov[li])):
            other = vs_mass(st, ov, c, heads(best_offsets(diag, group_sum(ov, group), s)))
            best = torch.where(heads(group_sum(other, group) > group_sum(best, group)), other, best)
        parts.append({"mass": mass, "tail": vs_mass(sums.tail, tail_ov[li], cols, offs),
                      "oracle": torch.maximum(mass, best), "tiles": vs_tile_count(cols[None], offs[None], n)[0],
                      "edges": cls(cols, offs).edges(n)})
    return stack_scores(parts)


def vs_mass(sums: Any, overlap: torch.Tensor, columns: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Captured fraction `[H]` of a VS index over the rows of `sums` (`LayerSums`): column sums + slash
    sums - the pairs counted twice (`overlap` `[H, N]` = `column_offset_mass` of `columns` over those rows)."""
    n = sums.column_mass.shape[-1]
    c = membership(columns.long(), n)
    d = membership(offsets.long(), n)
    d[:, 0] = True
    total = (sums.column_mass * c).sum(-1) + (sums.diag_mass * d).sum(-1) - (overlap * d).sum(-1)
    return (total / sums.n_rows).double()


def best_offsets(diag_mass: torch.Tensor, overlap: torch.Tensor, slash: int) -> torch.Tensor:
    """The `slash` offsets (0 always) holding the most mass not already on the chosen columns."""
    return top_positions(diag_mass - overlap, 1, slash, None)


def vs_oracle(sums: Reductions, vertical: int, slash: int, proxy: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-known VS index of a budget from the full attention of one layer -> (columns, offsets, mass `[H]`).

    Greedy: the `vertical` columns with the most mass, then the `slash` offsets with the most mass not
    already on those columns. With `proxy` = (columns, offsets) of a proxy index, the proxy's columns
    with their best offsets are tried too, so the oracle is never below the proxy at equal budget."""
    st = sums.sums
    starts = [top_positions(st.column_mass, 0, vertical)]
    if proxy is not None:
        starts.append(proxy[0])
    best = None
    for cols, overlap in zip(starts, sums.offset_mass(starts)):
        offs = best_offsets(st.diag_mass, overlap, slash)
        mass = vs_mass(st, overlap, cols, offs)
        if best is None:
            best = (cols, offs, mass)
        else:
            better = (mass > best[2])[:, None]
            best = (torch.where(better, cols, best[0]), torch.where(better, offs, best[1]), torch.maximum(mass, best[2]))
    return best
