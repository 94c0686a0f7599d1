"""workbench.decode.timeline: one traced decode step equals an untraced one and yields sane compute/copy spans."""
from __future__ import annotations

import pytest
import torch

from workbench.core.corpus import make_sample
from workbench.decode.engine import DecodeEngine, EngineConfig
from workbench.decode.engine.llama import LlamaLayers
from workbench.decode.timeline import _cut, trace_step
from workbench.patterns.infllm import Budget
from workbench.views import viz


def test_cut_removes_copy_intervals():
    span = {"stream": "compute", "start": 0.0, "end": 10.0, "label": "L1"}
    pieces = _cut(span, [{"start": 2.0, "end": 3.0}, {"start": 9.0, "end": 12.0}, {"start": 20.0, "end": 21.0}])
    assert [(p["start"], p["end"]) for p in pieces] == [(0.0, 2.0), (3.0, 9.0)]


@pytest.mark.model
def test_traced_step_matches_and_spans_cover_every_layer(embedded):
    model, tok, shape = embedded
    prompt = make_sample("passkey", tok, 256, seed=0).input_ids
    prefilled = [LlamaLayers(model).prefill(prompt)]
    cfg = EngineConfig(mode="sparse-offload-forecast", budget=Budget(init=1, local=1, topk=1), kernels="torch")
    engines = [DecodeEngine(model, cfg, batch=1, max_tokens=260) for _ in range(2)]
    firsts = [e.prefill([prompt], 2, prefilled=prefilled) for e in engines]
    plain = engines[0].step(firsts[0])
    traced, spans = trace_step(engines[1], firsts[1])
    assert torch.equal(plain, traced)
    assert "norm_in" not in vars(engines[1].lm) and "_copy" not in vars(engines[1])  # wrappers removed
    compute = [s for s in spans if s["stream"] == "compute"]
    copies = [s for s in spans if s["stream"] == "copy"]
    assert {s["layer"] for s in compute} == set(range(shape.n_layers))
    assert {s["layer"] for s in copies} == set(range(1, shape.n_layers))  # layer 0 stays resident
    assert all(0 <= s["start"] <= s["end"] for s in spans)
    ordered = sorted(spans, key=lambda s: s["start"])
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in zip(ordered, ordered[1:]))  # CPU: nothing overlaps
    fig = viz.decode_timeline(spans)
    assert {t.name for t in fig.data} == {"compute", "copy"}
