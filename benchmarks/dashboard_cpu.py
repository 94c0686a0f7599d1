"""`workbench bench dashboard`: dashboard timings on the CPU -> assets/benchmarks/dashboard_cpu.json.

1. Time to first paint: spawn `workbench dashboard`, open it in headless Chromium (Playwright), and
   record when the server answers, when the browser paints the page (first-contentful-paint), and
   when the first session is ready (sample captured, config evaluated, first head open).
2. One head edit at N tokens, server side: a `Session` in this process, the shipped config, edits of
   one head cycling through patterns; the time of the numbers (rescore_head + headview + index) and
   the time including the views' redraws (a `Dashboard` attached to the same session).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
EDITS = [("vs", {"vertical": 1000, "slash": 2048}), ("ashape", {"sink": 64, "window": 512}), ("block", {"topk": 16}),
         ("vs", {"vertical": 500, "slash": 1000}), ("ashape", {"sink": 4, "window": 128}), ("block", {"topk": 8})]


def first_paint(length: int, layers: str, timeout: float) -> dict:
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "workbench", "dashboard", "--port", str(port), "--length", str(length), "--layers", layers]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    try:
        while True:
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except OSError:
                time.sleep(0.1)
        http = time.perf_counter() - t0
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page()
            nav = time.perf_counter()
            page.goto(url)
            page.wait_for_selector(".bk-tab", timeout=timeout * 1000)
            tabs = time.perf_counter() - t0
            fcp = page.evaluate("performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? null")
            page.wait_for_selector(".wb-state[data-state='ready']", timeout=timeout * 1000)
            page.wait_for_selector(".wb-head-job-state[data-state='ready']", state="attached", timeout=timeout * 1000)
            ready = time.perf_counter() - t0
            browser.close()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"command": " ".join(["workbench", *cmd[3:]]),
            "server_answers_s": round(http, 2),
            "first_contentful_paint_s": round(nav - t0 + fcp / 1e3, 2) if fcp is not None else None,
            "tabs_rendered_s": round(tabs, 2),
            "first_session_ready_s": round(ready, 2)}


def head_edits(length: int, layers: str, reps: int) -> dict:
    import torch

    from workbench.views.dashboard.app import Dashboard
    from workbench.views.dashboard.state import Settings

    settings = Settings(length=length, layers=Settings.parse_layers(layers))
    dash = Dashboard(settings)  # starts loading in the background, like a browser session
    s = dash.session
    s.wait()
    if s.error:
        raise RuntimeError(s.error)
    layer = s.capture.layers[-1]
    dash.open_tab("Head")  # the Head tab is open while editing (hidden tabs redraw when opened)
    head = next(t for t in dash.tabs_list if t.title == "Head").job  # the tab's state: it opens the selected head
    s.select(layer, 3)  # the Head tab's state follows the selection: its job opens the head (after any open one)
    while head.busy or head.opened != (s.capture_key, s.config_version, layer, 3):
        head.wait()
        time.sleep(0.05)
    if head.error:
        raise RuntimeError(head.error)
    numbers, total, cpu, by_pattern = [], [], [], {}
    for i in range(reps):
        pattern, params = EDITS[i % len(EDITS)]
        c0 = time.process_time()  # CPU seconds of this process, all threads (what the edit costs the machine)
        head.edit(pattern, params)
        cpu.append((time.process_time() - c0) * 1e3)
        numbers.append(head.last_edit_ms)
        total.append(head.last_edit_total_ms)
        by_pattern.setdefault(f"{pattern}{tuple(params.values())}", []).append(head.last_edit_ms)
    summary = lambda xs: {"median": round(statistics.median(xs), 1), "max": round(max(xs), 1)}  # noqa: E731
    return {"length": length, "layer": layer, "head": 3, "edits": reps, "torch_threads": torch.get_num_threads(),
            "numbers_ms": summary(numbers), "with_views_ms": summary(total), "cpu_time_with_views_ms": summary(cpu),
            "numbers_ms_by_pattern": {k: round(statistics.median(v), 1) for k, v in by_pattern.items()}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--layers", default="0-3", help="captured layers (the edit cost does not depend on them)")
    p.add_argument("--reps", type=int, default=12, help="timed head edits (default 12)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for the first session")
    p.add_argument("--out", default="reports/benchmarks/dashboard_cpu.json", help="JSON output path")


def run(args: argparse.Namespace) -> int:
    from workbench.core.io import write_json
    from workbench.core.timing import environment

    load = [round(x, 2) for x in os.getloadavg()]
    result = {
        "environment": {**environment(), "load_average_1_5_15_at_start": load},
        "note": "load_average_1_5_15_at_start shows what else ran (a loaded machine gives upper bounds)",
        "first_paint": first_paint(args.length, args.layers, args.timeout),
        "head_edit": head_edits(args.length, args.layers, args.reps),
    }
    write_json(args.out, result)
    print(result)
    return 0


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
