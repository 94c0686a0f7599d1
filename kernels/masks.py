"""The one mask algebra: which (query i, key j) pairs a pattern keeps, as small composable predicates.

Each predicate is elementwise torch on index tensors that broadcast (e.g. i `[R, 1]` against j `[1, K]`,
sizes `[H, 1, 1]` per head), or on the scalar tensors FlexAttention passes to a `mask_mod`
(`lambda b, h, q_idx, kv_idx: ashape(q_idx, kv_idx, sink[h], window[h])`); no Python branch on values.

- `causal(i, j)`: j <= i.
- `sink(j, size)`: the first `size` keys.
- `local(offset, size)`: offsets i - j below `size` (a sliding window, the diagonal included), for masks
  built per offset (Toeplitz rows, slash sets).
- `window(i, j, size)`: `local(i - j, size)`.
- `band(i, j, sink_size, window_size)`: A-shape's token mask, sink or window (not causal by itself): what
  the prefill kernel applies on top of its tiles.
- `ashape(i, j, sink_size, window_size)`: causal and band.
- `dense_rows(i, j, first)`: causal, from query `first` on (dense rows, e.g. Tri-shape's question).
- `tile(table, i, j, block, key_block, head)`: membership in a per-row-block table, `table[..., i // block,
  j // key_block]` (key blocks of a block-sparse index with key_block = block, single keys of a kernel's
  pieces and columns with key_block = 1); `head` picks a head's table in the same indexing step (a
  `mask_mod` indexes once: `tile(table, q_idx, kv_idx, head=h)`, never `table[h]` first).

The Triton kernels (`workbench_kernels.prefill`) keep their own in-kernel expressions of the same
predicates (a Triton kernel cannot call torch functions); the kernel tests compare them with references
built from these (`AShape.to_mask`, `index_ref.tiles_to_mask`).
"""
from __future__ import annotations

import torch

from .tiling import BLOCK

Index = torch.Tensor | int


def causal(i: Index, j: Index) -> torch.Tensor:
    """Key j is at or before query i."""
    return j <= i


def sink(j: Index, size: Index) -> torch.Tensor:
    """Key j is one of the first `size` tokens."""
    return j < size


def local(offset: Index, size: Index) -> torch.Tensor:
    """Offset i - j is inside a window of `size` tokens ending at the diagonal (offset 0)."""
    return offset < size


def window(i: Index, j: Index, size: Index) -> torch.Tensor:
    """Key j is one of the `size` tokens ending at query i (for j <= i)."""
    return local(i - j, size)


def band(i: Index, j: Index, sink_size: Index, window_size: Index) -> torch.Tensor:
    """A-shape's token mask: key j is a sink or inside the window (not causal by itself)."""
    return sink(j, sink_size) | window(i, j, window_size)


def ashape(i: Index, j: Index, sink_size: Index, window_size: Index) -> torch.Tensor:
    """A-shape: causal, and a sink or inside the window."""
    return causal(i, j) & band(i, j, sink_size, window_size)


def dense_rows(i: Index, j: Index, first: Index) -> torch.Tensor:
    """Query i is a dense row (i >= first: it reads every key) and key j is causal to it."""
    return (i >= first) & causal(i, j)


def tile(table: torch.Tensor, i: Index, j: Index, block: int = BLOCK, key_block: int = BLOCK,
         head: Index | None = None) -> torch.Tensor:
    """Query i's row block reads key j's block: `table[..., i // block, j // key_block]` (or `table[head,
    ...]`), table Bool `[..., M, K]`: per query block of `block` rows, which key blocks of `key_block` keys
    it reads (key_block = 1: which keys)."""
    if head is None:
        return table[..., i // block, j // key_block]
    return table[head, i // block, j // key_block]
