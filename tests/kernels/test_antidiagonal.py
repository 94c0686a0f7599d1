"""XAttention's antidiagonal block scores in Triton (`workbench_kernels.antidiagonal`) against the PyTorch reference
(`workbench.patterns.xattention.antidiagonal_block_scores`, itself checked against plain loops in
tests/unit/test_methods.py), and the XAttention layer tiles it feeds."""
from __future__ import annotations

import pytest
import torch
from workbench_kernels.antidiagonal import antidiagonal_scores
from workbench_kernels.index_ref import tiles_to_mask

from workbench.patterns.xattention import XAttention, antidiagonal_block_scores

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,stride,d,hq,hkv", [
    (64, 8, 8, 2, 1), (150, 8, 8, 4, 2), (200, 16, 16, 2, 2), (130, 4, 8, 3, 1), (300, 64, 16, 2, 1),
    (700, 32, 8, 2, 1), (1000, 8, 16, 4, 2)])
def test_antidiagonal_scores_equal_the_reference(n, stride, d, hq, hkv):
    """N not a multiple of 64 or of the stride, GQA, every stride; fp32 (full-precision dots)."""
    torch.manual_seed(n)
    q, k = torch.randn(hq, n, d, device=DEV), torch.randn(hkv, n, d, device=DEV)
    got = antidiagonal_scores(q, k, 0.35, stride)
    want = antidiagonal_block_scores(q, k, 0.35, stride)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    m = -(-n // 64)
    assert torch.allclose(got.sum(-1), torch.ones(hq, m, device=DEV))
    assert not got.triu(1).any()  # nothing above the diagonal


@pytest.mark.parametrize("tile", [(64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (256, 64, 8, 3)])
def test_every_tile_gives_the_same_scores(tile):
    """The launch shapes the H200 probe compares (`scripts/antidiagonal_probe.py`): the same scores, N not a
    multiple of any tile."""
    torch.manual_seed(2)
    q, k = torch.randn(4, 1100, 16, device=DEV), torch.randn(2, 1100, 16, device=DEV)
    torch.testing.assert_close(antidiagonal_scores(q, k, 0.3, 8, tile=tile),
                               antidiagonal_block_scores(q, k, 0.3, 8), atol=1e-6, rtol=1e-5)


def test_bad_stride_and_shapes_name_the_field():
    q, k = torch.randn(2, 100, 8), torch.randn(1, 100, 8)
    with pytest.raises(ValueError, match="stride"):
        antidiagonal_scores(q, k, 0.3, 6)
    with pytest.raises(ValueError, match="Hkv"):
        antidiagonal_scores(q, torch.randn(3, 100, 8), 0.3, 8)
    with pytest.raises(ValueError, match="tile"):
        antidiagonal_scores(q, k, 0.3, 8, tile=(64, 128, 4, 3))


def test_xattention_layer_tiles_from_the_kernel_equal_the_reference_ones():
    """The prefill's XAttention tiles (`layer_tiles(triton=True)`: the Triton scores) hold the keys of the
    reference path's, per prompt of the batch."""
    torch.manual_seed(0)
    n = 320
    q, k = torch.randn(2, 4, n, 16, device=DEV) * 2, torch.randn(2, 2, n, 16, device=DEV) * 2
    params = [{"tau_milli": t, "stride": s} for t, s in ((500, 8), (900, 8), (950, 16), (800, 4))]
    got, _ = XAttention.layer_tiles(params, q, k, 0.25, {}, 64, triton=True)
    want, _ = XAttention.layer_tiles(params, q, k, 0.25, {}, 64, triton=False)
    assert torch.equal(tiles_to_mask(got, n), tiles_to_mask(want, n))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots need CUDA")
def test_antidiagonal_scores_bf16_at_a_model_shape():
    """bf16 q / k at head_dim 128, 4K tokens, GQA 4:1: within fp32 rounding of the reference on the same values."""
    torch.manual_seed(1)
    q, k = (torch.randn(h, 4096, 128, device="cuda").to(torch.bfloat16) for h in (8, 2))
    got = antidiagonal_scores(q, k, 128 ** -0.5, 8)
    want = antidiagonal_block_scores(q.double(), k.double(), 128 ** -0.5, 8).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-3)
