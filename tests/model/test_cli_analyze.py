"""`workbench analyze` end to end on the embedded model (small length, few layers)."""
import json
import subprocess
import sys

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
