"""Switching a head to another pattern in a real browser gives sizes that fit the prompt: at 1K, 4K and 8K tokens
every budget is below n / 4 and the head's physical density below 1 (sizes from the pattern registry,
`workbench.patterns.default_params`). One layer is captured from the shipped config to keep the 8K load short."""
from __future__ import annotations

import pytest
from conftest import (
    EDIT_MS,
    HEAD_READY,
    LOAD_S,
    SHIPPED,
    assert_no_traceback,
    dashboard,
    fill,
    number,
    open_page,
    tab,
    until,
)

pytestmark = [pytest.mark.ui, pytest.mark.model, pytest.mark.xdist_group("dashboard")]

BUDGETS = {"vs": ("vertical", "slash"), "ashape": ("sink", "window"), "block": ("topk",)}
TOKENS = {"topk": 64}  # a size counted in 64-token blocks


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("defaults_ui")
    with dashboard(folder, "--length", "1024", "--layers", "0", "--config", str(SHIPPED), "--device", "cpu") as (url, log):
        yield url, log


@pytest.mark.parametrize("n", [1024, 4096, 8192])
def test_a_head_switched_to_a_pattern_gets_budgets_below_a_quarter_of_the_prompt(server, browser, n):
    page = open_page(browser, server[0])
    if n != 1024:
        fill(page, ".wb-length", n)
        page.locator(".wb-load button").click()
        until(page, page.locator(".wb-state[data-state='busy']"))
        until(page, page.locator(".wb-state[data-state='ready']"), LOAD_S * 1000)
    tab(page, "Head")
    until(page, page.locator(".wb-head-prompt", has_text=f"{n} tokens"), LOAD_S * 1000)
    until(page, page.locator(HEAD_READY))
    for kind, sizes in BUDGETS.items():
        current = page.locator(".wb-head-head").inner_text()
        page.locator(".wb-pattern select").select_option("dense" if f": {kind}(" in current else kind)
        page.locator(".wb-pattern select").select_option(kind)
        until(page, page.locator(".wb-head-head", has_text=f": {kind}("), EDIT_MS)
        values = {k: int(page.locator(f".wb-{k} input").input_value()) for k in sizes}
        tokens = {k: v * TOKENS.get(k, 1) for k, v in values.items()}
        assert all(v < n / 4 for v in tokens.values()), f"{kind} at {n} tokens: {values}"
        assert number(page, "physical") < 1, f"{kind}{values} at {n} tokens covers every tile"
    page.close()


def test_the_budget_knob_sets_a_kinds_sizes_and_shows_only_where_it_describes_them(server, browser):
    """One number, keys per query row, sets any budgeted kind's sizes (`PatternBase.at_budget`): VS at 256 keys is
    VS(128, 256), block-sparse at 256 is top-4; a switched kind shows its default budget (n / 16); sizes typed by
    hand show the budget that gives them, or none; dense has no knob."""
    page = open_page(browser, server[0])
    tab(page, "Head")
    until(page, page.locator(HEAD_READY), LOAD_S * 1000)
    n = int(page.locator(".wb-head-prompt").inner_text().split(", ")[-1].split()[0])
    current = page.locator(".wb-head-head").inner_text()
    page.locator(".wb-pattern select").select_option("dense" if ": vs(" in current else "vs")
    page.locator(".wb-pattern select").select_option("vs")
    until(page, page.locator(".wb-head-head", has_text=": vs("), EDIT_MS)
    assert page.locator(".wb-budget input").input_value() == str(max(64, n // 16))
    fill(page, ".wb-budget", 256)
    until(page, page.locator(".wb-head-head", has_text="vs(vertical=128, slash=256)"), EDIT_MS)
    page.locator(".wb-pattern select").select_option("block")
    until(page, page.locator(".wb-head-head", has_text=": block("), EDIT_MS)
    fill(page, ".wb-budget", 256)
    until(page, page.locator(".wb-head-head", has_text="block(topk=4)"), EDIT_MS)
    fill(page, ".wb-topk", 5)  # 5 blocks: the budget of 320 keys
    until(page, page.locator(".wb-head-head", has_text="block(topk=5)"), EDIT_MS)
    assert page.locator(".wb-budget input").input_value() == "320"
    page.locator(".wb-pattern select").select_option("strided")
    until(page, page.locator(".wb-head-head", has_text=": strided("), EDIT_MS)
    fill(page, ".wb-stride", 7)  # no budget gives this stride at this length
    until(page, page.locator(".wb-head-head", has_text="stride=7)"), EDIT_MS)
    assert page.locator(".wb-budget input").input_value() == ""
    page.locator(".wb-pattern select").select_option("dense")
    until(page, page.locator(".wb-head-head", has_text=": dense("), EDIT_MS)
    assert not page.locator(".wb-budget input").is_visible()
    page.close()


def test_server_logged_no_traceback(server):
    assert_no_traceback(server[1])
