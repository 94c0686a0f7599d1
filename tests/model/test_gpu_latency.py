"""Live latency of the model's own layers (notebook 05 and the dashboard's Latency tab call
`latency.time_model_layer`): the captured q/k/v of a layer with that layer's heads from the shipped config,
index + sparse attention beside dense SDPA. CPU: the labelled PyTorch reference path; GPU: the Triton path."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workbench.config import HeadConfig
from workbench.prefill.latency import time_model_layer

SHIPPED = "workbench/data/configs/SmolLM2-135M-Instruct.json"
MIXED_LAYER = 12  # VS and A-shape heads in the shipped config


@pytest.mark.model
def test_time_model_layer_on_the_cpu_is_the_labelled_reference_path(embedded, capture_256):
    config = HeadConfig.load(SHIPPED, embedded[2])
    out = time_model_layer(capture_256, config, MIXED_LAYER, device="cpu", reps=1)
    assert "reference" in out["path"] and out["device"] == "cpu" and out["n"] == 256
    assert out["patterns"]["vs"] + out["patterns"]["ashape"] > 0
    assert out["dense_ms"] > 0 and out["sparse_ms"] > 0 and out["index_ms"] > 0
    dense_layer = next(l for l in range(30) if all(e.pattern == "dense" for e in config.layer(l)))
    assert time_model_layer(capture_256, config, dense_layer, device="cpu", reps=1)["index_ms"] == 0


def write_figure(name: str, obj: dict) -> None:
    """The lane's figures: $WORKBENCH_GPU_FIGURES/<name>.json (scripts/gpu_check.py collects them)."""
    from workbench.core.io import write_json

    write_json(Path(os.environ.get("WORKBENCH_GPU_FIGURES", "reports/gpu_figures")) / f"{name}.json", obj)


@pytest.mark.gpu
@pytest.mark.model
def test_time_model_layer_on_the_gpu_runs_the_triton_path():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample
    from workbench.core.model import load_model

    model, tok, shape = load_model(device="cuda", dtype=torch.bfloat16)
    cap = capture_attention(model, shape, make_sample("passkey", tok, 8192, seed=0).input_ids, progress=False)
    assert cap.q.is_cuda
    out = time_model_layer(cap, HeadConfig.load(SHIPPED, shape), MIXED_LAYER, reps=5)
    write_figure("latency", out)
    assert out["path"].startswith("Triton") and out["dtype"] == "bfloat16"
    assert out["dense_ms"] > 0 and out["sparse_ms"] > 0 and out["index_ms"] > 0


@pytest.mark.gpu
@pytest.mark.model
def test_dashboard_latency_tab_times_the_model_layer_on_the_gpu():
    """What the Latency tab's button runs (`LatencyState.time`), in a session whose model is on the GPU:
    the sample's captured layer, its heads from the shipped config, through the Triton path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("param")
    from workbench.views.dashboard.state import Session, Settings
    from workbench.views.dashboard.tab_state import LatencyState

    session = Session(Settings(length=4096, layers=(MIXED_LAYER,), config=SHIPPED, device="cuda"))
    latency = LatencyState(session)
    session.load().result(timeout=120)
    assert session.ready and not session.error, session.error
    session.param.update(layer=MIXED_LAYER)
    latency.time().result(timeout=120)
    out = latency.result
    assert not latency.error and out is not None, latency.error
    write_figure("dashboard_latency", out)
    assert out["layer"] == MIXED_LAYER and out["n"] == 4096 and out["path"].startswith("Triton")
    assert out["patterns"]["vs"] + out["patterns"]["ashape"] > 0 and out["sparse_ms"] > 0 and out["dense_ms"] > 0


@pytest.mark.gpu
@pytest.mark.model
def test_index_replayed_from_a_cuda_graph_equals_the_eager_index(embedded):
    """`SparsePrefill(graph_index=True)`: each mixed layer's online index (block + dense, VS + dense, VS + A-shape
    + dense) captured in a CUDA graph on the first q / k, then replayed on new ones, equals the eager index of
    the same q / k in every tile count, every entry under the counts and the band; no capture falls back to
    eager. Both forms of the index: per kind (one launch per kind, `per_kind=True`) and merged (`per_kind=False`)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.prefill.sparse import SparsePrefill

    def parts(index) -> list:  # [(tiles, band)] of either form: per kind (a dict) or merged (tiles, sink, window)
        if isinstance(index, dict):
            return [(tiles, band or ()) for _, tiles, band in index.values()]
        return [(index[0], index[1:])]

    shape = embedded[2]
    config = HeadConfig.load(SHIPPED, shape)
    n, layers = 2048, (2, 9, 12)
    for per_kind in (True, False):
        eager = SparsePrefill(None, shape, config, min_length=0, backend="triton", graph_index=False,
                              per_kind=per_kind)
        graphed = SparsePrefill(None, shape, config, min_length=0, backend="triton", graph_index=True,
                                per_kind=per_kind)
        g = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(2):  # capture on the first inputs, replay on the second
            q = torch.randn(1, shape.n_heads, n, shape.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, shape.n_kv_heads, n, shape.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for layer in layers:
                got_parts, want_parts = (parts(sp.layer_index(layer, q, k, shape.scale, "triton"))
                                         for sp in (graphed, eager))
                assert len(got_parts) == len(want_parts) == (3 if per_kind and layer == 12 else
                                                             2 if per_kind else 1), layer
                for (got, got_band), (want, want_band) in zip(got_parts, want_parts):
                    for count, name in (("block_count", "block_offset"), ("column_count", "column_index")):
                        assert torch.equal(getattr(got, count), getattr(want, count)), (layer, count)
                        n_slots = getattr(want, name).shape[-1]  # (entries past the counts are never read, nor written)
                        live = torch.arange(n_slots, device="cuda") < getattr(want, count)[..., None]
                        assert torch.equal(getattr(got, name)[live], getattr(want, name)[live]), (layer, name)
                    for a, b in zip(got_band, want_band, strict=True):
                        assert (a is None and b is None) or torch.equal(a, b), layer
        assert not graphed.index_graphs.failures, graphed.index_graphs.failures
        assert len(graphed.index_graphs) == len(layers)


@pytest.mark.gpu
def test_index_graphs_capture_on_the_second_call_and_keep_the_last_layouts():
    """`IndexGraphs(after=1, layouts=2)`: a layout's first call runs the build eagerly, its second captures (a timed
    warm-up build, then the capture) and replays, later calls only replay (no build) and equal the eager result on
    their own inputs; a call at a third layout drops the least recently used one's graphs, which then starts over
    eagerly.
    keep_slower=False (the prefill's default) drops a graph whose replay (q / k copy included) measured slower than
    the eager build: here a build that reads one row of a 512 MB q."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.prefill.index_graph import IndexGraphs

    builds = []

    def build(q, k):
        builds.append(q.shape[2])
        return (q.float() * k.float()).sum(-1).topk(3, dim=-1).indices

    graphs = IndexGraphs(after=1, layouts=2)
    g = torch.Generator(device="cuda").manual_seed(0)

    def call(n, graphs=graphs, build=build, heads=4):
        q = torch.randn(1, heads, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, heads, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        got = graphs("layer", build, q, k).clone()
        want = build(q, k)
        builds.pop()  # (the reference build)
        assert torch.equal(got, want), n

    call(128)
    assert builds == [128] and len(graphs) == 0  # first call: eager
    call(128)
    assert builds == [128] * 3 and len(graphs) == 1  # second: warm-up + capture, then the replays
    assert len(graphs.timings) == 1 and all(t > 0 for t in next(iter(graphs.timings.values())))
    call(128)
    assert builds == [128] * 3  # third: replay only
    call(256), call(256)
    assert len(graphs) == 2
    call(128)  # touch 128: 256 is now the least recently used
    call(512)  # a third length: 256's graph is dropped
    assert len(graphs) == 1
    call(512)
    assert len(graphs) == 2 and builds[-3:] == [512] * 3
    before = len(builds)
    call(256)  # eager again (its count was dropped too); 128 is now the least recently used: dropped
    assert len(builds) == before + 1 and len(graphs) == 1
    assert not graphs.failures

    def one_row(q, k):
        builds.append("row")
        return q[:, :, :1].float().sum(-1).topk(1, dim=-1).indices

    lean = IndexGraphs(after=1, keep_slower=False)
    for _ in range(3):
        call(1 << 21, lean, one_row, heads=2)  # q and k 512 MB each: the copy outweighs three small launches
    (eager_ms, replay_ms), = lean.timings.values()
    assert replay_ms > eager_ms, lean.timings
    assert len(lean) == 0 and not lean._inputs  # graph and buffers dropped
    assert builds[-4:] == ["row"] * 4  # eager, warm-up + capture, eager again
