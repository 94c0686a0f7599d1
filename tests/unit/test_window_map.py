"""`stats.window_map` (a zoom into one head's map, re-reduced) against dense softmax probabilities pooled by hand,
on the reference path and on the Triton path (TRITON_INTERPRET=1 on the CPU)."""
from __future__ import annotations

import math

import pytest
import torch

from workbench.analysis import stats

N, D, SCALE = 200, 64, 0.125


def _qk(hq: int, hkv: int, seed: int = 0, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(hq, N, d, generator=g) * 1.5, torch.randn(hkv, N, d, generator=g) * 1.5


def _pooled_by_hand(q, k, head, rows, cols, cell):
    """The dense causal softmax of head `head` (all N keys), cut to the window and max-pooled cell by cell."""
    kv = head // (q.shape[0] // k.shape[0])
    s = (q[head].double() @ k[kv].double().T) * SCALE
    p = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    (r0, r1), (c0, c1) = rows, cols
    out = torch.zeros(math.ceil((r1 - r0) / cell), math.ceil((c1 - c0) / cell), dtype=torch.float64)
    for a in range(out.shape[0]):
        for b in range(out.shape[1]):
            out[a, b] = p[r0 + a * cell:min(r1, r0 + (a + 1) * cell), c0 + b * cell:min(c1, c0 + (b + 1) * cell)].max()
    return out


# (hq, hkv, head, rows, cols, max_cells, cell): a window across the diagonal with a partial last cell (13 rows in
# cells of 4), one entirely below the diagonal, one with rows above the window's keys, the whole head, cell 1
WINDOWS = [(4, 2, 3, (20, 133), (7, 180), 50, 4), (4, 2, 1, (150, 200), (0, 40), 16, 4),
           (6, 2, 4, (0, 120), (60, 199), 7, 20), (6, 2, 5, (0, N), (0, N), 64, 4), (4, 2, 0, (90, 110), (95, 105), 20, 1)]


@pytest.mark.parametrize("held", [stats.WINDOW_PROBS, 900])  # 900: row steps of a few rows that split cells
@pytest.mark.parametrize("hq,hkv,head,rows,cols,max_cells,cell", WINDOWS)
def test_window_map_is_the_dense_softmax_pooled(hq, hkv, head, rows, cols, max_cells, cell, held, monkeypatch):
    monkeypatch.setattr(stats, "WINDOW_PROBS", held)
    q, k = _qk(hq, hkv, seed=head)
    got, got_cell = stats.window_map(q, k, SCALE, head, rows, cols, max_cells=max_cells)
    want = _pooled_by_hand(q, k, head, rows, cols, cell)
    assert got_cell == cell and got.dtype == torch.float32 and max(got.shape) <= max_cells
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)


def test_gemma_shape_one_kv_head_and_head_dim_256_on_both_paths(monkeypatch):
    """Gemma-3-270M's global layers: 4 query heads on one KV head, head_dim 256."""
    monkeypatch.setattr(stats, "WINDOW_PROBS", 900)
    q, k = _qk(4, 1, seed=7, d=256)
    q = q / 4  # scores of the same spread as the d = 64 cases
    want = _pooled_by_hand(q, k, 3, (20, 133), (7, 180), 4)
    got, cell = stats.window_map(q, k, SCALE, 3, (20, 133), (7, 180), max_cells=50)
    assert cell == 4
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    with stats.backend("triton"):
        tri, _ = stats.window_map(q, k, SCALE, 3, (20, 133), (7, 180), max_cells=50)
    torch.testing.assert_close(tri, got, atol=1e-6, rtol=1e-5)


def test_a_window_above_the_diagonal_is_zero():
    q, k = _qk(4, 2)
    got, cell = stats.window_map(q, k, SCALE, 2, (0, 50), (60, 200), max_cells=35)
    assert cell == 4 and got.shape == (13, 35) and not got.any()


@pytest.mark.parametrize("hq,hkv,head,rows,cols,max_cells,cell", [WINDOWS[0], WINDOWS[2]])
def test_triton_path_equals_the_reference(hq, hkv, head, rows, cols, max_cells, cell, monkeypatch):
    q, k = _qk(hq, hkv, seed=head)
    monkeypatch.setattr(stats, "WINDOW_PROBS", 900)
    want, _ = stats.window_map(q, k, SCALE, head, rows, cols, max_cells=max_cells)
    with stats.backend("triton"):
        got, got_cell = stats.window_map(q, k, SCALE, head, rows, cols, max_cells=max_cells)
    assert got_cell == cell  # exp(s - lse) vs a softmax: fp32 rounding of scores |s| ~ 20 is relative, ~2e-6
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("args,match", [
    (dict(head=4), r"head=4 is out of range: q has query heads 0\.\.3"),
    (dict(head=-1), "head=-1 is out of range"),
    (dict(rows=(30, 30)), r"rows=\(30, 30\) must satisfy 0 <= start < stop <= N = 200"),
    (dict(rows=(-1, 10)), r"rows=\(-1, 10\)"),
    (dict(cols=(0, 201)), r"cols=\(0, 201\) must satisfy"),
    (dict(max_cells=0), "max_cells=0 must be >= 1"),
])
def test_bad_input_names_the_field(args, match):
    q, k = _qk(4, 2)
    call = dict(head=0, rows=(0, 100), cols=(0, 100), max_cells=10) | args
    with pytest.raises(ValueError, match=match):
        stats.window_map(q, k, SCALE, **call)
