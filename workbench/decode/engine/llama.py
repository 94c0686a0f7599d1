"""Layer-by-layer access to a transformers Llama-family model, for a decoder that schedules each layer.

Uses the model's own modules (embedding, norms, projections, rotary tables, MLP, LM head); only the
attention over the KV cache is done by the engine. `workbench.decode.engine.gemma` adapts Gemma-3 the same
way; `workbench.decode.engine.adapters.decoder_layers` picks the adapter of a model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.core.model import ModelError

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> (cos, sin) `[B, T, D]`


class LlamaLayers:
    """Llama/Mistral/Qwen2-style decoder split into the pieces the engine interleaves with KV movement.

    Shapes: hidden x `[B, T, hidden]`; q `[B, Hq, T, D]`; k, v `[B, Hkv, T, D]`; positions `[B, T]`.
    `layer_types[l]` is the config's "full_attention" / "sliding_attention" (all full when the config has
    none) and `windows[l]` the tokens a sliding layer attends to (its `sliding_window`; None: every token).
    """

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        needed = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        if layers is None or not all(hasattr(layers[0], n) for n in needed) or not hasattr(inner, "rotary_emb"):
            raise ModelError(f"{type(model).__name__} is not a Llama-family decoder (layers with input_layernorm, "
                             "self_attn, post_attention_layernorm, mlp and a rotary_emb): the engine cannot run it")
        self.model, self.inner, self.layers = model, inner, layers
        attn = layers[0].self_attn
        cfg = model.config
        self.n_layers = len(layers)
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.scale = float(attn.scaling)
        self.max_positions = int(cfg.max_position_embeddings)
        self.hidden_size = int(cfg.hidden_size)
        self.layer_types = tuple(getattr(cfg, "layer_types", None) or ("full_attention",) * self.n_layers)
        window = getattr(cfg, "sliding_window", None)
        self.windows = tuple(int(window) if t == "sliding_attention" and window else None for t in self.layer_types)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> Rope:
        """cos, sin `[B, T, D]` at positions `[B, T]` (in `dtype`, default the model's) for every layer type."""
        x = torch.zeros(1, device=self.device, dtype=dtype or self.dtype)
        tables = self.inner.rotary_emb(x, positions)
        return {t: tables for t in set(self.layer_types)}

    def layer_rope(self, layer: int, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) of `layer` from `rope(...)`."""
        return rope[self.layer_types[layer]]

    def norm_in(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The input-normed hidden state entering attention (what Forecast heads read)."""
        return self.layers[layer].input_layernorm(x)

    def qkv(self, layer: int, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projections and RoPE of the normed input h `[B, T, hidden]` -> q, k, v."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = self.layers[layer].self_attn
        B, T, _ = h.shape
        q = attn.q_proj(h).view(B, T, -1, self.head_dim)
        k = attn.k_proj(h).view(B, T, -1, self.head_dim)
        v = attn.v_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3 / Gemma-3 per-head norms before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.layer_rope(layer, rope)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def finish(self, layer: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Rest of the layer: x `[B, T, hidden]`, attention output `[B, T, Hq * D]` -> next hidden state."""
        mod = self.layers[layer]
        x = x + mod.self_attn.o_proj(attn_out)
        return x + mod.mlp(mod.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.inner.norm(x))

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal prefill attention of one layer (sliding layers: only their window) -> `[B, Hq, T, D]`."""
        window = self.windows[layer]
        n = q.shape[2]
        if window is None or window >= n:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        out, chunk = torch.empty_like(q), 1024
        for a in range(0, n, chunk):  # query chunks see keys (a - window, b): masks stay [chunk, chunk + window]
            b, lo = min(n, a + chunk), max(0, a - window + 1)
            qi = torch.arange(a, b, device=q.device)[:, None]
            ki = torch.arange(lo, b, device=q.device)[None, :]
            mask = (ki <= qi) & (ki > qi - window)
            out[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], attn_mask=mask,
                                                            scale=self.scale, enable_gqa=True)
        return out

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Dense causal forward of one prompt `[N]` -> per-layer k, v `[Hkv, N, D]` and last-token logits `[V]`."""
        n = ids.shape[0]
        pos = torch.arange(n, device=self.device)[None]
        rope = self.rope(pos)
        x = self.embed(ids.to(self.device)[None])
        ks, vs = [], []
        for layer in range(self.n_layers):
            q, k, v = self.qkv(layer, self.norm_in(layer, x), rope)
            o = self.attention(layer, q, k, v)
            x = self.finish(layer, x, o.transpose(1, 2).reshape(1, n, -1))
            ks.append(k[0])
            vs.append(v[0])
        return ks, vs, self.logits(x[:, -1])[0]

