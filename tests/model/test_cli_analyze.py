"""`workbench analyze` end to end on the embedded model (small length, few layers)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model


def test_analyze_writes_report(tmp_path):
    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, "-m", "workbench", "analyze", "--length", "256", "--layers", "0,14,29",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layers"] == [0, 14, 29] and len(summary["heads"]) == 27
    assert summary["sample"]["length"] == 256
    for h in summary["heads"]:
        assert 0 <= h["sink"] <= 1.0001 and 0 <= h["local"] <= 1.0001
    assert "<html" in (out / "index.html").read_text()[:200]


def test_analyze_reports_bad_length_clearly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "workbench", "analyze", "--length", "9000", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--length 9000 exceeds" in r.stderr and "at most 8192" in r.stderr


def test_a_failed_config_leaves_the_report_as_it_was(tmp_path):
    """The bad config is read before the long work and the report is written only after every step: an
    earlier report keeps its summary.json and index.html byte for byte."""
    from workbench.cli import main

    out = tmp_path / "rep"
    assert main(["analyze", "--length", "256", "--layers", "0", "--no-fits", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "other_model.json"
    data = json.loads((Path(__file__).resolve().parents[2] / "workbench/data/configs/SmolLM2-135M-Instruct.json").read_text())
    data["model"]["n_layers"] = 29
    data["heads"] = data["heads"][:29 * 9]
    bad.write_text(json.dumps(data))
    assert main(["analyze", "--length", "256", "--layers", "0", "--config", str(bad), "--out", str(out)]) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
