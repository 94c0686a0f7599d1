"""Quest as a decode selector in the engine: offload stays lossless with it (CPU, embedded model)."""
from __future__ import annotations

import pytest
import torch

from workbench.decode.engine import DecodeEngine, EngineConfig
from workbench.patterns.infllm import Budget

pytestmark = pytest.mark.model
BUDGET = Budget(init=1, local=2, topk=5)
STEPS = 24


def test_quest_offload_sync_is_lossless(embedded, one_thread):
    from workbench.core.corpus import make_sample
    from workbench.decode.engine.llama import LlamaLayers

    model, tok, _ = embedded
    ids = [make_sample("passkey", tok, 1100, seed=0).input_ids, make_sample("vartrack", tok, 900, seed=1).input_ids]
    lm = LlamaLayers(model)
    done = [lm.prefill(p) for p in ids]
    out = {}
    for mode, selector in (("sparse-resident", "quest"), ("sparse-offload-sync", "quest"),
                           ("sparse-resident", "same-layer")):
        eng = DecodeEngine(model, EngineConfig(mode=mode, budget=BUDGET, selector=selector), batch=2,
                           max_tokens=1100 + STEPS)
        first = eng.prefill(ids, STEPS, prefilled=done)
        assert bool(eng.quest) == (selector == "quest")
        out[(mode, selector)], _, stats = eng.run(first, STEPS, progress=False)
        if mode == "sparse-offload-sync":
            assert 0 < stats.hit_rate < 1 and stats.bytes_moved_per_step > 0
    assert torch.equal(out[("sparse-offload-sync", "quest")], out[("sparse-resident", "quest")])
    with pytest.raises(ValueError, match="quest"):
        EngineConfig(selector="nearest")


def test_decode_cli_runs_quest_in_offload_sync(embedded, one_thread, tmp_path, capsys):
    import json

    from workbench.cli import main

    out = tmp_path / "quest.json"
    assert main(["decode", "--mode", "sparse-offload-sync", "--selector", "quest", "--length", "300", "--steps",
                 "3", "--budget", "1,1,2", "--out", str(out)]) == 0
    assert "quest" in capsys.readouterr().out
    (run,) = json.loads(out.read_text())["runs"]
    assert run["mode"] == "sparse-offload-sync/quest" and run["selector"] == "quest" and run["bytes_moved_per_step"] > 0
