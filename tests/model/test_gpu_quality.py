"""A small quality run through the deployed (Triton) path on the GPU: the embedded model in bf16, the shipped
config, 4 passkey prompts at 4K: the dense outcome is kept and the next-token KL vs dense stays under the bar;
the dense bf16-vs-fp32 drift (the same weights in fp32 on the GPU) is reported beside it, so that sparsity is
not blamed for the dtype. The full report (>= 20 prompts per length at 4K and 8K, fp32 and bf16) is
`workbench prefill quality --device cuda`. The figures go to $WORKBENCH_GPU_FIGURES/quality.json (gpu_check)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.model]

SHIPPED = "workbench/data/configs/SmolLM2-135M-Instruct.json"
KL_MEAN_BAR = 0.005


def test_triton_path_keeps_the_dense_outcome_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.config import HeadConfig
    from workbench.core.io import write_json
    from workbench.core.model import load_model
    from workbench.prefill.quality import quality_report

    model, tok, shape = load_model(device="cuda", dtype=torch.bfloat16)
    fp32, _, _ = load_model(device="cuda", dtype=torch.float32)
    config = HeadConfig.load(SHIPPED, shape)
    report = quality_report(model, tok, shape, config, lengths=(4096,), samples=4, cosine_samples=1,
                            sensitivity_samples=0, progress=False, drift_model=fp32)
    assert report["environment"]["backend"].startswith("Triton")
    changed = [r["depth"] for r in report["records"] if r["dense_correct"] != r["sparse_correct"]]
    row = report["summary"]["per_length"]["4096"]
    figures = Path(os.environ.get("WORKBENCH_GPU_FIGURES", "reports/gpu_figures"))
    write_json(figures / "quality.json", {"dtype": "bfloat16", "backend": report["environment"]["backend"],
                                          "config": SHIPPED, "n": 4096, **row})
    assert "dense_drift_kl_mean" in row, "the dense bf16-vs-fp32 drift is missing from the summary"
    assert not changed, f"sparse changed the retrieval outcome at needle depths {changed}"
    assert row["kl_mean"] <= KL_MEAN_BAR, f"next-token KL mean {row['kl_mean']:.4f} > {KL_MEAN_BAR}"
