"""The per-layer math of one decode step around the engine's attention, in two implementations with one
interface: `ModuleOps` calls the model's own modules through its adapter (any supported model, any device:
the reference), `FusedOps` runs a Llama-family layer as a few GEMMs and Triton kernels (`workbench_kernels.layer`),
so that a whole decode step launches ~15 kernels per layer instead of ~70.

Interface (B sequences, one token each): `embed(tokens)` -> x; per layer `attn_in(layer, x, delta)` -> (x, h)
(pending residual added, input norm); `project(layer, h, rope, rope_f, positions, append)` -> q `[B, Hq, D]`,
k, v `[B, Hkv, D]` after RoPE and the forecast queries `{target: [B, Hkv, D] float32}` read from this layer's
input, the new k, v appended to `append`'s targets (`append_token`'s keywords: host store, compressed keys);
`attn_out(layer, x, o)` -> (x, delta) (the rest of the layer; `delta` is a residual still to add, None when
added); `logits(x, delta)` -> `[B, V]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.decode.engine.llama import LlamaLayers, Rope


class ModuleOps:
    """The model's own modules (through `LlamaLayers` / `GemmaLayers`); Forecast heads in float32; `append_token`
    is the engine's (Triton or reference) token append."""

    def __init__(self, lm: LlamaLayers, append_token, heads=None, targets: dict[int, list[int]] | None = None) -> None:
        self.lm, self.append_token, self.heads, self.targets = lm, append_token, heads, targets or {}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm.embed(tokens.view(-1, 1))

    def attn_in(self, layer: int, x: torch.Tensor, delta: None) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.lm.norm_in(layer, x)

    def project(self, layer: int, h: torch.Tensor, rope: Rope, rope_f: Rope | None, positions: torch.Tensor,
                append: dict):
        q, k, v = self.lm.qkv(layer, h, rope)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        f = {t: self.heads.query(t, h, *self.lm.layer_rope(t, rope_f))[:, :, 0] for t in self.targets.get(layer, ())}
        if append:
            self.append_token(k, v, positions, **append)
        return q, k, v, f

    def attn_out(self, layer: int, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.lm.finish(layer, x, o.reshape(x.shape[0], 1, -1)), None

    def logits(self, x: torch.Tensor, delta: None) -> torch.Tensor:
        return self.lm.logits(x)[:, 0]


class FusedOps:
    """A Llama-family layer in 9 launches: add + RMSNorm, one GEMM for q/k/v and the forecast queries this
    layer's input feeds (weights packed once, in the model's dtype: a copy of the attention projections), RoPE
    split with the token's append, o_proj, add + RMSNorm, gate and up GEMMs, silu * up, down (its output is added
    by the next add + RMSNorm). Needs `supports(lm)`."""

    @staticmethod
    def supports(lm: LlamaLayers) -> bool:
        cfg = lm.model.config
        mod = lm.layers[0]
        return (type(lm) is LlamaLayers and getattr(cfg, "hidden_act", "") == "silu"
                and not hasattr(mod.self_attn, "q_norm") and all(w is None for w in lm.windows)
                and all(hasattr(mod.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
                and getattr(mod.mlp.gate_proj, "bias", None) is None and getattr(mod.self_attn.o_proj, "bias", None) is None)

    def __init__(self, lm: LlamaLayers, heads=None, targets: dict[int, list[int]] | None = None) -> None:
        from workbench_kernels.layer import add_rmsnorm, rope_split, silu_mul

        self.lm, self.targets = lm, targets or {}
        self._norm, self._rope, self._silu = add_rmsnorm, rope_split, silu_mul
        self.packed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for layer, mod in enumerate(lm.layers):
            attn = mod.self_attn
            rows = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
            rows += [heads.weight[t].to(lm.dtype) for t in self.targets.get(layer, ())]
            bias = None
            if attn.q_proj.bias is not None:  # Qwen2: q/k/v biases, none on the forecast rows
                bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias,
                                  attn.q_proj.bias.new_zeros(sum(r.shape[0] for r in rows[3:]))])
            self.packed.append((torch.cat(rows).detach().contiguous(), bias))

    @property
    def nbytes(self) -> int:
        """GPU bytes of the packed q/k/v/forecast weights (a copy beside the model's)."""
        return sum(w.numel() * w.element_size() for w, _ in self.packed)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm.embed(tokens.view(-1))

    def attn_in(self, layer: int, x: torch.Tensor, delta: torch.Tensor | None):
        norm = self.lm.layers[layer].input_layernorm
        return self._norm(x, delta, norm.weight, norm.variance_epsilon)

    def project(self, layer: int, h: torch.Tensor, rope: Rope, rope_f: Rope | None, positions: torch.Tensor,
                append: dict):
        lm = self.lm
        w, bias = self.packed[layer]
        targets = self.targets.get(layer, ())
        cos, sin = (t.reshape(h.shape[0], -1) for t in lm.layer_rope(layer, rope))
        cos_f = sin_f = None
        if targets:
            cos_f, sin_f = (t.reshape(h.shape[0], -1) for t in lm.layer_rope(targets[0], rope_f))
        q, k, v, f = self._rope(F.linear(h, w, bias), cos, sin, lm.n_heads, lm.n_kv_heads,
                                len(targets) * lm.n_kv_heads, cos_f, sin_f, positions, **append)
        return q, k, v, {t: f[:, i * lm.n_kv_heads:(i + 1) * lm.n_kv_heads] for i, t in enumerate(targets)}

    def attn_out(self, layer: int, x: torch.Tensor, o: torch.Tensor):
        mod = self.lm.layers[layer]
        norm = mod.post_attention_layernorm
        x, h = self._norm(x, F.linear(o.reshape(x.shape[0], -1), mod.self_attn.o_proj.weight), norm.weight,
                          norm.variance_epsilon)
        mlp = mod.mlp
        act = self._silu(F.linear(h, mlp.gate_proj.weight), F.linear(h, mlp.up_proj.weight))
        return x, F.linear(act, mlp.down_proj.weight)

    def logits(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        norm = self.lm.inner.norm
        return self.lm.model.lm_head(self._norm(x, delta, norm.weight, norm.variance_epsilon)[1])
