"""Commands that take `--config` and load a model read the config first: a missing or malformed file fails in
seconds, before the model's load (minutes for an 8B model), with the error naming the file."""
import json

import pytest

from workbench.cli import main

COMMANDS = {
    "analyze": ["analyze", "--length", "256", "--layers", "0"],
    "compare": ["compare", "--lengths", "256"],
    "generalize": ["generalize", "--lengths", "512"],
    "prefill quality": ["prefill", "quality", "--lengths", "256"],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", ["truncated", "missing", "not a config"])
def test_a_bad_config_fails_before_the_model_loads(tmp_path, capsys, command, case):
    path = tmp_path / "cfg.json"
    if case == "truncated":
        path.write_text('{"model": {"n_layers": 30,')
    elif case == "not a config":
        path.write_text(json.dumps({"heads": "none"}))
    # a model path that does not exist: had the model loaded first, its error would come instead of the config's
    argv = [*COMMANDS[command], "--config", str(path), "--model", str(tmp_path / "no_model"), "--out",
            str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "no_model" not in err, err
    assert {"truncated": "not valid JSON", "missing": "does not exist", "not a config": "cfg.json"}[case] in err
