"""Overlap and recall report: how well each selector finds the blocks a target layer really attends to.

Per target layer t and equal block budget (same init, local, topk), on held-out prompts:
- recall: the share of the target layer's exact attention mass (query heads averaged per GQA group) on
  the dynamic candidate blocks that the chosen top-k blocks hold;
- IoU with the teacher's blocks (fine teacher 2/1 pooled to 32/16, then to blocks, top-k).
Selectors: the same-layer InfLLM-V2 selector (SparDA's "Sparse"), the trained Forecast heads, an
untrained cross-layer proxy (layer t-1's own query heads on layer t's compressed keys, InfiniGen-like),
early-layer reuse (one calibrated shallow layer's exact top-k set for all deeper layers), optionally
Forecast heads trained with the coarse teacher, Quest (per-page key min/max upper bounds, same
budget: `workbench.patterns.quest`), and the oracle (exact top-k by mass) as the ceiling.
Also: the layer x layer IoU matrix of exact top-k sets and decode-time churn with and without EMA.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench.analysis.block_sets import (
    block_mass,
    candidates,
    churn,
    dynamic_set,
    ema_sets,
    iou,
    iou_matrix,
    pick_shallow_layer,
    recall,
)
from workbench.core.capture import capture_attention
from workbench.core.model import ModelShape
from workbench.core.progress import Progress
from workbench.decode.forecast.heads import ForecastHeads, candidate_positions, rope_tables, teacher_blocks, teacher_scores
from workbench.patterns.infllm import Budget, compress_keys, row_block_scores
from workbench.patterns.quest import group_page_scores, page_bounds

SELECTORS = ("oracle", "teacher", "same_layer", "forecast", "quest", "proxy", "reuse", "coarse_forecast")


def _rows(n: int, count: int, budget: Budget, seed: int) -> torch.Tensor:
    from workbench.decode.forecast.train import training_rows

    return training_rows(n, count, budget, seed + 10_000)  # other rows than training used


@torch.no_grad()
def exact_sets(model: torch.nn.Module, shape: ModelShape, input_ids: torch.Tensor, budget: Budget, *,
               rows: int, seed: int, progress: Progress | None = None) -> torch.Tensor:
    """Every layer's exact top-k set, fused over all heads (the blog's per-layer mask): `[L, R, nb]`.
    `progress` gets (what, done, total) after the capture and after each layer."""
    report = progress or (lambda what, done, total: None)
    L = shape.n_layers
    cap = capture_attention(model, shape, input_ids, dtype=torch.float32, progress=False)
    report("captured", 1, L + 1)
    pos = _rows(cap.n, rows, budget, seed)
    sets = []
    for t in range(L):
        sets.append(dynamic_set(block_mass(cap.q[t][:, pos], cap.k[t], pos, cap.scale, budget.block).sum(0), pos, budget))
        report(f"layer {t}", t + 2, L + 1)
    return torch.stack(sets)


@torch.no_grad()
def evaluate_prompt(model: torch.nn.Module, shape: ModelShape, input_ids: torch.Tensor, heads: ForecastHeads,
                    budget: Budget, *, shallow: int, rows: int = 256, steps: int = 64, seed: int = 0,
                    coarse_heads: ForecastHeads | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """All selectors on one prompt. Returns per-layer recall / IoU `[L]` per selector, the exact-set IoU
    matrix `[L, L]`, and churn over `steps` consecutive decode positions (the prompt's last tokens).
    `progress` gets (what, done, total) after the capture and after each layer."""
    report = progress or (lambda what, done, total: None)
    cap = capture_attention(model, shape, input_ids, hidden=True, dtype=torch.float32, progress=False)
    report("captured", 1, shape.n_layers + 1)
    n, L, hkv, g, d = cap.n, shape.n_layers, shape.n_kv_heads, shape.group, shape.head_dim
    nb = math.ceil(n / budget.block)
    pos = torch.cat([_rows(n, rows, budget, seed), torch.arange(n - steps, n)])
    r = len(pos) - steps  # rows [0, r) are random rows, [r, r + steps) consecutive decode steps
    cand = candidates(pos, nb, budget)
    cos, sin = rope_tables(model, pos)
    ck = compress_keys(cap.k, budget.window, budget.stride)
    sup = candidate_positions(pos, ck.shape[2], budget)
    nan = torch.full((L,), float("nan"))
    rec = {s: nan.clone() for s in SELECTORS}
    ovl = {s: nan.clone() for s in SELECTORS}
    fused = torch.zeros(L, len(pos), nb, dtype=torch.bool)
    churn_scores: dict[str, list[torch.Tensor]] = {"same_layer": [], "forecast": []}
    masses = []
    for t in range(L):
        qt = cap.q[t][:, pos]
        mass = block_mass(qt, cap.k[t], pos, cap.scale, budget.block)  # [Hkv, R, nb]
        masses.append(mass[:, r:])
        fused[t] = dynamic_set(mass.sum(0), pos, budget)
        teach = teacher_scores(qt, cap.k[t], pos, budget, scale=cap.scale)
        scores = {
            "oracle": mass,
            "same_layer": row_block_scores(qt.reshape(hkv, g, -1, d), ck[t], pos, nb, budget, cap.scale),
            "forecast": row_block_scores(heads.query(t, cap.hidden[heads.source(t)][pos], cos, sin)[:, None],
                                         ck[t], pos, nb, budget, cap.scale),
            "quest": group_page_scores(qt.reshape(hkv, g, -1, d), *page_bounds(cap.k[t], budget.block)),
        }
        if t > 0:
            scores["proxy"] = row_block_scores(cap.q[t - 1][:, pos].reshape(hkv, g, -1, d), ck[t], pos, nb,
                                               budget, cap.scale)
        if coarse_heads is not None:
            scores["coarse_forecast"] = row_block_scores(
                coarse_heads.query(t, cap.hidden[heads.source(t)][pos], cos, sin)[:, None], ck[t], pos, nb,
                budget, cap.scale)
        sets = {name: dynamic_set(s, pos, budget) for name, s in scores.items()}
        sets["teacher"] = teacher_blocks(teach, pos, sup, budget, nb)
        if t > shallow:  # early-layer reuse: the shallow layer's fused set for every KV head
            sets["reuse"] = fused[shallow].expand(hkv, -1, -1)
        for name in ("same_layer", "forecast"):
            churn_scores[name].append(scores[name][:, r:])
        for name, s in sets.items():
            rec[name][t] = recall(mass[:, :r], s[:, :r], cand[:r]).mean()
            ovl[name][t] = iou(s[:, :r], sets["teacher"][:, :r]).mean()
        report(f"layer {t}", t + 2, L + 1)
    steps_pos = pos[r:]
    churn_out = {}
    for name, per_layer in churn_scores.items():
        s = torch.stack(per_layer)  # [L, Hkv, T, nb]
        raw, smooth = dynamic_set(s, steps_pos, budget), ema_sets(s, steps_pos, budget)
        m = torch.stack(masses)
        churn_out[name] = {"churn": churn(raw).mean().item(), "churn_ema": churn(smooth).mean().item(),
                           "recall": recall(m, raw, cand[r:]).mean().item(),
                           "recall_ema": recall(m, smooth, cand[r:]).mean().item()}
    return {"recall": rec, "iou_teacher": ovl, "iou_matrix": iou_matrix(fused[:, :r]), "churn": churn_out}


def _mean(values: Sequence[float | None]) -> float:
    v = [x for x in values if x is not None and x == x]
    return sum(v) / len(v) if v else float("nan")


def build_report(model: torch.nn.Module, tok: Any, shape: ModelShape, heads: ForecastHeads, budget: Budget, *,
                 eval_specs: Sequence[tuple[str, int, int]], calib_specs: Sequence[tuple[str, int, int]],
                 shallow_candidates: range = range(0, 6), rows: int = 256, steps: int = 64,
                 coarse_heads: ForecastHeads | None = None, progress: bool | Progress = True) -> dict[str, Any]:
    """Calibrate the reuse layer on `calib_specs`, evaluate every selector on `eval_specs` `(task, length, seed)`.
    `progress`: True draws a tqdm bar per prompt, a callable gets (what, done, total) after every layer of
    every prompt, False is silent."""
    from workbench.core.corpus import make_sample

    def sample(spec):
        task, length, seed = spec
        return make_sample(task, tok, length, seed=seed, max_length=shape.max_positions)

    calib = [sample(s) for s in calib_specs]
    evals = [sample(s) for s in eval_specs]
    bar = tqdm(total=len(calib) + len(evals), desc="forecast report", unit="prompt", disable=progress is not True)
    prompts, per = len(calib) + len(evals), shape.n_layers + 1

    def step(i: int, kind: str) -> Progress | None:  # prompt i's layers as steps of the whole report
        if not callable(progress):
            return None
        return lambda what, done, total: progress(f"{kind} prompt {i + 1}/{prompts}: {what}", i * per + done, prompts * per)

    mats = []
    for i, s in enumerate(calib):
        mats.append(iou_matrix(exact_sets(model, shape, s.input_ids, budget, rows=rows, seed=s.seed,
                                          progress=step(i, "calibration"))))
        bar.update(1)
    if mats:
        shallow, calib_scores = pick_shallow_layer(torch.stack(mats).mean(0), shallow_candidates)
    else:  # no calibration prompts: no reuse baseline
        shallow, calib_scores = shape.n_layers, []
    results = []
    for i, s in enumerate(evals):
        results.append(evaluate_prompt(model, shape, s.input_ids, heads, budget, shallow=shallow, rows=rows,
                                       steps=steps, seed=s.seed, coarse_heads=coarse_heads,
                                       progress=step(len(calib) + i, "evaluation")))
        bar.update(1)
    bar.close()
    L = shape.n_layers
    layers = []
    for t in range(L):
        row = {"target": t}
        for key in ("recall", "iou_teacher"):
            row[key] = {name: _round(_mean([res[key][name][t].item() for res in results])) for name in SELECTORS}
        layers.append(row)
    matrix = torch.stack([res["iou_matrix"] for res in results]).mean(0)
    mean_recall = {name: _round(_mean([row["recall"][name] for row in layers])) for name in SELECTORS}
    cross = [row for row in layers if row["target"] > 0]
    short = [row["target"] for row in layers if row["recall"]["forecast"] < row["recall"]["same_layer"]]
    last = list(range(max(0, L - 4), L))
    blog = {s: _round(matrix[s, last].mean().item()) for s in (2, 3, 4) if s < L - 4}
    churn_out = {name: {k: _round(_mean([res["churn"][name][k] for res in results]))
                        for k in ("churn", "churn_ema", "recall", "recall_ema")}
                 for name in results[0]["churn"]}
    return {
        "budget": budget.to_dict(),
        "rows_per_prompt": rows, "decode_steps": steps,
        "eval_prompts": [s.describe() for s in evals],
        "calibration_prompts": [s.describe() for s in calib],
        "summary": {
            "mean_recall": mean_recall,
            "forecast_over_same_layer": _round(_mean([mean_recall["forecast"]]) / _mean([mean_recall["same_layer"]])),
            "forecast_over_same_layer_cross_layer_only": _round(
                _mean([r["recall"]["forecast"] for r in cross]) / _mean([r["recall"]["same_layer"] for r in cross])),
            "short_layers": short,
            "mean_iou_teacher": {name: _round(_mean([row["iou_teacher"][name] for row in layers])) for name in SELECTORS},
        },
        "layers": layers,
        "reuse": {"shallow_candidates": list(shallow_candidates), "calibration_mean_iou": [_round(x) for x in calib_scores],
                  "picked_layer": shallow,
                  "blog_claim": {"claim": "layers 2-4 overlap the last layers' top-k sets by > 80% (IoU)",
                                 "last_layers": last, "iou_by_shallow_layer": blog,
                                 "holds": bool(blog) and max(blog.values()) > 0.8}},
        "iou_matrix": [[_round(x) for x in row] for row in matrix.tolist()],
        "churn": churn_out,
    }


def _round(x: float) -> float | None:
    """4 decimals; NaN (a selector that does not apply) -> None so that the JSON stays valid."""
    return round(float(x), 4) if x == x else None


def _training_line(h: dict[str, Any] | None) -> str:
    if not h or h.get("total_train_seconds") is None:
        return ""
    return (f"<p>Heads: {h.get('path')} ({h.get('teacher')} teacher), {h.get('steps')} steps on {h.get('train_prompts')} "
            f"prompts; training took {h.get('total_train_seconds')} s in all ({h.get('prepare_seconds')} s capture + "
            f"teacher, {h.get('train_seconds')} s optimisation) with {h.get('train_threads')} thread(s), load average "
            f"{h.get('train_load_average_1_5_15min')}; held-out partition KL before/after "
            f"{h.get('held_out_kl_mean_before_after')}.</p>")


def report_html(report: dict[str, Any]) -> str:
    """A self-contained HTML page of the report (tables only; the numbers come from `build_report`)."""
    import html

    s = report["summary"]
    names = [n for n in SELECTORS if s["mean_recall"][n] is not None]

    def cell(v: float | None) -> str:
        if v is None:
            return "<td>-</td>"
        return f'<td style="background:rgba(40,120,200,{max(0.0, min(1.0, v)):.2f})">{v:.3f}</td>'

    head = "".join(f"<th>{n}</th>" for n in names)
    rows = "".join(f"<tr><td>{r['target']}</td>{''.join(cell(r['recall'][n]) for n in names)}"
                   f"{''.join(cell(r['iou_teacher'][n]) for n in names)}</tr>" for r in report["layers"])
    m = report["iou_matrix"]
    matrix = "".join(f"<tr><th>{i}</th>{''.join(cell(v) for v in row)}</tr>" for i, row in enumerate(m))
    churn = "".join(f"<tr><td>{k}</td>{''.join(f'<td>{v:.3f}</td>' for v in c.values())}</tr>"
                    for k, c in report["churn"].items())
    reuse = report["reuse"]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Forecast report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 5px;text-align:right}}</style></head><body>
<h1>Forecast: recall and overlap per target layer</h1>
<p>Budget {html.escape(str(report['budget']))}; {len(report['eval_prompts'])} held-out prompts,
{report['rows_per_prompt']} random rows each. Forecast recall / same-layer recall (mean over layers):
<b>{s['forecast_over_same_layer']}</b> (cross-layer targets only: {s['forecast_over_same_layer_cross_layer_only']}).
Layers where Forecast falls short: {s['short_layers']}.</p>
{_training_line(report.get("heads"))}
<h2>Mean over layers</h2><table><tr><th></th>{head}</tr>
<tr><td>recall</td>{''.join(cell(s['mean_recall'][n]) for n in names)}</tr>
<tr><td>IoU with teacher</td>{''.join(cell(s['mean_iou_teacher'][n]) for n in names)}</tr></table>
<h2>Per target layer (recall | IoU with the teacher's blocks)</h2>
<table><tr><th>layer</th>{head}{head}</tr>{rows}</table>
<h2>Early-layer reuse</h2><p>Calibrated shallow layer: {reuse['picked_layer']} (mean IoU with deeper layers per
candidate {reuse['shallow_candidates']}: {reuse['calibration_mean_iou']}).
Blog claim "{html.escape(reuse['blog_claim']['claim'])}":
measured {reuse['blog_claim']['iou_by_shallow_layer']} against layers {reuse['blog_claim']['last_layers']}
-> holds: {reuse['blog_claim']['holds']}.</p>
<h2>Layer x layer IoU of exact top-k sets</h2><table>{matrix}</table>
<h2>Decode churn (consecutive steps, EMA 0.7 current + 0.3 previous)</h2>
<table><tr><th></th><th>churn</th><th>churn EMA</th><th>recall</th><th>recall EMA</th></tr>{churn}</table>
</body></html>
"""
