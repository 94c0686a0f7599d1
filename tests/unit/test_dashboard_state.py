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


def test_sidebar_inputs_are_applied_or_refused_naming_the_field(tmp_path):
    from workbench.views.dashboard.state import SEARCH, Session

    s = Session(Settings(config="search"))
    ok = dict(task="passkey", length=512, seed=0, target=0.95, config_choice=SEARCH)
    s.configure(**ok)
    assert (s.length, s.target) == (512, 0.95)
    for bad, match in [({"length": 40}, "length 40 is below the minimum of 128"), ({"target": 0}, "search target 0"),
                       ({"target": 1.5}, "must be in"), ({"seed": -1}, "seed -1 is negative"),
                       ({"task": "poem"}, "task 'poem' is unknown"),
                       ({"config_choice": str(tmp_path / "nope.json")}, "does not exist")]:
        with pytest.raises(ValueError, match=match):
            s.configure(**{**ok, **bad})
        assert (s.length, s.target, s.seed) == (512, 0.95, 0)  # nothing applied
    s._applied = (str(tmp_path), None)  # a session whose config came from a file: the target does not apply
    with pytest.raises(ValueError, match="search target 0.5 is not used: the config comes from"):
        s.configure(**{**ok, "target": 0.5, "config_choice": str(tmp_path)})
    s.configure(**{**ok, "target": 0.5})  # with the search chosen it does


def test_estimate_reads_the_nearest_measured_length_and_says_so():
    from workbench.prefill.latency import BENCH
    from workbench.views.dashboard.tab_state import Estimate

    shape = ModelShape(name="SmolLM2-135M-Instruct", architecture="llama", n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, hidden_size=576, rope_type="default", rope_theta=1e5, max_positions=8192,
                       fingerprint="f")
    est, why = Estimate.load(BENCH, shape)
    assert why == "" and min(est.by_length) == 16384 and len(est.by_length) >= 3
    short, long = est.head("vs", 100, 4096), est.head("vs", 100, 131072)
    assert short["measured_n"] == 16384 and long["measured_n"] == 131072
    assert short["index_ms"] != long["index_ms"]  # the index time follows the measured lengths
    text = est.sentence(short, 4096)
    assert text.startswith("NVIDIA H200 estimate, not this machine") and "a 4096-token prompt was not timed" in text
    assert "measured cost per query head" in text and "Takeaway: on the NVIDIA H200 sparse attention" in text
    assert est.sentence(est.head("dense", 36, 512), 512).endswith("runs dense attention: nothing to gain or lose.")
    missing, why = Estimate.load("/nonexistent/bench.json", shape)
    assert missing is None and why.startswith("no estimate: bench.json")


def test_the_server_drops_only_the_report_of_a_message_to_a_closed_tab(caplog):
    """`quiet_closed_tabs` (the dashboard server's asyncio exception handler): a task that failed because its browser
    tab had closed (Tornado's WebSocketClosedError) logs nothing; any other task's exception still reaches asyncio's
    default handler, which logs it."""
    import asyncio
    import logging

    from tornado.websocket import WebSocketClosedError

    from workbench.views.dashboard.app import quiet_closed_tabs

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            quiet_closed_tabs(loop, {"message": "Task exception was never retrieved", "exception": WebSocketClosedError()})
            assert caplog.records == []
            quiet_closed_tabs(loop, {"message": "Task exception was never retrieved", "exception": KeyError("layer")})
        assert len(caplog.records) == 1 and "KeyError: 'layer'" in caplog.text
    finally:
        loop.close()


def test_a_served_session_quiets_closed_tabs_on_the_server_loop():
    """`quiet_server_loop`, which `create_app` calls: in a session of a real Panel server it sets `quiet_closed_tabs`
    as the server loop's exception handler (so `panel serve app.py` gets it as `workbench dashboard` does); outside a
    server it leaves the loop alone."""
    import asyncio
    import threading
    import urllib.request

    import panel as pn

    from workbench.views.dashboard.app import quiet_closed_tabs, quiet_server_loop

    quiet_server_loop()  # no server session here: nothing to do, nothing raised
    ready, started, served = threading.Event(), threading.Event(), {}

    def page():
        quiet_server_loop()
        ready.set()
        return pn.pane.Markdown("ok")

    def serve():
        """The server on a new loop of its own thread: this thread's current loop may be Playwright's, running
        (a browser test earlier in this worker), and a Tornado IOLoop made here would wrap it."""
        asyncio.set_event_loop(asyncio.new_event_loop())
        server = pn.serve({"/": page}, port=0, address="127.0.0.1", show=False, start=False)
        served.update(server=server, handler=server.io_loop.asyncio_loop.get_exception_handler())
        started.set()
        server.io_loop.start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(60)
    server = served["server"]
    assert served["handler"] is None
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=60).read()
        assert ready.wait(60)
        assert server.io_loop.asyncio_loop.get_exception_handler() is quiet_closed_tabs
    finally:
        server.io_loop.add_callback(server.stop)
        server.io_loop.add_callback(server.io_loop.stop)
        thread.join(30)
