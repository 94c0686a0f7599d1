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


def test_server_logged_no_traceback(server):
    assert_no_traceback(server[1])
