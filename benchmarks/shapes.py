"""The random-weight models the GPU benchmarks time (the weights are not the point: times are): the
Llama-3-8B shape that `workbench.core.shapes` names, or with `tiny` the same family shrunk for a CPU smoke run."""
from __future__ import annotations

from typing import Any

import torch

from workbench.core.model import ModelShape
from workbench.core.shapes import random_model

LLAMA3_8B = "Llama-3-8B"
TINY: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, vocab_size=1024)


def random_llama(layers: int, *, tiny: bool = False, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, max_positions: int = 131072, seed: int = 0
                 ) -> tuple[torch.nn.Module, ModelShape]:
    """(model, shape) of the Llama-3-8B shape (or `tiny`) with `layers` decoder layers, random weights (seed
    `seed`), built on `device` in `dtype`, accepting prompts of up to `max_positions` tokens."""
    return random_model(LLAMA3_8B, layers, device, dtype, seed=seed, max_positions=max_positions,
                        overrides=TINY if tiny else None)
