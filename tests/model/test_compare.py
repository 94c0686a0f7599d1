"""`workbench compare` on the embedded model at a small length: the harness's numbers are consistent."""
from __future__ import annotations

import json

import pytest
import torch

from workbench.analysis.compare import Method, default_methods, pareto_front
from workbench.patterns.xattention import xattention

pytestmark = pytest.mark.model
N = 320


def test_pareto_front_is_the_non_dominated_set():
    cost, value = [0.1, 0.2, 0.2, 0.5, 0.4, 0.9], [0.5, 0.4, 0.7, 0.6, 0.8, 0.8]
    front = pareto_front(cost, value)
    assert front == [0, 2, 4]
    for i in range(len(cost)):
        dominated = any(cost[j] <= cost[i] and value[j] >= value[i] and (cost[j], value[j]) != (cost[i], value[i])
                        for j in range(len(cost)))
        assert (i in front) == (not dominated)


def test_compare_small(embedded, tmp_path):
    from workbench.config import HeadConfig
    from workbench.prefill.compare import SEARCHED, compare
    from workbench.views.methods import report_html

    model, tok, shape = embedded
    dense_like = Method("xattention@1", "tau", (1.0,), True, True, lambda q, k, s, v: xattention(q, k, s, v, 8))
    methods = [m for m in default_methods() if m.name in ("tri-shape", "flexprefill")] + [dense_like]
    config = HeadConfig.load("workbench/data/configs/SmolLM2-135M-Instruct.json", shape)
    rep = compare(model, tok, shape, tasks=["passkey"], lengths=[N], layers=[2, 20], methods=methods, config=config,
                  rows=128, quality="mid", progress=False)
    pts = rep["points"]
    assert [p["method"] for p in pts] == ["tri-shape"] * 3 + ["flexprefill"] * 3 + ["xattention@1", SEARCHED]
    for p in pts:
        assert 0 < p["mass"] <= 1 + 1e-6 and 0 < p["answer_mass"] <= 1 + 1e-6
        assert 0 < p["logical"] <= p["physical"] + 1e-9 <= 1 + 1e-9
    tri = [p for p in pts if p["method"] == "tri-shape"]
    assert all(abs(p["answer_mass"] - 1) < 1e-5 for p in tri)  # the question rows are dense
    assert [p["mass"] for p in tri] == sorted(p["mass"] for p in tri)  # a wider window keeps more
    dense = pts[6]
    assert dense["mass"] == pytest.approx(1.0, abs=1e-5) and dense["physical"] == pytest.approx(1.0)
    assert dense["quality"]["kl"] < 1e-6 and dense["quality"]["top1_agree"]  # tau = 1: exactly dense
    assert dense["quality"]["correct"] == dense["quality"]["dense_correct"]
    assert "quality" in pts[1] and "quality" not in pts[0] and "quality" in pts[-1]  # mid points and the config
    front = rep["pareto"][f"passkey@{N}"]
    assert front and all(a["physical"] < b["physical"] and a["mass"] < b["mass"] for a, b in zip(front, front[1:]))
    json.dumps(rep)
    page = report_html(rep, figures=False)
    assert "flexprefill" in page and SEARCHED in page


def test_compare_cli_writes_json_and_html(tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "m.json"
    assert main(["compare", "--tasks", "code", "--lengths", "256", "--layers", "5", "--quality", "none",
                 "--config", "none", "--out", str(out), "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    assert rep["command"].startswith("workbench compare") and rep["environment"]["torch"] == torch.__version__
    assert len(rep["points"]) == sum(len(m.values) for m in default_methods())
    assert out.with_suffix(".html").exists()
    again = tmp_path / "again.json"
    assert main(["compare", "--render", str(out), "--out", str(again)]) == 0
    assert again.with_suffix(".html").exists() and not again.exists()  # re-rendered, nothing run
    assert main(["compare", "--lengths", "256,x"]) == 2
    assert "--lengths" in capsys.readouterr().err
