"""GPU lane: the streaming forward of a random-weight Llama-3-8B shape in bf16 (each chunk two fused attention
calls merged by their row log-sum-exps) and in fp32 (SDPA: no fused kernel computes in fp32) agrees with the
model's own forward, stays within its memory estimate,
and hands over row log-sum-exps equal to the statistics kernels' own first pass."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llama():
    from workbench.core.shapes import random_model

    return random_model("Llama-3-8B-1048k", 2, "cuda")


def test_chunked_forward_matches_the_model_in_bf16(llama):
    from workbench.core.capture import capture_attention
    from workbench.core.stream import LayerRunner, stream_capture

    model, shape = llama
    ids = torch.randint(0, model.config.vocab_size, (16384,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        want = model.model(ids[None]).last_hidden_state.float()
    got = LayerRunner(model, chunk=4096, progress=False).forward(ids).float()
    cos = torch.nn.functional.cosine_similarity(got[0], want[0], dim=-1)
    assert cos.min() > 0.999, float(cos.min())
    cap = capture_attention(model, shape, ids, progress=False)
    stream = stream_capture(model, shape, ids, chunk=3000, progress=False)  # ragged chunks
    for layer in (0, 1):
        for a, b in zip(stream.layer_qkv(layer), cap.layer_qkv(layer)):
            assert torch.nn.functional.cosine_similarity(a.float().flatten(1), b.float().flatten(1), -1).min() > 0.999


def test_chunked_forward_matches_the_model_in_fp32():
    """fp32 takes no fused kernel (called directly, cuDNN's op ran on fp32 inputs and returned NaN: Gemma-3's fp32
    search at 32K stopped on NaN q / k): the streamed forward is finite and equals the model's own, chunked or not."""
    from workbench.core.shapes import random_model
    from workbench.core.stream import LayerRunner

    model, _ = random_model("Llama-3-8B-1048k", 2, "cuda", torch.float32, overrides={"vocab_size": 1024})
    ids = torch.randint(0, 1024, (8192,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        want = model.model(ids[None]).last_hidden_state
    for chunk in (8192, 3000):  # one chunk (the square alone), ragged chunks (prefix + square)
        got = LayerRunner(model, chunk=chunk, progress=False).forward(ids)
        assert torch.isfinite(got).all()
        cos = torch.nn.functional.cosine_similarity(got[0].double(), want[0].double(), dim=-1)
        assert cos.min() > 0.9999, (chunk, float(cos.min()))


def test_peak_memory_stays_within_the_estimate(llama):
    """At 64K with 8K chunks a materialised mask or the math kernel would need > 60 GB; the runner stays
    within `peak_bytes` (analysis=None) beyond the weights."""
    from workbench.core.stream import LayerRunner, peak_bytes

    model, shape = llama
    n, chunk = 65536, 8192
    ids = torch.randint(0, model.config.vocab_size, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    LayerRunner(model, chunk=chunk, progress=False).forward(ids, last=1)
    peak = torch.cuda.max_memory_allocated() - base
    estimate = sum(peak_bytes(shape, n, chunk, intermediate=model.config.intermediate_size, dtype_bytes=2, cuda=True,
                              analysis=None).values())
    assert peak <= estimate, (peak / 2**30, estimate / 2**30)


def test_the_forwards_row_lse_equals_pass_one_and_gives_the_same_statistics(llama):
    """`LayerRunner.row_lse` (ragged chunks) equals `attn_stats.row_lse` of the captured q/k; the statistics
    and the search scores read from it equal those of the two-pass path."""
    from workbench_kernels import attn_stats

    from workbench.analysis.layer_profiles import PROFILE_MAPS
    from workbench.analysis.stats import layer_stats
    from workbench.core.stream import LayerRunner
    from workbench.search.search import default_candidates, layer_scores

    model, shape = llama
    n = 8000
    ids = torch.randint(0, model.config.vocab_size, (n,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    runner = LayerRunner(model, chunk=3000, progress=False)
    scale = float(model.model.layers[0].self_attn.scaling)
    for _, q, k, _v in runner.layers(ids, [0, 1]):
        lse = runner.row_lse
        assert lse is not None and lse.shape == (shape.n_heads, n) and lse.dtype == torch.float32
        torch.testing.assert_close(lse, attn_stats.row_lse(q, k, scale)[0], atol=2e-3, rtol=0)
        got = layer_stats(q, k, scale, block=64, maps=PROFILE_MAPS, lse=lse)
        want = layer_stats(q, k, scale, block=64, maps=PROFILE_MAPS)
        for name in PROFILE_MAPS:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=2e-3, rtol=1e-3)
        cands = default_candidates(n)[:6]
        a, b = layer_scores(q, k, scale, cands, lse=lse), layer_scores(q, k, scale, cands)
        torch.testing.assert_close(a["mass"], b["mass"], atol=1e-3, rtol=0)
