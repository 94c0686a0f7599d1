"""Quality report of sparse prefill vs dense: its measures, the resumable layer runs, and the CLI (tiny n)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from prefill_configs import covering, make_config, tight

from workbench.core.corpus import depths
from workbench.prefill.quality import LayerInputs, dense_greedy, kl_top1, merge_reports, quality_report, sensitivity

N = 256


def test_kl_top1():
    a = torch.tensor([2.0, 1.0, 0.0])
    assert kl_top1(a, a) == (0.0, True)
    p, q = torch.softmax(a.double(), 0), torch.softmax(torch.tensor([0.0, 1.0, 2.0]).double(), 0)
    kl, agree = kl_top1(a, torch.tensor([0.0, 1.0, 2.0]))
    assert not agree and math.isclose(kl, float((p * (p / q).log()).sum()), rel_tol=1e-9)
    assert depths(5) == [0.05, 0.275, 0.5, 0.725, 0.95] and depths(1) == [0.5]


@pytest.fixture(scope="module")
def prompt(embedded):
    from workbench.core.corpus import make_sample

    return make_sample("passkey", embedded[1], N, seed=2, depth=0.6).input_ids


def test_layer_inputs_resume_exactly(embedded, prompt):
    model, _, shape = embedded
    base = LayerInputs(model, prompt)
    assert len(base.inputs) == shape.n_layers
    for layer in (0, 17, shape.n_layers - 1):
        assert (base.logits_from(layer) - base.logits).abs().max().item() <= 1e-4


def test_sensitivity_zero_with_full_budgets(embedded, prompt):
    model, _, shape = embedded
    rows = sensitivity(model, shape, make_config(shape, covering(N)), prompt, progress=False)
    dense_layers = {l for l in range(shape.n_layers) if all(covering(N)(l, h)[0] == "dense" for h in range(shape.n_heads))}
    assert [r["layer"] for r in rows] == [l for l in range(shape.n_layers) if l not in dense_layers]
    assert max(r["kl"] for r in rows) < 1e-6 and all(r["top1_agree"] for r in rows)


def test_dense_side_is_cached_per_prompt(embedded, tmp_path, monkeypatch):
    from workbench.core.corpus import make_sample
    from workbench.prefill.sparse import generate_greedy

    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path))
    model, tok, shape = embedded
    sample = make_sample("passkey", tok, N, seed=3, depth=0.3)
    tokens, logits, _ = dense_greedy(model, tok, shape, sample, 3)
    assert len(list((tmp_path / "dense").rglob("*.pt"))) == 1
    fresh_tokens, fresh_logits = generate_greedy(model, sample.input_ids, 3, tok.eos_token_id)
    assert torch.equal(fresh_tokens, tokens) and torch.equal(fresh_logits, logits)
    again = dense_greedy(model, tok, shape, sample, 3)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], logits)
    other = make_sample("passkey", tok, N, seed=4, depth=0.3)  # another prompt: another entry
    assert not torch.equal(dense_greedy(model, tok, shape, other, 3)[1], logits)
    assert len(list((tmp_path / "dense").rglob("*.pt"))) == 2


def test_report_and_merge(embedded, tmp_path):
    model, tok, shape = embedded
    cfg = make_config(shape, tight)
    out = tmp_path / "q.json"
    rep = quality_report(model, tok, shape, cfg, lengths=[N], samples=2, max_new_tokens=3, cosine_samples=1,
                         sensitivity_samples=0, out=out, progress=False)
    assert len(rep["records"]) == 2 and {r["depth"] for r in rep["records"]} == {0.05, 0.95}
    assert "cosine" in rep["records"][0] and "cosine" not in rep["records"][1]
    s = rep["summary"]["per_length"][str(N)]
    assert s["samples"] == 2 and s["kl_mean"] > 0
    assert out.with_suffix(".html").read_text().count("<table>") >= 2
    again = quality_report(model, tok, shape, cfg, lengths=[N], samples=2, max_new_tokens=3, cosine_samples=1,
                           sensitivity_samples=0, out=out, progress=False)  # resumes: nothing recomputed
    assert again["records"] == json.loads(out.read_text())["records"]
    merged = merge_reports([out, out], tmp_path / "m.json")
    assert merged["summary"]["per_length"][str(N)]["samples"] == 4
    other = json.loads(out.read_text())
    other["settings"]["config_sha"] = "different"
    (tmp_path / "o.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different head configs"):
        merge_reports([out, tmp_path / "o.json"], tmp_path / "x.json")


def test_config_fixes_from_stored_evidence():
    """Re-choosing at the shipped target reproduces the shipped config; a higher target only moves heads to
    costlier candidates; dense fallback makes exactly the given layers dense."""
    from pathlib import Path

    from workbench.config import HeadConfig
    from workbench.prefill.quality import dense_fallback, rechoose

    shipped = HeadConfig.load(Path(__file__).parents[2] / "workbench" / "data" / "configs" / "SmolLM2-135M-Instruct.json")
    same = rechoose(shipped, shipped.provenance["target"], shipped.provenance.get("tail_target"))
    assert [(e.pattern, e.params) for e in same.heads] == [(e.pattern, e.params) for e in shipped.heads]
    higher = rechoose(shipped, 0.99)
    density = lambda e: e.density["physical"] if e.pattern != "dense" else 1.0  # noqa: E731
    assert all(density(b) >= density(a) - 1e-9 for a, b in zip(shipped.heads, higher.heads))
    assert higher.summary()["dense"] > shipped.summary()["dense"]
    fixed = dense_fallback(shipped, [3, 16])
    assert {e.layer for e in fixed.heads if e.pattern == "dense" and shipped.entry(e.layer, e.head).pattern != "dense"} == {3, 16}
    assert fixed.provenance["dense_fallback"]["layers"] == [3, 16]
    fixed.check()
