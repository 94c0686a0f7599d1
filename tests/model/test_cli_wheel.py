"""Every command runs from any folder after a wheel install: build the wheel, install it (no dependencies:
the test's own environment provides them) into a temporary folder, and run analyze, prefill quality,
compare and export at tiny sizes from another temporary folder, with neither the repository nor its
configs/ or assets/ in reach. Outputs land under that folder's reports/; the installed package is not
written to."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "workbench", "kernels", "benchmarks")


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own; returns that folder (the one to put on PYTHONPATH)."""
    src, wheels, site = (tmp_path_factory.mktemp(n) for n in ("src", "wheels", "site"))
    for name in SOURCES:  # build from a copy: the build writes build/ and *.egg-info beside the sources
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   timeout=300, capture_output=True)
    wheel = next(wheels.glob("*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300,
                   capture_output=True)
    return site


def run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "workbench", *argv], cwd=cwd, env={**env, "PYTHONPATH": str(site)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_commands_run_from_any_folder_after_a_wheel_install(installed, tmp_path):
    site, here = installed, tmp_path / "somewhere"
    here.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import workbench, workbench.data as d; print(workbench.__file__); "
                            "print(d.shipped_config('SmolLM2-135M-Instruct')); print(d.LATENCY_BENCH.is_file())"],
                           cwd=here, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(site)) and where[1].startswith(str(site)) and where[2] == "True"
    package = _files(site / "workbench")

    run(site, here, "analyze", "--length", "256", "--layers", "0-1", "--no-fits")
    summary = json.loads((here / "reports/analyze/summary.json").read_text())
    assert summary["layers"] == [0, 1] and summary["sample"]["length"] == 256

    run(site, here, "prefill", "quality", "--lengths", "256", "--samples", "1", "--cosine-samples", "0",
        "--sensitivity-samples", "0", "--max-new-tokens", "2", "--no-progress")  # the shipped config, by default
    quality = json.loads((here / "reports/prefill_quality.json").read_text())
    assert quality["config"]["provenance"]["command"].startswith("workbench search") and len(quality["records"]) == 1

    run(site, here, "compare", "--tasks", "code", "--lengths", "256", "--layers", "0", "--rows", "64", "--quality",
        "none", "--no-progress")
    methods = json.loads((here / "reports/methods.json").read_text())
    assert any(p["method"] == "searched config" for p in methods["points"]), {p["method"] for p in methods["points"]}

    shipped = where[1]
    run(site, here, "export", shipped, "--shape", "embedded", "--out", "mi.json")
    assert len(json.loads((here / "mi.json").read_text())) == 30

    assert _files(site / "workbench") == package  # nothing written into the installed package
    written = {p.relative_to(here).parts[0] for p in here.rglob("*") if p.is_file()}
    assert written == {"reports", "mi.json"}
