"""The embedded model prefilled through FlexAttention with the shipped config: the same next-token
logits as the PyTorch reference of the sparse kernel (CPU, n = 512), and not those of dense."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workbench.prefill.quality import backend_agreement
from workbench.search.config import HeadConfig

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "SmolLM2-135M-Instruct.json"


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
