"""GPU lane: a head config through FlexAttention (compiled) gives the Triton prefill kernel's output on the
same physical tiles (`SparsePrefill(backend="flex")` vs `backend="triton"`), bf16 and fp16."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workbench.core.model import ModelShape
from workbench.search.config import HeadConfig, HeadEntry

pytestmark = pytest.mark.gpu

SHAPE = ModelShape(name="llama-ish", architecture="llama", n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128,
                   hidden_size=1024, rope_type="default", rope_theta=500000.0, max_positions=131072, fingerprint="f")
LAYERS = [
    [("vs", {"vertical": 300, "slash": 600}), ("ashape", {"sink": 64, "window": 1024}), ("block", {"topk": 8}),
     ("dense", {}), ("vs", {"vertical": 1000, "slash": 100}), ("block", {"topk": 20}), ("ashape", {"sink": 0, "window": 500}),
     ("vs", {"vertical": 64, "slash": 2048})],
    [("vs", {"vertical": 100, "slash": 200})] * 4 + [("block", {"topk": 4})] * 4,
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("n", [3000])  # not a multiple of 64: the last row block is partial
def test_flex_equals_triton_on_the_same_tiles(dtype, atol, n):
    from workbench.prefill.sparse import SparsePrefill

    config = HeadConfig(model=SHAPE.to_dict(), heads=[HeadEntry(l, h, p, dict(params)) for l, layer in enumerate(LAYERS)
                                                      for h, (p, params) in enumerate(layer)])
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(1, 8, n, 128, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, 2, n, 128, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, 2, n, 128, device="cuda", dtype=dtype, generator=g)
    q[:, :, :, :8] += 2.0  # some structure, so that the proxies select non-trivial sets
    k[:, :, : n // 7, :8] += 1.5
    out = {}
    for backend in ("triton", "flex"):
        sp = SparsePrefill(torch.nn.Module(), SHAPE, config, min_length=0, backend=backend,
                           record_density=backend == "triton")
        for layer in range(2):
            out[backend, layer] = sp.attention(SimpleNamespace(layer_idx=layer, scaling=128 ** -0.5), q, k, v, None)[0]
        if backend == "triton":
            density = dict(sp.density)
    for layer in range(2):
        diff = (out["flex", layer].float() - out["triton", layer].float()).abs().max().item()
        assert diff < atol, f"layer {layer}: flex vs triton max |diff| {diff} ({dtype}, n={n})"
        bound = (0.95, 0.5)[layer]  # layer 0 holds a dense head and a 2048-offset VS head; layer 1 is sparse
        assert density[layer] < bound, f"layer {layer} computes {density[layer]:.0%} of the causal pairs: not sparse"
