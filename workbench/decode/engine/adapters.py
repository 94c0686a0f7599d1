"""Which layer-by-layer adapter the decode engine uses for a transformers model."""
from __future__ import annotations

from torch import nn

from workbench.decode.engine.gemma import GemmaLayers
from workbench.decode.engine.llama import LlamaLayers


def decoder_layers(model: nn.Module) -> LlamaLayers:
    """The engine's adapter of `model`: `GemmaLayers` for Gemma-3 text models, `LlamaLayers` otherwise."""
    if getattr(model.config, "model_type", "") in ("gemma3_text", "gemma3"):
        return GemmaLayers(model)
    return LlamaLayers(model)
