"""Issue 19's patterns run on the existing Triton prefill kernel through `to_tiles`: the kernel equals
exact attention over the tiles (CPU: Triton interpreter, fp32; GPU: bf16), and on XAttention, whose
tiles are exactly its mask, equals the logical pattern."""
from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench_kernels.index_ref import tiles_to_mask  # noqa: E402
from workbench_kernels.prefill import sparse_prefill  # noqa: E402
from workbench_kernels.prefill_ref import masked_attention_ref  # noqa: E402

from workbench.patterns.dilated import Dilated, Strided  # noqa: E402
from workbench.patterns.flexprefill import flexprefill  # noqa: E402
from workbench.patterns.trishape import TriShape  # noqa: E402
from workbench.patterns.xattention import xattention  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, TOL = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 2e-5)


@pytest.mark.parametrize("name", ["trishape", "dilated", "strided", "xattention", "flexprefill"])
def test_kernel_runs_each_new_pattern(name):
    n, hq, hkv, d = 200, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    pattern = {"trishape": lambda: TriShape(torch.tensor([4, 0, 64, 8]), torch.tensor([16, 1, 70, 8]),
                                            torch.tensor([20, 0, 64, 130])),
               "dilated": lambda: Dilated(torch.tensor([5, 1, 40, 9]), torch.tensor([3, 7, 2, 20])),
               "strided": lambda: Strided(torch.tensor([8, 1, 30, 2]), torch.tensor([5, 64, 17, 3])),
               "xattention": lambda: xattention(q[0], k[0], scale, torch.tensor([0.3, 0.6, 0.9, 1.0])),
               "flexprefill": lambda: flexprefill(q[0], k[0], scale, 0.5, torch.tensor([0.0, 1.0, 0.0, 1.0]), 16)}[name]()
    tiles = pattern.to_tiles(n)
    o, _ = sparse_prefill(*(x.to(DEV, DTYPE) for x in (q, k, v)), tiles.to(DEV), scale=scale)
    covered = tiles_to_mask(tiles, n)
    assert not (pattern.to_mask(n)[None] & ~covered).any()
    ref = masked_attention_ref(q.double(), k.double(), v.double(), covered, scale)[0]
    assert torch.allclose(o.double().cpu(), ref, atol=TOL, rtol=TOL)
    if name == "xattention":
        logical = masked_attention_ref(q.double(), k.double(), v.double(), pattern.to_mask(n)[None], scale)[0]
        assert torch.allclose(o.double().cpu(), logical, atol=TOL, rtol=TOL)


@pytest.mark.model
def test_whole_model_on_the_kernel_matches_the_reference(embedded):
    """`workbench compare`'s GPU path (Triton kernel over to_tiles in every layer) against its CPU path
    (row-mask reference) for XAttention, whose tiles are exactly its mask."""
    from workbench.core.attention import attention_override
    from workbench.core.corpus import make_sample
    from workbench.prefill.compare import pattern_attention

    model, tok, shape = embedded  # fp32 on the CPU; a copy runs on the GPU where there is one
    model = model if DEV == "cpu" else copy.deepcopy(model).to(DEV)
    ids = make_sample("passkey", tok, 192, seed=1).input_ids.reshape(1, -1).to(DEV)
    build = lambda layer, q, k, scale: xattention(q, k, scale, 0.8)  # noqa: E731
    logits = []
    for triton in (False, True):
        with attention_override(model, pattern_attention(build, triton=triton)), torch.no_grad():
            logits.append(model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu())
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3)
