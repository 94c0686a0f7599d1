"""A streamed chunk's attention as two calls merged by their row log-sum-exps (`workbench.core.stream`):
equal to one causal softmax over all keys, with GQA, on the first chunk and on later ones."""
import math

import pytest
import torch

from workbench.core.stream import agrees_with_softmax, lse_kernel, merge_partials, split_causal_attention


def softmax_attention(q, k, v, causal, scale):
    """Plain attention with each row's log-sum-exp: q `[1, Hq, C, D]`, k/v `[1, Hkv, K, D]`, causal lower-right."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        c, e = s.shape[-2:]
        s = s.masked_fill(torch.ones(c, e, dtype=torch.bool).triu(e - c + 1), float("-inf"))
    return (s.softmax(-1) @ v.double()).to(q.dtype), s.logsumexp(-1).float()


@pytest.mark.parametrize("start,c", [(0, 48), (80, 48), (37, 61)])
def test_split_chunk_equals_one_causal_softmax(start, c):
    g = torch.Generator().manual_seed(start)
    q = torch.randn(1, 8, c, 32, generator=g)
    k, v = (torch.randn(1, 2, start + c, 32, generator=g) for _ in range(2))
    scale = 1 / math.sqrt(32)
    out, lse = split_causal_attention(q, k, v, start, scale, softmax_attention)
    want_out, want_lse = softmax_attention(q, k, v, True, scale)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_merging_two_key_sets_weights_each_by_its_mass():
    """Merging attention over keys A and over keys B gives attention over A + B; a key set far below the
    other (lse 30 lower) contributes nothing measurable."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 10, 16, generator=g)
    k, v = (torch.randn(1, 4, 30, 16, generator=g) for _ in range(2))
    a = softmax_attention(q, k[:, :, :12], v[:, :, :12], False, 0.25)
    b = softmax_attention(q, k[:, :, 12:], v[:, :, 12:], False, 0.25)
    out, lse = merge_partials(*a, *b)
    want_out, want_lse = softmax_attention(q, k, v, False, 0.25)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    out, lse = merge_partials(a[0], a[1], b[0], b[1] - 30.0)
    torch.testing.assert_close(out, a[0], atol=1e-6, rtol=1e-6)


def test_no_fused_kernel_on_the_cpu():
    q = torch.randn(1, 4, 8, 16)
    assert lse_kernel(q, q[:, :2], q[:, :2], 0.25) is None


def test_the_probe_refuses_a_kernel_that_is_wrong_or_nan():
    """A fused kernel is used only where it gives causal attention on the probe: plain attention passes, one
    that drops the causal mask, returns NaN or a wrong lse does not."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 16, 32, generator=g)
    k, v = (torch.randn(1, 1, 16, 32, generator=g) for _ in range(2))
    assert agrees_with_softmax(softmax_attention, q, k, v, 0.2)
    no_mask = lambda q, k, v, causal, scale: softmax_attention(q, k, v, False, scale)  # noqa: E731
    nan = lambda q, k, v, causal, scale: (torch.full_like(q, float("nan")), torch.zeros(q.shape[:3]))  # noqa: E731

    def lse_off(q, k, v, causal, scale):
        out, lse = softmax_attention(q, k, v, causal, scale)
        return out, lse + 0.5

    for wrong in (no_mask, nan, lse_off):
        assert not agrees_with_softmax(wrong, q, k, v, 0.2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads,head_dim", [((4, 1), 256), ((9, 3), 64)], ids=["gemma3", "smollm2"])
def test_fused_kernel_only_in_half_precision_and_exact(heads, head_dim):
    """fp32 never takes a fused kernel (the streamed forward falls back to SDPA); bf16 takes one that equals
    plain attention on a chunk with a prefix, GQA included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads[0], 256, head_dim, generator=g).cuda()
    k, v = (torch.randn(1, heads[1], 384, head_dim, generator=g).cuda() for _ in range(2))
    scale = head_dim ** -0.5
    assert lse_kernel(q, k, v, scale) is None
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    attend = lse_kernel(qb, kb, vb, scale)
    assert attend is not None
    out, lse = split_causal_attention(qb, kb, vb, 128, scale, attend)
    want_out, want_lse = softmax_attention(qb.cpu(), kb.cpu(), vb.cpu(), True, scale)
    torch.testing.assert_close(out.float().cpu(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=2e-2, rtol=1e-2)
