"""`workbench search --latency`: the cost comes from the benchmark shape nearest the model's (the pick the
dashboard's estimate makes), never from a shape asked for by name."""
from __future__ import annotations

import json

import pytest

from workbench.config import HeadConfig
from workbench.prefill.latency import match_shape, tile_rates

pytestmark = pytest.mark.model

# A synthetic benchmark without the embedded model's shape: Llama-3-8B-shaped rows only (head_dim 128)
BENCH = {"environment": {"gpu": "Test GPU"}, "rows": [
    {"shape": "llama3-8b", "q_heads": 32, "kv_heads": 8, "head_dim": 128, "n": 16384, "block": "64", "kernel": kernel,
     "time_ms": ms, "index_ms": index_ms, "physical_density": density}
    for kernel, ms, index_ms, density in (("dense_sdpa", 3.3, 0.0, 1.0), ("a_shape", 0.6, 0.0, 0.2))]}


def test_search_latency_uses_the_nearest_measured_shape(embedded, tmp_path, capsys):
    from workbench.cli import main

    bench, cands, out = tmp_path / "bench.json", tmp_path / "cands.json", tmp_path / "cfg.json"
    bench.write_text(json.dumps(BENCH))
    cands.write_text(json.dumps([{"pattern": "ashape", "params": {"sink": 64, "window": 64}}]))
    assert main(["search", "--lengths", "128", "--tasks", "passkey", "--holdout", "", "--candidates", str(cands),
                 "--latency", str(bench), "--out", str(out), "--no-progress"]) == 0
    assert "latency cost from" in capsys.readouterr().out
    latency = HeadConfig.load(out, embedded[2]).provenance["latency"]
    assert "shape 'llama3-8b'" in latency["bench"] and "scaled by 64/128" in latency["bench"]
    assert latency["rates"] == tile_rates(BENCH, embedded[2]) and match_shape(BENCH, embedded[2])[0] == "llama3-8b"


def test_search_latency_alone_reads_the_table_shipped_for_this_machine(embedded, tmp_path):
    """`--latency` without a file: the table shipped for this machine's GPU (the H200's off a GPU), recorded in the
    command by its GPU so that the command reads the same table elsewhere."""
    from workbench.cli import main
    from workbench.prefill.latency import bench_path, load_bench

    cands, out = tmp_path / "cands.json", tmp_path / "cfg.json"
    cands.write_text(json.dumps([{"pattern": "ashape", "params": {"sink": 64, "window": 64}}]))
    assert main(["search", "--lengths", "128", "--tasks", "passkey", "--holdout", "", "--candidates", str(cands),
                 "--out", str(out), "--no-progress", "--latency"]) == 0
    provenance = HeadConfig.load(out, embedded[2]).provenance
    table = bench_path()
    gpu = table.stem.removeprefix("prefill_")
    assert provenance["command"].endswith(f"--latency {gpu}") and bench_path(gpu) == table
    assert provenance["latency"]["bench"].startswith(f"{table}: shape 'embedded'")
    assert provenance["latency"]["rates"] == tile_rates(load_bench(table), embedded[2])
