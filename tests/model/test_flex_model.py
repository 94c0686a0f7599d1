"""The embedded model prefilled through FlexAttention with the shipped config: the same next-token
logits as the PyTorch reference of the sparse kernel (CPU, n = 512), and not those of dense. GPU lane: on
every sparse layer of the real model (fp32, n = 2000: a partial last row block) Flex on the Triton index's
tiles (merged into one launch) == the Triton kernel, as that one launch and as one launch per kind == the reference
path (torch proxies, exact masked SDPA), eager flex (the mask is
the point; the compiled path is tests/kernels/test_flex_gpu.py). Triton's fp32 dots are asked for IEEE
(TRITON_F32_DEFAULT, read when a kernel compiles), as in the parity test."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.config import HeadConfig
from workbench.prefill.quality import backend_agreement

SHIPPED = Path(__file__).resolve().parents[2] / "workbench" / "data" / "configs" / "SmolLM2-135M-Instruct.json"
MAX_ABS = 1e-3  # fp32, as the parity test


@pytest.mark.model
def test_flex_prefill_equals_the_reference_on_the_embedded_model(embedded):
    from workbench.core.corpus import make_sample
    from workbench.core.shapes import named_shape

    model, tok, shape = embedded
    assert named_shape("embedded") == shape  # the named shape is the one load_model reports
    config = HeadConfig.load(SHIPPED, shape)
    ids = make_sample("passkey", tok, 512, depth=0.3).input_ids
    got = backend_agreement(model, shape, config, ids, backends=("torch", "flex"))
    assert got["max_abs_diff"]["flex"] < 1e-3, got["max_abs_diff"]
    assert got["top1"]["flex"] == got["top1"]["torch"]
    with torch.no_grad():
        dense = model(ids.reshape(1, -1), use_cache=False, logits_to_keep=1).logits[0, -1].float()
    assert float((dense - got["logits"]["torch"]).abs().max()) > 1e-3  # the config is really sparse at 512


@pytest.mark.gpu
@pytest.mark.model
def test_flex_triton_and_reference_agree_on_the_model_layers_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample
    from workbench.core.model import load_model
    from workbench.prefill.flex import tiles_attention
    from workbench.prefill.sparse import SparsePrefill

    model, tok, shape = load_model(device="cuda", dtype=torch.float32)
    config = HeadConfig.load(SHIPPED, shape)
    cap = capture_attention(model, shape, make_sample("passkey", tok, 2000, seed=1, depth=0.5).input_ids, progress=False)
    sp = SparsePrefill(None, shape, config, min_length=0, per_kind=False)
    kinds = SparsePrefill(None, shape, config, min_length=0, per_kind=True)
    worst: dict[int, tuple[float, float, float]] = {}
    for layer in range(shape.n_layers):
        if sp.plans[layer].all_dense:
            continue
        q, k, v = (t[None].contiguous() for t in cap.layer_qkv(layer))
        index = sp.layer_index(layer, q, k, cap.scale, "triton")
        triton = sp.layer_kernel(layer, index, q, k, v, cap.scale, "triton")
        flex = tiles_attention(q, k, v, *index, cap.scale, compile=False)
        per_kind = kinds.layer_kernel(layer, kinds.layer_index(layer, q, k, cap.scale, "triton"), q, k, v,
                                         cap.scale, "triton")
        ref = sp.layer_kernel(layer, sp.layer_index(layer, q, k, cap.scale, "torch"), q, k, v, cap.scale, "torch")
        worst[layer] = (float((flex - triton).abs().max()), float((flex - per_kind).abs().max()),
                        float((flex - ref).abs().max()))
    assert len(worst) >= 10, f"only {len(worst)} sparse layers: the check would be thin"
    bad = {l: d for l, d in worst.items() if max(d) > MAX_ABS}
    assert not bad, f"layers where flex differs from (Triton, Triton per kind, reference) by > {MAX_ABS}: {bad}"
