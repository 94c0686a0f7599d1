"""Length generalisation: a config searched at L evaluated at longer lengths (as searched and with budgets
scaled to n), on the embedded model and on the tiny Gemma (fixed layers keep the model's window)."""
from __future__ import annotations

import json

import pytest
import torch

from workbench.config import ConfigError, HeadConfig, HeadEntry
from workbench.core.capture import capture_attention
from workbench.core.corpus import make_sample
from workbench.prefill.generalize import (
    generalization_report,
    head_mass_by_length,
    held_out_samples,
    scale_config,
    searched_length,
)
from workbench.search.search import Candidate, evaluate_config, search_heads

L = 128


@pytest.fixture(scope="module")
def smol_config(embedded):
    model, tok, shape = embedded
    samples = [make_sample("passkey", tok, L, seed=0)]
    cands = [Candidate("ashape", (16, 64)), Candidate("vs", (30, 64)), Candidate("block", (2,)), Candidate("dense")]
    return search_heads(model, tok, shape, samples, candidates=cands, target=0.9, progress=False)[0]


def test_scale_config_scales_budgets_not_sinks_or_fixed_heads():
    from workbench.core.model import ModelShape

    shape = ModelShape("toy", "gemma3_text", 2, 3, 1, 64, 64, "default", 1e6, 32768, "x",
                       layer_types=("sliding_attention", "full_attention"), sliding_window=512)
    heads = [HeadEntry.model_fixed(0, h, 512) for h in range(3)] + [
        HeadEntry(1, 0, "vs", {"vertical": 1000, "slash": 6096}), HeadEntry(1, 1, "ashape", {"sink": 64, "window": 512}),
        HeadEntry(1, 2, "block", {"topk": 40})]
    cfg = HeadConfig(model=shape.to_dict(), heads=heads, provenance={"calibration": [{"length": 4096}]})
    assert searched_length(cfg) == 4096
    big = scale_config(cfg, 16384, 4096)
    assert [e.params for e in big.layer(1)] == [{"vertical": 4000, "slash": 16384}, {"sink": 64, "window": 2048},
                                                {"topk": 160}]
    assert all(e.fixed and e.params == {"sink": 0, "window": 512} for e in big.layer(0))
    assert big.provenance["scaled"]["factor"] == 4.0
    small = scale_config(cfg, 512, 4096)
    assert small.entry(1, 2).params == {"topk": 5} and small.entry(1, 0).params == {"vertical": 125, "slash": 512}
    assert scale_config(cfg, 1 << 20, 4096).entry(1, 2).params == {"topk": 10240}
    with pytest.raises(ConfigError, match="calibration lengths"):
        searched_length(HeadConfig(model=shape.to_dict(), heads=heads, provenance={}))


def test_mass_by_length_on_tiny_gemma_matches_evaluate_config(tiny_gemma, embedded):
    """The per-head table (the dashboard's view) agrees with `evaluate_config` on the same prompt; fixed
    layers are 1 and their density is the window's."""
    model, shape = tiny_gemma
    tok = embedded[1]
    cfg = HeadConfig.every_head(shape, "ashape", {"sink": 16, "window": 64}, calibration=[{"length": 256}])
    prompts = held_out_samples(tok, ["multikey"], [256, 512], 1, cfg)
    table = head_mass_by_length(model, shape, cfg, prompts, progress=False)
    assert table["lengths"] == [256, 512] and table["mass"].shape == (2, 4, 2)
    cap = capture_attention(model, shape, prompts[512][0].input_ids, progress=False)
    ref = evaluate_config(cfg, cap)["mass"]
    torch.testing.assert_close(table["mass"][1], ref, atol=1e-5, rtol=0)
    assert (table["mass"][:, [0, 2]] == 1).all() and (table["mass"][:, [1, 3]] < 1).all()
    assert table["density"][1, 0, 0] < table["density"][0, 0, 0] < 1  # a 96-token window is a smaller share of 512
    scaled = head_mass_by_length(model, shape, cfg, prompts, scaled_from=256, progress=False)
    torch.testing.assert_close(scaled["mass"][0], table["mass"][0])  # factor 1 at L
    assert (scaled["density"][1, [1, 3]] > table["density"][1, [1, 3]]).all()  # a window of 128 at 512, not 64


def test_chosen_layers_shorter_lengths_and_a_progress_callback(tiny_gemma, embedded):
    """The dashboard's call: only the chosen layers are evaluated (the others NaN, fixed ones 1), a length below
    L is evaluated too (the drop is measured to the length farthest from L), and the callback sees every layer."""
    from workbench.views.lengths import evaluated_heads, takeaway

    model, shape = tiny_gemma
    tok = embedded[1]
    cfg = HeadConfig.every_head(shape, "ashape", {"sink": 16, "window": 64}, calibration=[{"length": 256}])
    calls = []
    rep = generalization_report(model, tok, shape, cfg, lengths=[128, 256], layers=[1, 0], quality_samples=0,
                                progress=lambda what, done, total: calls.append((what, done, total)))
    assert rep["settings"]["layers"] == [1] and rep["settings"]["drop_to"] == 128
    assert evaluated_heads(rep) == [(1, 0), (1, 1)] and rep["summary"]["as_is"]["128"]["heads"] == 2
    assert [c[1:] for c in calls if "layer" in c[0]] == [(1, 2), (2, 2)] and "128 tokens" in calls[0][0]
    mass = rep["mass"]["as_is"]["128"]["mass"]
    assert mass[0] == [1.0, 1.0] and all(x != x for x in mass[3]) and all(0 < x <= 1 for x in mass[1])
    scaled = rep["mass"]["scaled"]["128"]["density"][1]
    assert all(s >= a for s, a in zip(rep["mass"]["as_is"]["128"]["density"][1], scaled))  # budgets x 1/2
    assert takeaway(rep).startswith("At 128 tokens, ")  # the length farthest from L
    with pytest.raises(ValueError, match="all fixed by the model"):
        generalization_report(model, tok, shape, cfg, lengths=[256], layers=[0, 2], quality_samples=0, progress=False)
    with pytest.raises(ValueError, match=r"layers \[7\] do not exist"):
        generalization_report(model, tok, shape, cfg, lengths=[256], layers=[7], quality_samples=0, progress=False)


def test_report_names_dropping_heads_and_runs_both_variants_end_to_end(embedded, smol_config, tmp_path):
    from workbench.views.lengths import write_html

    model, tok, shape = embedded
    out = tmp_path / "gen.json"
    rep = generalization_report(model, tok, shape, smol_config, lengths=[4 * L, 2 * L], tasks=["multikey"],
                                quality_samples=1, max_new_tokens=4, out=out, progress=False)
    assert rep["settings"]["lengths"] == [L, 2 * L, 4 * L] and rep["settings"]["drop_to"] == 4 * L
    assert json.loads(out.read_text()) == json.loads(json.dumps(rep))
    for variant in ("as_is", "scaled"):
        m = rep["mass"][variant]
        drops = {(l, h) for l in range(shape.n_layers) for h in range(shape.n_heads)
                 if m[str(L)]["mass"][l][h] - m[str(4 * L)]["mass"][l][h] > 0.01}
        assert {(r["layer"], r["head"]) for r in rep["dropping"][variant]} == drops
        below = {(l, h) for l in range(shape.n_layers) for h in range(shape.n_heads)
                 if m[str(4 * L)]["mass_worst"][l][h] < 0.9 - 1e-9 or m[str(4 * L)]["tail_worst"][l][h] < 0.9 - 1e-9}
        assert {tuple(x) for x in rep["below_target"][variant][str(4 * L)]} == below
        q = rep["quality"][variant]
        assert q["n"] == 4 * L and q["samples"] == 1 and q["kl_mean"] >= 0
    assert rep["mass"]["scaled"][str(L)]["mass"] == rep["mass"]["as_is"][str(L)]["mass"]
    dens = lambda v: rep["summary"][v][str(4 * L)]["physical_density_mean"]  # noqa: E731
    assert dens("scaled") > dens("as_is")  # scaled budgets read more keys at 4L
    assert rep["dropping"]["as_is"], "budgets in tokens lose mass at 4L on some head"
    html = write_html(rep, tmp_path / "gen.html").read_text()
    assert "Length generalisation" in html and "plotly" in html and len(html) < 1_000_000


def test_cli_generalize_and_its_refusals(embedded, smol_config, tmp_path, capsys):
    from workbench.cli import main

    path = smol_config.save(tmp_path / "cfg.json")
    out = tmp_path / "r.json"
    assert main(["generalize", "--config", str(path), "--lengths", str(2 * L), "--quality-samples", "0",
                 "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "heads below target" in printed and out.exists() and out.with_suffix(".html").exists()
    assert main(["generalize", "--config", str(path), "--lengths", "0", "--device", "cpu", "--out", str(out)]) == 2
    assert "whole numbers >= 1" in capsys.readouterr().err
    assert main(["generalize", "--config", str(path), "--lengths", "9000", "--device", "cpu", "--out", str(out)]) == 2
    assert "at most 8192" in capsys.readouterr().err


def test_a_config_for_another_model_is_refused(tiny_gemma, smol_config):
    model, shape = tiny_gemma
    with pytest.raises(ConfigError, match=r"model\.n_layers"):
        head_mass_by_length(model, shape, smol_config, {}, progress=False)
