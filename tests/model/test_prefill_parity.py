"""Parity of the deployed sparse prefill with what the search scored: the same weights, prompt and shipped
head config through the PyTorch reference path (`backend="torch"`: the torch proxies and exact masked SDPA)
and the Triton path (Triton VS index, fast block index, one sparse kernel launch per layer) give the same
per-layer attention outputs and next-token distribution.

CPU: the Triton path runs under TRITON_INTERPRET=1 (set before triton is imported) in fp32 at small n.
GPU (`gpu` marker): the real model at 4K and 8K in fp32. Triton's fp32 `tl.dot` defaults to TF32 on a GPU
(10-bit mantissa) while the reference's SDPA is full fp32, so this module asks Triton for IEEE fp32 dots
(TRITON_F32_DEFAULT=ieee, read when a kernel compiles): the check is about the index and the tiles, not TF32.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workbench.config import HeadConfig
from workbench.core.corpus import make_sample
from workbench.prefill.sparse import SparsePrefill

SHIPPED = "workbench/data/configs/SmolLM2-135M-Instruct.json"
MAX_ABS = 1e-3
MAX_KL = 1e-4
CPU_KINDS = {2: {"dense", "block"}, 9: {"dense", "vs"}, 12: {"dense", "vs", "ashape"}, 16: {"dense", "ashape"}}
CPU_LAYERS = tuple(CPU_KINDS)


def attention_outputs(model, shape, config, input_ids, backend, layers=None):
    """Per layer the attention output `[N, hidden]` (after o_proj) and the next-token log-probs `[vocab]`
    of one prefill with `layers` sparse (default every layer; min_length 0)."""
    outs: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.register_forward_hook(lambda _m, _a, o, i=i: outs.__setitem__(i, o[0][0].float()))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad(), SparsePrefill(model, shape, config, min_length=0, layers=layers, backend=backend) as sp:
            logits = model(input_ids.reshape(1, -1).to(model.device), logits_to_keep=1).logits[0, -1]
    finally:
        for h in hooks:
            h.remove()
    assert sp.calls[("sparse", "prefill")] > 0, "no layer ran sparse: the parity check would be vacuous"
    return outs, torch.log_softmax(logits.float(), -1)


def check_parity(model, tok, shape, n, seed=0, layers=None, config=None):
    config = config or HeadConfig.load(SHIPPED, shape)
    ids = make_sample("passkey", tok, n, seed=seed, depth=0.4).input_ids
    ref, ref_lp = attention_outputs(model, shape, config, ids, "torch", layers)
    tri, tri_lp = attention_outputs(model, shape, config, ids, "triton", layers)
    worst = {layer: float((ref[layer] - tri[layer]).abs().max()) for layer in ref}
    kl = float((ref_lp.exp() * (ref_lp - tri_lp)).sum())
    bad = {layer: d for layer, d in worst.items() if d > MAX_ABS}
    assert not bad, f"n={n}: layers whose Triton attention output differs from the reference by > {MAX_ABS}: {bad}"
    assert kl <= MAX_KL, f"n={n}: next-token KL(reference || Triton) = {kl:.2e} > {MAX_KL}"
    return max(worst.values()), kl


@pytest.mark.model
def test_triton_path_equals_reference_path_on_cpu(embedded):
    """Small n under the interpreter, on the layers of the shipped config that cover its mixes (the other
    layers run dense on both paths: ~165 s on 2 cores, against ~490 s with all 28 sparse layers): block + dense
    (2), VS + dense (9), VS + A-shape + dense in one layer (12) and A-shape + dense only (16, the merge that
    once handed a dense head an A-shape head's tiles)."""
    model, tok, shape = embedded
    config = HeadConfig.load(SHIPPED, shape)
    kinds = {layer: {h.pattern for h in config.heads if h.layer == layer} for layer in CPU_LAYERS}
    assert kinds == CPU_KINDS, f"the shipped config changed: pick layers that cover its mixes again ({kinds})"
    check_parity(model, tok, shape, 512, layers=CPU_LAYERS, config=config)


@pytest.mark.gpu
@pytest.mark.model
@pytest.mark.parametrize("n", [4096, 8192])
def test_triton_path_equals_reference_path_on_gpu(n):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.core.io import write_json
    from workbench.core.model import load_model

    model, tok, shape = load_model(device="cuda", dtype=torch.float32)
    worst, kl = check_parity(model, tok, shape, n)
    figures = Path(os.environ.get("WORKBENCH_GPU_FIGURES", "reports/gpu_figures"))
    write_json(figures / f"parity_{n}.json", {"n": n, "dtype": "float32", "config": SHIPPED,
                                               "max_abs_diff": worst, "kl": kl, "bars": [MAX_ABS, MAX_KL]})
