"""The dashboard on a model with sliding-window layers (tiny random Gemma-3): the search keeps the model's
own entry for them, and editing one is refused with the reason (the page shows the message)."""
from __future__ import annotations

import time

import pytest


def test_dashboard_search_and_edit_respect_fixed_layers(tiny_gemma, monkeypatch, tmp_path):
    from workbench.views.dashboard import state
    from workbench.views.dashboard.state import Session, Settings
    from workbench.views.dashboard.tab_state import HeadState

    model, shape = tiny_gemma
    tok = state.SHARED.model(None, "cpu", "float32")[1]  # the embedded tokenizer: its ids fit the tiny vocabulary
    monkeypatch.setattr(state.SHARED, "model", lambda *a, **k: (model, tok, shape))
    s = Session(Settings(length=256, config="search", configs_dir=str(tmp_path), bench=str(tmp_path / "none.json")))
    head = HeadState(s)
    s.load().result(timeout=600)
    assert s.error == "" and s.ready
    fixed, free = shape.fixed_layers[0], shape.free_layers[0]
    assert all(s.config.entry(fixed, h).fixed for h in range(shape.n_heads))
    assert not s.config.entry(free, 0).fixed
    s.select(fixed, 0)
    deadline = time.monotonic() + 600
    while (head.busy or head.view is None or head.layer != fixed) and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(ValueError, match="fixed by the model"):
        head.edit("vs")
    assert s.config.entry(fixed, 0).fixed and s.config.entry(fixed, 0).pattern == "ashape"
