"""The Lengths tab in a real browser: a real `workbench dashboard` server (CPU, embedded model, a 512-token sample,
layers 0 and 4, the config searched on it) driven by Playwright through Debian's headless Chromium. The tab
evaluates the session's config on held-out prompts at other lengths (`prefill.generalize`)."""
from __future__ import annotations

import pytest
from conftest import ERROR, LOAD_S, alert_text, assert_no_traceback, dashboard, edit, fill, open_head, open_page, tab, until

pytestmark = [pytest.mark.ui, pytest.mark.model, pytest.mark.xdist_group("dashboard")]

DONE = ".wb-lengths-job-state[data-state='ready']"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lengths_ui")
    with dashboard(folder, "--length", "512", "--layers", "0,4", "--config", "search", "--device", "cpu") as (url, log):
        yield url, log


def test_lengths_tab_refuses_bad_lengths_then_draws_mass_per_head_vs_length(server, browser):
    from playwright.sync_api import expect

    page = open_page(browser, server[0])
    tab(page, "Lengths")
    expect(page.locator(".wb-lengths-lengths input")).to_have_value("512, 1024, 2048", timeout=30_000)  # L, 2L, 4L
    expect(page.locator(".wb-lengths-note p")).to_contain_text("L = 512 tokens")
    assert not page.locator(".wb-lengths-plot").is_visible()  # no empty chart before the first run
    fill(page, ".wb-lengths-lengths", "512, 99999")
    page.locator(".wb-lengths-run button").click()
    error = page.locator(".wb-lengths-job-error")
    error.wait_for(timeout=10_000)
    assert "length 99999 is above the 8192 positions" in alert_text(error)
    fill(page, ".wb-lengths-lengths", "512,1024")
    fill(page, ".wb-lengths-prompts", 1)
    page.locator(".wb-lengths-run button").click()
    page.locator(ERROR).wait_for(state="hidden", timeout=15_000)  # a good request clears the refusal
    until(page, page.locator(".wb-lengths-takeaway"), LOAD_S * 1000)
    until(page, page.locator(DONE))
    expect(page.locator(".wb-lengths-lengths input")).to_have_value("512,1024")  # what the user typed stays
    takeaway = page.locator(".wb-lengths-takeaway").inner_text()
    assert takeaway.startswith("At 1024 tokens,") and "of 18 heads fall below the target" in takeaway
    rows = page.locator("table.wb-lengths-table tbody tr")
    assert rows.count() == 4  # 2 variants x 2 lengths
    assert rows.nth(0).locator("td").nth(0).inner_text() == "as_is"
    page.locator(".wb-lengths-show button", has_text="every head").click()
    page.locator(".wb-lengths-plot .gtitle").wait_for(timeout=60_000)
    assert "mass per head vs length" in page.locator(".wb-lengths-plot .gtitle").text_content()
    trace = page.locator(".wb-lengths-plot .scatterlayer .trace")
    expect(trace).to_have_count(36, timeout=30_000)  # 2 layers x 9 heads, as searched and scaled
    page.locator(".wb-lengths-show button", has_text="the selected head").click()
    expect(trace).to_have_count(2, timeout=30_000)
    assert page.locator(".wb-lengths-run button").is_enabled()  # not left busy by the job's thread
    assert not page.locator(".wb-lengths-stale").count()
    open_head(page, 4, 2)  # an edit after the evaluation: the report says it is of the config as it was
    edit(page, "ashape", sink=1, window=8)
    tab(page, "Lengths")
    until(page, page.locator(".wb-lengths-stale", has_text="The config changed after this evaluation"))
    page.close()
    assert_no_traceback(server[1])
