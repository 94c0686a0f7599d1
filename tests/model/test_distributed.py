"""Distributed search and tensor-parallel head checks, with real torchrun jobs (gloo on the CPU).

- 2 ranks run `workbench search` and write the same config as one process (all but provenance's
  date/hardware/timing/ranks fields byte-identical);
- 3 ranks shard the embedded model's attention heads (9 heads, 3 KV heads), check each rank's local
  heads against the config's per-head q fingerprints, and run the sparse prefill with the rank views;
  wrong mappings are caught.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.search.distributed import _layers_of, q_fingerprint

pytestmark = pytest.mark.xdist_group(name="distributed")  # the torchrun jobs use both cores: run them in one worker

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = [{"pattern": "ashape", "params": {"sink": 16, "window": 64}},
              {"pattern": "vs", "params": {"vertical": 30, "slash": 64}},
              {"pattern": "block", "params": {"topk": 2}}, {"pattern": "dense", "params": {}}]
SEARCH = ["search", "--lengths", "256", "--tasks", "passkey,code", "--seed", "3", "--holdout", "",
          "--threads", "1", "--no-progress"]
VARIES = ("created", "hardware", "search_seconds", "search_cpu_seconds", "distributed")


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """(single-process config, 2-rank config) as parsed JSON, plus the paths."""
    from workbench.cli import main

    tmp = tmp_path_factory.mktemp("dist")
    cands = tmp / "candidates.json"
    cands.write_text(json.dumps(CANDIDATES))
    before = torch.get_num_threads()
    try:
        assert main([*SEARCH, "--candidates", str(cands), "--out", str(tmp / "single.json")]) == 0
    finally:
        torch.set_num_threads(before)
    torchrun(2, "-m", "workbench", *SEARCH, "--distributed", "--candidates", str(cands), "--out", str(tmp / "dist.json"))
    return tmp / "single.json", tmp / "dist.json"


def test_two_ranks_write_the_single_process_config(configs):
    single, dist = (json.loads(p.read_text()) for p in configs)
    ranks = dist["provenance"]["distributed"]
    assert ranks["world_size"] == 2 and ranks["backend"] == "gloo"
    assert [r["rank"] for r in ranks["ranks"]] == [0, 1]
    assert sum(r["items"] for r in ranks["ranks"]) == 2 * single["model"]["n_layers"]  # every (sample, layer) once
    assert "distributed" not in single["provenance"]
    for d in (single, dist):
        for key in VARIES:
            d["provenance"].pop(key, None)
    assert json.dumps(dist, sort_keys=True) == json.dumps(single, sort_keys=True)
    # the choice is not trivial: several patterns and the recorded fingerprints are there
    patterns = {h["pattern"] for h in single["heads"]}
    assert len(patterns) >= 3, patterns
    assert all(len(h["evidence"]["q_fingerprint"]) == 4 for h in single["heads"])


def test_tensor_parallel_ranks_catch_a_wrong_head_mapping(configs, tmp_path):
    torchrun(3, "tests/model/distributed_tp_worker.py", str(configs[0]), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["heads"] for r in ranks] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    for r in ranks:
        # the right view passes (fp32 split matmuls), and the sharded sparse prefill is the whole model's
        assert r["worst_deviation"] < 1e-3
        assert r["logits_max_abs_diff"] < 1e-3
        errors = r["errors"]
        assert "view of rank" in errors["other_rank_view"] and f"rank {r['rank']} of 3" in errors["other_rank_view"]
        assert "no provenance.tensor_parallel" in errors["full_config"]
        assert "wrong tensor-parallel head mapping" in errors["strided"]  # local head h read global h*3 + r
    # local head h read global head h: right on rank 0 only
    assert ranks[0]["errors"]["no_offset"] is None
    assert all("wrong tensor-parallel head mapping" in r["errors"]["no_offset"] for r in ranks[1:])


def test_shards_cover_every_item_once():
    for world in (1, 2, 3, 7):
        seen = sorted((s, l) for r in range(world) for s in range(3) for l in _layers_of(s, 30, r, world))
        assert seen == [(s, l) for s in range(3) for l in range(30)]


def test_q_fingerprint_ignores_rope_rotation():
    """Rotating each (i, i + D/2) pair by any angle (what RoPE does) leaves the fingerprint unchanged."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 50, 64, generator=g, dtype=torch.float64)
    angle = torch.rand(50, 32, generator=g, dtype=torch.float64) * 6.28
    x1, x2 = q[..., :32], q[..., 32:]
    rotated = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)
    torch.testing.assert_close(q_fingerprint(rotated), q_fingerprint(q))
    assert not torch.allclose(q_fingerprint(q * 1.1), q_fingerprint(q))


def test_distributed_flag_without_torchrun_names_the_fix(monkeypatch, capsys):
    from workbench.cli import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        assert main([*SEARCH, "--distributed", "--out", "unused.json"]) == 2
    finally:
        torch.set_num_threads(before)
    assert "torchrun --nproc_per_node" in capsys.readouterr().err
