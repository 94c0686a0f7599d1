"""Dashboard session helpers that need no browser: config names, uploads, settings."""
from __future__ import annotations

import json

import pytest

from workbench.config import ConfigError, HeadConfig, HeadEntry
from workbench.core.model import ModelShape
from workbench.views.dashboard.state import Settings, config_path, parse_config

SHAPE = ModelShape(name="tiny", architecture="llama", n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, hidden_size=16,
                   rope_type="default", rope_theta=10000.0, max_positions=1024, fingerprint="abc")


def _config() -> HeadConfig:
    return HeadConfig(model=SHAPE.to_dict(), heads=[HeadEntry(l, h, "ashape", {"sink": 4, "window": 64})
                                                    for l in range(2) for h in range(2)])


@pytest.mark.parametrize("name", ["../evil", "a/b", "/etc/passwd", "", " ", ".hidden", "..", "x..y", "a\\b", "é"])
def test_config_names_cannot_leave_the_folder(tmp_path, name):
    with pytest.raises(ValueError, match="config name"):
        config_path(tmp_path, name)


@pytest.mark.parametrize("name", ["my-edit", "my-edit.json", "v1.2_final"])
def test_config_names_inside_the_folder(tmp_path, name):
    path = config_path(tmp_path, name)
    assert path.parent == tmp_path.resolve() and path.suffix == ".json" and not path.name.endswith(".json.json")


def test_parse_config_round_trips_and_names_bad_fields():
    cfg = _config()
    assert parse_config(json.dumps(cfg.to_dict()), SHAPE).to_dict() == cfg.to_dict()
    bad = cfg.to_dict()
    bad["heads"][3]["pattern"] = "diagonal"
    with pytest.raises(ConfigError, match=r"heads\[3\]\.pattern"):
        parse_config(json.dumps(bad), SHAPE)
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_config("{oops", SHAPE)
    other = dict(cfg.to_dict(), model=dict(SHAPE.to_dict(), n_heads=4))
    other["heads"] = [dict(h, head=i % 4, layer=i // 4) for i, h in enumerate(other["heads"] * 2)]
    with pytest.raises(ConfigError, match="n_heads"):
        parse_config(json.dumps(other), SHAPE)
    with pytest.raises(ConfigError, match="has 1 layers"):  # a MInference list for another model
        parse_config(json.dumps([{"0": ["vertical_and_slash", 100, 200, 0.9]}]), SHAPE)


def test_settings_layers():
    assert Settings.parse_layers("0-3") == (0, 1, 2, 3)
    assert Settings.parse_layers("5,1,2-3") == (1, 2, 3, 5)
    assert Settings.parse_layers(None) is None
    with pytest.raises(ValueError, match="0-3"):
        Settings.parse_layers("first")
    env = {"WORKBENCH_DASHBOARD_LENGTH": "512", "WORKBENCH_DASHBOARD_LAYERS": "0-1"}
    assert Settings.from_env(env) == Settings(length=512, layers=(0, 1))
