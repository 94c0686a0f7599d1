"""Random-weight models of real shapes (`workbench.core.shapes.random_model`, `--random-weights SHAPE`)."""
import json

import pytest
import torch

from workbench.core.model import ModelError
from workbench.core.shapes import NAMED, RANDOM_WEIGHTS, _random_config, hf_config, named_shape, random_model

TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512}


@pytest.mark.parametrize("name", list(NAMED))
def test_every_named_shape_has_a_full_config(name):
    """The transformers config built for each named shape has the shape's attention and its MLP and vocab."""
    cfg, _, _, _ = hf_config(name)
    shape = named_shape(name)
    config = _random_config(cfg, shape, 2, shape.max_positions)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.hidden_size, config.max_position_embeddings) == (
        2, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.hidden_size, shape.max_positions)
    assert config.rope_parameters["rope_theta"] == shape.rope_theta
    assert config.intermediate_size > shape.hidden_size and config.vocab_size > 30000


def test_llama_3_8b_dimensions():
    cfg, _, _, _ = hf_config("Llama-3-8B-1048k")
    config = _random_config(cfg, named_shape("Llama-3-8B-1048k"), 4, 1048576)
    assert (config.model_type, config.intermediate_size, config.vocab_size, config.max_position_embeddings) == (
        "llama", 14336, 128256, 1048576)


def test_random_model_is_built_in_the_asked_dtype_with_some_layers():
    model, shape = random_model("Llama-3-8B", 2, "cpu", torch.float16, overrides=TINY)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.rope_theta) == (2, 4, 2, 32, 5e5)
    assert shape.name == "Llama-3-8B (random weights)" and shape.fingerprint == RANDOM_WEIGHTS
    assert "random weights (2 of 32 layers, seed 0)" in model.workbench_random
    again, _ = random_model("Llama-3-8B", 2, "cpu", torch.float16, overrides=TINY)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded
    with torch.no_grad():
        assert model(torch.randint(0, 512, (1, 16))).logits.shape == (1, 16, 512)
    full, _ = random_model("Llama-3-8B", None, "cpu", overrides={**TINY, "num_hidden_layers": 3})
    assert full.config.num_hidden_layers == 3 and full.dtype == torch.float32  # CPU default: float32


def test_glm_is_built_as_a_llama_of_its_dimensions_and_gemma_keeps_its_layer_types(tmp_path):
    model, shape = random_model("GLM-4-9B", 1, "cpu", overrides={"hidden_size": 128, "num_attention_heads": 4,
                                                                  "kv_channels": 32, "multi_query_group_num": 2,
                                                                  "ffn_hidden_size": 256, "padded_vocab_size": 512})
    assert type(model).__name__ == "LlamaForCausalLM" and (shape.n_kv_heads, shape.head_dim) == (2, 32)
    gemma = {"model_type": "gemma3_text", **TINY, "num_hidden_layers": 6, "sliding_window": 64,
             "query_pre_attn_scalar": 32, "max_position_embeddings": 4096,
             "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gemma))
    model, shape = random_model(str(path), 3, "cpu")
    assert model.config.layer_types == ["sliding_attention"] * 3 and model.config.sliding_window == 64


def test_bad_requests_name_the_fix(tmp_path):
    with pytest.raises(ModelError, match="at least one decoder layer"):
        random_model("Llama-3-8B", 0, "cpu", overrides=TINY)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "max_position_embeddings": 128}))
    with pytest.raises(ModelError, match="intermediate_size"):
        random_model(str(path), 1, "cpu")
    with pytest.raises(ModelError, match="unknown shape 'Llama-9'"):
        random_model("Llama-9", 1, "cpu")
