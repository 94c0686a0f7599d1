"""Group-shared Vertical-Slash: one VS index per KV head, read by every query head of its group.

The index is the VS proxy's column and diagonal scores added over the G query heads of a KV head, then one
selection (`vs_proxy(group_shared=True)`, on a GPU `index_build.vs_index(group_shared=True)`). Every head of a
group reads the same keys, so the kernel loads each K/V tile once for two heads (`prefill_ws`'s shared ring on
sm_90, an even G; elsewhere GQA-packed where G is a power of two, else per head). H200, Llama-3-8B shape (32 / 8
heads, head_dim 128), VS(1000, 6096), planted inputs, one run (prefill_minference_eff4416_h200.json): 54.2 / 159.5
ms at 64K / 128K against 57.2 / 175.1 per head, 0.88 / 0.95 of dense SDPA's TFLOP/s per computed tile against
0.85 / 0.89. On the embedded shape (G = 3, head_dim 64) it ran 2-5 % slower than per head: the search's latency
cost decides per model.

The price is recall: a head gets the keys its group agrees on. A config gives this kind to whole KV groups with
one size (`PatternBase.kv_shared`), and the search takes it for a group only where every head still meets the
target and the group's cost falls.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from workbench_kernels.index_ref import VSTiles, vs_tile_count, vs_to_tiles

from workbench.patterns.base import Reductions, Scores, budgets_on, per_head, register_pattern, stack_scores
from workbench.patterns.proxy import top_positions, vs_proxy
from workbench.patterns.vertical_slash import TRITON_PROXY, VerticalSlash, best_offsets, vs_mass


def group_sum(x: torch.Tensor, group: int) -> torch.Tensor:
    """`[H, ...]` per query head -> `[H / group, ...]` summed over each KV group's consecutive heads."""
    return x.unflatten(0, (-1, group)).sum(1)


@register_pattern
class GroupVerticalSlash(VerticalSlash):
    """A VS index whose heads come in KV groups with equal rows: columns Long `[H, Kv]`, offsets Long `[H, Ks]`
    (-1 = padding), one row per query head (its group's index)."""

    kind = "vs_group"
    title = "Vertical-Slash, shared by a KV group"
    params = ("vertical", "slash")
    order = 25
    kv_shared = True
    bench_kernel = "vertical_slash_group_shared"
    minference_name = None
    default_search = False
    sweep = dataclasses.replace(VerticalSlash.sweep, name="vertical-slash-group")

    @classmethod
    def defaults(cls, n: int) -> dict[str, int]:
        return VerticalSlash.defaults(n)

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """VS's budgets (`VerticalSlash.grid`), shared: a method candidate (`--group-shared` in `workbench search`)."""
        return VerticalSlash.grid(n)

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        """Closed form as `VerticalSlash.evidence`, with each KV group's shared proxy index (every head of the
        layer in this kind: what a group the search gives it runs). Oracle: for each head, the better of that
        index and the group's best known shared index of the same budget (the heaviest group columns, or the
        proxy's, each with the group's heaviest remaining offsets, whichever holds more of the group's mass)."""
        n, st, group = sums.n, sums.sums, sums.q.shape[0] // sums.k.shape[0]
        sizes = [(p["vertical"], p["slash"]) for p in params]
        levels = sorted({v for v, _ in sizes})
        cols_g, offs_g = vs_proxy(sums.q, sums.k, sums.scale, levels[-1], max(s for _, s in sizes), ranked=True,
                                  group_shared=True, **sums.proxy)
        best_g = top_positions(group_sum(st.column_mass, group), 0, levels[-1], None, ranked=True)

        def heads(x: torch.Tensor) -> torch.Tensor:  # one row per KV head -> one per query head
            return x.repeat_interleave(group, 0)

        proxy_ov, best_ov = sums.offset_mass([heads(cols_g), heads(best_g)], prefixes=[levels, levels])
        tail_ov = sums.offset_mass([heads(cols_g)], prefixes=[levels], rows=sums.tail_rows)[0]
        diag = group_sum(st.diag_mass, group)
        parts = []
        for v, s in sizes:
            li = levels.index(v)
            cols, offs = heads(cols_g[:, :v]), heads(offs_g[:, :s])
            mass = vs_mass(st, proxy_ov[li], cols, offs)
            best = mass
            for c, ov in ((cols, proxy_ov[li]), (heads(best_g[:, :v]), best_ov[li])):
                other = vs_mass(st, ov, c, heads(best_offsets(diag, group_sum(ov, group), s)))
                better = heads(group_sum(other, group) > group_sum(best, group))
                best = torch.where(better, other, best)
            parts.append({"mass": mass, "tail": vs_mass(sums.tail, tail_ov[li], cols, offs),
                          "oracle": torch.maximum(mass, best), "tiles": vs_tile_count(cols[None], offs[None], n)[0],
                          "edges": cls(cols, offs).edges(n)})
        return stack_scores(parts)

    @classmethod
    def for_heads(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                  block: int, triton: bool = False) -> GroupVerticalSlash:
        """q `[H, N, D]` of whole KV groups in order, k `[H / G, N, D]` their KV heads (per-head k: each head its
        own group); params per query head, equal within a group."""
        group = q.shape[0] // k.shape[0]
        cols, offs = vs_proxy(q, k, scale, per_head(params[::group], "vertical"), per_head(params[::group], "slash"),
                              group_shared=True, **proxy)
        return cls(cols.repeat_interleave(group, 0), offs.repeat_interleave(group, 0))

    def kv_tiles(self, n: int, group: int) -> VSTiles:
        """The kernel's tiles per KV head `[1, H / group, M]` (one row of each group of `group` heads)."""
        return vs_to_tiles(self.columns[None, ::group], self.offsets[None, ::group], n)

    @classmethod
    def layer_tiles(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                    block: int, triton: bool = False) -> tuple[VSTiles, None]:
        """Tiles per KV head `[B, H / G, M]` (group-shared: `sparse_prefill` runs them on one K/V ring or
        GQA-packed; `index_ref.expand_groups` gives the per-head ones) from q `[B, H, N, D]` of whole groups and
        k `[B, H / G, N, D]`; with `triton`, the Triton index and tile expansion (columns per head included)."""
        n, group = q.shape[2], q.shape[1] // k.shape[1]
        groups = params[::group]
        if triton and all(proxy.get(key, value) == value for key, value in TRITON_PROXY.items()):
            from workbench_kernels.index_build import vs_index

            (vertical, per_v), (slash, per_s) = (budgets_on(groups, key, q.device) for key in ("vertical", "slash"))
            cols, offs = vs_index(q, k, scale, vertical, slash, proxy["sink"], proxy["local"], group_shared=True,
                                  per_head=(per_v, per_s))
        else:
            cols, offs = vs_proxy(q, k, scale, per_head(groups, "vertical"), per_head(groups, "slash"),
                                  group_shared=True, **proxy)
        if triton:
            from workbench_kernels.index_build import vs_tiles

            return vs_tiles(cols, offs, n, block, head_columns=True), None
        return vs_to_tiles(cols, offs, n, block), None
