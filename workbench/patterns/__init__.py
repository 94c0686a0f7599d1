"""Sparse attention patterns as compact per-layer indexes, and the online proxies that build them.

`AShape(sink, window)`, `VerticalSlash(columns, offsets)` (and `GroupVerticalSlash`, one per KV group),
`BlockSparse(block_index)`, `Dense(H)` and `Stack([...])` (different patterns for different heads of one layer)
implement the `Pattern` protocol (`base.py`): each owns its geometry once - logical `row_mask` / `edges` /
FlexAttention `mask_mod` (from the predicates of `workbench_kernels.masks`), the kernel's physical `to_tiles` /
`token_band` / `tiles`, the latency `cost`, and the overlay `shapes` - and every consumer (prefill, latency,
config, headview, viz, benchmarks) calls these.

The registry is the only list of kinds. `PATTERNS` maps a head config's kind ("ashape", "vs", "block",
"dense", ...) to its class in the classes' `order`; `cls.kind` goes back. Everything else derives from it:
the config's params and schema (`workbench.config.PARAMS`), MInference's names, the search's grids
(`default_candidates`, `method_candidates`) and evidence (`layer_scores`, `rescore_head`), the default
sizes of a head switched to a kind (`default_params(kind, n)`: the dashboard) and its sizes at a budget of
keys per query (`cls.at_budget(b, n)`: the notebooks' budget slider, `analyze`'s equal-budget fits), the `workbench
compare` sweeps and the latency table's kernels. `vs_proxy` / `block_proxy` build VS and block-sparse
indexes from q and k online.

How to add a pattern: write one module here with one class that subclasses `PatternBase`, carries the
`@register_pattern` decorator, and is imported below so that it registers when `workbench.patterns` is
imported. In its own body (the decorator refuses a class that misses one, or that would inherit a
kind's member from another registered kind):

- `kind` (its config name), `title` (its name in pages and reports), `params` (the names of its per-head
  sizes, whole numbers >= 0), `order` (its place in every list of kinds and its colour in figures: an
  unused number), and its sizes: `at_budget(budget, n)` (its params at a budget of keys per query row, the
  knob that puts kinds side by side; the sizes a head switched to it gets, `defaults(n)`, are then those of
  n / 16 keys) or, for a kind without a key budget, `defaults(n)` itself;
- the `Pattern` methods (`row_mask`, `edges`, `tiles`, `to_tiles`, `mask_mod`, `shapes`, `head`, and the
  classmethod `for_heads` that indexes one layer's heads, online from q and k where it needs them;
  `token_band` only if the kernel needs a per-token mask on top of the tiles; `static = True` if its index
  needs no prompt and its whole mask is `token_band` plus its tiles' dense rows, causal; subclass `PromptFree` instead of
  `PatternBase` if its index reads only its params and n: it then builds from the params alone and a layer's
  tiles are cached; `kv_shared = True` if it builds one index per KV head, which the config then gives to whole
  KV groups and the search chooses per group, as `GroupVerticalSlash`);
- where it applies: `grid(n)` (search candidates; `default_search = True` puts them in
  `default_candidates`, else they are `method_candidates`), `evidence(params, sums)` (closed-form scores
  from the exact reductions; the default is one exact pass per candidate), `sweep` (`Sweep`: its
  `workbench compare` row), `bench_kernel` (its kernel's row in `workbench bench kernels`),
  `minference_name` with `minference_sizes` / `from_minference_sizes` (its entry in MInference's per-head
  config), `minference_attn_type` (the model-wide `attn_type` MInference runs it as).

Tests: `tests/unit/test_registry.py` walks every registered kind through config, search, export and the
dashboard, and fails for a kind it cannot walk; add one instance to `tests/unit/test_patterns.py::
PROTOCOL_CASES` (the geometric parts agree) and one head to `tests/kernels/test_methods_kernel.py::MIXED`
(every prefill backend runs it).
"""
from workbench.patterns import dilated, flexprefill, trishape, xattention  # noqa: F401  (register their kinds)
from workbench.patterns.ashape import AShape
from workbench.patterns.base import (
    BLOCK,
    EVIDENCE,
    PATTERNS,
    Pattern,
    PatternBase,
    PromptFree,
    Reductions,
    Stack,
    Sweep,
    causal_edges,
    causal_tiles,
    default_params,
    pattern_class,
    register_pattern,
)
from workbench.patterns.block_sparse import BlockSparse
from workbench.patterns.dense import Dense
from workbench.patterns.group_vertical_slash import GroupVerticalSlash
from workbench.patterns.proxy import block_proxy, vs_proxy
from workbench.patterns.vertical_slash import VerticalSlash, membership, vs_tile_count

__all__ = ["AShape", "BLOCK", "BlockSparse", "Dense", "EVIDENCE", "GroupVerticalSlash", "PATTERNS", "Pattern",
           "PatternBase", "PromptFree", "Reductions", "Stack", "Sweep", "VerticalSlash", "block_proxy",
           "causal_edges", "causal_tiles", "default_params", "membership", "pattern_class", "register_pattern",
           "vs_proxy", "vs_tile_count"]
