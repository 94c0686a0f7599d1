"""Shared pieces of the browser tests: a real `workbench dashboard` server on a free port (its log checked for
tracebacks), Debian's headless Chromium driven by Playwright, and waits that fail at once with the page's
error message."""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from headless import CHROMIUM

READY = ".wb-state[data-state='ready']"  # the sidebar's job: the sample is loaded and evaluated
HEAD_READY = ".wb-head-job-state[data-state='ready']"  # the Head tab's job: the head is open
ERROR = ".wb-error:visible"  # an Alert: the sidebar's, or a tab's (a failed job, a refused input)
LOAD_S = 600  # the first session captures and searches the sample on a busy 2-core machine
STEP_MS = 300_000  # any one click's effect; generous because CI shares 2 cores with other tests
EDIT_MS = 30_000  # an edit re-scores one head on the page's own thread: seconds at most, even on a busy CI machine
ROOT = Path(__file__).parents[2]
SHIPPED = ROOT / "workbench" / "data" / "configs" / "SmolLM2-135M-Instruct.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def dashboard(folder: Path, *args: str):
    """A `workbench dashboard` process with `args`, its configs folder and log in `folder`; yields (url, log
    path). Stopped by its pid at the end."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium is not installed: `make browser` (apt-get install chromium)")
    port = free_port()
    log_path = folder / "dashboard.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "dashboard", "--port", str(port),
                             "--out", str(folder), *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(url, timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
            assert proc.poll() is None, log_path.read_text()
        yield url, log_path
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def assert_no_traceback(log_path: Path) -> None:
    """The server logged no traceback (a refused input or a failed job logs one line, not a traceback; a message to
    a page the test had just closed is dropped by `workbench.views.dashboard.app.quiet_closed_tabs`)."""
    text = log_path.read_text()
    assert "Traceback" not in text and "TypeError" not in text, text[-6000:]


def until(page, locator, timeout_ms=STEP_MS):
    """Wait for `locator`; fail at once, with its text, if an error Alert shows first; on a timeout, say what
    the page's status lines show."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        locator.or_(page.locator(ERROR)).first.wait_for(timeout=timeout_ms)
    except PlaywrightTimeout:
        states = page.locator("[data-state]")
        shown = [f"{states.nth(i).get_attribute('data-state')!r}: {states.nth(i).inner_text()!r}"
                 for i in range(states.count())]
        pytest.fail(f"waited {timeout_ms / 1000:.0f} s for {locator}; the page's states are {shown}")
    if page.locator(ERROR).count():
        pytest.fail(f"the page shows an error: {alert_text(page.locator(ERROR).first)!r}")


# An Alert's text is inside its shadow root, which inner_text() does not read; STYLE / SCRIPT text left out.
DEEP_TEXT = """(e) => { const walk = (n) => (n.shadowRoot ? walk(n.shadowRoot) : '') + [...n.childNodes].map((c) =>
  c.nodeType === Node.TEXT_NODE ? c.textContent : (['STYLE', 'SCRIPT'].includes(c.nodeName) ? '' : walk(c))).join('');
  return walk(e).replace(/\\s+/g, ' ').trim(); }"""


def alert_text(locator) -> str:
    return locator.evaluate(DEEP_TEXT)


def open_page(browser, url, width: int = 1400):
    page = browser.new_context(accept_downloads=True, viewport={"width": width, "height": 1000}).new_page()
    page.set_default_timeout(STEP_MS)
    page.goto(url)
    wait_ready(page)
    return page


def tab(page, name):
    page.locator(".bk-tab").filter(has_text=re.compile(f"^{re.escape(name)}$")).click()


def wait_ready(page):
    until(page, page.locator(READY), LOAD_S * 1000)


def number(page, key) -> float:
    return float(page.locator(f".wb-head-{key}").inner_text())


def fill(page, css, value):
    page.locator(f"{css} input").fill(str(value))
    page.locator(f"{css} input").press("Enter")


def open_head(page, layer, head):
    """Select a head in the sidebar and open it: the page switches to the Head tab and opens it."""
    fill(page, ".wb-layer", layer)
    fill(page, ".wb-head-index", head)
    page.locator(".wb-open button").click()
    until(page, page.locator(".wb-head-head", has_text=f"layer {layer}, head {head}:"), LOAD_S * 1000)
    until(page, page.locator(HEAD_READY))


def edit(page, pattern, **sizes):
    """Choose a pattern and sizes in the Head tab as a user does (the switch's default sizes show before a size
    is typed); returns the captured mass shown afterwards. An edit is computed at once on the page's thread:
    one that has not shown within EDIT_MS will not show."""
    before = page.locator(".wb-head-head").inner_text()
    page.locator(".wb-pattern select").select_option(pattern)
    until(page, page.locator(".wb-head-head", has_text=re.compile(f": {re.escape(pattern)}\\(")), EDIT_MS)
    for k, v in sizes.items():
        fill(page, f".wb-{k}", v)
    want = ", ".join(f"{k}={v}" for k, v in sizes.items())
    until(page, page.locator(".wb-head-head", has_text=f"{pattern}({want})"), EDIT_MS)
    assert page.locator(".wb-head-head").inner_text() != before
    return number(page, "captured")


def download(page, css=".wb-download") -> dict | list:
    tab(page, "Export/Import")
    with page.expect_download() as d:
        page.locator(f"{css} button").click()
    return json.loads(Path(d.value.path()).read_text())
