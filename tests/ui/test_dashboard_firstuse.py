"""What a new user meets in the dashboard, in a real Chromium against a real server (1024 tokens, layers 0-3, a
search on the sample): nothing loaded from the internet, every sidebar input applied or refused with a message,
plots whose axes show small gaps, nothing cut at 1400 px, determinate progress, honest latency labels, token
text on the maps, and a server log without tracebacks."""
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
    fill,
    open_head,
    open_page,
    tab,
    until,
    wait_ready,
)

from workbench.prefill.latency import bench_path, load_bench

pytestmark = [pytest.mark.ui, pytest.mark.model, pytest.mark.xdist_group("dashboard")]

# Panel renders into shadow roots: these helpers search through every open one.
DEEP = """
window.__deep = (selector) => {
  const out = [];
  const walk = (root) => {
    root.querySelectorAll(selector).forEach((e) => out.push(e));
    root.querySelectorAll('*').forEach((e) => { if (e.shadowRoot) walk(e.shadowRoot); });
  };
  walk(document);
  return out;
};
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    configs = tmp_path_factory.mktemp("configs_firstuse")
    with dashboard(configs, "--length", "1024", "--layers", "0-3", "--config", "search") as (url, log):
        yield url, configs, log


def _plot(page, css: str) -> dict:
    """The drawn layout of the plotly figure inside `css`: y range, title and legend boxes, bar texts."""
    div = page.locator(f"{css} .js-plotly-plot").first
    div.wait_for(state="attached")
    return div.evaluate("""(div) => {
      const box = (sel) => { const e = div.querySelector(sel); if (!e) return null;
                             const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
      return {yrange: div._fullLayout.yaxis.range, width: div.getBoundingClientRect().right,
              left: div.getBoundingClientRect().left, title: box('.gtitle'), legend: box('.legend'),
              colorbar: !!div.querySelector('.colorbar'),
              legend_texts: [...div.querySelectorAll('.legendtext')].map((e) => e.textContent),
              bar_texts: [...div.querySelectorAll('.bartext')].map((e) => e.textContent)};
    }""")


def _right_edges(page, css: str) -> list[float]:
    page.evaluate(DEEP)
    return page.evaluate("(css) => window.__deep(css).map((e) => e.getBoundingClientRect().right)", css)


def test_no_request_leaves_localhost_during_a_page_load_and_every_tab(server, browser):
    """Fonts, scripts and styles all come from the dashboard server (no Google Fonts, no CDN)."""
    url = server[0]
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    seen: list[str] = []
    context.on("request", lambda r: seen.append(r.url))
    page = context.new_page()
    page.set_default_timeout(STEP_MS)
    page.goto(url)
    wait_ready(page)
    for name in ("Heads", "Head", "Proxy", "Lengths", "Forecast", "Latency", "Export/Import", "Decode"):
        tab(page, name)
        page.wait_for_timeout(500)
    tab(page, "Forecast")
    page.locator(".wb-forecast-load button").click()
    page.locator(".wb-forecast-iou .main-svg").first.wait_for()
    outside = [u for u in seen if not re.match(r"^(https?|wss?)://127\.0\.0\.1:\d+/|^(data|blob|about):", u)]
    assert len(seen) > 10 and not outside, outside
    page.evaluate(DEEP)
    text = page.evaluate("() => window.__deep('*').map((e) => e.shadowRoot ? '' : (e.children.length ? '' : e.textContent))"
                         ".join(' ')")
    assert "{'" not in text and "': " not in text, re.findall(r".{40}\{'.{40}", text)  # no Python dicts in the page
    context.close()


def test_sidebar_inputs_are_applied_or_refused_with_a_message(server, browser):
    url, configs, _ = server
    page = open_page(browser, url)
    note = page.locator(".wb-config-text")
    assert "searched on passkey/1024 (seed 0) at target 0.95" in note.inner_text()
    before = download(page)
    fill(page, ".wb-target", 0.5)  # a new target re-runs the search on Load
    page.locator(".wb-load button").click()
    until(page, page.locator(".wb-config-text", has_text="at target 0.5"), LOAD_S * 1000)
    wait_ready(page)
    after = download(page)
    assert after["provenance"]["target"] == 0.5 and before["provenance"]["target"] == 0.95
    dense = lambda cfg: sum(e["pattern"] == "dense" for e in cfg["heads"])  # noqa: E731
    assert dense(after) < dense(before)  # a lower bar: more heads sparse

    fill(page, ".wb-length", 40)  # below the minimum: refused, not silently replaced
    page.locator(".wb-error p", has_text="length 40 is below the minimum of 128 tokens").wait_for(timeout=10_000)
    page.locator(".wb-load button").click()
    assert page.locator(".wb-progress progress").get_attribute("value") == "0"  # nothing started
    fill(page, ".wb-length", 1024)
    page.locator(ERROR).wait_for(state="hidden", timeout=10_000)

    open_head(page, 1, 0)  # a negative budget is refused by the config's check, and the inputs go back
    page.locator(".wb-pattern select").select_option("vs")
    until(page, page.locator(".wb-head-head", has_text="vs("), EDIT_MS)
    fill(page, ".wb-vertical", -5)
    page.locator(".wb-head-job-error", has_text=re.compile(r"edit refused: .*vertical = -5 .*must be >= 0")).wait_for(
        timeout=10_000)
    assert page.locator(".wb-vertical input").input_value() != "-5"

    # a saved config named after the model becomes a choice at once (no reload); with it, the search target
    # does not apply
    tab(page, "Export/Import")
    page.locator(".wb-name input").fill("SmolLM2-135M-Instruct")
    page.locator(".wb-save button").click()
    page.locator(".wb-message", has_text="saved").wait_for(timeout=STEP_MS)
    choice = str(configs / "SmolLM2-135M-Instruct.json")
    page.locator(".wb-config select").select_option(choice)  # waits for the option to appear
    page.locator(".wb-load button").click()
    until(page, page.locator(".wb-config-text", has_text=f"loaded from {choice}"), LOAD_S * 1000)
    wait_ready(page)
    fill(page, ".wb-target", 0.8)
    page.locator(".wb-error p", has_text="search target 0.8 is not used: the config comes from").wait_for(timeout=10_000)
    page.close()


def test_plots_show_small_gaps_a_colour_scale_and_count_only_captured_heads(server, browser):
    page = open_page(browser, server[0])
    page.locator(".wb-grid .js-plotly-plot .colorbar").first.wait_for(state="attached", timeout=30_000)  # drawn
    grid = _plot(page, ".wb-grid")
    assert grid["colorbar"]  # the shade's scale
    assert grid["title"][2] <= grid["width"] + 1  # the title is not cut
    counts = [int(m.group(1)) for t in grid["legend_texts"] if (m := re.search(r"\((\d+)\)$", t))]
    assert sum(counts) == 4 * 9, grid["legend_texts"]  # 4 captured layers x 9 heads, not 30 x 9
    tab(page, "Proxy")
    page.locator(".wb-proxy-bars .bartext").first.wait_for()
    bars = _plot(page, ".wb-proxy-bars")
    values = [float(t) for t in bars["bar_texts"]]
    assert values and all(re.fullmatch(r"\d\.\d{3}", t) for t in bars["bar_texts"])  # every value printed
    if min(values) >= 0.35:  # zoomed: the axis starts just below the smallest value, not at 0
        assert 0 < bars["yrange"][0] <= min(values) - 0.05 + 1e-9
    open_head(page, 0, 0)
    seg = _plot(page, ".wb-segments")
    assert len(seg["bar_texts"]) == 4
    page.close()


def test_nothing_is_cut_at_1400_px(server, browser):
    page = open_page(browser, server[0], width=1400)
    tab(page, "Forecast")
    page.locator(".wb-forecast-load button").click()
    page.locator(".wb-forecast-recall .legendtext").first.wait_for()
    recall = _plot(page, ".wb-forecast-recall")
    assert recall["legend"][2] <= 1400 and recall["width"] <= 1400, recall
    tab(page, "Latency")
    page.locator(".wb-lat-run button").click()
    until(page, page.locator(".wb-lat-source"), LOAD_S * 1000)
    assert max(_right_edges(page, ".wb-lat td")) <= 1400
    tab(page, "Decode")
    fill(page, ".wb-decode-tokens", 2)
    page.locator(".wb-decode-modes .choices__button").first.wait_for()
    page.locator(".wb-decode-run button").click()
    # the tables, not the status line: "ready" and the done callback's redraw reach the page in either order
    until(page, page.locator("table.wb-decode-text tr[data-mode] >> nth=0"), LOAD_S * 1000)
    assert max(_right_edges(page, "table.wb-decode td")) <= 1400
    assert max(_right_edges(page, "table.wb-decode-text td")) <= 1400
    assert page.evaluate("document.documentElement.scrollWidth") <= 1400
    page.close()


def test_latency_tab_says_what_ran_where_and_its_chart_matches_its_legend(server, browser):
    page = open_page(browser, server[0])
    open_head(page, 3, 0)  # the searched config makes some heads of layer 3 sparse
    tab(page, "Latency")
    page.locator(".wb-lat-run button").click()
    until(page, page.locator(".wb-lat-source"), LOAD_S * 1000)
    assert "this machine" in page.locator(".wb-lat-measured").inner_text()
    assert page.locator(".wb-lat-takeaway").inner_text().strip()
    source = page.locator(".wb-lat-source").inner_text()
    gpu = load_bench(bench_path())["environment"]["gpu"]  # the table shipped for this machine's GPU, else the H200's
    assert re.search(rf"^{re.escape(gpu)} estimate, not this machine: .* Takeaway: .+\.$", source), source
    page.locator(".wb-lat-plot .legendtext").first.wait_for()
    chart = _plot(page, ".wb-lat-plot")
    assert set(chart["legend_texts"]) <= {"dense attention", "T_index (online index)", "T_sparse (sparse attention)"}
    assert "dense attention" in chart["legend_texts"]
    if "PyTorch reference path" in page.locator(".wb-lat-path").inner_text():  # a layer with sparse heads
        assert {"T_index (online index)", "T_sparse (sparse attention)"} <= set(chart["legend_texts"])
    assert not {"T_proj (projections)", "T_other (MLP, norms)"} & set(chart["legend_texts"])  # not drawn: not listed
    page.close()


# Every value the bar takes, however briefly (a job of a few 100 ms sends its steps between two samples of a
# poll): each change of its value attribute, old and new.
PROGRESS = """(css) => { window.__seen = window.__seen || {}; const seen = window.__seen[css] = [];
  const [host, inner] = css.split(' ');  // the bar is inside its pane's shadow root
  const watch = new MutationObserver((records) => records.filter((r) => r.target.matches(inner))
    .forEach((r) => seen.push(r.oldValue, r.target.getAttribute('value'))));
  window.__deep(host).forEach((h) => watch.observe(h.shadowRoot || h,
    {subtree: true, attributes: true, attributeOldValue: true, attributeFilter: ['value']})); }"""


def _values(page, css) -> list[int]:
    return [int(v) for v in page.evaluate("(css) => window.__seen[css]", css) if v is not None]


def test_forecast_compute_and_an_import_show_determinate_progress(server, browser, tmp_path):
    page = open_page(browser, server[0])
    page.evaluate(DEEP)
    tab(page, "Forecast")
    page.evaluate(PROGRESS, ".wb-forecast-job-progress progress")
    page.locator(".wb-forecast-compute button").click()
    until(page, page.locator(".wb-forecast-job-state[data-state='ready']"), LOAD_S * 1000)
    values = _values(page, ".wb-forecast-job-progress progress")
    assert len({v for v in values if 0 < v < 100}) >= 3, values  # a bar that moves through the layers
    layers = download(page, ".wb-download-minference")
    layers[0]["0"] = ["stream_llm", 3, 77, 0.0]  # a config no session evaluated yet (not a memo hit)
    (tmp_path / "minference.json").write_text(json.dumps(layers))
    page.evaluate(PROGRESS, ".wb-progress progress")
    page.locator(".wb-upload input[type=file]").set_input_files(str(tmp_path / "minference.json"))
    page.locator(".wb-message", has_text="imported").wait_for(timeout=LOAD_S * 1000)
    values = _values(page, ".wb-progress progress")
    assert any(0 < v < 100 for v in values), values
    page.close()


def test_the_head_map_shows_tokens_on_its_axes_and_under_the_pointer(server, browser):
    page = open_page(browser, server[0])
    open_head(page, 2, 1)
    page.locator(".wb-map .xtick").first.wait_for()
    ticks = page.locator(".wb-map .xtick").all_text_contents()
    assert any(re.search(r"^\d+\S", t) for t in ticks), ticks  # "position" + token text
    assert page.locator(".wb-map .annotation-text", has_text="needle").count() >= 1
    page.locator(".wb-map .nsewdrag").first.scroll_into_view_if_needed()
    box = page.locator(".wb-map .nsewdrag").first.bounding_box()
    page.mouse.move(box["x"] + 0.3 * box["width"], box["y"] + 0.8 * box["height"])
    hover = page.locator(".wb-hover-text", has_text="query")
    hover.wait_for(timeout=30_000)
    assert re.search(r"query \d+\.\.\d+: '.+'.*key \d+\.\.\d+: '.+'", hover.inner_text(), re.S), hover.inner_text()
    until(page, page.locator(HEAD_READY))
    page.close()


def test_server_logged_no_traceback(server):
    assert_no_traceback(server[2])
