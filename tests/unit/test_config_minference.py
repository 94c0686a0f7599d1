"""MInference configs that travel: strict import from generated files, exact round trips, every malformed
input refused with file / place / fix, tensor-parallel rank files as MInference's vLLM path reads them,
the opaque score, and shape-only import (`workbench.core.shapes`)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.config import ConfigError, HeadConfig
from workbench.core.model import ModelError
from workbench.core.shapes import NAMED, SHAPE_ONLY, named_shape, resolve_shape
from workbench.data import shipped_config

SHIPPED = shipped_config("SmolLM2-135M-Instruct")


def generated_file(shape, seed: int = 0, patterns=("vertical_and_slash", "stream_llm", "block_sparse"),
                   int_scores: bool = False) -> list[dict]:
    """A MInference-style file for `shape`: every head, every pattern name, sizes and scores of the kinds
    the published files hold (float recalls, integer error counts, values above 1), dense-sized VS heads."""
    rng = random.Random(seed)
    out = []
    for _ in range(shape.n_layers):
        layer = {}
        for h in range(shape.n_heads):
            name = patterns[rng.randrange(len(patterns))]
            score = rng.randrange(0, 22_000_000) if int_scores else rng.choice([rng.random(), 1.0, 1.0001837015151978])
            if name == "vertical_and_slash" and rng.random() < 0.1:
                v = s = shape.max_positions  # every key: imported as dense
            elif name == "vertical_and_slash":
                v, s = rng.choice([30, 100, 500, 1000, 3500]), rng.choice([50, 100, 800, 2048, 6096])
            elif name == "stream_llm":
                v, s = rng.choice([4, 64, 100]), rng.choice([60, 800, 4096])
            else:
                v, s = rng.choice([1, 8, 100]), rng.choice([0, 800])
            layer[str(h)] = [name, v, s, score]
        out.append(layer)
    return out


@pytest.mark.parametrize("name", [n for n in NAMED if n != "SmolLM2-135M-Instruct"])
def test_generated_files_round_trip_exactly(name, tmp_path):
    shape = named_shape(name)
    data = generated_file(shape, seed=len(name), int_scores=name.startswith(("Llama-3-8B", "Yi")))
    path = tmp_path / "mi.json"
    path.write_text(json.dumps(data))
    cfg = HeadConfig.load_minference(path, shape)
    assert json.dumps(cfg.to_minference()) == json.dumps(data)  # keys, order, sizes, scores: byte for byte
    patterns = {e.pattern for e in cfg.heads}
    assert patterns == {"vs", "ashape", "block", "dense"}
    assert all(e.recall is None for e in cfg.heads), "MInference's score is opaque, never a recall"
    # through the workbench format and back
    saved = cfg.save(tmp_path / "wb.json")
    assert json.dumps(HeadConfig.load(saved, shape).to_minference()) == json.dumps(data)


def test_shipped_config_round_trips(tmp_path):
    shape = named_shape("SmolLM2-135M-Instruct")
    cfg = HeadConfig.load(SHIPPED, shape)
    assert cfg.save(tmp_path / "c.json").read_text() == SHIPPED.read_text()
    mi = cfg.to_minference()
    back = HeadConfig.from_minference(json.loads(json.dumps(mi)), shape)
    assert [(e.layer, e.head, e.pattern, e.params) for e in back.heads] == \
           [(e.layer, e.head, e.pattern, e.params) for e in cfg.heads]
    assert back.to_minference() == mi
    assert mi[0]["0"][3] == cfg.entry(0, 0).recall["worst"]  # our own heads: the worst recall as score


def test_cli_converts_with_a_named_shape_and_back(tmp_path, capsys):
    mi, wb = tmp_path / "mi.json", tmp_path / "wb.json"
    assert main(["export", str(SHIPPED), "--out", str(mi)]) == 0
    assert main(["export", str(mi), "--from", "minference", "--shape", "SmolLM2-135M-Instruct",
                 "--format", "workbench", "--out", str(wb)]) == 0
    assert main(["export", str(wb), "--shape", "embedded", "--format", "minference", "--out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text()) == json.loads(mi.read_text())
    assert main(["export", str(SHIPPED), "--format", "check", "--shape", "embedded"]) == 0
    assert "matches SmolLM2-135M-Instruct: 270 heads" in capsys.readouterr().out



MALFORMED = [  # (name, file text or an edit of a good file, expected message parts: place and fix)
    ("truncated", lambda d: json.dumps(d)[:25027], [r"is not valid JSON .* line 1 column", "restore the complete file"]),
    ("empty file", lambda d: "", ["is empty", "JSON list of per-layer dicts"]),
    ("object", lambda d: json.dumps({"0": d[0]}), ["top level is an object", "give the file MInference loads"]),
    ("workbench config", lambda d: SHIPPED.read_text(), ["workbench head config", "drop `--from minference`"]),
    ("layer count", lambda d: json.dumps(d[:27]), ["has 27 layers but Qwen2.5-7B has 28", "--shape of the model"]),
    ("layer not a dict", lambda d: json.dumps(d[:3] + [list(d[3].values())] + d[4:]),
     ["layer 3 is list", "object keyed by head"]),
    ("empty layer", lambda d: json.dumps(d[:5] + [{}] + d[6:]), ["layer 5 is empty", "--fill-missing"]),
    ("missing head", lambda d: (d[2].pop("7"), json.dumps(d))[1], ["layer 2 lacks heads 7 ", "add them", "--fill-missing"]),
    ("32-head file", lambda d: (d[0].update({str(h): d[0]["0"] for h in range(28, 32)}), json.dumps(d))[1],
     [r"layer 0: head key '28' is outside Qwen2.5-7B's heads 0..27", "--shape of the model"]),
    ("zero-padded key", lambda d: (d[1].__setitem__("04", d[1].pop("4")), json.dumps(d))[1],
     ["layer 1: head key '04' is not canonical", 'write it as "4"', "--fill-missing"]),
    ("duplicate key", lambda d: json.dumps(d).replace('{"0": ', '{"0": ["stream_llm", 1, 2, 0], "0": ', 1),
     ["layer 0: head key '0' appears twice", "keep one entry per head"]),
    ("non-number key", lambda d: (d[1].__setitem__("q4", d[1]["4"]), json.dumps(d))[1],
     ["layer 1: head key 'q4' is not a head number", "head id 0..27"]),
    ("boolean size", lambda d: (d[2]["12"].__setitem__(1, True), json.dumps(d))[1],
     ["layer 2, head 12: field vertical_size is true", "whole number of tokens"]),
    ("decimal size", lambda d: (d[2]["12"].__setitem__(2, 6096.0), json.dumps(d))[1],
     ["layer 2, head 12: field slash_size is 6096.0", "whole number"]),
    ("string size", lambda d: (d[2]["12"].__setitem__(2, "6096"), json.dumps(d))[1], ['field slash_size is "6096"']),
    ("negative size", lambda d: (d[2]["12"].__setitem__(1, -1), json.dumps(d))[1], ["field vertical_size is -1", ">= 0"]),
    ("three fields", lambda d: (d[4]["0"].pop(), json.dumps(d))[1],
     ["layer 4, head 0: entry", "is not [pattern, vertical_size, slash_size, score]", "write four fields"]),
    ("unknown pattern", lambda d: (d[4]["1"].__setitem__(0, "dilated"), json.dumps(d))[1],
     ["layer 4, head 1: field pattern is 'dilated'", "use one of MInference's names"]),
]


@pytest.mark.parametrize("name,make,parts", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_files_are_refused_with_file_place_and_fix(name, make, parts, tmp_path, capsys):
    shape = named_shape("Qwen2.5-7B")
    path = tmp_path / f"{name.replace(' ', '_')}.json"
    path.write_text(make(generated_file(shape, seed=3)))
    assert main(["export", str(path), "--from", "minference", "--shape", "Qwen2.5-7B", "--format", "check"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err, err
    for part in parts:
        assert part in err or __import__("re").search(part, err), (part, err)


def test_fill_missing_accepts_what_minference_would_run(tmp_path):
    shape = named_shape("Qwen2.5-7B")
    data = generated_file(shape, seed=5)
    data[3] = {}
    data[1]["04"] = data[1].pop("4")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning) as record:
        cfg = HeadConfig.load_minference(path, shape, fill_missing=True)
    text = " ".join(str(w.message) for w in record)
    assert "28 heads missing" in text and "layer 3 head 27" in text and "'04'" in text
    assert cfg.entry(3, 5).params == {"vertical": 1000, "slash": 6096} and cfg.provenance["filled"][0] == [3, 0]
    assert cfg.entry(1, 4).minference == data[1]["04"]
    out = cfg.to_minference()
    assert "04" not in out[1] and out[1]["4"] == data[1]["04"]
    data[1]["+4"] = data[1]["04"]  # two spellings of one head: refused even when reading keys with int()
    with pytest.raises(ConfigError, match="layer 1: keys for head 4 appear twice"):
        HeadConfig.from_minference(data, shape, fill_missing=True)


def test_hints_name_real_flags(tmp_path, capsys):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(generated_file(named_shape("Yi-9B"))))
    assert main(["export", str(path), "--format", "workbench"]) == 2  # forgot --from minference
    err = capsys.readouterr().err
    assert "--from minference --shape MODEL --format workbench" in err
    assert main(["export", str(path), "--from", "minference"]) == 2
    assert "add --shape MODEL" in capsys.readouterr().err
    from workbench.cli import build_parser

    flags = {a for action in build_parser()._subparsers._group_actions[0].choices["export"]._actions
             for a in action.option_strings}
    assert {"--from", "--shape", "--format", "--out", "--fill-missing", "--tp", "--rank"} <= flags


def test_score_is_opaque_and_an_edit_keeps_or_clears_it():
    shape = named_shape("Llama-3-8B-262k")
    data = generated_file(shape, seed=1, int_scores=True)
    data[0]["0"] = ["vertical_and_slash", 1000, 6096, 0.5]
    data[0]["1"] = ["vertical_and_slash", 1000, 6096, 14994473]
    cfg = HeadConfig.from_minference(data, shape)
    assert cfg.entry(0, 0).recall is None and cfg.entry(0, 1).recall is None
    cfg.edit(0, 0, "vs", {"vertical": 500, "slash": 2048}, keep_score=True)
    cfg.edit(0, 1, "ashape", {"sink": 64, "window": 1024}, keep_score=False)
    out = cfg.to_minference()
    assert out[0]["0"] == ["vertical_and_slash", 500, 2048, 0.5]
    assert out[0]["1"] == ["stream_llm", 64, 1024, None]
    assert out[0]["2"] == data[0]["2"]
    with pytest.raises(ConfigError, match="needs|exactly its params"):
        cfg.edit(0, 2, "vs", {"vertical": 5}, keep_score=True)


def minference_vllm_lookup(file: list[dict], layer: int, rank: int, local_heads: int, head: int) -> list:
    """What MInference's vLLM forward runs for local head `head` on TP rank `rank` (its lookup, restated):
    the layer's dict with int() keys, queried at head + rank * (heads on this rank), default otherwise."""
    table = {int(k): v for k, v in file[layer].items()}
    return table.get(head + rank * local_heads, ["vertical_and_slash", 1000, 6096, 1])


@pytest.mark.parametrize("name,tp", [("Llama-3.1-8B", 4), ("GLM-4-9B", 4), ("GLM-4-9B", 8), ("Qwen2.5-7B", 2),
                                     ("Qwen2.5-7B", 4), ("Phi-3-mini", 8)])
def test_rank_files_are_what_minference_vllm_reads(name, tp, tmp_path):
    shape = named_shape(name)
    data = generated_file(shape, seed=tp)
    full = HeadConfig.from_minference(data, shape)
    h_local = shape.n_heads // tp
    for rank in range(tp):
        view = full.for_rank(rank, tp)
        rank_file = json.loads(json.dumps(view.to_minference()))
        assert set(rank_file[0]) == {str(rank * h_local + h) for h in range(h_local)}
        for layer in (0, shape.n_layers - 1):
            for h in range(h_local):
                assert minference_vllm_lookup(rank_file, layer, rank, h_local, h) == data[layer][str(rank * h_local + h)]
        kv = view.provenance["tensor_parallel"]["kv_heads"]
        assert {shape.kv_head(rank * h_local + h) for h in range(h_local)} <= set(kv)
        assert view.model["n_kv_heads"] == max(1, shape.n_kv_heads // tp)
    path = tmp_path / "r1.json"
    assert main(["export", str(_save(tmp_path, data)), "--from", "minference", "--shape", name,
                 "--tp", str(tp), "--rank", "1", "--out", str(path)]) == 0
    assert set(json.loads(path.read_text())[0]) == {str(h_local + h) for h in range(h_local)}


def _save(tmp_path: Path, data) -> Path:
    path = tmp_path / "full.json"
    path.write_text(json.dumps(data))
    return path


def test_named_shapes():
    glm = named_shape("THUDM/glm-4-9b-chat")  # by hub id too
    assert (glm.n_layers, glm.n_heads, glm.n_kv_heads, glm.head_dim, glm.rope_theta) == (40, 32, 2, 128, 5e6)
    phi = named_shape("phi-3-mini")
    assert (phi.n_kv_heads, phi.head_dim, phi.rope_type, phi.max_positions) == (32, 96, "longrope", 131072)
    l31 = named_shape("Llama-3.1-8B")
    assert (l31.rope_type, l31.n_kv_heads, l31.fingerprint) == ("llama3", 8, SHAPE_ONLY)
    assert named_shape("embedded").to_dict() == HeadConfig.load(SHIPPED).model
    with pytest.raises(ModelError, match="unknown shape 'Llama-2'.*config.json path.*Qwen2.5-7B"):
        named_shape("Llama-2")


def test_shapes_from_config_json_and_the_hf_cache(tmp_path, monkeypatch):
    cfg = {"model_type": "mistral", "hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16,
           "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1e6,
           "rope_scaling": {"type": "yarn", "factor": 4.0}}
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    shape = resolve_shape(str(folder))
    assert (shape.name, shape.n_layers, shape.head_dim, shape.rope_type, shape.rope_theta) == ("my-model", 4, 64, "yarn", 1e6)
    assert resolve_shape(str(folder / "config.json")) == shape
    import huggingface_hub.constants as c

    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_shape("acme/tiny").n_kv_heads == 4
    with pytest.raises(ModelError, match="unknown shape 'acme/other'"):
        resolve_shape("acme/other")
    (folder / "config.json").write_text("{")
    with pytest.raises(ModelError, match="not valid JSON"):
        resolve_shape(str(folder))
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ModelError, match="no num_attention_heads / n_head field"):
        resolve_shape(str(folder))
