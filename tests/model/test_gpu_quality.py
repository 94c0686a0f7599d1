"""A small quality run through the deployed (Triton) path on the GPU: the embedded model in bf16, the shipped
config, passkey prompts at 4K: the dense outcome is kept and the next-token KL stays under the bar. The full
report (>= 20 prompts per length at 4K and 8K, fp32 and bf16) is `workbench prefill quality --device cuda`."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.model]

KL_MEAN_BAR = 0.005


def test_triton_path_keeps_the_dense_outcome_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.prefill.quality import quality_report
    from workbench.search.config import HeadConfig

    model, tok, shape = load_model(device="cuda", dtype=torch.bfloat16)
    config = HeadConfig.load("configs/SmolLM2-135M-Instruct.json", shape)
    report = quality_report(model, tok, shape, config, lengths=(4096,), samples=4, cosine_samples=1,
                            sensitivity_samples=0, progress=False)
    assert report["environment"]["backend"].startswith("Triton")
    changed = [r["depth"] for r in report["records"] if r["dense_correct"] != r["sparse_correct"]]
    row = report["summary"]["per_length"]["4096"]
    write_json(os.environ.get("WORKBENCH_GPU_QUALITY_JSON", "reports/gpu_quality.json"),
               {"dtype": "bfloat16", "config": "configs/SmolLM2-135M-Instruct.json", **row})
    assert not changed, f"sparse changed the retrieval outcome at needle depths {changed}"
    assert row["kl_mean"] <= KL_MEAN_BAR, f"next-token KL mean {row['kl_mean']:.4f} > {KL_MEAN_BAR}"
