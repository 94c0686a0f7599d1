"""Pictures and the HTML page of `workbench compare` (`workbench.prefill.compare`): captured mass vs
physical density per task with each task's Pareto front, and one table per task and length.
Plotly is imported inside the functions (the GPU image has none)."""
from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from workbench.patterns import PATTERNS
from workbench.views.viz import PATTERN_COLORS

COLORS = {**{cls.sweep.name: PATTERN_COLORS[kind] for kind, cls in PATTERNS.items() if cls.sweep},
          "searched config": "#000000"}  # each method's sweep in its kind's colour


def pareto_figure(report: Mapping[str, Any], length: int | None = None, key: str = "mass", title: str | None = None):
    """One panel per task: `key` ("mass" or "answer_mass") vs physical density, one line per method
    over its sweep, the Pareto front dashed. `length`: which prompt length (default the first)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    points = report["points"]
    length = length if length is not None else report["settings"]["lengths"][0]
    tasks = [t for t in report["settings"]["tasks"] if any(p["task"] == t and p["length"] == length for p in points)]
    if not tasks:
        raise ValueError(f"the report has no points at length {length}: use one of {report['settings']['lengths']}")
    fig = make_subplots(rows=1, cols=len(tasks), subplot_titles=[f"{t} @ {length}" for t in tasks], shared_yaxes=True)
    for c, task in enumerate(tasks, 1):
        group = [p for p in points if p["task"] == task and p["length"] == length]
        for method in dict.fromkeys(p["method"] for p in group):
            pts = sorted((p for p in group if p["method"] == method), key=lambda p: p["physical"])
            fig.add_trace(go.Scatter(
                x=[p["physical"] for p in pts], y=[p[key] for p in pts], name=method, legendgroup=method,
                showlegend=c == 1, mode="lines+markers", marker=dict(size=9 if method == "searched config" else 7,
                                                                     symbol="star" if method == "searched config" else "circle"),
                line=dict(color=COLORS.get(method)), text=[f"{method} {p['value']}" for p in pts]), row=1, col=c)
        front = report["pareto"][f"{task}@{length}"] if key == "mass" else None
        if front:
            fig.add_trace(go.Scatter(x=[p["physical"] for p in front], y=[p["mass"] for p in front], name="Pareto front",
                                     legendgroup="front", showlegend=c == 1, mode="lines",
                                     line=dict(color="rgba(0,0,0,0.35)", dash="dash", width=3)), row=1, col=c)
        fig.update_xaxes(title_text="physical density (64x64 tiles / causal tiles)", range=[0, 1.02], row=1, col=c)
    fig.update_yaxes(title_text="captured mass" if key == "mass" else "captured mass, answer rows", row=1, col=1)
    fig.update_layout(title=title or f"{report['model']['name']}: every method's sweep, mean over layers "
                      f"{report['settings']['layers']}", width=420 * len(tasks) + 160, height=460)
    return fig


def _cell(v: Any, digits: int = 3) -> str:
    if v is None:
        return "<td></td>"
    if isinstance(v, bool):
        return f"<td>{'yes' if v else 'no'}</td>"
    if isinstance(v, float):
        return f"<td>{v:.{digits}f}</td>"
    return f"<td>{html.escape(str(v))}</td>"


def _table(group: Sequence[Mapping[str, Any]], front: set[tuple[str, Any]], gpu: bool,
           front_ms: set[tuple[str, Any]] = frozenset()) -> str:
    head = ["method", "knob = value", "mass", "answer mass", "logical", "physical", f"index ms ({'GPU' if gpu else 'CPU'})"]
    head += ["index + tiles ms (GPU)", "kernel ms", "dense ms", "kernel speed-up"] if gpu else []
    head += ["KL", "top-1", "answer", "dense answer"]
    rows = []
    for p in group:
        q = p.get("quality", {})
        mark = (" *" if (p["method"], p["value"]) in front else "") + (" †" if (p["method"], p["value"]) in front_ms else "")
        cells = [_cell(p["method"] + mark), _cell("" if p["value"] is None else p["value"]), _cell(p["mass"]),
                 _cell(p["answer_mass"]), _cell(p["logical"]), _cell(p["physical"]), _cell(p["index_ms"], 1)]
        if gpu:
            speed = p["dense_kernel_ms"] / p["kernel_ms"] if p.get("kernel_ms") else None
            cells += [_cell(p.get("gpu_index_ms"), 3), _cell(p.get("kernel_ms"), 3), _cell(p.get("dense_kernel_ms"), 3),
                      _cell(speed, 2)]
        cells += [_cell(q.get("kl"), 4), _cell(q.get("top1_agree")), _cell(q.get("correct")), _cell(q.get("dense_correct"))]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


def report_html(report: Mapping[str, Any], figures: bool = True) -> str:
    """The whole report as one self-contained HTML page (plotly from its CDN when `figures`)."""
    s, env = report["settings"], report["environment"]
    gpu = s["device"] == "cuda"
    parts = []
    for length in s["lengths"]:
        if figures:
            parts.append(pareto_figure(report, length).to_html(include_plotlyjs="cdn", full_html=False))
        for task in s["tasks"]:
            group = [p for p in report["points"] if p["task"] == task and p["length"] == length]
            if not group:
                continue
            front = {(p["method"], p["value"]) for p in report["pareto"][f"{task}@{length}"]}
            front_ms = {(p["method"], p["value"]) for p in (report.get("pareto_ms") or {}).get(f"{task}@{length}", [])}
            sample = group[0]["sample"]
            parts.append(f"<h3>{html.escape(task)} @ {length} tokens (prompt sha {sample['sha']})</h3>"
                         + _table(group, front, gpu, front_ms))
    methods = "".join(f"<li>{html.escape(name)}: {html.escape(m['knob'])} in {m['values']}"
                      f"{' (adaptive: the config records the threshold)' if m['adaptive'] else ''}</li>"
                      for name, m in s["methods"].items())
    timing_note = ("Everything ran on the GPU. Kernel times: Triton sparse prefill of one layer in bf16 vs dense "
                   "SDPA, medians; index + tiles: the method's online index and its kernel tiles from fp32 q/k (the "
                   "searched config through the deployed Triton index), on " + html.escape(str(env.get("gpu"))) if gpu else
                   "No GPU in this run: index times are CPU wall times; kernel times come from "
                   "`workbench compare --device cuda`.")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Every prefill method, one harness</title>
<style>body{{font-family:sans-serif;max-width:1500px;margin:auto}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}th{{background:#eee}}</style></head><body>
<h1>Every prefill method, one harness: {html.escape(report['model']['name'])}</h1>
<p>One prompt per task and length (seed {s['seed']}, needle depth {s['depth']}); masses are the mean over layers
{s['layers']} of each layer's mean over heads, {'all query rows (exact)' if s['rows'] is None else
f"a stratified sample of ~{s['rows']} query rows per layer (each row exact) plus the last 64 (answer) rows"}.
Physical density = 64x64 tiles the Triton kernel computes / causal tiles. KL = KL(dense || sparse) of the
next-token distribution with every layer sparse; answer = the greedy continuation ({s['max_new_tokens']} tokens)
contains the planted answer. Quality ran at {s['quality']} sweep values, lengths {s['quality_lengths']}.
* = on the task's Pareto front (mass vs physical density); † = on its front of mass vs measured GPU time
(index + tiles + kernel of one layer).
{timing_note}</p>
<ul>{methods}</ul>
{''.join(parts)}
<p>Machine: {html.escape(str(env))}<br>Command: <code>{html.escape(str(report.get('command', '')))}</code></p>
</body></html>"""
