"""Sparse attention patterns as compact per-layer indexes, and the online proxies that build them.

`AShape(sink, window)`, `VerticalSlash(columns, offsets)`, `BlockSparse(block_index)`, `Dense(H)` and
`Stack([...])` (different patterns for different heads of one layer) implement the `Pattern` protocol
(`base.py`): each owns its geometry once - logical `row_mask` / `edges` / FlexAttention `mask_mod`,
the kernel's physical `to_tiles` / `token_band` / `tiles`, the latency `cost`, and the overlay
`shapes` - and every consumer (prefill, latency, config, headview, viz, benchmarks) calls these.
`PATTERNS` maps a head config's kind ("vs", "ashape", "block", "dense") to its class; `cls.kind` goes back.
`vs_proxy` / `block_proxy` build VS and block-sparse indexes from q and k online.

How to add a pattern: write one module here with a class that subclasses `PatternBase`, sets the class
attributes `kind` (its config name), `params` (its per-head sizes in a config entry) and `bench_kernel`
(its row name in `workbench bench kernels`, or None), implements every method of `Pattern` (`row_mask`,
`edges`, `tiles`, `to_tiles`, `mask_mod`, `shapes`, the classmethod `build` that indexes one layer
online; `token_band` only if the kernel needs a per-token mask on top of the tiles), and carries the
`@register_pattern` decorator; then import it below so that it registers when `workbench.patterns` is
imported. `tests/unit/test_patterns.py::PROTOCOL_CASES` checks that the parts agree: add one instance.
"""
from workbench.patterns import dilated, flexprefill, trishape, xattention  # noqa: E402,F401  (issue 19's kinds register)
from workbench.patterns.ashape import AShape
from workbench.patterns.base import (
                                     BLOCK,
                                     PATTERNS,
                                     Dense,
                                     Pattern,
                                     PatternBase,
                                     Stack,
                                     causal_edges,
                                     causal_tiles,
                                     pattern_class,
                                     register_pattern,
)
from workbench.patterns.block_sparse import BlockSparse
from workbench.patterns.proxy import block_proxy, vs_proxy
from workbench.patterns.vertical_slash import VerticalSlash, membership, vs_tile_count

__all__ = ["AShape", "BLOCK", "BlockSparse", "Dense", "PATTERNS", "Pattern", "PatternBase", "Stack",
           "VerticalSlash", "block_proxy", "causal_edges", "causal_tiles", "membership", "pattern_class",
           "register_pattern", "vs_proxy", "vs_tile_count"]
