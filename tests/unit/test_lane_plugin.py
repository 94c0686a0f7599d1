"""The GPU lane's shards (scripts/lane_plugin.py): dealt by recorded test seconds, every test in exactly one."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from lane_plugin import deal  # noqa: E402


def test_deal_puts_the_heavy_groups_apart_and_balances_the_rest():
    weights = {"slow_a": 75.0, "slow_b": 50.0, **{f"quick_{i}": 5.0 for i in range(10)}}
    shards = deal(weights, 3)
    assert set().union(*shards) == set(weights) and sum(map(len, shards)) == len(weights)
    assert not any({"slow_a", "slow_b"} <= s for s in shards)
    loads = [sum(weights[x] for x in s) for s in shards]
    assert max(loads) <= max(weights.values()) + 1e-9  # no shard above the heaviest single group here


def test_the_plugin_deals_by_the_recorded_seconds(tmp_path):
    tests = tmp_path / "test_cases.py"
    tests.write_text("import pytest\n\n"
                     "@pytest.mark.parametrize('i', range(4))\ndef test_many(i):\n    pass\n\n"
                     "def test_heavy():\n    pass\n\ndef test_light():\n    pass\n")
    record = {"lanes": {"kernels": {"tests": [
        {"test": "test_cases.py::test_heavy", "seconds": 100.0},
        *({"test": f"test_cases.py::test_many[{i}]", "seconds": 1.0} for i in range(4)),
        {"test": "test_cases.py::test_light", "seconds": 1.0}]}}}
    times = tmp_path / "record.json"
    times.write_text(json.dumps(record))
    ran = []
    for i in range(2):
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "lane_plugin",
                              f"--shard={i}/2", f"--shard-times={times}", "--collect-only", str(tests)],
                             cwd=tmp_path, capture_output=True, text=True,
                             env={"PYTHONPATH": str(ROOT / "scripts"), "PATH": "/usr/bin:/bin"})
        ran.append({line.split("::")[1] for line in out.stdout.splitlines() if "::" in line})
    assert ran[0] | ran[1] == {"test_heavy", "test_light", *(f"test_many[{i}]" for i in range(4))}
    assert not ran[0] & ran[1]
    heavy = 0 if "test_heavy" in ran[0] else 1
    # by case count test_many (4 cases) would be alone; by seconds test_heavy is, the rest share the other shard
    assert ran[heavy] == {"test_heavy"}
