"""The Decode tab in a real browser: a real `workbench dashboard` server (CPU, embedded model, 256-token sample)
driven by Playwright through Debian's headless Chromium. Decoding runs the engine's CPU reference path."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ui, pytest.mark.model, pytest.mark.xdist_group("dashboard")]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
READY = ".wb-state[data-state='ready']"
SETTLED = f"{READY}, .wb-error:visible"  # ready, or the sidebar's error Alert: fail at once with its text
WAIT_MS = 600_000  # a shared 2-core machine
MODES = ("dense-resident", "sparse-resident", "sparse-offload-sync", "sparse-resident/forecast", "sparse-offload-forecast")


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed: `make browser` (apt-get install chromium)")
    folder = tmp_path_factory.mktemp("decode_ui")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(folder / "dashboard.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "dashboard", "--port", str(port), "--length", "256",
                             "--layers", "0-1", "--config", "search", "--out", str(folder), "--device", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(address, timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
            assert proc.poll() is None, (folder / "dashboard.log").read_text()
        yield address
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _settle(page) -> None:
    page.wait_for_selector(SETTLED)
    assert page.locator(READY).count(), f"the page shows an error: {page.locator('.wb-error p').inner_text()}"


def test_decode_tab_shows_every_mode_and_offload_is_lossless(url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            page.goto(url)
            _settle(page)
            page.locator(".bk-tab").filter(has_text=re.compile("^Decode$")).click()
            page.locator(".wb-decode-tokens input").fill("3")
            page.locator(".wb-decode-tokens input").press("Enter")
            page.locator(".wb-decode-run button").click()
            page.wait_for_selector("table.wb-decode tr[data-mode], .wb-error:visible")
            _settle(page)
            assert "cpu reference path" in page.locator(".wb-decode-device").inner_text()
            rows = {}
            for mode in MODES:
                row = page.locator(f"table.wb-decode tr[data-mode='{mode}']")
                tokens = row.locator(".wb-decode-tokens").inner_text().split()
                rows[mode] = (float(row.locator(".wb-decode-tps").inner_text()), tokens)
            assert all(tps > 0 for tps, _ in rows.values()), rows
            assert all(len(tokens) == 3 for _, tokens in rows.values()), rows
            assert rows["sparse-offload-sync"][1] == rows["sparse-resident"][1]
            assert rows["sparse-offload-forecast"][1] == rows["sparse-resident/forecast"][1]
            assert float(page.locator("tr[data-mode='sparse-offload-sync'] .wb-decode-mb").inner_text()) > 0
            title = page.locator(".wb-decode-timeline .gtitle")  # the step's timeline
            title.wait_for(timeout=60_000)
            assert "one decode step" in title.text_content()
            assert page.locator(".wb-decode-run button").is_enabled()  # not left busy by the job's thread
        finally:
            browser.close()
