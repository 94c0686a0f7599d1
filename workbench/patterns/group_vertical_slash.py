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
target and the group's cost falls. Index, tiles and evidence are `VerticalSlash`'s, which read `kv_shared`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from workbench_kernels.index_ref import VSTiles, vs_to_tiles

from workbench.patterns.base import Reductions, Scores, register_pattern
from workbench.patterns.vertical_slash import VerticalSlash, vs_evidence


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
    def at_budget(cls, budget: int, n: int) -> dict[str, int]:
        return VerticalSlash.at_budget(budget, n)

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """VS's budgets (`VerticalSlash.grid`), shared: a method candidate (`--group-shared` in `workbench search`)."""
        return VerticalSlash.grid(n)

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        return vs_evidence(cls, params, sums)

    def kv_tiles(self, n: int, group: int) -> VSTiles:
        """The kernel's tiles per KV head `[1, H / group, M]` (one row of each group of `group` heads)."""
        return vs_to_tiles(self.columns[None, ::group], self.offsets[None, ::group], n)
