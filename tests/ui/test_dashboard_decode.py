"""The Decode tab in a real browser: a real `workbench dashboard` server (CPU, embedded model, 1024-token sample)
driven by Playwright through Debian's headless Chromium. Decoding runs the engine's CPU reference path. The sample
holds the library's whole default budget (1 sink + 2 local + 8 top-k blocks of 64 tokens; a shorter one gets it cut
to its blocks, tests/model/test_gemma_dashboard.py)."""
from __future__ import annotations

import re
import time

import pytest
from conftest import ERROR, LOAD_S, assert_no_traceback, dashboard, fill, open_page, tab, until

pytestmark = [pytest.mark.ui, pytest.mark.model, pytest.mark.xdist_group("dashboard")]

MODES = ("dense-resident", "sparse-resident", "sparse-offload-sync", "sparse-resident/forecast", "sparse-offload-forecast")
DONE = ".wb-decode-job-state[data-state='ready']"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decode_ui")
    with dashboard(folder, "--length", "1024", "--layers", "0-1", "--config", "search", "--device", "cpu") as (url, log):
        yield url, log


def test_decode_tab_shows_every_mode_its_text_and_offload_is_lossless(server, browser):
    page = open_page(browser, server[0])
    tab(page, "Decode")
    assert not page.locator(".wb-decode-timeline").is_visible()  # no empty chart frame before the first run
    fill(page, ".wb-decode-tokens", 3)
    page.locator(".wb-decode-run button").click()
    until(page, page.locator("table.wb-decode tr[data-mode] >> nth=0"), LOAD_S * 1000)
    until(page, page.locator(DONE))
    device = page.locator(".wb-decode-device").inner_text()
    assert "cpu reference path" in device and "1 sink + 2 local + 8 top-k blocks of 64 tokens" in device
    assert "{" not in device  # no Python dict in the page
    rows = {}
    for mode in MODES:
        row = page.locator(f"table.wb-decode tr[data-mode='{mode}']")
        text = page.locator(f"table.wb-decode-text tr[data-mode='{mode}']")
        rows[mode] = (float(row.locator(".wb-decode-tps").inner_text()), text.locator(".wb-decode-text").inner_text(),
                      text.locator(".wb-decode-dense").inner_text(), text.locator(".wb-decode-found").inner_text())
    assert all(tps > 0 for tps, *_ in rows.values()), rows
    assert all(text.strip() for _, text, *_ in rows.values()), rows  # token text, not ids
    assert rows["sparse-offload-sync"][1] == rows["sparse-resident"][1]
    assert rows["sparse-offload-forecast"][1] == rows["sparse-resident/forecast"][1]
    assert rows["dense-resident"][2] == "3 of 3"  # every mode, the forecast ones too, is compared with dense
    assert all(re.fullmatch(r"\d of 3", dense) for _, _, dense, _ in rows.values()), rows
    assert all(re.fullmatch(r"(yes|no) \(\d{5}\)", found) for *_, found in rows.values()), rows  # the passkey
    assert float(page.locator("tr[data-mode='sparse-offload-sync'] .wb-decode-mb").inner_text()) > 0
    title = page.locator(".wb-decode-timeline .gtitle")  # the step's timeline
    title.wait_for(timeout=60_000)
    assert "one decode step" in title.text_content()
    assert page.locator(".wb-decode-run button").is_enabled()  # not left busy by the job's thread
    page.close()


@pytest.mark.parametrize(("label", "store", "codes"), [("INT8", "int8", "INT8 codes"),
                                                      ("INT8 keys, INT4 values", "int8k-int4v", "INT8-key / INT4-value")])
def test_an_int8_host_store_decodes_every_mode_but_dense_through_the_codes(server, browser, label, store, codes):
    """The host KV store select: every mode but dense-resident runs with INT8 codes (rows marked @int8; or INT8 keys
    and INT4 values, @int8k-int4v), the offload modes still give their resident references' tokens, and the device
    line says what the codes are."""
    page = open_page(browser, server[0])
    tab(page, "Decode")
    fill(page, ".wb-decode-tokens", 3)
    page.locator(".wb-decode-store select").select_option(label=label)
    page.locator(".wb-decode-run button").click()
    until(page, page.locator(f"table.wb-decode tr[data-mode='sparse-offload-sync@{store}']"), LOAD_S * 1000)
    until(page, page.locator(DONE))
    assert codes in page.locator(".wb-decode-device").inner_text()
    modes = page.locator("table.wb-decode tr[data-mode]").evaluate_all("rows => rows.map(r => r.dataset.mode)")
    assert modes == ["dense-resident"] + [f"{m}@{store}" for m in MODES[1:]], modes
    for offload, ref in ((f"sparse-offload-sync@{store}", f"sparse-resident@{store}"),
                         (f"sparse-offload-forecast@{store}", f"sparse-resident/forecast@{store}")):
        same = page.locator(f"table.wb-decode-text tr[data-mode='{offload}'] .wb-decode-same").inner_text()
        assert same == f"{ref}: yes", same
    page.close()


def test_a_bad_decode_budget_shows_an_error_within_10_s(server, browser):
    """A negative count is refused before any work; a top-k far beyond the prompt's blocks is the library's
    to refuse: its message shows in the tab's Alert within 10 s and the Decode button works again."""
    page = open_page(browser, server[0])
    tab(page, "Decode")
    fill(page, ".wb-decode-topk", -1)
    page.locator(".wb-decode-run button").click()
    page.locator(".wb-decode-job-error", has_text="budget topk=-1 is negative").wait_for(timeout=10_000)
    fill(page, ".wb-decode-topk", 100000)
    t0 = time.monotonic()
    page.locator(".wb-decode-run button").click()
    page.locator(".wb-decode-job-error", has_text=re.compile(r"decoding failed: .*\S")).wait_for(timeout=10_000)
    assert time.monotonic() - t0 < 10
    page.locator(".wb-decode-job-state[data-state='failed']").wait_for(timeout=5_000)
    assert page.locator(".wb-decode-run button").is_enabled()
    fill(page, ".wb-decode-topk", 8)  # and a good budget decodes again
    fill(page, ".wb-decode-tokens", 2)
    page.locator(".wb-decode-run button").click()
    page.locator(ERROR).wait_for(state="hidden", timeout=15_000)
    until(page, page.locator(DONE), LOAD_S * 1000)
    page.close()


def test_server_logged_no_traceback(server):
    assert_no_traceback(server[1])
