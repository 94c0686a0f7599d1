"""The command line on bad input: every case ends with exit status 2 (or a documented refusal), one line
naming the file / field / flag and the fix, no traceback, and no output file written or touched. None of
these cases loads a model (they fail before it, or need only a model's shape)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import build_parser, main
from workbench.data import shipped_config

SHAPE = "Llama-3-8B-262k"  # 32 layers, 32 query heads, 8 KV heads, 262144 tokens
SMOL = shipped_config("SmolLM2-135M-Instruct")


def minference_file(n_layers: int = 32, n_heads: int = 32) -> list[dict]:
    """Every head distinct, all three MInference pattern names."""
    out = []
    for l in range(n_layers):
        layer = {}
        for h in range(n_heads):
            name = ("vertical_and_slash", "stream_llm", "block_sparse")[(l + h) % 3]
            layer[str(h)] = [name, 100 + h, 0 if name == "block_sparse" else 1000 + l, round(h / 100 + l, 3)]
        out.append(layer)
    return out


def fails(capsys, argv: list[str], *needles: str) -> str:
    """Run `workbench ARGV` in-process: status 2 and every needle in its one-line error."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture
def full(tmp_path):
    path = tmp_path / "mi.json"
    path.write_text(json.dumps(minference_file()))
    return path


@pytest.fixture
def sentinel(tmp_path):
    """An existing output file that a failing command must leave as it is."""
    path = tmp_path / "existing.json"
    path.write_text("keep me\n")
    return path


# ---- 1. rank views -------------------------------------------------------------------------------

def test_a_rank_view_is_split_again_only_into_heads_it_holds(full, tmp_path, capsys):
    r1 = tmp_path / "r1.json"
    assert main(["export", str(full), "--from", "minference", "--shape", SHAPE, "--tp", "2", "--rank", "1",
                 "--format", "workbench", "--out", str(r1)]) == 0
    view = json.loads(r1.read_text())["provenance"]["tensor_parallel"]
    assert view["heads"] == list(range(16, 32)) and (view["n_heads"], view["n_kv_heads"]) == (32, 8)
    data = minference_file()
    # the same view again: global keys 16..31 holding their own entries (the defect wrote head 31 under "15")
    again = tmp_path / "again.json"
    assert main(["export", str(r1), "--tp", "2", "--rank", "1", "--out", str(again)]) == 0
    out = json.loads(again.read_text())
    assert all(out[l] == {str(h): data[l][str(h)] for h in range(16, 32)} for l in range(32))
    # a rank of a larger TP size inside the view maps through the global ids
    inner, direct = tmp_path / "inner.json", tmp_path / "direct.json"
    assert main(["export", str(r1), "--tp", "4", "--rank", "3", "--out", str(inner)]) == 0
    assert main(["export", str(full), "--from", "minference", "--shape", SHAPE, "--tp", "4", "--rank", "3",
                 "--out", str(direct)]) == 0
    assert inner.read_text() == direct.read_text()
    # another rank's heads are refused, naming them; nothing is written
    fails(capsys, ["export", str(r1), "--tp", "2", "--rank", "0", "--out", str(tmp_path / "bad.json")],
          "rank 1 of 2", "global heads 0-15", "holds none of them", "FULL_CONFIG --tp 2 --rank 0")
    fails(capsys, ["export", str(r1), "--tp", "4", "--rank", "1", "--out", str(tmp_path / "bad.json")],
          "global heads 8-15")
    assert not (tmp_path / "bad.json").exists()
    # checked against the whole model's shape, a view says what it is
    assert main(["export", str(r1), "--shape", SHAPE, "--format", "check"]) == 0
    assert "rank 1 of 2 (global heads 16-31" in capsys.readouterr().out


def test_every_rank_file_is_what_minference_vllm_looks_up(full, tmp_path, capsys):
    """MInference's vLLM forward on rank r reads {int(key): entry} of each layer and asks for
    head + r * local_heads: every head of every rank finds its own entry, also through a saved view."""
    data = minference_file()
    for tp in (2, 4, 8):
        for rank in range(tp):
            view, out = tmp_path / "view.json", tmp_path / "rank.json"
            assert main(["export", str(full), "--from", "minference", "--shape", SHAPE, "--tp", str(tp), "--rank",
                         str(rank), "--format", "workbench", "--out", str(view)]) == 0
            assert main(["export", str(view), "--out", str(out)]) == 0
            rank_file = json.loads(out.read_text())
            local = 32 // tp
            for l in range(32):
                lookup = {int(k): v for k, v in rank_file[l].items()}
                assert [lookup[h + rank * local] for h in range(local)] == \
                       [data[l][str(h + rank * local)] for h in range(local)]
    capsys.readouterr()


# ---- 2. defaults never write into the package or committed folders --------------------------------

def _out_defaults(parser, path=()):
    for action in parser._actions:
        if getattr(action, "choices", None) and isinstance(action.choices, dict):  # subcommands
            for name, sub in action.choices.items():
                yield from _out_defaults(sub, path + (name,))
        elif action.dest in ("out", "minference_out", "config_out") and action.default is not None:
            yield " ".join(path), action.default


def test_default_outputs_go_under_reports():
    defaults = dict(_out_defaults(build_parser()))
    assert {"analyze", "compare", "prefill quality", "forecast report", "dashboard", "bench kernels"} <= set(defaults)
    for command, default in defaults.items():
        assert default.startswith("reports/"), (command, default)
    help_text = build_parser()._subparsers._group_actions[0].choices["search"].format_help()
    assert "reports/configs/<model>.json" in help_text


# ---- 4. no tracebacks: folders, files, permissions, devices -----------------------------------------

def test_paths_that_cannot_be_used_get_one_line(tmp_path, sentinel, capsys, monkeypatch):
    folder = tmp_path / "folder"
    folder.mkdir()
    fails(capsys, ["export", str(folder)], "folder", "give the file")
    fails(capsys, ["analyze", "--out", str(sentinel)], "--out", "is a file", "folder")
    fails(capsys, ["decode", "--out", str(folder)], "--out", "is a folder")
    fails(capsys, ["export", str(SMOL), "--out", str(sentinel / "x.json")], "is a file, not a folder")
    fails(capsys, ["export", str(SMOL), "--tp", "0", "--rank", "0"], "--tp", ">= 1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by the kernel tests' modules in this process
    fails(capsys, ["prefill", "quality", "--backend", "triton", "--device", "cpu", "--out", str(tmp_path / "q.json")],
          "workbench prefill quality: error: --backend triton", "GPU", "--backend torch")
    fails(capsys, ["prefill", "quality", "--out", str(sentinel)], "--out report", str(sentinel), "another --out")
    assert not (tmp_path / "q.json").exists()
    fails(capsys, ["decode", "--graph", "--device", "cpu", "--out", str(sentinel)], "--graph", "GPU")
    assert sentinel.read_text() == "keep me\n"

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    fails(capsys, ["export", str(SMOL)], str(SMOL), "permission denied")


def test_an_unexpected_error_keeps_its_traceback(monkeypatch):
    """Only library and file errors become one line: a bug (here a KeyError) still raises."""
    from workbench.cli import export

    monkeypatch.setattr(export, "run", lambda args: {}["bug"])
    with pytest.raises(KeyError):
        main(["export", str(SMOL)])


def test_no_traceback_in_a_real_process(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    done = subprocess.run([sys.executable, "-m", "workbench", "export", str(folder)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("workbench export: error:") and len(done.stderr.strip().splitlines()) == 1


# ---- 6. sizes have upper bounds --------------------------------------------------------------------

def _edited(tmp_path, edit) -> Path:
    data = json.loads(SMOL.read_text())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_sizes_above_the_models_length_are_refused_at_import(tmp_path, sentinel, capsys):
    def huge(d):
        i = next(i for i, h in enumerate(d["heads"]) if h["pattern"] == "vs")
        d["heads"][i]["params"]["vertical"] = 10 ** 30
    fails(capsys, ["export", str(_edited(tmp_path, huge)), "--out", str(sentinel)],
          "params.vertical = 1000000000000000000000000000000", "8192", "use a value from 0 to 8192")
    mi = minference_file()
    mi[3]["5"] = ["vertical_and_slash", 10 ** 30, 100, 0.5]
    (tmp_path / "mi.json").write_text(json.dumps(mi))
    fails(capsys, ["export", str(tmp_path / "mi.json"), "--from", "minference", "--shape", SHAPE, "--out",
                   str(sentinel)], "layer 3, head 5", "vertical_size", "at most 262144")
    fails(capsys, ["export", str(SMOL), "--format", "flex", "--length", "100000", "--out", str(sentinel)],
          "--length 100000", "at most 8192")
    assert sentinel.read_text() == "keep me\n"


# ---- 7. one integer rule, no NaN -------------------------------------------------------------------

def test_integers_are_strict_in_every_format(tmp_path, sentinel, capsys):
    def decimal(d):
        i = next(i for i, h in enumerate(d["heads"]) if h["pattern"] == "vs")
        d["heads"][i]["params"]["slash"] = 16.0
    fails(capsys, ["export", str(_edited(tmp_path, decimal)), "--out", str(sentinel)], ".params.slash", "integer")
    mi = minference_file()
    mi[0]["0"] = ["vertical_and_slash", 16.0, 100, 0.5]
    (tmp_path / "mi.json").write_text(json.dumps(mi))
    fails(capsys, ["export", str(tmp_path / "mi.json"), "--from", "minference", "--shape", SHAPE], "vertical_size is 16.0",
          "whole number")
    fails(capsys, ["export", str(_edited(tmp_path, lambda d: d["model"].update(n_layers=30.0)))], "model.n_layers")
    assert sentinel.read_text() == "keep me\n"


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_nan_is_never_written(tmp_path, capsys):
    mi = minference_file()
    mi[2]["7"][3] = float("nan")
    mi[4]["1"][3] = float("inf")
    src, wb, back = tmp_path / "mi.json", tmp_path / "wb.json", tmp_path / "back.json"
    src.write_text(json.dumps(mi))  # Python writes NaN / Infinity, which JSON has no numbers for
    assert main(["export", str(src), "--from", "minference", "--shape", SHAPE, "--format", "workbench",
                 "--out", str(wb)]) == 0
    assert "2 scores are NaN or infinite (e.g. layer 2 head 7: nan)" in capsys.readouterr().err
    assert main(["export", str(wb), "--out", str(back)]) == 0
    out = _strict(back.read_text())
    assert out[2]["7"][3] is None and out[4]["1"][3] is None and out[0]["0"] == mi[0]["0"]
    # a NaN in a workbench config is refused naming the field
    def nan(d):
        d["heads"][0]["recall"]["mean"] = float("nan")
    fails(capsys, ["export", str(_edited(tmp_path, nan))], "heads[0].recall.mean")


# ---- 8. MInference block_sparse runs top-100 -------------------------------------------------------

def test_block_sparse_says_minference_runs_top_100(full, tmp_path, capsys):
    wb, back = tmp_path / "wb.json", tmp_path / "back.json"
    assert main(["export", str(full), "--from", "minference", "--shape", SHAPE, "--format", "workbench",
                 "--out", str(wb)]) == 0
    err = capsys.readouterr().err
    assert "workbench export: warning:" in err and "block_sparse heads" in err and "top-100" in err
    cfg = json.loads(wb.read_text())
    assert cfg["provenance"]["minference_block_topk"] == 100
    block = next(h for h in cfg["heads"] if h["pattern"] == "block")
    assert block["params"]["topk"] == block["minference"][1]  # the file's value, which the workbench runs
    assert main(["export", str(wb), "--out", str(back)]) == 0
    assert "top-100" in capsys.readouterr().err
    assert json.loads(back.read_text()) == minference_file()


# ---- 9. binary and Latin-1 files -------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary", "{\"caf\u00e9\": 1}".encode("latin-1")])
def test_files_that_are_not_utf8_text(tmp_path, content, capsys):
    path = tmp_path / "odd.json"
    path.write_bytes(content)
    fails(capsys, ["export", str(path)], str(path), "not UTF-8", "re-save it as UTF-8")
    fails(capsys, ["export", str(path), "--from", "minference", "--shape", SHAPE], str(path), "not UTF-8")
    fails(capsys, ["analyze", "--tasks", str(path)], "--tasks text file", str(path), "not UTF-8")


# ---- 10. one flag vocabulary -----------------------------------------------------------------------

@pytest.mark.parametrize("argv,new", [
    (["decode", "--context", "10000"], "--length"),
    (["decode", "--json", "x.json"], "--out"),
    (["decode", "--task", "passkey"], "--tasks"),
    (["analyze", "--sample", "passkey"], "--tasks"),
    (["search", "--length", "4096"], "--lengths"),
    (["compare", "--length", "4096"], "--lengths"),
    (["analyze", "--lengths", "4096"], "--length"),
    (["prefill", "quality", "--task", "multikey"], "--tasks"),
    (["dashboard", "--configs-dir", "x"], "--out"),
    (["forecast", "report", "--json", "x.json"], "--out"),
])
def test_old_spellings_name_the_new_flag(argv, new, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"is now {new}" in err and "Traceback" not in err


def test_flags_parse_the_same_everywhere(capsys):
    parser = build_parser()
    for argv in (["analyze"], ["compare"], ["dashboard"]):
        assert parser.parse_args(argv + ["--layers", "0-3,7"]).layers == [0, 1, 2, 3, 7]
    for argv in (["analyze", "--layers", "3-1"], ["compare", "--layers", "4096,x"]):
        assert "e.g. 4096" not in fails(capsys, argv, "--layers", "such as 0-3,7")  # the example is a layer range
    assert parser.parse_args(["compare", "--lengths", "256"]).lengths == [256]
    fails(capsys, ["compare", "--lengths", "256,x"], "--lengths", "4096,8192")
    fails(capsys, ["decode", "--length", "0"], "--length", ">= 1")
    fails(capsys, ["analyze", "--len", "256"], "unrecognized arguments: --len")  # no prefix abbreviations
    args = parser.parse_args(["export", "--model", "embedded", "--device", "cpu", "--dtype", "float16", "--format", "check"])
    assert (args.device, args.dtype) == ("cpu", "float16")
    fails(capsys, ["analyze", "--tasks", "passkey,code"], "--tasks", "one task")
    fails(capsys, ["analyze", "--tasks", "passky"], "--tasks 'passky'", "passkey")


def test_an_offline_hub_id_fails_fast_with_the_fix(tmp_path):
    done = subprocess.run([sys.executable, "-m", "workbench", "export", str(SMOL), "--model", "nobody/no-such-model",
                           "--format", "check"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not in the local Hugging Face cache" in done.stderr and "hf download nobody/no-such-model" in done.stderr


def test_a_heads_file_that_is_not_safetensors_is_named(tmp_path):
    from workbench.core.model import ModelError
    from workbench.core.shapes import named_shape
    from workbench.decode.forecast.heads import ForecastHeads

    path = tmp_path / "heads.safetensors"
    path.write_text("{\"not\": \"safetensors\"}")
    with pytest.raises(ModelError, match=f"{path} is not a safetensors file.*workbench forecast train"):
        ForecastHeads.load(path, named_shape("embedded"))
    with pytest.raises(IsADirectoryError, match="is a folder"):
        ForecastHeads.load(tmp_path, named_shape("embedded"))
