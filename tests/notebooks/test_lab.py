"""Notebooks in a real JupyterLab driven by Playwright through Debian's headless Chromium (the way a user runs
them): notebook 02's head editor redraws its figure when the pattern changes. The notebook runs at CI sizes
(512 tokens, quick) from a copy in a temporary folder."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from headless import CHROMIUM

pytestmark = [pytest.mark.ui, pytest.mark.notebook, pytest.mark.model, pytest.mark.xdist_group("jupyterlab")]

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"WORKBENCH_NB_LENGTH": "512", "WORKBENCH_NB_LAYERS": "0,4,11", "WORKBENCH_NB_QUICK": "1"}
RUN_MS = 480_000  # every cell of the notebook on a shared 2-core machine (about 30 s alone)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(url with token, folder) of a JupyterLab server serving a folder with a copy of notebook 02."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed: `make browser` (apt-get install chromium)")
    folder = tmp_path_factory.mktemp("lab")
    shutil.copy(ROOT / "notebooks" / "02_fit_search_edit.ipynb", folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    env = {**os.environ, **SIZES, "WORKBENCH_NB_OUT": str(folder / "out"), "PYTHONPATH": str(ROOT),
           "JUPYTER_RUNTIME_DIR": str(folder / ".runtime"), "JUPYTERLAB_WORKSPACES_DIR": str(folder / ".workspaces"),
           "JUPYTERLAB_SETTINGS_DIR": str(folder / ".settings")}
    log = open(folder / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}",
                             "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                             *(["--allow-root"] if os.geteuid() == 0 else [])],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
            assert proc.poll() is None, (folder / "lab.log").read_text()
        yield url, token, folder
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _kernels(url: str, token: str) -> list[dict]:
    """The kernels the server runs, from its REST API. A 500 is asked again for up to 10 s: jupyter_server lists a
    kernel it is still creating and fails on its unset `last_activity` (seen in CI-sized runs, lab.log)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/kernels?token={token}", timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            if e.code != 500 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _kernel_states(url: str, token: str) -> list[str]:
    """Execution state of every kernel the server runs ("starting", "idle", "busy")."""
    return [k["execution_state"] for k in _kernels(url, token)]


def _diagnosis(page, url: str, token: str, folder: Path) -> str:
    """What the notebook and the server were doing, for a failure message."""
    prompts = page.locator(".jp-InputPrompt").all_inner_texts()
    outputs = [text[:200] for text in page.locator(".jp-OutputArea-output").all_inner_texts()]
    log = (folder / "lab.log").read_text(errors="replace")[-3000:]
    return f"kernels {_kernel_states(url, token)}; input prompts {prompts}; outputs {outputs}; lab.log tail:\n{log}"


def _wait_nudging(page, locator, url: str, token: str, total_ms: int) -> int:
    """Wait up to `total_ms` for `locator`; every 30 s without it, open one more websocket to the kernel from the
    page (the server then asks the kernel for its info, and the kernel's status messages reach every open
    connection). That matters only when the server's socket missed a wakeup, as nbclient's did (see
    test_notebooks.SlicedChannel): the next message on the socket delivers what waited. Returns the nudges."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline, nudges = time.monotonic() + total_ms / 1000, 0
    while True:
        try:
            locator.wait_for(timeout=30_000)
            return nudges
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                raise
        kernel = _kernels(url, token)[0]["id"]
        ws = f"{url.replace('http', 'ws', 1)}/api/kernels/{kernel}/channels?token={token}"
        page.evaluate("(u) => { const w = new WebSocket(u); setTimeout(() => w.close(), 10000); }", ws)
        nudges += 1


def test_notebook_02_editor_redraws_its_figure_after_a_pattern_change(lab, browser):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    url, token, folder = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.set_default_timeout(RUN_MS)
        page.goto(f"{url}/lab/tree/02_fit_search_edit.ipynb?token={token}")
        page.locator(".jp-Notebook").wait_for()
        deadline = time.monotonic() + 300
        while _kernel_states(url, token) != ["idle"]:  # the kernel started and answered
            assert time.monotonic() < deadline, _diagnosis(page, url, token, folder)
            time.sleep(1)
        page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for()
        started = page.locator(".jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
        for _ in range(3):  # a click on the menu before the notebook is ready runs nothing: try again
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile("^Run$")).click()
            page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Run All Cells$")).click()
            try:
                started.first.wait_for(timeout=30_000)
                break
            except PlaywrightTimeout:
                page.keyboard.press("Escape")
        editor = page.locator(".widget-output .gtitle")  # the editor's figure lives in its Output widget
        nudges = 0
        try:
            nudges = _wait_nudging(page, editor.first, url, token, RUN_MS)
            nudges += _wait_nudging(page, page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']"),
                                    url, token, RUN_MS)  # every cell ran
        except PlaywrightTimeout:
            pytest.fail(f"notebook 02 did not finish in {RUN_MS / 1000:.0f} s ({nudges} nudges): "
                        + _diagnosis(page, url, token, folder))
        print(f"notebook 02 ran with {nudges} nudges")
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                              has_text="Traceback")
        assert errors.count() == 0, errors.first.inner_text()
        before = editor.first.text_content()
        pattern = page.locator(".widget-dropdown select").first
        new = next(v for v in ("ashape", "block", "vs") if f": {v}(" not in before)
        pattern.select_option(new)
        redrawn = page.locator(".widget-output .gtitle", has_text=f": {new}(")
        redrawn.wait_for(timeout=120_000)
        assert page.locator(".widget-output .gtitle").count() == 1  # redrawn in place, not appended
        assert page.locator(".widget-output .gtitle").text_content() != before
        assert page.locator(".widget-output .xtick").count() > 0  # a real plotly figure, with token ticks
    finally:
        page.close()
