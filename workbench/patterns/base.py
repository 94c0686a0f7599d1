"""What every pattern index offers, plus the dense pattern and a per-head stack of patterns.

A pattern object holds the index of all H heads of one layer for one prompt. It never stores an
n x n mask: `row_mask(r0, r1, n)` materialises only the rows the caller asks for (the exact statistics
in `workbench.analysis.stats` walk the rows in chunks). All counts exclude non-causal entries (j > i).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

BLOCK = 64
MAX_MASK_N = 4096  # to_mask() refuses longer prompts: an n x n mask per head is for tests and pictures


class Pattern(Protocol):
    """A sparse attention index for H heads of one layer."""

    n_heads: int

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        """Bool `[H, r1-r0, n]`: True where query row i (r0 <= i < r1) may read key j (always j <= i)."""

    def edges(self, n: int) -> torch.Tensor:
        """Long `[H]`: logical edge count (causal query-key pairs read, duplicates once)."""

    def tiles(self, n: int) -> torch.Tensor:
        """Long `[H]`: physical 64x64 tile area the kernel computes."""


def causal_rows(r0: int, r1: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool `[r1-r0, n]`: the causal mask of rows r0..r1-1."""
    i = torch.arange(r0, r1, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return j <= i


def check_rows(r0: int, r1: int, n: int) -> None:
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"rows [{r0}, {r1}) are not inside a prompt of {n} tokens: need 0 <= r0 <= r1 <= n")


def to_mask(pattern: Pattern, n: int) -> torch.Tensor:
    """Bool `[H, n, n]` of any pattern; small n only (tests and pictures)."""
    if n > MAX_MASK_N:
        raise ValueError(f"to_mask(n={n}) would build {n}x{n} per head: use n <= {MAX_MASK_N}, or "
                         "row_mask(r0, r1, n) / workbench.analysis.stats for long prompts")
    return pattern.row_mask(0, n, n)


def causal_tiles(n: int, block: int = BLOCK) -> int:
    """Number of 64x64 tiles that hold at least one causal entry (the dense kernel's work)."""
    m = -(-n // block)
    return m * (m + 1) // 2


def causal_edges(n: int) -> int:
    return n * (n + 1) // 2


class Dense:
    """Full causal attention for H heads (the fallback when no sparse candidate is good enough)."""

    def __init__(self, n_heads: int):
        self.n_heads = n_heads

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        return causal_rows(r0, r1, n).expand(self.n_heads, -1, -1)

    def to_mask(self, n: int) -> torch.Tensor:
        return to_mask(self, n)

    def edges(self, n: int) -> torch.Tensor:
        return torch.full((self.n_heads,), causal_edges(n), dtype=torch.long)

    def tiles(self, n: int) -> torch.Tensor:
        return torch.full((self.n_heads,), causal_tiles(n), dtype=torch.long)

    def __repr__(self) -> str:
        return f"Dense(n_heads={self.n_heads})"


class Stack:
    """Heads of one layer that use different patterns: `parts[0]` covers the first heads, and so on."""

    def __init__(self, parts: Sequence[Pattern]):
        if not parts:
            raise ValueError("Stack needs at least one pattern")
        self.parts = list(parts)
        self.n_heads = sum(p.n_heads for p in self.parts)

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        return torch.cat([p.row_mask(r0, r1, n) for p in self.parts])

    def to_mask(self, n: int) -> torch.Tensor:
        return to_mask(self, n)

    def edges(self, n: int) -> torch.Tensor:
        return torch.cat([p.edges(n) for p in self.parts])

    def tiles(self, n: int) -> torch.Tensor:
        return torch.cat([p.tiles(n) for p in self.parts])

    def __repr__(self) -> str:
        return f"Stack({self.parts!r})"
