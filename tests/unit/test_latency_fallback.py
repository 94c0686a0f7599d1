"""The latency estimate's benchmark shape: the model's own when measured, else the same head_dim, else the
nearest (scaled); the dashboard says which, or "no estimate: <why>", and never fails a job over it."""
from __future__ import annotations

import json

import pytest
import torch

from workbench.core.io import write_json
from workbench.core.model import ModelShape
from workbench.core.timing import gpu_tag
from workbench.data import DATA, latency_gpus, shipped_latency
from workbench.prefill.latency import BENCH, bench_path, load_bench, match_shape, rate_table, tile_rates
from workbench.views.dashboard.state import Session, Settings, Shared, latency_rates

EMBEDDED = ModelShape(name="SmolLM2-135M-Instruct", architecture="llama", n_layers=30, n_heads=9, n_kv_heads=3,
                      head_dim=64, hidden_size=576, rope_type="default", rope_theta=1e5, max_positions=8192,
                      fingerprint="f")


def _bench(*shapes: tuple[str, int, int, int]) -> dict:
    """A kernel benchmark with one dense and one block-sparse row per (name, q heads, kv heads, head_dim)."""
    rows = []
    for name, hq, hkv, d in shapes:
        common = {"shape": name, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "n": 16384}
        rows += [{**common, "kernel": "dense_sdpa", "time_ms": 1.0 * hq},
                 {**common, "kernel": "block_sparse", "block": "64", "time_ms": 0.5 * hq, "index_ms": 0.1 * hq,
                  "physical_density": 0.5}]
    return {"environment": {"gpu": "Test GPU"}, "rows": rows}


BOTH = _bench(("embedded", 9, 3, 64), ("llama3-8b", 32, 8, 128))
LLAMA3_ONLY = _bench(("llama3-8b", 32, 8, 128))


def test_the_models_own_shape_when_measured():
    name, note = match_shape(BOTH, EMBEDDED)
    assert name == "embedded" and "this model's attention shape" in note
    assert tile_rates(BOTH, EMBEDDED) == tile_rates(BOTH, "embedded")


def test_without_the_models_shape_the_nearest_head_dim_scaled():
    with pytest.raises(ValueError, match=r"no rows for shape 'embedded'.*\['llama3-8b'\]"):
        tile_rates(LLAMA3_ONLY)  # the default name, as the dashboard used to ask for it
    name, note = match_shape(LLAMA3_ONLY, EMBEDDED)
    assert name == "llama3-8b" and "head_dim 128" in note and "scaled by 64/128" in note
    rates, theirs = tile_rates(LLAMA3_ONLY, EMBEDDED), tile_rates(LLAMA3_ONLY, "llama3-8b")
    assert set(rates) == set(theirs) == {"block", "dense"}
    for p in rates:
        assert rates[p]["per_tile_ms"] == pytest.approx(theirs[p]["per_tile_ms"] * 64 / 128)
        assert rates[p]["index_ms"] == theirs[p]["index_ms"]


def test_the_shipped_table_is_package_data_in_the_rate_table_form():
    """The estimate reads a table shipped inside the package (no repo folder needed); `rate_table` keeps
    exactly the rows and fields the estimate reads."""
    assert BENCH.is_relative_to(DATA)
    shipped = load_bench(BENCH)
    assert set(shipped) == {"environment", "source", "rows"} and shipped["rows"]
    table = rate_table({**BOTH, "rows": BOTH["rows"] + [{"kernel": "flex", "time_ms": 1.0}]}, "full.json")
    assert table["source"] == "full.json" and len(table["rows"]) == len(BOTH["rows"])
    for shape in ("embedded", "llama3-8b"):
        assert tile_rates(table, shape) == tile_rates(BOTH, shape)


def test_a_table_per_gpu_each_measured_on_the_gpu_it_is_named_for(tmp_path):
    """Each shipped table's rows come from the GPU its name says, and cover the three measured shapes; this machine's
    GPU picks its own by `gpu_tag`; anything else is a JSON path, or an error naming the shipped GPUs."""
    assert {"h100", "h200"} <= set(latency_gpus())
    for gpu in latency_gpus():
        table = load_bench(bench_path(gpu))
        assert gpu_tag(table["environment"]["gpu"]) == gpu and table["source"].endswith(f"_{gpu}.json")
        for shape in ("llama3-8b", "embedded", "gemma3-270m"):
            assert set(tile_rates(table, shape)) == {"dense", "vs", "vs_group", "block", "ashape"}
    assert shipped_latency(gpu_tag("NVIDIA H100 80GB HBM3")) == bench_path("h100") != bench_path("H200") == BENCH
    assert shipped_latency(gpu_tag("NVIDIA A100-SXM4-80GB")) is None
    assert bench_path(None) == (shipped_latency(gpu_tag()) or BENCH)  # no GPU, or none with a table: the H200's
    if not torch.cuda.is_available():
        assert bench_path(None) == BENCH
    mine = write_json(tmp_path / "mine.json", BOTH)
    assert bench_path(str(mine)) == mine and bench_path("not-yet-run.json").name == "not-yet-run.json"
    with pytest.raises(ValueError, match=r"'a100' is neither a JSON file nor a GPU .*\(h100, h200"):
        bench_path("a100")


def test_same_head_dim_wins_then_nearest_head_counts():
    bench = _bench(("big64", 64, 8, 64), ("mid128", 8, 2, 128), ("mid64", 16, 4, 64))
    name, note = match_shape(bench, EMBEDDED)
    assert name == "mid64" and "same head_dim" in note and "9 / 3 heads" in note
    rates = tile_rates(bench, EMBEDDED)
    assert rates["dense"]["per_tile_ms"] == pytest.approx(tile_rates(bench, "mid64")["dense"]["per_tile_ms"])
    with pytest.raises(ValueError, match="no kernel rows"):
        match_shape({"rows": []}, EMBEDDED)


def test_dashboard_rates_name_their_source_or_say_why_none(tmp_path):
    both, llama = write_json(tmp_path / "both.json", BOTH), write_json(tmp_path / "llama3_only.json", LLAMA3_ONLY)
    rates, source = latency_rates(both, EMBEDDED)
    assert rates == tile_rates(BOTH, "embedded") and "shape 'embedded'" in source
    rates, source = latency_rates(llama, EMBEDDED)
    assert rates is not None and source.startswith("Test GPU per-tile model from llama3_only.json")
    assert "shape 'llama3-8b'" in source and "not measured here" in source
    rates, source = latency_rates(tmp_path / "missing.json", EMBEDDED)
    assert rates is None and source.startswith("no estimate: missing.json:") and "does not exist" in source
    (tmp_path / "junk.json").write_text("{not json")
    assert latency_rates(tmp_path / "junk.json", EMBEDDED)[1].startswith("no estimate: junk.json:")
    (tmp_path / "empty.json").write_text(json.dumps({"rows": []}))
    assert "no kernel rows" in latency_rates(tmp_path / "empty.json", EMBEDDED)[1]


def test_bench_is_a_setting():
    assert Settings.from_env({"WORKBENCH_DASHBOARD_BENCH": "x.json"}).bench == "x.json"
    assert Settings().bench is None


def test_a_failed_memo_is_retried_not_cached():
    shared, calls = Shared(), []

    def make():
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("first call fails")
        return 7

    with pytest.raises(ValueError, match="first call fails"):
        shared.memo(("k",), make)
    assert shared.memo(("k",), make) == 7 and shared.memo(("k",), make) == 7 and len(calls) == 2
    assert not shared._pending


def test_a_failed_job_shows_its_error_and_stops_the_progress_bar():
    s = Session(Settings())
    s.run_job("working", lambda: (s._step("half way", 1, 2), 1 / 0)).result(timeout=30)
    assert (s.status, s.busy, s.progress) == ("failed", False, -1)
    assert s.error == "working failed: division by zero"
    assert s.progress_bar() == {"value": 0, "active": False}
    s.busy, s.progress = True, 0
    assert s.progress_bar() == {"value": -1, "active": True}  # animated until the job reports a percentage
    s.progress = 40
    assert s.progress_bar() == {"value": 40, "active": False}
