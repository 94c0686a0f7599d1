"""Length generalisation on screen and on paper: per-head captured mass vs prompt length (a plotly figure for
the notebook, the dashboard and the report) and the HTML page of a `prefill.generalize` report.

Everything here reads the plain dicts `prefill.generalize` returns; nothing is computed beyond layout.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from workbench.views.viz import PATTERN_COLORS


def mass_vs_length(lengths: Sequence[int], mass: Any, patterns: Sequence[Sequence[str]], *,
                   heads: Sequence[tuple[int, int]] | None = None, target: float | None = None,
                   scaled: Any = None, title: str | None = None):
    """One line per head: its captured mass (y) at each prompt length (x, log2).

    mass: `[len(lengths), L, H]` (e.g. `head_mass_by_length(...)["mass"]`); patterns: `[L][H]` pattern names
    (the line's colour); heads: the (layer, head) pairs to draw (default: every head); target: a dashed line;
    scaled: the same table for the budget-scaled config, drawn dotted beside it."""
    import plotly.graph_objects as go  # inside: the GPU image has no plotly

    mass = [[[float(x) for x in row] for row in table] for table in mass]
    if len(mass) != len(lengths):
        raise ValueError(f"mass has {len(mass)} lengths but lengths has {len(lengths)}: give one table per length")
    pairs = heads if heads is not None else [(l, h) for l in range(len(mass[0])) for h in range(len(mass[0][0]))]
    fig = go.Figure()
    for name, table, dash in (("as searched", mass, "solid"), ("scaled", scaled, "dot")):
        if table is None:
            continue
        table = [[[float(x) for x in row] for row in t] for t in table]
        shown = set()
        for l, h in pairs:
            kind = patterns[l][h]
            fig.add_scatter(x=list(lengths), y=[t[l][h] for t in table], mode="lines+markers",
                            line={"color": PATTERN_COLORS.get(kind, "#e45756"), "dash": dash, "width": 1},
                            name=f"{kind} ({name})", legendgroup=f"{kind}-{name}", showlegend=(kind, name) not in shown,
                            hovertemplate=f"layer {l} head {h} ({kind}, {name})<br>n=%{{x}}<br>mass %{{y:.4f}}<extra></extra>")
            shown.add((kind, name))
    if target is not None:
        fig.add_hline(y=target, line_dash="dash", line_color="#444", annotation_text=f"target {target}")
    fig.update_layout(title=title or "Captured attention mass per head vs prompt length", height=420,
                      xaxis={"title": "prompt length (tokens)", "type": "log", "tickvals": list(lengths)},
                      yaxis={"title": "captured mass"}, margin={"l": 60, "r": 20, "t": 70, "b": 50})
    return fig


def evaluated_heads(report: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(layer, head) of every head a generalisation report evaluated (its settings' layers; reports written
    before layers were a setting evaluated every layer the model does not fix)."""
    model = report["model"]
    fixed = set(report["config"].get("fixed_layers") or [])
    layers = report["settings"].get("layers") or [l for l in range(model["n_layers"]) if l not in fixed]
    return [(l, h) for l in layers for h in range(model["n_heads"])]


def below_target_heads(report: Mapping[str, Any], variant: str = "as_is") -> list[tuple[int, int]]:
    """(layer, head) of the heads below the report's target at any of its lengths."""
    return sorted({(l, h) for heads in report["below_target"][variant].values() for l, h in heads})


def summary_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per variant and length: mean mass, worst head (all rows / answer rows), heads below target,
    mean physical density."""
    return [{"variant": v, "length": int(n), **row} for v, rows in report["summary"].items() for n, row in rows.items()]


def takeaway(report: Mapping[str, Any]) -> str:
    """One sentence: at the length farthest from L (the report's drop length), how many heads fall below target
    as searched and with budgets scaled to n, the density each costs, and how many heads lose mass."""
    s, L = report["settings"], report["config"]["searched_at"]
    n = str(s["drop_to"])
    a = report["summary"]["as_is"][n]
    text = (f"At {n} tokens, {a['heads_below_target']} of {a['heads']} heads fall below the target "
            f"{report['config']['target']} with the budgets searched at {L} (worst head {a['mass_worst_head']:.3f} over "
            f"all rows, {a['tail_worst_head']:.3f} over answer rows; mean density {a['physical_density_mean']:.3f})")
    if "scaled" in report["summary"]:
        b = report["summary"]["scaled"][n]
        text += (f"; with every budget x n/L, {b['heads_below_target']} (worst {b['mass_worst_head']:.3f} / "
                 f"{b['tail_worst_head']:.3f}; mean density {b['physical_density_mean']:.3f})")
    drops = len(report["dropping"]["as_is"])
    return text + (f". {drops} heads lose more than {s['drop']} of their mass from {L} to {n} tokens: search those "
                   f"again at {n}." if drops else
                   f". No head loses more than {s['drop']} of its mass from {L} to {n} tokens.")


def report_figure(report: Mapping[str, Any], variant: str = "as_is", only_dropping: bool = False,
                  heads: Sequence[tuple[int, int]] | None = None):
    """`mass_vs_length` of a generalisation report (`prefill.generalize.generalization_report`): `heads`, else
    every head it evaluated, or only the heads that drop by more than the report's threshold."""
    lengths = report["settings"]["lengths"]
    model = report["model"]
    if heads is None:
        heads = ([(r["layer"], r["head"]) for r in report["dropping"][variant]] if only_dropping else
                 evaluated_heads(report))
    table = lambda v: [report["mass"][v][str(n)]["mass"] for n in lengths]  # noqa: E731
    return mass_vs_length(lengths, table(variant), report["patterns"], heads=heads, target=report["config"]["target"],
                          scaled=table("scaled") if variant == "as_is" and "scaled" in report["mass"] else None,
                          title=f"{model['name']}: mass per head vs length, config searched at "
                                f"{report['config']['searched_at']} tokens<br><sub>solid: budgets as searched; "
                                "dotted: every budget x n/L</sub>")


def write_html(report: Mapping[str, Any], path: str | Path) -> Path:
    """The report as one HTML page: summary per variant and length, the dropping heads, the end-to-end check
    at the longest length, the figure of the dropping heads (plotly.js from its CDN, as `views.methods` does:
    the page stays small) and every head's mass per length (atomic write)."""
    from workbench.core.report import Report

    s, c = report["settings"], report["config"]
    page = Report(f"Length generalisation: {report['model']['name']}")
    page.text(f"Config searched at L = {c['searched_at']} tokens (target {c['target']}, answer rows {c['tail_target']}; "
              f"{c['summary']}) evaluated on held-out prompts ({', '.join(s['tasks'])}, {s['samples']} per task and "
              f"length, seeds from {s['held_out_seed']}) at {s['lengths']} tokens. Variants: "
              + "; ".join(f"{k}: {v}" for k, v in report["variants"].items()) + ". Mass = exact captured attention "
              f"mass of the index each head runs online, over all query rows and over the last {s['tail_rows']} "
              "(answer) rows; a head is below target when its worst prompt is. "
              + (f"Layers {c['fixed_layers']} are fixed by the model (sliding window) and run as the model does."
                 if c.get("fixed_layers") else ""))
    if report.get("command"):
        page.text("Command: " + report["command"])
    page.text("Takeaway: " + takeaway(report))
    page.heading("Summary (layers the model does not fix)")
    page.table(summary_rows(report), digits=4)
    for variant, rows in report["dropping"].items():
        page.heading(f"Heads whose mean mass drops by more than {s['drop']} from {c['searched_at']} to "
                     f"{s['drop_to']} tokens ({variant}): {len(rows)}")
        page.table([{**r, "params": str(r["params"])} for r in rows], digits=4)
    if report.get("quality"):
        page.heading(f"End to end at {s['lengths'][-1]} tokens: retrieval and next-token KL vs dense")
        page.table([{"variant": v, **{k: x for k, x in q.items() if k != "records"}} for v, q in report["quality"].items()],
                   digits=5)
    if any(report["dropping"].values()):
        page.heading("Mass vs length of the heads that drop (as searched: solid; budgets x n/L: dotted)")
        page.parts.append(report_figure(report, only_dropping=True).to_html(include_plotlyjs="cdn", full_html=False))
    page.heading("Every head (worst prompt, all rows / answer rows)")
    rows = []
    for l, h in evaluated_heads(report):
        row: dict[str, Any] = {"layer": l, "head": h, "config": report["labels"][l][h]}
        for v in report["mass"]:
            for n in s["lengths"]:
                t = report["mass"][v][str(n)]
                row[f"{v} {n}"] = f"{t['mass_worst'][l][h]:.4f} / {t['tail_worst'][l][h]:.4f}"
        rows.append(row)
    page.table(rows)
    return page.write(path)
