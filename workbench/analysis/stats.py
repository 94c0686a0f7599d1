"""Exact dense attention statistics of one layer: Triton kernels on the GPU, a PyTorch reference elsewhere.

`layer_stats` and `captured_mass` (and `metrics.layer_sums` / `metrics.column_offset_mass`) run the
two-pass Triton kernels of `workbench_kernels.attn_stats` when q is on a CUDA device, and the blockwise
PyTorch reference `workbench_kernels.attn_stats_ref` otherwise (same arguments, same results up to fp32
summation order). `backend("triton")` forces the kernels (on the CPU they need TRITON_INTERPRET=1),
`backend("torch")` the reference; the environment variable WORKBENCH_STATS_BACKEND sets the default.

The kernel path pools the maps at a cell (ceil(N / resolution)) and a `block` that divide 64 or are
larger than 64; other sizes (a cell of 20 or 48, say) run the reference. `captured_mass` runs the
kernel when the index's tiles plus its token band and dense rows (`Pattern.to_tiles`, `token_band`) keep
exactly its logical edges (`edges`); otherwise the reference.

`window_map` re-reduces one head over a window of its attention (a zoom into the pooled map) at the
finest cell that fits the screen, exactly: each row keeps its full causal softmax normaliser.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator

import torch
from tqdm.auto import tqdm
from workbench_kernels import attn_stats_ref as ref
from workbench_kernels.attn_stats_ref import MAPS, LayerStats, RowMasked, TokenRule, attention_rows
from workbench_kernels.tiling import BLOCK

__all__ = ["MAPS", "LayerStats", "RowMasked", "attention_rows", "backend", "captured_mass", "kernel_rule",
           "layer_stats", "use_triton", "window_map"]

BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("WORKBENCH_STATS_BACKEND", "auto")
WINDOW_PROBS = 1 << 22  # probabilities `window_map` holds at a time (16 MB fp32)


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Within the block, statistics run on `name`: "auto" (Triton for CUDA tensors, PyTorch otherwise),
    "triton" (always the kernels) or "torch" (always the reference)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is unknown: use one of {BACKENDS}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def use_triton(q: torch.Tensor) -> bool:
    """Whether the statistics of q run on the Triton kernels (see `backend`)."""
    if _backend not in BACKENDS:
        raise ValueError(f"WORKBENCH_STATS_BACKEND={_backend!r} is unknown: use one of {BACKENDS}")
    return _backend == "triton" or (_backend == "auto" and q.is_cuda)


def layer_stats(q: torch.Tensor, k: torch.Tensor, scale: float, resolution: int = 1024, block: int = BLOCK,
                chunk: int = 256, progress: bool = False, maps: Collection[str] = MAPS,
                lse: torch.Tensor | None = None) -> LayerStats:
    """The requested statistics (`maps`, a subset of `MAPS`) of one layer, exact.

    q `[Hq, N, D]`, k `[Hkv, N, D]`; query head h reads KV head h // (Hq // Hkv). `resolution` caps the
    pooled maps at R x R cells (cell = ceil(N / resolution)). On the reference path `chunk` query rows
    are in memory at a time (`[Hq, chunk, N]` fp32) and every map costs passes over them: request only
    those you read; `progress` shows a bar there (the kernels take one launch per pass). `lse` `[Hq, N]`
    (the rows' log-normalisers, natural log, e.g. `LayerRunner.row_lse`) saves the kernels their first
    pass; the reference computes each row's normaliser with its probabilities and does not read it.
    """
    ref.check_qk(q, k)
    want, cell = ref.stats_layout(q.shape[1], resolution, block, maps)
    if use_triton(q):
        from workbench_kernels import attn_stats

        if (attn_stats.pooling_supported(cell) or not want & {"max_map", "mean_map"}) and (
                attn_stats.pooling_supported(block) or "block_mass" not in want):
            return attn_stats.layer_stats(q, k, scale, resolution, block, maps, lse)
    bar = (lambda chunks, total: tqdm(chunks, total=total, desc="stats", leave=False)) if progress else None
    return ref.layer_stats(q, k, scale, resolution, block, chunk, bar, maps)


def kernel_rule(index: RowMasked, n: int) -> TokenRule | None:
    """The index as the captured-mass kernel reads it: its tiles (with their dense rows) plus its token band
    (`TokenRule`). None when the index has no tiles (the reference reads `row_mask` only)."""
    to_tiles = getattr(index, "to_tiles", None)
    if to_tiles is None:
        return None
    tiles = to_tiles(n)
    band = index.token_band() if hasattr(index, "token_band") else None
    return TokenRule(tiles) if band is None else TokenRule.banded(tiles, band[0], band[1], n)


def captured_mass(q: torch.Tensor, k: torch.Tensor, scale: float, index: RowMasked,
                  chunk: int = 256, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Exact dense probability mass that `index` keeps, per query row: `[Hq, N]` in [0, 1].

    The kernel path counts the tokens it kept per head; when that is not the index's logical edge
    count (`edges(n)`: its tiles cover more than its mask, as Vertical-Slash pieces do), the reference
    recomputes the mass from `row_mask`. `lse` `[Hq, N]` (the rows'
    log-normalisers, e.g. `LayerSums.lse`) saves the kernel path its first pass."""
    ref.check_qk(q, k)
    n = q.shape[1]
    if use_triton(q):
        rule = kernel_rule(index, n)
        if rule is not None:
            from workbench_kernels import attn_stats

            mass, count = attn_stats.captured_mass(q, k, scale, rule, lse)
            if torch.equal(count.sum(1, dtype=torch.int64).cpu(), index.edges(n).cpu().long()):
                return mass
    return ref.captured_mass(q, k, scale, index, chunk)


def _window_probs(q: torch.Tensor, k: torch.Tensor, scale: float, rows: tuple[int, int], cols: tuple[int, int]
                  ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield (a, b, p) over the query rows [a, b) of `rows`: p `[b - a, min(c1, b) - c0]` fp32, one head's
    exact causal probabilities at keys c0.. (keys from b on are 0 for these rows, so they are left out).

    q, k `[1, N, D]`; rows start at c0 or later. Triton path: the rows' log-sum-exp from `attn_stats.row_lse`,
    then only the window's columns, p = exp(scale q.k - lse). Reference path: the window's columns of
    `attention_rows` (its chunks hold keys 0..b-1)."""
    (r0, r1), (c0, c1) = rows, cols
    if not use_triton(q):
        for a, b, p, _ in attention_rows(q, k, scale, chunk=max(1, WINDOW_PROBS // r1), rows=rows):
            yield a, b, p[0, :, c0:c1]
        return
    from workbench_kernels import attn_stats

    lse = attn_stats.row_lse(q, k, scale, rows=rows)[0][0]
    keys = k[0, c0:min(c1, r1)].float().T
    step = max(1, WINDOW_PROBS // keys.shape[1])
    for a in range(r0, r1, step):
        b = min(r1, a + step)
        w = min(c1, b) - c0
        s = (q[0, a:b].float() * scale) @ keys[:, :w] - lse[a:b, None]
        future = torch.arange(c0, c0 + w, device=q.device) > torch.arange(a, b, device=q.device)[:, None]
        yield a, b, s.masked_fill_(future, float("-inf")).exp_()


@torch.no_grad()
def window_map(q: torch.Tensor, k: torch.Tensor, scale: float, head: int, rows: tuple[int, int],
               cols: tuple[int, int], max_cells: int = 1024) -> tuple[torch.Tensor, int]:
    """One head's attention over a window, max-pooled at the finest cell that fits: (map `[R, C]` fp32
    probabilities, cell in tokens).

    q `[Hq, N, D]`, k `[Hkv, N, D]`; query head `head` reads KV head head // (Hq // Hkv). rows = (r0, r1)
    query rows, cols = (c0, c1) keys. cell = ceil(max(r1 - r0, c1 - c0) / max_cells), cells start at
    (r0, c0), R = ceil((r1 - r0) / cell), C = ceil((c1 - c0) / cell); the last cells pool the tokens left.
    Exact: every probability uses its row's softmax over all its keys 0..i, keys j > i are 0 (a cell
    above the diagonal is 0); cell 1 gives the probabilities themselves.

    Cost: the rows' normalisers (rows x r1 scores) plus rows x window width, `WINDOW_PROBS` probabilities
    in memory at a time (never rows x N). On the Triton path (`use_triton`: a GPU) the normalisers are one
    `row_lse` pass, so a zoom at N = 1M costs the rows' lse plus rows x width, not the whole head.
    """
    ref.check_qk(q, k)
    hq, n, _ = q.shape
    if not 0 <= head < hq:
        raise ValueError(f"head={head} is out of range: q has query heads 0..{hq - 1}")
    for name, (a, b) in (("rows", rows), ("cols", cols)):
        if not 0 <= a < b <= n:
            raise ValueError(f"{name}=({a}, {b}) must satisfy 0 <= start < stop <= N = {n}: "
                             "pick a non-empty range inside the capture")
    if max_cells < 1:
        raise ValueError(f"max_cells={max_cells} must be >= 1: the map needs a cell per side")
    (r0, r1), (c0, c1) = rows, cols
    cell = -(-max(r1 - r0, c1 - c0) // max_cells)
    out = torch.zeros(-(-(r1 - r0) // cell), -(-(c1 - c0) // cell), device=q.device)
    first = max(r0, c0)  # rows above the first key see none of the window
    if first >= r1:
        return out, cell
    kv = head // (hq // k.shape[0])
    for a, b, p in _window_probs(q[head:head + 1], k[kv:kv + 1], scale, (first, r1), cols):
        top = (a - r0) % cell  # zeros (p >= 0) pad the rows to whole cells and the keys to the map's width
        p = torch.nn.functional.pad(p, (0, out.shape[1] * cell - p.shape[1], top, -(b - a + top) % cell))
        pooled = p.view(-1, cell, out.shape[1], cell).amax((1, 3))
        i = (a - r0) // cell  # a row step's first and last cells may be shared with its neighbours
        out[i:i + len(pooled)] = pooled.maximum(out[i:i + len(pooled)])
    return out, cell
