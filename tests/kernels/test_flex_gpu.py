"""GPU lane: a head config through FlexAttention gives the Triton prefill kernel's output on the same
physical tiles, bf16 and fp16, on a Llama-like layer mixing every pattern (n = 3000: the last row block is
partial). The mask is the point, so flex runs eager (no compile: seconds, not minutes) on the tiles the
Triton index built (merged into one launch, `per_kind=False`), and equals both the Triton kernel's one launch over
those tiles and the deployed layer (on sm_90, layer 0, which holds A-shape heads, runs one launch per kind:
`SparsePrefill.kinds_attention`, its VS and block heads on the Gluon kernel). One case runs the deployed path,
`SparsePrefill(backend="flex")` with flex_attention compiled (dynamic=False), against `backend="triton"` on one
layer. The real model's layers: tests/model/test_flex_model.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workbench.config import HeadConfig, HeadEntry
from workbench.core.model import ModelShape

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N = 3000
N_COMPILED = 2048
SCALE = 128 ** -0.5
SHAPE = ModelShape(name="llama-ish", architecture="llama", n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128,
                   hidden_size=1024, rope_type="default", rope_theta=500000.0, max_positions=131072, fingerprint="f")
LAYERS = [
    [("vs", {"vertical": 300, "slash": 600}), ("ashape", {"sink": 64, "window": 1024}), ("block", {"topk": 8}),
     ("dense", {}), ("vs", {"vertical": 1000, "slash": 100}), ("block", {"topk": 20}), ("ashape", {"sink": 0, "window": 500}),
     ("vs", {"vertical": 64, "slash": 2048})],
    [("vs", {"vertical": 100, "slash": 200})] * 4 + [("block", {"topk": 4})] * 4,
]
CONFIG = HeadConfig(model=SHAPE.to_dict(), heads=[HeadEntry(l, h, p, dict(params)) for l, layer in enumerate(LAYERS)
                                                  for h, (p, params) in enumerate(layer)])
ATOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
DENSITY_BOUND = (0.95, 0.5)  # layer 0 holds a dense head and a 2048-offset VS head; layer 1 is sparse


def qkv(dtype: torch.dtype, n: int = N):
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(1, h, n, 128, device="cuda", dtype=dtype, generator=g) for h in (8, 2, 2))
    q[:, :, :, :8] += 2.0  # some structure, so that the proxies select non-trivial sets
    k[:, :, : n // 7, :8] += 1.5
    return q, k, v


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def triton_run(request):
    """(dtype, q, k, v, {layer: (merged index, its Triton output, the deployed output)}, {layer: physical density})
    computed once per dtype."""
    from workbench.prefill.sparse import SparsePrefill

    q, k, v = qkv(request.param)
    sp = SparsePrefill(None, SHAPE, CONFIG, min_length=0, backend="triton", record_density=True, per_kind=False)
    deployed = SparsePrefill(None, SHAPE, CONFIG, min_length=0, backend="triton")
    # the default splits layer 0 (A-shape heads among others) per kind where the Gluon kernel runs (sm_90); layer 1
    # (VS and block, no band) stays one launch
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert [deployed.launch_per_kind(deployed.group_tiles(l, q, k, SCALE), q, "triton") for l in (0, 1)] == [sm90, False]
    runs = {}
    for layer in range(SHAPE.n_layers):
        index = sp.layer_index(layer, q, k, SCALE, "triton")
        out = deployed.layer_kernel(layer, deployed.layer_index(layer, q, k, SCALE, "triton"), q, k, v, SCALE, "triton")
        runs[layer] = index, sp.layer_kernel(layer, index, q, k, v, SCALE, "triton"), out
    return request.param, q, k, v, runs, dict(sp.density)


def test_flex_eager_equals_triton_on_the_same_tiles(triton_run):
    from workbench.prefill.flex import tiles_attention

    dtype, q, k, v, runs, density = triton_run
    for layer, (index, triton_out, deployed_out) in runs.items():
        out = tiles_attention(q, k, v, *index, SCALE, compile=False)
        for route, got in (("one launch", triton_out), ("deployed", deployed_out)):
            diff = (out.float() - got.float()).abs().max().item()
            assert diff < ATOL[dtype], f"layer {layer}: flex vs triton ({route}) max |diff| {diff} ({dtype}, n={N})"
        assert density[layer] < DENSITY_BOUND[layer], \
            f"layer {layer} computes {density[layer]:.0%} of the causal pairs: not sparse"


def test_compiled_flex_backend_equals_triton():
    """The deployed flex path (compiled mask and flex_attention) on layer 0, bf16: one compile per process, at
    a multiple of 128 tokens (compiled create_block_mask is known to take minutes at some other lengths)."""
    from workbench.prefill.sparse import SparsePrefill

    q, k, v = qkv(torch.bfloat16, N_COMPILED)
    out = {}
    for backend in ("triton", "flex"):
        sp = SparsePrefill(torch.nn.Module(), SHAPE, CONFIG, min_length=0, backend=backend)
        out[backend] = sp.attention(SimpleNamespace(layer_idx=0, scaling=SCALE), q, k, v, None)[0]
    diff = (out["flex"].float() - out["triton"].float()).abs().max().item()
    assert diff < ATOL[torch.bfloat16], f"compiled flex vs triton max |diff| {diff} (layer 0, bf16, n={N_COMPILED})"
