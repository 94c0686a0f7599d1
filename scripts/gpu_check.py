"""The GPU lane (`make gpu-check` on the GPU machine): run every `gpu`-marked test plus the kernel tests (bf16
on CUDA), then write one JSON with the GPU, driver, versions, the exact commands, pass/fail per test and
the quality and latency figures the lane measured (default assets/benchmarks/gpu_check.json)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Shortest first; each lane rewrites the JSON when it ends, so a lane that runs out of time still leaves the others.
LANES = {"gpu": ["-m", "gpu and not notebook", "tests"], "kernels": ["tests/kernels"],
         "notebooks": ["-m", "gpu and notebook", "tests"]}


def junit_results(path: Path) -> list[dict[str, str]]:
    """[{test, outcome, message}] from a pytest JUnit XML file (outcome: passed, failed, error, skipped)."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "")[:300]
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "message": message,
                     "seconds": round(float(case.get("time", 0)), 2)})
    return rows


def environment() -> dict[str, object]:
    import torch
    import transformers
    import triton

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip() if torch.cuda.is_available() else None
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "driver": driver,
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "host": platform.node()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="assets/benchmarks/gpu_check.json", help="where the JSON goes")
    p.add_argument("--lanes", default=",".join(LANES), help=f"comma-separated subset of {list(LANES)}")
    p.add_argument("--lane-timeout", type=float, default=400, help="seconds per lane before it is stopped (default 400)")
    args = p.parse_args()
    from workbench.core.io import write_json

    tmp = Path(tempfile.mkdtemp(prefix="gpu_check."))
    env = {**os.environ, "WORKBENCH_GPU_LATENCY_JSON": str(tmp / "latency.json"),
           "WORKBENCH_GPU_QUALITY_JSON": str(tmp / "quality.json")}
    result: dict[str, object] = {"command": "make gpu-check (python3 scripts/gpu_check.py " + " ".join(sys.argv[1:]) + ")",
                                 "environment": environment(), "lanes": {}}
    ok = True
    for lane in [x for x in args.lanes.split(",") if x]:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
               f"--junitxml={tmp / lane}.xml", *LANES[lane]]
        t0 = time.perf_counter()
        try:
            rc: int | str = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.lane_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"stopped after {args.lane_timeout:.0f} s"
        tests = junit_results(tmp / f"{lane}.xml") if (tmp / f"{lane}.xml").exists() else []
        counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
        result["lanes"][lane] = {"command": "python3 -m pytest " + " ".join(cmd[3:]), "returncode": rc,
                                 "seconds": round(time.perf_counter() - t0, 1), **counts, "tests": tests}
        ok &= rc == 0
        for name in ("latency", "quality"):
            f = tmp / f"{name}.json"
            result[name] = json.loads(f.read_text()) if f.exists() else None
        result["green"] = ok
        write_json(args.out, result)
    print(f"wrote {args.out}: " + ", ".join(f"{k}: {v['passed']} passed, {v['failed'] + v['error']} failed, "
                                            f"{v['skipped']} skipped" for k, v in result["lanes"].items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
