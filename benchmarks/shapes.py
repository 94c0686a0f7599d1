"""Random-weight models of real shapes for GPU benchmarks (the weights are not the point: times are).

`LLAMA3_8B` holds Llama-3-8B's dimensions as `LlamaConfig` keyword arguments in the transformers 5.x
form (`rope_parameters`; tested with 5.17 on the GPU machine and 5.24 here); `TINY_LLAMA` a shape small
enough for a CPU smoke run. `random_llama` builds a model of a shape with some layers, seeded.
"""
from __future__ import annotations

from typing import Any

import torch

LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
TINY_LLAMA: dict[str, Any] = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}


def random_llama(layers: int, *, dims: dict[str, Any] = LLAMA3_8B, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, max_positions: int | None = None, seed: int = 0
                 ) -> torch.nn.Module:
    """A `LlamaForCausalLM` of shape `dims` with `layers` decoder layers and random weights (seed `seed`),
    built directly on `device` in `dtype`, SDPA attention, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if layers < 1:
        raise ValueError(f"layers={layers}: a model needs at least one decoder layer")
    extra = {"max_position_embeddings": max_positions} if max_positions else {}
    cfg = LlamaConfig(num_hidden_layers=layers, attn_implementation="sdpa", **{**dims, **extra})
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the target dtype: an fp32 8B copy would not fit beside bf16
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()
