"""Head profiles of a whole model, one layer at a time (`workbench analyze`, streaming).

`LayerProfiles` is called with each layer's q/k as the forward reaches it (`StreamCapture.on_layer`):
it computes that layer's statistics (`layer_stats`, the maps `profile_layer` reads), keeps the head
profiles and, for the report, the max-pooled map of the strongest head of each kind so far; the layer's
statistics are then dropped. What stays is O(layers x heads) numbers plus a few `[R, R]` maps.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from workbench.analysis.head_kinds import HeadProfile, profile_layer
from workbench.analysis.stats import LayerStats, layer_stats
from workbench.core.stream import tile_size

PROFILE_MAPS = ("max_map", "block_mass", "column_mass", "diag_mass", "row_entropy")  # what profiles and maps read
TOP_KINDS = ("vertical", "slash", "block")


class LayerProfiles:
    """Collects `HeadProfile`s layer by layer; `top[kind]` = (profile, one-head LayerStats with its max map)
    of the first head with the highest `kind` score (the same head `max(profiles, key=...)` gives).

    Tile masses use `tile_size(n)`-token tiles (64 up to 256K tokens). `seconds` is the wall time spent
    in the statistics (synchronised on a GPU)."""

    def __init__(self, scale: float, resolution: int = 1024):
        self.scale, self.resolution = scale, resolution
        self.profiles: list[HeadProfile] = []
        self.top: dict[str, tuple[HeadProfile, LayerStats]] = {}
        self.seconds = 0.0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None) -> None:
        """Profile one layer: q `[Hq, N, D]`, k `[Hkv, N, D]`; `lse` `[Hq, N]` the rows' log-sum-exps when the
        forward gave them (`LayerRunner.row_lse`; saves the statistics' first pass)."""
        t0 = time.perf_counter()
        n = q.shape[1]
        st = layer_stats(q, k, self.scale, resolution=self.resolution, block=tile_size(n), maps=PROFILE_MAPS, lse=lse)
        profiles = profile_layer(st, layer)  # reads the maps back: synchronises
        self.profiles += profiles
        for kind in TOP_KINDS:
            best = max(profiles, key=lambda p: getattr(p, kind))
            if kind not in self.top or getattr(best, kind) > getattr(self.top[kind][0], kind):
                one = st.max_map[best.head:best.head + 1].cpu()
                self.top[kind] = (best, replace(st, max_map=one, block_mass=None, column_mass=None, diag_mass=None,
                                                row_entropy=None))
        self.seconds += time.perf_counter() - t0
