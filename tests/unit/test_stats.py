"""Every blockwise statistic equals an explicit n x n computation at small n."""
import math

import pytest
import torch

from workbench.analysis.stats import MAPS, attention_rows, captured_mass, layer_stats


def dense_probs(q, k, scale):
    g = q.shape[0] // k.shape[0]
    kk = k.repeat_interleave(g, 0)
    s = (q.double() @ kk.double().transpose(1, 2)) * scale
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1)


# cell 1; cell 7 (blocks not made of cells); one ragged chunk; cell 4 nested in blocks over 4 chunks;
# cell 8 with a ragged last chunk (the 8K layout, scaled down)
@pytest.mark.parametrize("n,resolution,chunk,hq,hkv", [(100, 1024, 64, 3, 1), (200, 32, 64, 6, 2), (130, 7, 256, 4, 4),
                                                       (256, 64, 64, 6, 3), (1000, 125, 128, 9, 3)])
def test_layer_stats_match_explicit(n, resolution, chunk, hq, hkv):
    torch.manual_seed(n)
    q, k = torch.randn(hq, n, 16) * 2, torch.randn(hkv, n, 16) * 2
    p = dense_probs(q, k, 0.25)
    st = layer_stats(q, k, 0.25, resolution=resolution, block=16, chunk=chunk)
    assert torch.allclose(st.column_mass.double(), p.sum(1), atol=1e-5)
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    causal = i >= j
    diag = torch.zeros(hq, n, dtype=torch.float64).index_add_(1, (i - j)[causal], p[:, causal])
    assert torch.allclose(st.diag_mass.double(), diag, atol=1e-5)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert torch.allclose(st.row_entropy.double(), ent, atol=1e-4)
    cell = math.ceil(n / resolution)
    R = math.ceil(n / cell)
    pad = torch.zeros(hq, R * cell, R * cell, dtype=torch.float64)
    pad[:, :n, :n] = p
    cells = pad.view(hq, R, cell, R, cell)
    assert st.max_map.shape == (hq, R, R)
    assert torch.allclose(st.max_map.double(), cells.amax((2, 4)), atol=1e-6)
    cnt = torch.zeros(R * cell, R * cell, dtype=torch.float64)
    cnt[:n, :n] = 1
    counts = cnt.view(R, cell, R, cell).sum((1, 3))
    assert torch.allclose(st.mean_map.double(), cells.sum((2, 4)) / counts, atol=1e-6)
    M = math.ceil(n / 16)
    bp = torch.zeros(hq, M * 16, M * 16, dtype=torch.float64)
    bp[:, :n, :n] = p
    assert torch.allclose(st.block_mass.double(), bp.view(hq, M, 16, M, 16).sum((2, 4)), atol=1e-5)
    # every row is a distribution: the masses add up to n
    assert torch.allclose(st.block_mass.sum((1, 2)), torch.full((hq,), float(n)), atol=1e-3)


def test_layer_stats_computes_only_requested_maps():
    torch.manual_seed(3)
    q, k = torch.randn(6, 300, 16) * 2, torch.randn(2, 300, 16) * 2
    full = layer_stats(q, k, 0.25, resolution=50, block=16, chunk=96)
    for name in MAPS:
        st = layer_stats(q, k, 0.25, resolution=50, block=16, chunk=96, maps=[name])
        assert all(getattr(st, other) is None for other in MAPS if other != name)
        torch.testing.assert_close(getattr(st, name), getattr(full, name), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="maps=.*subset"):
        layer_stats(q, k, 0.25, maps=("max_map", "mean"))
    with pytest.raises(ValueError, match="non-empty"):
        layer_stats(q, k, 0.25, maps=())


def test_attention_rows_reuses_one_buffer_per_walk():
    """Chunks overwrite each other's p (documented): the first chunk's values are gone after the walk."""
    torch.manual_seed(4)
    q, k = torch.randn(2, 64, 8), torch.randn(1, 64, 8)
    chunks = [(r0, p) for r0, _, p, _ in attention_rows(q, k, 0.5, chunk=16)]
    ptrs = {p.data_ptr() for _, p in chunks}
    assert len(ptrs) == 1
    fresh = next(attention_rows(q, k, 0.5, chunk=16))[2]
    assert fresh.is_contiguous() and not torch.equal(chunks[0][1], fresh)


class ColumnIndex:
    def __init__(self, cols, h):
        self.cols, self.h = cols, h

    def row_mask(self, r0, r1, n):
        m = torch.zeros(self.h, r1 - r0, n, dtype=torch.bool)
        m[:, :, self.cols] = True
        return m


def test_captured_mass_is_masked_sum_and_gqa():
    torch.manual_seed(1)
    q, k = torch.randn(6, 90, 8), torch.randn(2, 90, 8)
    p = dense_probs(q, k, 0.5)
    cols = [0, 3, 40, 89]
    got = captured_mass(q, k, 0.5, ColumnIndex(cols, 6), chunk=32)
    assert torch.allclose(got.double(), p[:, :, cols].sum(-1), atol=1e-5)
    # GQA: head 4 reads KV head 1 (4 // 3), not KV head 0
    p_wrong = dense_probs(q[4:5], k[0:1], 0.5)
    assert not torch.allclose(got[4].double(), p_wrong[0][:, cols].sum(-1), atol=1e-3)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        next(attention_rows(torch.randn(5, 8, 4), torch.randn(2, 8, 4), 1.0))
    with pytest.raises(ValueError, match="empty"):
        layer_stats(torch.randn(2, 0, 4), torch.randn(2, 0, 4), 1.0)
    q = torch.randn(2, 8, 4)
    q[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        layer_stats(q, torch.randn(2, 8, 4), 1.0)
    with pytest.raises(ValueError, match="expected"):
        captured_mass(torch.randn(3, 8, 4), torch.randn(1, 8, 4), 1.0, ColumnIndex([0], 2))


@pytest.mark.parametrize("rows", [(0, 200), (136, 200), (13, 77), (190, 200)])
def test_layer_sums_over_a_row_segment_equal_the_dense_softmax_of_those_rows(rows):
    from workbench.analysis.metrics import column_offset_mass, layer_sums

    torch.manual_seed(0)
    h, n, r0, r1 = 6, 200, *rows
    q, k = torch.randn(h, n, 16), torch.randn(2, n, 16)
    s = (q @ k.repeat_interleave(3, 0).transpose(1, 2)) * 0.3
    p = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    seg = torch.zeros_like(p)
    seg[:, r0:r1] = p[:, r0:r1]
    sums = layer_sums(q, k, 0.3, chunk=64, rows=rows)
    assert sums.n_rows == r1 - r0
    torch.testing.assert_close(sums.column_mass, seg.sum(1), atol=1e-5, rtol=0)
    i, j = torch.tril_indices(n, n)
    diag = torch.zeros(h, n).index_add_(1, i - j, seg[:, i, j])
    torch.testing.assert_close(sums.diag_mass, diag, atol=1e-5, rtol=0)
    pad = torch.nn.functional.pad(seg, (0, -n % 64, 0, -n % 64))
    m = pad.shape[-1] // 64
    m0, m1 = sums.block_rows  # the segment's row blocks only: O(n) memory for the answer rows
    assert (m0, m1) == (r0 // 64, -(-r1 // 64)) and sums.block_mass.shape == (h, m1 - m0, m)
    torch.testing.assert_close(sums.block_mass, pad.reshape(h, m, 64, m, 64).sum((2, 4))[:, m0:m1], atol=1e-5, rtol=0)
    torch.testing.assert_close(sums.lse[:, r0:r1], s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                                  float("-inf")).logsumexp(-1)[:, r0:r1], atol=1e-4, rtol=0)
    cols = torch.stack([torch.randperm(n)[:10] for _ in range(h)])
    overlap = column_offset_mass(q, k, 0.3, sums.lse, [cols], rows=rows)[0]
    on_cols = torch.zeros(h, n, n, dtype=torch.bool).scatter_(2, cols[:, None, :].expand(-1, n, -1), True)
    ref = torch.zeros(h, n).index_add_(1, i - j, (seg * on_cols)[:, i, j])
    torch.testing.assert_close(overlap, ref, atol=1e-5, rtol=0)


def test_backend_choice_is_checked_and_cpu_tensors_default_to_the_reference(monkeypatch):
    from workbench.analysis import stats

    q, k = torch.randn(2, 40, 8), torch.randn(1, 40, 8)
    assert not stats.use_triton(q)  # "auto": Triton only for CUDA tensors
    with stats.backend("triton"):
        assert stats.use_triton(q)
    assert not stats.use_triton(q)
    with pytest.raises(ValueError, match="backend 'gpu' is unknown"):
        with stats.backend("gpu"):
            pass
    torch.testing.assert_close(layer_stats(q, k, 0.5, progress=True).diag_mass, layer_stats(q, k, 0.5).diag_mass)
    monkeypatch.setattr(stats, "_backend", "cuda")
    with pytest.raises(ValueError, match="WORKBENCH_STATS_BACKEND='cuda' is unknown"):
        layer_stats(q, k, 0.5)
