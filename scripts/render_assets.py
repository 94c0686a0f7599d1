"""Render the README figures into assets/ with the same `workbench.views.viz` functions the notebooks use.

    python scripts/render_assets.py [--length 2048] [--out assets] [--html]
    python scripts/render_assets.py --dashboard [--length 2048] [--tabs Lengths]   # screenshots of dashboard tabs

Attention figures come from the embedded model on the CPU (a passkey prompt of --length tokens); the
head grid from the shipped config; the latency figures from the committed H200 benchmark JSON. PNGs are
written by plotly's static export (kaleido, which drives the system Chromium: `pip install kaleido`,
`apt-get install chromium`); `--html` writes self-contained HTML instead (no browser needed).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def save(fig, out: Path, name: str, html: bool, scale: float = 2.0) -> Path:
    from workbench.core.io import atomic_path, write_text

    if html:
        return write_text(out / f"{name}.html", fig.to_html(include_plotlyjs=True, full_html=True))
    path = out / f"{name}.png"
    with atomic_path(path) as tmp:
        fig.write_image(str(tmp), format="png", scale=scale)
    return path


def attention_figures(length: int) -> dict:
    import torch

    from workbench.analysis.head_kinds import profile_layer
    from workbench.analysis.stats import layer_stats
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample
    from workbench.core.model import load_model
    from workbench.patterns import VerticalSlash, vs_proxy
    from workbench.views import viz

    model, tok, shape = load_model()
    sample = make_sample("passkey", tok, length, seed=0)
    cap = capture_attention(model, shape, sample.input_ids)
    stats = {layer: layer_stats(*cap.layer_qkv(layer)[:2], cap.scale) for layer in cap.layers}
    profiles = [p for layer in cap.layers for p in profile_layer(stats[layer], layer)]
    thumbs = torch.stack([torch.stack([viz.thumbnail(stats[l].max_map[h], 32) for h in range(shape.n_heads)])
                          for l in cap.layers])
    figs = {"head_thumbnails": viz.head_thumbnails(
        thumbs, title=f"{shape.name}: all {len(profiles)} heads, passkey prompt of {length} tokens")}
    top = max(profiles, key=lambda p: p.vertical)
    q, k, _ = cap.layer_qkv(top.layer)
    cols, offs = vs_proxy(q, k, cap.scale, **VerticalSlash.at_budget(length // 16, length))
    figs["attention_vs_overlay"] = viz.attention_map(
        stats[top.layer], top.head, pattern=VerticalSlash(cols, offs),
        title=f"L{top.layer} H{top.head}: max-pooled map + online Vertical-Slash index")
    r0 = max(0, length - 256)
    figs["attention_zoom"] = viz.attention_zoom(q, k, cap.scale, top.head, rows=(r0, length), cols=(0, 256),
                                                title=f"L{top.layer} H{top.head}: exact zoom, last 256 queries x first 256 keys")
    return figs


def benchmark_figures() -> dict:
    from workbench_benchmarks.decode import main_run

    from workbench.config import HeadConfig
    from workbench.views import viz

    figs = {}
    cfg_path = ROOT / "workbench" / "data" / "configs" / "SmolLM2-135M-Instruct.json"
    if cfg_path.exists():
        cfg = HeadConfig.load(cfg_path)
        figs["pattern_grid"] = viz.pattern_grid(cfg, title="shipped config: pattern per head (shade = calibration recall)")
    e2e = ROOT / "assets" / "benchmarks" / "prefill_e2e_h200.json"
    if e2e.exists():
        bench = json.loads(e2e.read_text())
        n = max(r["n"] for r in bench["rows"])
        rows = {r["config"]: {"T_proj": r["per_layer_mean"]["proj_ms"], "T_index": r["per_layer_mean"]["index_ms"],
                              "T_sparse": r["per_layer_mean"]["sparse_ms"], "T_other": r["per_layer_mean"]["other_ms"]}
                for r in bench["rows"] if r["n"] == n}
        rows["dense"] = {"T_dense" if k == "T_sparse" else k: v for k, v in rows["dense"].items()}  # dense attention
        figs["prefill_breakdown_h200"] = viz.latency_breakdown(
            rows, reference="dense", title=f"{bench['environment']['gpu']}: one layer at {n // 1024}K tokens "
                                           "(random-weight Llama-3-8B shape)")
    dec = ROOT / "assets" / "benchmarks" / "decode_h200.json"
    if dec.exists():
        bench = json.loads(dec.read_text())
        context = max(r["context"] for r in bench["runs"])
        groups: dict = {}
        for r in bench["runs"]:
            if r["context"] == context and main_run(bench, r) and r.get("store_dtype", "model") == "model" \
                    and r["reuse_imposed"] == (None if r["mode"].endswith("-resident") else 0.79):
                groups.setdefault(r["mode"], {})[f"batch {r['batch']}"] = r["tokens_per_s"]
        figs["decode_h200"] = viz.grouped_bars(groups, "tokens/s", title=f"{bench['environment']['gpu']}: decode at "
                                               f"{context // 1024}K tokens, {bench['layers']} layers of a random-weight "
                                               "Llama-3-8B shape (offload: 0.79 block reuse)")
    return figs


SHOWN_HEAD = (9, 4)  # a Vertical-Slash head of the shipped config (its layer also has dense heads)
TAB_ACTIONS = {  # what each tab shows in its screenshot: the button pressed first, and what to wait for
    "Heads": (None, ".wb-grid .main-svg"),
    "Head": (None, ".wb-map .main-svg"),
    "Proxy": (None, ".wb-proxy-bars .main-svg"),
    "Lengths": (".wb-lengths-run button", ".wb-lengths-takeaway"),
    "Forecast": (".wb-forecast-load button", ".wb-forecast-iou .main-svg"),
    "Latency": (".wb-lat-run button", ".wb-lat-plot .main-svg"),
    "Export/Import": (None, ".wb-download"),
    "Decode": (".wb-decode-run button", ".wb-decode-timeline .main-svg"),
}


LENGTHS = "1024, 2048, 4096"  # what the Lengths tab evaluates the shipped config (searched at 8192) at


def dashboard_screenshots(out: Path, length: int, widths: tuple[int, ...] = (1280, 1920), timeout_s: float = 1800,
                          tabs: tuple[str, ...] = tuple(TAB_ACTIONS)) -> list[Path]:
    """Every dashboard tab at each window width: a real `workbench dashboard` (the shipped config, all layers,
    a passkey prompt of `length` tokens, the CPU) in headless Chromium -> out/dashboard_<tab>_<width>.png."""
    import shutil
    import socket
    import subprocess
    import urllib.request

    from playwright.sync_api import sync_playwright

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(out / ".dashboard_screenshots.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "dashboard", "--port", str(port), "--length", str(length),
                             "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                                        args=["--headless", "--no-sandbox", "--disable-gpu"])
            paths = shoot_tabs(browser, url, out, widths, timeout_s, tabs=tabs)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    return paths


def shoot_tabs(browser, url: str, out: Path, widths: tuple[int, ...], timeout_s: float,
               head: tuple[int, int] = SHOWN_HEAD, tabs: tuple[str, ...] = tuple(TAB_ACTIONS)) -> list[Path]:
    """Open the dashboard at `url`, open `head` (layer, head), fill each of `tabs` (TAB_ACTIONS) and screenshot
    it at each width."""
    import re

    page = browser.new_page(viewport={"width": widths[0], "height": 1000})
    page.set_default_timeout(timeout_s * 1000)
    page.goto(url)
    page.wait_for_selector(".wb-state[data-state='ready']")
    for css, value in ((".wb-layer", head[0]), (".wb-head-index", head[1])):
        page.locator(f"{css} input").fill(str(value))
        page.locator(f"{css} input").press("Enter")
    page.locator(".wb-open button").click()
    page.locator(".wb-head-head", has_text=f"layer {head[0]}, head {head[1]}:").wait_for()
    paths = []
    for width in widths:
        for tab in tabs:
            button, ready = TAB_ACTIONS[tab]
            page.set_viewport_size({"width": width, "height": 1000})
            page.locator(".bk-tab").filter(has_text=re.compile(f"^{re.escape(tab)}$")).click()
            if button and width == widths[0]:
                if tab == "Decode":  # a short run: 4 new tokens
                    page.locator(".wb-decode-tokens input").fill("4")
                    page.locator(".wb-decode-tokens input").press("Enter")
                if tab == "Lengths":  # typed once the tab has drawn its defaults (else they arrive after the text)
                    page.locator(".wb-lengths-note p").wait_for()
                    page.locator(".wb-lengths-lengths input").fill(LENGTHS)
                    page.locator(".wb-lengths-lengths input").press("Enter")
                page.locator(button).click()
            page.locator(ready).first.wait_for()
            page.wait_for_timeout(1500)
            main = page.locator("#main")  # the template's scrolling column: show all of it
            tall = page.evaluate("(e) => e.getBoundingClientRect().top + e.scrollHeight", main.element_handle())
            page.set_viewport_size({"width": width, "height": int(max(1000, tall + 20))})
            page.wait_for_timeout(1000)
            path = out / f"dashboard_{tab.split('/')[0].lower()}_{width}.png"
            page.screenshot(path=str(path), full_page=True)
            paths.append(path)
    page.close()
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=2048, help="prompt tokens for the attention figures (default 2048)")
    p.add_argument("--out", default=str(ROOT / "assets"), help="output folder (default assets/)")
    p.add_argument("--html", action="store_true", help="write HTML instead of PNG (no kaleido/Chromium needed)")
    p.add_argument("--skip-model", action="store_true", help="only the figures from committed JSON and configs")
    p.add_argument("--dashboard", action="store_true",
                   help="only the dashboard screenshots: every tab at 1280 and 1920 px (Playwright + Chromium)")
    p.add_argument("--tabs", default=None, help="with --dashboard: only these tabs, comma-separated (e.g. Lengths)")
    args = p.parse_args(argv)
    if args.dashboard:
        tabs = tuple(t.strip() for t in args.tabs.split(",")) if args.tabs else tuple(TAB_ACTIONS)
        unknown = [t for t in tabs if t not in TAB_ACTIONS]
        if unknown:
            sys.exit(f"--tabs {unknown} unknown: choose from {list(TAB_ACTIONS)}")
        for path in dashboard_screenshots(Path(args.out), args.length, tabs=tabs):
            print("wrote", path)
        return 0
    if not args.html:
        try:
            import kaleido  # noqa: F401
        except ImportError:
            sys.exit("PNG export needs kaleido (pip install kaleido) and a Chromium (apt-get install chromium); "
                     "or pass --html")
    t0 = time.perf_counter()
    figs = benchmark_figures()
    if not args.skip_model:
        figs.update(attention_figures(args.length))
    out = Path(args.out)
    for name, fig in figs.items():
        print("wrote", save(fig, out, name, args.html))
    print(f"{len(figs)} figures in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
