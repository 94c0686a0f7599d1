"""Gemma-3: per-layer attention facts in ModelShape, and captures that reproduce the model's own attention
(post-QK-norm, post-RoPE q/k, Gemma's softmax scale, the sliding window on sliding layers).

The tiny random-weight model runs everything in seconds; the real Gemma-3-270M runs at <= 2K tokens."""
from __future__ import annotations

import pytest
import torch

from workbench.core.capture import capture_attention
from workbench.core.model import FULL, SLIDING, ModelError, ModelShape


def attention_outputs(model, ids: torch.Tensor, layers) -> dict[int, torch.Tensor]:
    """The model's attention output of `layers` (the o_proj input) -> {layer: `[N, Hq, D]`}."""
    out: dict[int, torch.Tensor] = {}
    attn = [model.model.layers[l].self_attn for l in layers]
    hooks = [a.o_proj.register_forward_pre_hook(lambda m, args, l=l: out.__setitem__(l, args[0][0].detach().clone()))
             for l, a in zip(layers, attn)]
    try:
        with torch.no_grad():
            model(ids.reshape(1, -1), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {l: o.view(o.shape[0], -1, a.head_dim) for (l, o), a in zip(sorted(out.items()), attn)}


def dense_from_capture(cap, layer: int) -> torch.Tensor:
    """Attention recomputed in float64 from the captured q/k/v with the layer's own mask -> `[N, Hq, D]`."""
    q, k, v = (t.double() for t in cap.layer_qkv(layer))
    g = cap.shape.group
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    n = cap.n
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = j <= i
    window = cap.shape.window(layer)
    if window is not None:
        mask &= i - j < window
    s = (q @ k.transpose(-1, -2)) * cap.scale
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return (p @ v).transpose(0, 1)


def test_shape_reads_per_layer_attention(tiny_gemma):
    model, shape = tiny_gemma
    assert shape.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert shape.fixed_layers == (0, 2) and shape.free_layers == (1, 3)
    assert shape.sliding_window == 96 and shape.window(0) == 96 and shape.window(1) is None
    assert shape.layer_rope_theta == (1e4, 1e6, 1e4, 1e6) and shape.rope_theta == 1e6
    assert shape.scale == pytest.approx(64 ** -0.5)  # query_pre_attn_scalar, not head_dim (256)
    assert (shape.head_dim, shape.n_heads, shape.n_kv_heads) == (256, 2, 1)
    again = ModelShape.from_dict(shape.to_dict())
    assert again == shape  # JSON lists come back as tuples


def test_old_shape_json_loads_as_all_full():
    old = {"name": "SmolLM2-135M-Instruct", "architecture": "llama", "n_layers": 3, "n_heads": 9, "n_kv_heads": 3,
           "head_dim": 64, "hidden_size": 576, "rope_type": "default", "rope_theta": 1e5, "max_positions": 8192,
           "fingerprint": "abc"}
    shape = ModelShape.from_dict(old)
    assert shape.layer_types == (FULL,) * 3 and shape.fixed_layers == () and shape.sliding_window is None
    assert shape.layer_rope_theta == (1e5,) * 3 and shape.scale == 0.125 and shape.to_dict() == old
    with pytest.raises(ModelError, match="sliding_window"):
        ModelShape.from_dict({**old, "layer_types": [SLIDING, FULL, FULL]})
    with pytest.raises(ModelError, match="layer_types has 2 entries"):
        ModelShape.from_dict({**old, "layer_types": [SLIDING, FULL], "sliding_window": 512})


def test_capture_reproduces_tiny_gemma_attention(tiny_gemma):
    """Dense attention from the captured q/k/v under each layer's own mask (window 96 on sliding layers)
    equals the model's attention output; the full causal mask does not on a sliding layer."""
    model, shape = tiny_gemma
    ids = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(1))
    cap = capture_attention(model, shape, ids, progress=False)
    assert cap.scale == pytest.approx(shape.scale)
    ref = attention_outputs(model, ids, range(shape.n_layers))
    for layer in range(shape.n_layers):
        torch.testing.assert_close(dense_from_capture(cap, layer).float(), ref[layer], atol=2e-5, rtol=1e-4)
    full = ModelShape.from_dict({**shape.to_dict(), "layer_types": [FULL] * 4, "sliding_window": None})
    cap.shape = full
    assert (dense_from_capture(cap, 0).float() - ref[0]).abs().max() > 1e-3


@pytest.mark.model
@pytest.mark.xdist_group("gemma")  # one worker loads the real Gemma (~2 min on 2 cores, cold cache)
def test_real_gemma_shape_and_capture(gemma):
    """The real Gemma-3-270M: 18 layers, 4 query heads on 1 KV head of d=256, 32K positions, full layers
    5, 11, 17 (RoPE 1e6), sliding window 512 elsewhere (RoPE 1e4); a 1024-token capture reproduces the
    model's attention on a sliding and a full layer."""
    from workbench.core.corpus import make_sample

    model, tok, shape = gemma
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim) == (18, 4, 1, 256)
    assert shape.max_positions == 32768 and shape.sliding_window == 512
    assert shape.free_layers == (5, 11, 17)
    assert shape.layer_rope_theta[5] == 1e6 and shape.layer_rope_theta[0] == 1e4
    assert shape.scale == pytest.approx(256 ** -0.5)
    ids = make_sample("passkey", tok, 1024, seed=0).input_ids
    cap = capture_attention(model, shape, ids, layers=[4, 5], progress=False)
    ref = attention_outputs(model, ids, [4, 5])
    for layer in (4, 5):
        torch.testing.assert_close(dense_from_capture(cap, layer).float(), ref[layer], atol=1e-4, rtol=1e-3)


def test_a_tokenizer_converted_character_by_character_is_refused():
    """transformers 5.17 converts Gemma-3's GGUF tokenizer one character per token: refused, naming the fix."""
    from workbench.core.model import EMBEDDED_MODEL, GEMMA_MODEL, _check_tokenizer

    def per_character(text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def per_word(text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}

    with pytest.raises(ModelError, match="one character per token: upgrade transformers"):
        _check_tokenizer(per_character, GEMMA_MODEL)
    _check_tokenizer(per_word, EMBEDDED_MODEL)
