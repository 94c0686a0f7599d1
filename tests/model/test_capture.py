"""Capture reproduces the model's own attention; model loading and its errors."""
import pytest
import torch

from workbench.core.capture import Capture, capture_attention
from workbench.core.model import ModelError, load_model

pytestmark = pytest.mark.model


def test_shape_of_embedded_model(embedded):
    _, _, shape = embedded
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim) == (30, 9, 3, 64)
    assert shape.max_positions == 8192 and shape.group == 3 and shape.kv_head(5) == 1
    assert len(shape.fingerprint) == 16


def test_the_model_keeps_its_own_modules(embedded):
    """No Hugging Face hub kernels swapped in (transformers >= 5.25 does so by default, fetching them at load time):
    the workbench captures and times the model's own attention modules."""
    model, _, _ = embedded
    assert not model.use_kernels
    assert type(model.model.layers[0].self_attn).__module__.startswith("transformers.models.llama")


def test_capture_reproduces_eager_attention(embedded, capture_256):
    """At n = 256 the captured post-RoPE q/k give the model's own eager probabilities (<= 1e-4)."""
    model, _, shape = embedded
    cap = capture_256
    ids = cap.input_ids[None]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = model(ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    n = cap.n
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    for layer in range(shape.n_layers):
        q, k, _ = cap.layer_qkv(layer)
        kk = k[torch.arange(shape.n_heads) // shape.group]  # GQA: head h reads KV head h // 3
        p = (q @ kk.transpose(1, 2) * cap.scale).masked_fill(causal, float("-inf")).softmax(-1)
        assert (p - att[layer][0]).abs().max() <= 1e-4, layer
    # the hidden state is the input-normed one: re-projecting it gives k before RoPE at position 0
    attn = model.model.layers[3].self_attn
    k0 = attn.k_proj(cap.hidden[3, :1]).view(shape.n_kv_heads, shape.head_dim)
    assert torch.allclose(k0, cap.k[3, :, 0], atol=1e-4)  # RoPE at position 0 is the identity


def test_selected_layers_and_save_load(embedded, capture_256, tmp_path):
    model, _, shape = embedded
    cap = capture_attention(model, shape, capture_256.input_ids[:64], layers=[7, 2], progress=False)
    assert cap.layers == (2, 7) and cap.q.shape == (2, 9, 64, 64)
    full = capture_attention(model, shape, capture_256.input_ids[:64], progress=False)
    assert torch.equal(cap.layer_qkv(7)[0], full.layer_qkv(7)[0])
    cap.save(tmp_path / "c.safetensors")
    back = Capture.load(tmp_path / "c.safetensors")
    assert back.layers == (2, 7) and back.shape == shape and torch.equal(back.k, cap.k)
    with pytest.raises(ModelError, match="was not captured"):
        cap.layer_qkv(3)


def test_bad_input_errors(embedded):
    model, _, shape = embedded
    with pytest.raises(ModelError, match="empty"):
        capture_attention(model, shape, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ModelError, match="at most 8192"):
        capture_attention(model, shape, torch.zeros(8193, dtype=torch.long))
    with pytest.raises(ModelError, match="layer 30 is out of range"):
        capture_attention(model, shape, torch.zeros(8, dtype=torch.long), layers=[30])
    with pytest.raises(ModelError, match="batch 1"):
        capture_attention(model, shape, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ModelError, match="not found"):
        load_model("/no/such/model")


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from workbench.core.model import model_shape

    tiny = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16))
    with pytest.raises(ModelError, match="unsupported architecture"):
        model_shape(tiny, "gpt2-tiny")
