"""GPU lane: the streaming forward of a random-weight Llama-3-8B shape in bf16 (chunks use lower-right
causal flash attention with GQA) agrees with the model's own forward and stays within its memory estimate."""
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
