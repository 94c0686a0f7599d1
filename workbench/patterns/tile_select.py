"""Helpers shared by the newer prefill patterns (Tri-shape, dilated, strided, XAttention, FlexPrefill):
per-row-block or per-head choice between two tilings, tile counts, cumulative-share selection, and sorted
position lists from boolean masks.

All run on q's device with no host synchronisation except `select_tiles`' width (static: the wider of
the two inputs).
"""
from __future__ import annotations

import dataclasses

import torch
from workbench_kernels.index_ref import VSTiles


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=-1)


def select_tiles(a: VSTiles, b: VSTiles, take_b: torch.Tensor) -> VSTiles:
    """Tiles of `b` where `take_b` (Bool broadcastable to `[B, H, M]`) else of `a`; same block and piece."""
    if (a.block, a.piece) != (b.block, b.piece) or a.shape != b.shape:
        raise ValueError(f"cannot mix tiles of shape {a.shape} / block {a.block} with {b.shape} / block {b.block}")
    if a.dense_from is not None or b.dense_from is not None:
        raise ValueError("select_tiles mixes list tiles per row block: tiles with dense rows (dense_from) cannot mix")
    take = take_b.to(a.block_count.device).expand(a.shape)
    ns = max(a.block_offset.shape[-1], b.block_offset.shape[-1])
    nc = max(a.column_index.shape[-1], b.column_index.shape[-1])
    pick = lambda x, y, w=None: torch.where(take if w is None else take[..., None],  # noqa: E731
                                            y if w is None else _pad_last(y, w), x if w is None else _pad_last(x, w))
    return VSTiles(pick(a.block_count, b.block_count), pick(a.block_offset, b.block_offset, ns),
                   pick(a.column_count, b.column_count), pick(a.column_index, b.column_index, nc), a.block, a.width)


def repeat_batch(tiles: VSTiles, batch: int) -> VSTiles:
    """Tiles of batch 1 -> the same tiles for `batch` prompts (a view, no copy)."""
    return tiles.map(lambda t: t.expand(batch, *t.shape[1:]))


def stack_batch(parts: list[VSTiles]) -> VSTiles:
    """Tiles of batch 1 each (same heads and row blocks) -> one `VSTiles` over the batch, widths padded."""
    if len(parts) == 1:
        return parts[0]
    ns = max(t.block_offset.shape[-1] for t in parts)
    nc = max(t.column_index.shape[-1] for t in parts)
    cat = lambda get, w=None: torch.cat([get(t) if w is None else _pad_last(get(t), w) for t in parts])  # noqa: E731
    out = VSTiles(cat(lambda t: t.block_count), cat(lambda t: t.block_offset, ns), cat(lambda t: t.column_count),
                  cat(lambda t: t.column_index, nc), parts[0].block, parts[0].width)
    if any(t.dense_from is not None for t in parts):
        starts = [t.with_dense_rows(parts).dense_from if t.dense_from is None else t.dense_from for t in parts]
        out = dataclasses.replace(out, dense_from=torch.cat(starts), dense_rows=max(t.dense_rows for t in parts))
    return out


def tile_count(tiles: VSTiles) -> torch.Tensor:
    """Long `[B, H]`: tiles the kernel computes (pieces plus column strips packed `piece` at a time); a row block
    that holds dense rows counts as every causal key block (at most the causal tiles, like a dense head)."""
    per_block = tiles.block_count.long() + -(-tiles.column_count.long() // tiles.piece)
    dense = tiles.dense_blocks()
    if dense is not None:
        per_block = torch.where(dense, torch.arange(tiles.shape[-1], device=dense.device) + 1, per_block)
    return per_block.sum(-1)


def cumulative_keep(weight: torch.Tensor, share: float | torch.Tensor, min_keep: int = 1) -> torch.Tensor:
    """Bool like `weight` `[..., K]` (>= 0; 0 = never chosen unless needed for `min_keep`): keep the
    largest entries, in order, until the kept ones hold `share` of the row's total; at least
    `min_keep`. share >= 1 keeps every entry with weight > 0 (and `min_keep`). `share` broadcasts
    against `weight[..., :1]` (e.g. one per head)."""
    share = torch.as_tensor(share, dtype=weight.dtype, device=weight.device)
    w, order = weight.sort(-1, descending=True)
    before = w.cumsum(-1) - w  # mass of the entries ranked above
    total = w.sum(-1, keepdim=True)
    rank = torch.arange(w.shape[-1], device=w.device)
    keep = ((before < share * total) & (w > 0)) | (rank < min_keep) | ((share >= 1) & (w > 0))
    return torch.zeros_like(keep).scatter(-1, order, keep)


def positions(keep: torch.Tensor) -> torch.Tensor:
    """Long `[..., K]`: the indices where `keep` `[..., K]` is True, ascending, -1 padded (static width K)."""
    k = keep.shape[-1]
    idx = torch.where(keep, torch.arange(k, device=keep.device), k).sort(-1).values
    return torch.where(idx >= k, -1, idx)
