"""Layers the model fixes (Gemma-3's sliding-window layers): recorded as fixed in head configs, never
searched or edited, exported for what they are, and run by the sparse prefill exactly as the model does."""
from __future__ import annotations

import warnings

import pytest
import torch

from workbench.config import ConfigError, HeadConfig, HeadEntry
from workbench.core.corpus import Sample
from workbench.core.model import FULL, ModelShape
from workbench.prefill.sparse import SparsePrefill
from workbench.search.search import Candidate, search_heads


def random_samples(n: int, count: int) -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    return [Sample("random", torch.randint(0, 49152, (n,), generator=g), "", seed) for seed in range(count)]


@pytest.fixture(scope="module")
def tiny_config(tiny_gemma):
    model, shape = tiny_gemma
    cands = [Candidate("ashape", (64, 64)), Candidate("vs", (30, 64)), Candidate("block", (2,)), Candidate("dense")]
    cfg, ev = search_heads(model, None, shape, random_samples(320, 2), candidates=cands, target=0.6,
                           tail_target=0.2, progress=False)
    return cfg, ev


def fixed_and_dense(shape: ModelShape) -> HeadConfig:
    """The model itself as a config: its window on the fixed layers, dense elsewhere."""
    cfg = HeadConfig.every_head(shape, "dense", {}, source="test")
    assert [e.fixed for e in cfg.heads] == [shape.window(e.layer) is not None for e in cfg.heads]
    assert all(e.params == {"sink": 0, "window": shape.window(e.layer)} for e in cfg.heads if e.fixed)
    return cfg


def test_search_records_fixed_layers_and_never_scores_them(tiny_gemma, tiny_config):
    _, shape = tiny_gemma
    cfg, ev = tiny_config
    for e in cfg.heads:
        if e.layer in shape.fixed_layers:
            assert e.fixed and (e.pattern, e.params) == ("ashape", {"sink": 0, "window": 96})
            assert e.recall["worst"] == 1.0 and e.evidence is None
            assert e.density["physical"] < 1.0
        else:
            assert not e.fixed and e.evidence is not None
    assert cfg.provenance["fixed_layers"] == [0, 2]
    assert ev.done.all()
    assert ev.mass[:, list(shape.fixed_layers)].abs().sum() == 0  # no score was computed there
    assert ev.mass[:, list(shape.free_layers)].abs().sum() > 0
    again = HeadConfig.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() and again.heads[0].fixed
    cfg.validate(shape)


def test_fixed_heads_refuse_edits_and_hand_written_patterns(tiny_gemma, tiny_config):
    _, shape = tiny_gemma
    cfg = HeadConfig.from_dict(tiny_config[0].to_dict())
    with pytest.raises(ConfigError, match=r"fixed by the model: layer 0 .* last 96 tokens.*full_attention layers \[1, 3\]"):
        cfg.edit(0, 1, "vs", {"vertical": 30, "slash": 64}, keep_score=False)
    cfg.edit(1, 0, "dense", {}, keep_score=False)  # a free layer is a choice
    cfg.heads[0] = HeadEntry(0, 0, "dense", {})  # what a dashboard edit writes before its check
    with pytest.raises(ConfigError, match=r"heads\[0\].*fixed by the model.*\"fixed\": true"):
        cfg.check("edit")
    cfg.heads[0] = HeadEntry.model_fixed(0, 0, 96)
    cfg.heads[2] = HeadEntry(1, 0, "ashape", {"sink": 0, "window": 96}, fixed=True)
    with pytest.raises(ConfigError, match="marked fixed but layer 1 has full attention"):
        cfg.check("edit")


def test_config_for_another_model_is_refused_naming_the_field(tiny_gemma, tiny_config):
    _, shape = tiny_gemma
    cfg = tiny_config[0]
    other = ModelShape.from_dict({**shape.to_dict(), "layer_types": [FULL, FULL, FULL, "sliding_attention"]})
    with pytest.raises(ConfigError, match=r"model.layer_types \(attention type per layer\)"):
        cfg.validate(other)
    with pytest.raises(ConfigError, match=r"model.head_dim"):
        cfg.validate(ModelShape.from_dict({**shape.to_dict(), "head_dim": 128}))
    with pytest.raises(ConfigError, match=r"model.n_kv_heads"):
        cfg.validate(ModelShape.from_dict({**shape.to_dict(), "n_kv_heads": 2}))
    with pytest.raises(ConfigError, match=r"model.sliding_window"):
        cfg.validate(ModelShape.from_dict({**shape.to_dict(), "sliding_window": 512}))


def test_minference_export_writes_the_window_and_round_trips(tiny_gemma, tiny_config):
    _, shape = tiny_gemma
    cfg = tiny_config[0]
    with pytest.warns(UserWarning, match="skip Gemma's QK-norm"):
        mi = cfg.to_minference()
    assert all(mi[l][str(h)][:3] == ["stream_llm", 0, 96] for l in shape.fixed_layers for h in range(shape.n_heads))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = HeadConfig.from_minference(mi, shape)
    assert [(e.pattern, e.params, e.fixed) for e in back.heads] == [(e.pattern, e.params, e.fixed) for e in cfg.heads]
    mi[0]["1"] = ["vertical_and_slash", 30, 64, None]
    with pytest.raises(ConfigError, match=r"layer 0, head 1\) is fixed by the model"):
        HeadConfig.from_minference(mi, shape)


def test_sparse_prefill_runs_fixed_layers_as_the_model(tiny_gemma, tiny_config):
    """Fixed layers through the sparse path (A-shape without sink, window 96) give the model's own logits;
    the searched config runs its free layers sparse too."""
    model, shape = tiny_gemma
    ids = random_samples(400, 1)[0].input_ids[None]
    with torch.no_grad():
        dense = model(ids, use_cache=False).logits
        with SparsePrefill(model, shape, fixed_and_dense(shape), min_length=0, backend="torch") as sp:
            fixed = model(ids, use_cache=False).logits
        assert sp.calls[("sparse", "fixed window")] == 2 and sp.calls[("dense", "dense layer")] == 2
        torch.testing.assert_close(fixed, dense, atol=1e-4, rtol=1e-4)
        with SparsePrefill(model, shape, tiny_config[0], min_length=0, backend="torch") as sp:
            model(ids, use_cache=False)
        assert sp.calls[("sparse", "fixed window")] == 2 and sp.calls[("sparse", "prefill")] >= 1


def test_fixed_layer_with_padding_runs_the_models_attention(tiny_gemma):
    _, shape = tiny_gemma
    sp = SparsePrefill(None, shape, fixed_and_dense(shape), min_length=0)
    n = 200
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    window = ((j <= i) & (i - j < 96))[None, None]
    assert sp.window_only(0, window)
    padded = window.clone()
    padded[..., :3] = False  # three left-padding keys
    assert not sp.window_only(0, padded) and not sp.window_only(0, None)
    assert not sp.window_only(0, ((j <= i) & (i - j < 64))[None, None])


@pytest.mark.model
@pytest.mark.xdist_group("gemma")  # one worker loads the real Gemma (~2 min on 2 cores, cold cache)
def test_real_gemma_fixed_layers_equal_the_models_forward(gemma):
    """The real Gemma-3-270M at 1536 tokens: its 15 sliding layers through the sparse path (window 512),
    the 3 full layers dense, give the model's own next-token logits."""
    from workbench.core.corpus import make_sample

    model, tok, shape = gemma
    ids = make_sample("multikey", tok, 1536, seed=0).input_ids[None]
    with torch.no_grad():
        dense = model(ids, use_cache=False, logits_to_keep=1).logits[0, -1]
        with SparsePrefill(model, shape, fixed_and_dense(shape), min_length=0, backend="torch", compare=True) as sp:
            fixed = model(ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    assert sp.calls[("sparse", "fixed window")] == 15
    assert min(float(c.min()) for c in sp.cosine.values()) > 0.99999
    torch.testing.assert_close(fixed, dense, atol=2e-3, rtol=1e-3)
    assert int(fixed.argmax()) == int(dense.argmax())
