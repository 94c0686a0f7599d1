"""Execute every notebook top to bottom in a real Jupyter kernel (`python3`, installed by the Makefile).

CI sizes: 512-token prompts, 3 layers where a notebook lets you choose, few samples and steps
(`WORKBENCH_NB_*`; the notebooks' defaults are the interactive sizes). Each notebook is its own test,
so pytest-xdist spreads them over the workers. A cell that raises fails the test with its traceback.
"""
from __future__ import annotations

import time
from pathlib import Path
from queue import Empty

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from jupyter_client.asynchronous import AsyncKernelClient  # noqa: E402  (after the skips: notebook extra)
from jupyter_client.channels import AsyncZMQSocketChannel  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from traitlets import Type, default  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CI_SIZES = {"WORKBENCH_NB_LENGTH": "512", "WORKBENCH_NB_LAYERS": "0,4,11", "WORKBENCH_NB_QUICK": "1"}
CELL_TIMEOUT_S = 480


class SlicedChannel(AsyncZMQSocketChannel):
    """A kernel channel that waits for a message in polls of at most 1 s.

    nbclient waits for each cell's execute_reply in one asyncio poll of the shell socket as long as the cell
    timeout. Here (pyzmq 27.3, jupyter_client 8.10, 2 cores) that poll sometimes misses the reply of a cell the
    kernel has finished (kernel idle, its idle status received) and sees it only when the poll times out and
    checks the socket once more: notebook 02's editor cells waited 480 s each, and CI's 900 s limit ran out.
    Polls of 1 s make such a missed wakeup cost 1 s; a cell busy past the timeout still fails."""

    async def get_msg(self, timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            try:
                return await super().get_msg(timeout=step)
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class SlicedClient(AsyncKernelClient):
    shell_channel_class = Type(SlicedChannel)
    iopub_channel_class = Type(SlicedChannel)


class SlicedKernelManager(AsyncKernelManager):
    @default("client_factory")
    def _sliced(self) -> type:
        return SlicedClient


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
                                     kernel_manager_class=SlicedKernelManager,
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
