"""Head configs the sparse-prefill tests share (a helper module, not a test module)."""
from __future__ import annotations

from workbench.config import HeadConfig, HeadEntry


def make_config(shape, pattern_of) -> HeadConfig:
    """A HeadConfig for `shape` whose (layer, head) entry is `pattern_of(layer, head)` = (pattern, params)."""
    heads = [HeadEntry(l, h, *pattern_of(l, h)) for l in range(shape.n_layers) for h in range(shape.n_heads)]
    return HeadConfig(model=shape.to_dict(), heads=heads, provenance={"source": "test"})


def covering(n: int):
    """Every pattern with budgets that reach every causal key of an n-token prompt, mixed across heads."""
    choices = [("vs", {"vertical": n, "slash": n}), ("block", {"topk": -(-n // 64)}),
               ("ashape", {"sink": 0, "window": n}), ("dense", {}), ("vs", {"vertical": 30, "slash": n})]
    return lambda l, h: choices[(l + h) % len(choices)]


def tight(l, h):
    """Small budgets that really drop keys at n = 256."""
    return [("vs", {"vertical": 8, "slash": 16}), ("block", {"topk": 1}), ("ashape", {"sink": 4, "window": 32})][h % 3]
