"""Notebooks 05 (live latency of the model's own layers) and 06 (offloaded decode) executed on a GPU, where
their GPU branches run (Triton index + kernel, the engine's Triton and UVA paths) on 4K-token prompts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.model, pytest.mark.notebook]

ROOT = Path(__file__).resolve().parents[2]
GPU_SIZES = {"WORKBENCH_NB_LENGTH": "4096", "WORKBENCH_NB_QUICK": "1"}


@pytest.mark.parametrize("name", ["05_kernel_latency", "06_offloaded_decode"])
def test_notebook_runs_on_the_gpu(name, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for key, value in GPU_SIZES.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORKBENCH_NB_OUT", str(tmp_path))
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{name} failed on the GPU:\n{e}"[:6000])
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "CPU (PyTorch reference" not in text, f"{name} took its CPU branch on a GPU machine"
