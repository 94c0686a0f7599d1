"""Execute every notebook top to bottom in a real Jupyter kernel (`python3`, installed by the Makefile).

CI sizes: 512-token prompts, 3 layers where a notebook lets you choose, few samples and steps
(`WORKBENCH_NB_*`; the notebooks' defaults are the interactive sizes). Each notebook is its own test,
so pytest-xdist spreads them over the workers. A cell that raises fails the test with its traceback.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CI_SIZES = {"WORKBENCH_NB_LENGTH": "512", "WORKBENCH_NB_LAYERS": "0,4,11", "WORKBENCH_NB_QUICK": "1"}
# nbclient waits for each cell's execute_reply in one poll of the shell socket, as long as the cell timeout. Here
# (pyzmq 27, jupyter_client 8.10, two kernels at once on 2 cores) that poll sometimes misses the reply of a
# cell the kernel has finished (kernel idle, its idle status received) and returns it only when the poll times
# out: notebook 02 saw its editor cell's reply 480 s late, twice, and CI's 900 s test limit ran out. A cell
# timeout of 150 s bounds that stall; a cell really busy for 150 s (the longest takes ~60 s here) still fails.
CELL_TIMEOUT_S = 150


def test_there_are_eight_notebooks_stored_without_outputs():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06", "07", "08"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.name}: cells {dirty} carry outputs; strip them before committing"
        assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.notebook
@pytest.mark.model
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    for key, value in CI_SIZES.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORKBENCH_NB_OUT", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}"[:6000])
    seconds = time.perf_counter() - t0
    print(f"{path.name}: {seconds:.1f} s")
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert figures or widgets, f"{path.name} drew no figure"
    for cell in nb.cells:  # long work shows progress: a cell that captures the model draws a tqdm bar
        if cell.cell_type == "code" and "capture_attention(" in cell.source and "progress=False" not in cell.source:
            bars = [o for o in cell.outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
                    or (o.get("name") == "stderr" and "%|" in o.get("text", ""))]
            assert bars, f"{path.name}: the capture cell shows no progress bar:\n{cell.source}"
