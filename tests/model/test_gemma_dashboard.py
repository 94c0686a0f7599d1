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


def test_decode_tab_fits_its_default_budget_to_a_short_sample(tiny_gemma, monkeypatch, tmp_path):
    """A 256-token sample has 5 blocks of 64 with 16 new tokens: the tab shows 1 + 2 + 2, not the default 1 + 2 + 8
    that the engine would refuse; a budget the user typed is left alone; the fitted one decodes."""
    from workbench.views.dashboard import state
    from workbench.views.dashboard.decode_tab import DecodeTab
    from workbench.views.dashboard.state import Session, Settings

    model, shape = tiny_gemma
    tok = state.SHARED.model(None, "cpu", "float32")[1]
    monkeypatch.setattr(state.SHARED, "model", lambda *a, **k: (model, tok, shape))
    s = Session(Settings(length=256, config="search", configs_dir=str(tmp_path), bench=str(tmp_path / "none.json")))
    tab = DecodeTab(session=s)
    shown = lambda: tuple(tab.budget[k].value for k in ("init", "local", "topk"))  # noqa: E731
    assert shown() == (1, 2, 8)  # no sample yet: the library's default
    s.load().result(timeout=600)
    assert shown() == (1, 2, 2)
    tab.new_tokens.value = 80  # 256 + 80 + 2 tokens: 6 blocks
    assert shown() == (1, 2, 3)
    tab.budget["topk"].value = 1  # typed by the user: kept
    tab.new_tokens.value = 16
    assert shown() == (1, 2, 1)
    tab.budget["topk"].value = 2
    tab.job.decode(["sparse-resident"], 3, dict(zip(("init", "local", "topk"), shown()))).result(timeout=600)
    assert tab.job.error == "" and tab.job.result.budget.topk == 2
