"""The dashboard in a real browser: a real `workbench dashboard` server on a free port, driven by Playwright
through Debian's headless Chromium. The sample is short (512 tokens, layers 0-3) so the whole file stays within
a few minutes on 2 cores. The server's kernel benchmark lacks the embedded model's shape (Llama-3-8B rows only),
so the latency estimate runs on its fallback throughout. Every wait also ends, failing with the page's message,
as soon as an error Alert shows; the last test checks that the server logged no traceback."""
from __future__ import annotations

import json
import re

import pytest
from conftest import (
    EDIT_MS,
    ERROR,
    HEAD_READY,
    LOAD_S,
    STEP_MS,
    assert_no_traceback,
    dashboard,
    download,
    edit,
    fill,
    number,
    open_head,
    open_page,
    tab,
    until,
    wait_ready,
)
from playwright.sync_api import expect

pytestmark = [pytest.mark.ui, pytest.mark.model, pytest.mark.xdist_group("dashboard")]

# A synthetic kernel benchmark with Llama-3-8B-shaped rows only (32 q / 8 KV heads, head_dim 128): the embedded
# model's estimate (9 / 3 heads, head_dim 64) runs on its fallback.
LLAMA3_ONLY = {"environment": {"gpu": "Test GPU"}, "rows": [
    {"shape": "llama3-8b", "q_heads": 32, "kv_heads": 8, "head_dim": 128, "n": 16384, "block": "64", "kernel": kernel,
     "time_ms": ms, "index_ms": index_ms, "physical_density": density}
    for kernel, ms, index_ms, density in (("dense_sdpa", 3.3, 0.0, 1.0), ("vertical_slash", 1.9, 0.9, 0.6),
                                          ("block_sparse", 1.4, 0.4, 0.4), ("a_shape", 0.6, 0.0, 0.2))]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, configs folder, log path) of a dashboard that searches its config on the sample."""
    configs = tmp_path_factory.mktemp("configs")
    bench = configs.parent / "bench_llama3_only.json"
    bench.write_text(json.dumps(LLAMA3_ONLY))
    with dashboard(configs, "--length", "512", "--layers", "0-3", "--config", "search", "--bench", str(bench)) as (url, log):
        yield url, configs, log


def test_grid_click_opens_a_head_and_an_edit_changes_its_recall(server, browser):
    url, _, _ = server
    page = open_page(browser, url)
    # the drawn grid: before it the pane holds an empty plot, whose plot area has another size and place
    until(page, page.locator(".wb-grid .gtitle", has_text="pattern per head"), EDIT_MS)
    box = page.locator(".wb-grid .nsewdrag").first.bounding_box()
    layer, head = 2, 3  # the grid shows 30 layers x 9 heads; cell centres
    page.mouse.click(box["x"] + (head + 0.5) / 9 * box["width"], box["y"] + (layer + 0.5) / 30 * box["height"])
    expect(page.locator(".wb-layer input")).to_have_value(str(layer), timeout=EDIT_MS)  # the sidebar follows the click
    expect(page.locator(".wb-head-index input")).to_have_value(str(head), timeout=EDIT_MS)
    until(page, page.locator(".wb-head-head", has_text=f"layer {layer}, head {head}:"), LOAD_S * 1000)  # Head tab opened
    until(page, page.locator(HEAD_READY))
    wide = edit(page, "ashape", sink=64, window=256)
    narrow = edit(page, "ashape", sink=1, window=8)
    assert 0 < narrow < wide <= 1
    assert number(page, "physical") < 1
    vs = edit(page, "vs", vertical=30, slash=50)
    assert vs != narrow and 0 < vs <= 1
    assert number(page, "oracle") >= vs - 1e-4  # the same-budget oracle is never below the proxy
    page.close()


def test_export_save_and_reimport(server, browser):
    url, configs, _ = server
    page = open_page(browser, url)
    open_head(page, 1, 2)
    mass = edit(page, "ashape", sink=2, window=16)
    data = download(page)
    entry = data["heads"][1 * 9 + 2]
    assert (entry["pattern"], entry["params"]) == ("ashape", {"sink": 2, "window": 16})
    assert entry["recall"]["mean"] == pytest.approx(mass, abs=1e-4)
    assert data["provenance"]["edits"][-1]["layer"] == 1
    layers = download(page, ".wb-download-minference")  # MInference's format from the page too
    assert isinstance(layers, list) and len(layers) == 30 and layers[1]["2"][0] == "stream_llm"

    page.locator(".wb-name input").fill("ui-edit")
    page.locator(".wb-save button").click()
    page.locator(".wb-message", has_text="saved").wait_for(timeout=STEP_MS)
    assert json.loads((configs / "ui-edit.json").read_text())["heads"] == data["heads"]
    page.locator(".wb-name input").fill("../escape")
    page.locator(".wb-save button").click()
    page.locator(".wb-message", has_text="not allowed").wait_for(timeout=STEP_MS)
    assert not (configs.parent / "escape.json").exists()
    page.close()

    # a fresh session starts from the searched config, then imports the exported one
    other = open_page(browser, url)
    open_head(other, 1, 2)
    assert "ashape(sink=2, window=16)" not in other.locator(".wb-head-head").inner_text()
    tab(other, "Export/Import")
    path = configs.parent / "exported.json"
    path.write_text(json.dumps(data))
    other.locator(".wb-upload input[type=file]").set_input_files(str(path))
    other.locator(".wb-message", has_text="imported").wait_for(timeout=LOAD_S * 1000)
    wait_ready(other)
    tab(other, "Head")
    until(other, other.locator(".wb-head-head", has_text="ashape(sink=2, window=16)"))
    assert number(other, "captured") == pytest.approx(mass, abs=1e-4)
    other.close()


def test_malformed_config_shows_the_field_and_other_tabs_fill(server, browser, tmp_path):
    url, _, _ = server
    page = open_page(browser, url)
    tab(page, "Proxy")  # every captured head's proxy vs oracle, worst gap first
    page.locator(".wb-proxy .tabulator-row").first.wait_for(timeout=STEP_MS)
    gaps = [float(x) for x in page.locator(".wb-proxy .tabulator-cell[tabulator-field='gap']").all_inner_texts()]
    assert len(gaps) >= 10 and gaps == sorted(gaps, reverse=True)
    tab(page, "Latency")
    page.get_by_role("button", name="Time the selected layer").click()
    # on the CPU the path is labelled: the PyTorch reference (no speed-up), or dense SDPA for an all-dense layer
    until(page, page.locator(".wb-lat-measured", has_text="cpu"), LOAD_S * 1000)
    assert re.search(r"PyTorch reference path|all heads dense", page.locator(".wb-lat-path").inner_text())
    assert "shape 'llama3-8b'" in page.locator(".wb-lat-source").inner_text()  # the fallback, named
    data = download(page)
    del data["heads"][5]["params"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    page.locator(".wb-upload input[type=file]").set_input_files(str(bad))
    # the message names the field: "import refused: ...: field heads[5]: 'params' is a required property ..."
    page.locator(".wb-message", has_text=re.compile(r"import refused.*field heads\[5\].*'params'")).wait_for(timeout=STEP_MS)
    (tmp_path / "junk.json").write_text("{not json")
    page.locator(".wb-upload input[type=file]").set_input_files(str(tmp_path / "junk.json"))
    page.locator(".wb-message", has_text="not valid JSON").wait_for(timeout=STEP_MS)
    page.close()


def test_minference_upload_with_missing_heads_is_refused_then_filled_with_a_warning(server, browser, tmp_path):
    """Strict by default (the message points at the page's control, not a CLI flag); with "fill missing
    heads" ticked the import goes through and the page names each filled head."""
    from workbench.config import HeadConfig

    url, _, _ = server
    page = open_page(browser, url)
    layers = HeadConfig.from_dict(download(page)).to_minference()
    del layers[2]["4"]
    (tmp_path / "one.json").write_text(json.dumps(layers))
    page.locator(".wb-upload input[type=file]").set_input_files(str(tmp_path / "one.json"))
    refused = re.compile(r"import refused.*layer 2 lacks heads 4.*tick 'fill missing heads' and upload again", re.S)
    page.locator(".wb-message", has_text=refused).wait_for(timeout=STEP_MS)
    assert page.locator(".wb-message", has_text="--fill-missing").count() == 0
    del layers[2]["7"]  # a new file: the upload widget reacts to new content only
    (tmp_path / "two.json").write_text(json.dumps(layers))
    page.locator(".wb-fill-missing input").check()
    page.locator(".wb-upload input[type=file]").set_input_files(str(tmp_path / "two.json"))
    filled = re.compile(r"imported two\.json.*warning: .*2 heads missing.*layer 2 head 4, layer 2 head 7", re.S)
    page.locator(".wb-message", has_text=filled).wait_for(timeout=STEP_MS)
    page.close()


def test_two_sessions_edit_different_heads_in_isolation(server, browser):
    url, _, _ = server
    a, b = open_page(browser, url), open_page(browser, url)
    open_head(a, 0, 1)
    open_head(b, 3, 4)
    edit(a, "ashape", sink=3, window=24)
    edit(b, "block", topk=1)
    cfg_a, cfg_b = download(a), download(b)
    assert cfg_a["heads"][0 * 9 + 1]["params"] == {"sink": 3, "window": 24}
    assert cfg_b["heads"][3 * 9 + 4]["params"] == {"topk": 1}
    assert cfg_b["heads"][0 * 9 + 1]["params"] != {"sink": 3, "window": 24}  # (not in the search's grid)
    assert cfg_a["heads"][3 * 9 + 4]["params"] != {"topk": 1}
    assert {(e["layer"], e["head"]) for e in cfg_a["provenance"]["edits"]} == {(0, 1)}
    assert {(e["layer"], e["head"]) for e in cfg_b["provenance"]["edits"]} == {(3, 4)}
    a.close()
    b.close()


def test_estimate_names_its_gpu_and_a_refused_length_shows_in_the_alert(server, browser):
    """The benchmark lacks the embedded shape: the page still loads and the estimate names the GPU, the shape
    it reads instead and that it is not this machine's time. A length the model cannot take is refused
    at once in the Alert, the sample stays loaded, and a valid length loads."""
    url, _, _ = server
    page = open_page(browser, url)
    tab(page, "Head")
    until(page, page.locator(".wb-head-head", has_text="layer 0, head 0:"))
    until(page, page.locator(HEAD_READY))
    source = page.locator(".wb-head-source").inner_text()
    gpu, n = LLAMA3_ONLY["environment"]["gpu"], LLAMA3_ONLY["rows"][0]["n"]  # the benchmark's GPU and its one length
    assert re.search(rf"^{re.escape(gpu)} estimate, not this machine: rates of the {n}-token runs.*a 512-token prompt "
                     r"was not timed.*bench_llama3_only\.json, shape 'llama3-8b' .*head_dim 128.*scaled by 64/128",
                     source), source
    assert "Takeaway:" in source

    length = page.locator(".wb-length input")
    assert length.input_value() == "512"
    fill(page, ".wb-length", 100000)
    alert = page.locator(".wb-error p", has_text=re.compile(r"length 100000 is above the 8192 positions"))
    alert.wait_for(timeout=15_000)
    page.locator(".wb-load button").click()  # refused again: nothing is loaded
    assert page.locator(".wb-progress progress").get_attribute("value") == "0"  # no job runs
    assert page.locator(".wb-load button").is_enabled()

    fill(page, ".wb-length", 512)
    page.locator(ERROR).wait_for(state="hidden", timeout=15_000)  # a valid input clears the refusal
    page.locator(".wb-load button").click()
    wait_ready(page)
    page.close()


def test_server_logged_no_traceback(server):
    """Runs last in this file: every test above (refusals, a malformed upload, jobs) left no traceback."""
    assert_no_traceback(server[2])
