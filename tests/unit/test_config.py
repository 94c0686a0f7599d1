"""HeadConfig: exact round-trip, schema, validation errors, MInference import/export, tensor parallelism."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import torch

from workbench.config import SCHEMA, ConfigError, HeadConfig, HeadEntry, global_head, local_head, tp_split
from workbench.core.model import ModelShape
from workbench.data import SCHEMA_FILE
from workbench.patterns import AShape, Dense

SHAPE = ModelShape(name="tiny", architecture="llama", n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   hidden_size=32, rope_type="default", rope_theta=10000.0, max_positions=2048, fingerprint="abc123")
PICKS = [("vs", {"vertical": 64, "slash": 128}), ("ashape", {"sink": 64, "window": 256}), ("block", {"topk": 4}),
         ("dense", {})]


def make_config(shape: ModelShape = SHAPE) -> HeadConfig:
    heads = []
    for l in range(shape.n_layers):
        for h in range(shape.n_heads):
            pattern, params = PICKS[(l + h) % len(PICKS)]
            heads.append(HeadEntry(l, h, pattern, dict(params), recall={"mean": 0.97 + 0.001 * h, "worst": 0.951},
                                   density={"logical": 0.1, "physical": 0.2}, oracle=0.99,
                                   evidence={"mass_mean": [0.5, 1.0 / 3.0]}))
    return HeadConfig(model=shape.to_dict(), heads=heads, provenance={"target": 0.95, "calibration": []})


def test_round_trip_is_exact(tmp_path):
    cfg = make_config()
    path = cfg.save(tmp_path / "c.json")
    text = path.read_text()
    back = HeadConfig.load(path, SHAPE)
    assert back.to_dict() == cfg.to_dict()
    back.save(path)
    assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"], "atomic write left a temp file"


def test_shipped_schema_matches_code():
    assert json.loads(SCHEMA_FILE.read_text()) == SCHEMA


@pytest.mark.parametrize("field,value", [("n_layers", 3), ("n_heads", 8), ("n_kv_heads", 4), ("head_dim", 16),
                                         ("rope_type", "yarn"), ("rope_theta", 5e5), ("max_positions", 4096)])
def test_validate_names_each_mismatch(field, value):
    cfg = make_config()
    with pytest.raises(ConfigError, match=rf"model\.{field} .*workbench search"):
        cfg.validate(replace(SHAPE, **{field: value}))


def test_other_weights_warn_or_fail():
    cfg = make_config()
    other = replace(SHAPE, fingerprint="ffff")
    with pytest.warns(UserWarning, match="fingerprint"):
        cfg.validate(other)
    with pytest.raises(ConfigError, match="fingerprint"):
        cfg.validate(other, strict_weights=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.validate(SHAPE)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(version=2), r"field version"),
    (lambda d: d["heads"][3].update(pattern="sliding"), r"field heads\[3\]\.pattern"),
    (lambda d: d["heads"][0]["params"].update(vertical=-5), r"field heads\[0\]\.params\.vertical"),
    (lambda d: d["model"].pop("head_dim"), r"field model.*head_dim"),
    (lambda d: d["proxy"].update(aggregate="mean"), r"field proxy\.aggregate"),
    (lambda d: d["heads"].pop(5), r"missing \(layer, head\) \[\(1, 1\)\]"),
    (lambda d: d["heads"].append(dict(d["heads"][0])), r"duplicate"),
    (lambda d: d["heads"][0].update(params={"vertical": 64}), r"heads\[0\].*needs params \['vertical', 'slash'\]"),
    (lambda d: d["heads"][1].update(params={"sink": 4, "window": 0}), r"heads\[1\]\.params\.window = 0"),
])
def test_load_errors_name_the_field(tmp_path, edit, match):
    d = make_config().to_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=match):
        HeadConfig.load(path)


def test_load_errors_for_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="workbench search"):
        HeadConfig.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        HeadConfig.load(tmp_path / "x.json")
    (tmp_path / "m.json").write_text(json.dumps([{"0": ["vertical_and_slash", 1000, 6096, 0.9]}]))
    with pytest.raises(ConfigError, match="MInference"):
        HeadConfig.load(tmp_path / "m.json")


def minference_file() -> list[dict]:
    return [{"0": ["vertical_and_slash", 1000, 1536, 0.97], "1": ["stream_llm", 100, 800, 12345],
             "2": ["block_sparse", 100, 800, 0.5], "3": ["vertical_and_slash", 30, 50, 1]},
            {"0": ["vertical_and_slash", 2048, 2048, 0.99], "1": ["vertical_and_slash", 64, 1024, 0.0],
             "2": ["stream_llm", 4, 60, 0.91], "3": ["block_sparse", 2, 0, 0.8]}]


def test_minference_round_trips_both_ways():
    data = minference_file()
    cfg = HeadConfig.from_minference(data, SHAPE)
    assert cfg.to_minference() == data
    assert json.dumps(cfg.to_minference()) == json.dumps(data)
    assert cfg.entry(0, 1).pattern == "ashape" and cfg.entry(0, 1).params == {"sink": 100, "window": 800}
    assert cfg.entry(1, 0).pattern == "dense"  # sizes >= max length mean every key
    assert cfg.entry(0, 2).params == {"topk": 100}
    ours = make_config()
    back = HeadConfig.from_minference(ours.to_minference(), SHAPE)
    assert [(e.layer, e.head, e.pattern, e.params) for e in back.heads] == \
           [(e.layer, e.head, e.pattern, e.params) for e in ours.heads]
    # an imported head changed in place is exported from its new params, without MInference's stale score
    cfg.entry(0, 0).params["vertical"] = 500
    assert cfg.to_minference()[0]["0"] == ["vertical_and_slash", 500, 1536, None]


def test_minference_import_errors_and_defaults():
    with pytest.raises(ConfigError, match="has 1 layers but tiny has 2"):
        HeadConfig.from_minference(minference_file()[:1], SHAPE)
    with pytest.raises(ConfigError, match="head key '7' is outside tiny's heads 0..3"):
        HeadConfig.from_minference([{"7": ["stream_llm", 1, 2, 0]}, {}], SHAPE)
    with pytest.raises(ConfigError, match="layer 0, head 0: field pattern is 'dilated'"):
        HeadConfig.from_minference([{"0": ["dilated", 1, 2, 0]}, {}], SHAPE)
    with pytest.raises(ConfigError, match="layer 0 is empty.*--fill-missing"):
        HeadConfig.from_minference([{}, {}], SHAPE)
    with pytest.warns(UserWarning, match="8 heads missing .*layer 0 head 0, layer 0 head 1"):
        cfg = HeadConfig.from_minference([{}, {}], SHAPE, fill_missing=True)
    # MInference's default (1000, 6096), its slash clamped to the model's 2048 tokens (no prompt is longer)
    assert all(e.pattern == "vs" and e.params == {"vertical": 1000, "slash": 2048} for e in cfg.heads)
    assert cfg.provenance["filled"] == [[l, h] for l in range(2) for h in range(4)]


def test_tensor_parallel_mapping():
    n_heads, tp = 32, 4
    seen = set()
    for head in range(n_heads):
        rank, local = local_head(head, tp, n_heads)
        assert global_head(rank, local, tp, n_heads) == head == rank * (n_heads // tp) + local
        seen.add((rank, local))
    assert len(seen) == n_heads
    cfg = make_config()
    for rank in range(2):
        view = cfg.for_rank(rank, 2)
        view.check()
        view.validate(replace(SHAPE, n_heads=2, n_kv_heads=1))
        for e in view.heads:
            g = cfg.entry(e.layer, rank * 2 + e.head)
            assert (e.pattern, e.params) == (g.pattern, g.params)
        assert view.provenance["tensor_parallel"] == {"size": 2, "rank": rank, "heads": [rank * 2, rank * 2 + 1],
                                                      "head_offset": rank * 2, "kv_heads": [rank], "kv_replicas": 1,
                                                      "n_heads": 4, "n_kv_heads": 2}
    # TP 4 > 2 KV heads: each rank holds one query head and one KV head shared by two ranks (vLLM)
    views = [cfg.for_rank(r, 4) for r in range(4)]
    assert [v.provenance["tensor_parallel"]["kv_heads"] for v in views] == [[0], [0], [1], [1]]
    assert all(v.model["n_heads"] == 1 and v.model["n_kv_heads"] == 1 for v in views)
    for r, v in enumerate(views):  # the KV head a rank holds is the one its query head reads
        assert v.provenance["tensor_parallel"]["kv_heads"] == [SHAPE.kv_head(r)]
    with pytest.raises(ConfigError, match="does not split 4 query heads and 2 KV heads"):
        cfg.for_rank(0, 3)
    with pytest.raises(ConfigError, match="rank 2 is outside"):
        cfg.for_rank(2, 2)
    assert tp_split(9, 3, 3) == (3, 1)
    assert tp_split(32, 2, 4) == (8, 1) and tp_split(32, 8, 16) == (2, 1)
    with pytest.raises(ConfigError, match="multiple of it"):
        tp_split(24, 4, 6)


def test_layer_index_follows_the_config():
    cfg = make_config()
    torch.manual_seed(0)
    q, k = torch.randn(4, 200, 8), torch.randn(2, 200, 8)
    index = cfg.layer_index(0, q, k, 0.35)
    mask = index.to_mask(200)
    assert index.n_heads == 4
    assert torch.equal(mask[1], AShape(64, 256).to_mask(200)[0])  # head 1 of layer 0 is A-shape
    assert torch.equal(mask[3], Dense(1).to_mask(200)[0])
    assert mask[0].diagonal().all() and (mask[0].sum(1) <= 64 + 128).all()
    with pytest.raises(ConfigError, match="q has 3 heads"):
        cfg.layer_index(0, q[:3], k, 0.35)
