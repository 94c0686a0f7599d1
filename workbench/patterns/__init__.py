"""Sparse attention patterns as compact per-layer indexes, and the online proxies that build them.

`AShape(sink, window)`, `VerticalSlash(columns, offsets)`, `BlockSparse(block_index)`, `Dense(H)` and
`Stack([...])` (different patterns for different heads of one layer) all offer `row_mask(r0, r1, n)`,
`to_mask(n)` (small n), `edges(n)` (logical) and `tiles(n)` (physical 64x64 tiles).
`vs_proxy` / `block_proxy` build VS and block-sparse indexes from q and k online.
"""
from workbench.patterns.ashape import AShape
from workbench.patterns.base import BLOCK, Dense, Pattern, Stack, causal_edges, causal_tiles
from workbench.patterns.block_sparse import BlockSparse
from workbench.patterns.proxy import block_proxy, vs_proxy
from workbench.patterns.vertical_slash import VerticalSlash, membership, vs_tile_count

__all__ = ["AShape", "BLOCK", "BlockSparse", "Dense", "Pattern", "Stack", "VerticalSlash", "block_proxy",
           "causal_edges", "causal_tiles", "membership", "vs_proxy", "vs_tile_count"]
