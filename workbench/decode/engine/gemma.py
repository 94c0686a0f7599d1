"""Layer-by-layer access to a transformers Gemma-3 text model (the engine's second adapter, beside `llama`).

What differs from Llama, all read from the model's own modules: the embedding is scaled by sqrt(hidden)
(`Gemma3TextScaledWordEmbedding`); q and k pass per-head RMSNorms before RoPE; attention scales by
`query_pre_attn_scalar ** -0.5`; RoPE tables depend on the layer type (sliding layers: local theta, 1e4 on
Gemma-3-270M; full layers: global theta, 1e6); sliding layers attend only to their last `sliding_window`
tokens; each layer norms its attention and MLP outputs before the residual adds (four norms a layer, weights
applied as 1 + w); the final logits may be soft-capped.
"""
from __future__ import annotations

import torch
from torch import nn

from workbench.core.model import ModelError
from workbench.decode.engine.llama import LlamaLayers, Rope


class GemmaLayers(LlamaLayers):
    """`LlamaLayers` for `Gemma3ForCausalLM` (same pieces, same shapes)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        if getattr(cfg, "attn_logit_softcapping", None):
            raise ModelError("attention logit soft-capping (Gemma-2) is not supported by the decode engine")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ModelError("bidirectional attention cannot be decoded token by token")
        needed = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        if not all(hasattr(self.layers[0], n) for n in needed):
            raise ModelError(f"{type(model).__name__} lacks Gemma-3's {needed}: use LlamaLayers")
        self.softcap = getattr(cfg, "final_logit_softcapping", None)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> Rope:
        x = torch.zeros(1, device=self.device, dtype=dtype or self.dtype)
        return {t: self.inner.rotary_emb(x, positions, t) for t in set(self.layer_types)}

    def finish(self, layer: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        mod = self.layers[layer]
        x = x + mod.post_attention_layernorm(mod.self_attn.o_proj(attn_out))
        return x + mod.post_feedforward_layernorm(mod.mlp(mod.pre_feedforward_layernorm(x)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.inner.norm(x))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
