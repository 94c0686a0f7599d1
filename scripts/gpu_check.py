"""The GPU lane (`make gpu-check` on the GPU machine): the kernel tests (bf16 on CUDA), every other
`gpu`-marked test, and the notebooks on the GPU, as three pytest runs ("lanes") within one time budget, in two
chains side by side: the kernels lane (8 pytest processes, so that its cold Triton compiles, CPU-bound, overlap on
the GPU machine's 16 cores), and beside it the lanes that load the model (notebooks, then gpu: one process each).
Writes one JSON (default assets/benchmarks/gpu_check.json) with the GPU, driver, versions, the exact
commands, pass/fail per test, the quality / latency / parity figures the tests measured and `green`; the
JSON is rewritten as each lane ends, so a lane that runs out of time still leaves the others.

--budget S (less one grace period) is each chain's: inside a chain it is split across the lanes in proportion to
their estimated times, and time a lane leaves unused goes to the lanes after it. (One chain of all three, as before
2026-12-05, left the model lanes 1.3-1.45x slower hosts no margin: 9acea96's gpu lane ran 195 s against its 182 s
share.) Inside a lane every test has a time limit
(`scripts/lane_plugin.py`): one hang fails that test and the lane goes on; a lane past its share + grace is
killed and its running test is reported as stopped. Green: every lane ran to its end, no test failed, and
every `gpu`-marked test passed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRACE_S = 20  # a lane may overrun its share by this much (teardown, JSON) before its process group is killed
# Tests that may spend minutes in a cold compile run last in their lane (flex_attention: >90 s per case on the
# H200 in the last session's lane); the lane's other tests are reported whatever these do.
RUN_LAST = ("test_compiled_flex_backend_equals_triton",)
# sm_90 compiles without a GPU (CPU-bound, minutes of ptxas): CI runs them; on the GPU machine of 2026-12-02
# they held three of the four kernel shards past the lane's share, so the lane leaves them out; the Gluon
# kernel's compile cases likewise (their fixture compiles every case in one process: it was the test stopped by
# the lane's deadline at c32b77d, 2026-12-03), and the row-block pair module's compiles (its GPU tests run here)
COMPILE_ONLY = "tests/kernels/test_kernels_compile.py"
COMPILE_ONLY_TESTS = ("not test_ws_prefill_compiles_for_sm90 and not test_pair_kernel_compiles_for_sm90"
                      " and not test_pair_union_merge_compiles_without_spills")
# The lane record whose per-test seconds deal a lane's tests to its shards (`lane_plugin.deal`): the latest run whose
# kernels lane reached every test (668c34a, green on a cold Triton cache; update it with each run).
SHARD_TIMES = ROOT / "assets/benchmarks/gpu_check_668c34a_h100.json"


def gpu_test_files(notebook: bool) -> list[str]:
    """Test files outside tests/kernels that carry the gpu marker (notebook ones or the others)."""
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "tests/kernels" in path.as_posix() or "mark.gpu" not in text:
            continue
        if ("mark.notebook" in text) == notebook:
            files.append(str(path.relative_to(ROOT)))
    return files


def lanes() -> dict[str, dict[str, object]]:
    """name -> {"args": pytest arguments, "estimate_s": expected seconds on a fresh H200 machine (cold Triton
    and Inductor caches), "test_timeout_s", "shards": parallel pytest processes}. Estimates (DEVELOPERS.md
    lists them per test) from the fresh-machine runs of 2026-12-01 (notebooks 87 / 118 s, gpu 121 / 148 s,
    kernels 179 s for 135 tests in 4 shards), the warm-cache green run of 2026-12-02 (notebooks 93 s, gpu 170 s,
    kernels 244 s in 4 shards) and the cold green runs after it (empty Triton and Inductor caches: notebooks 92 /
    112 s, gpu 162 / 134 s, kernels 142 / 157 s for 202 / 207 tests in 8 shards, 396 / 402 s in all; the second
    is assets/benchmarks/gpu_check.json); cd65d7b: notebooks 127, gpu 122, kernels 182 s (431 s); the kernels lane
    with the Gluon kernel's tests alone, 1c3a160: 191 s; 2b7f4b7, green: notebooks 138, gpu 159, kernels 171 s,
    so notebooks 115 -> 140 s: their last three cold runs took 127-138 s against a share of 125 + 20 s grace)."""
    return {
        "kernels": {"args": ["tests/kernels", f"--ignore={COMPILE_ONLY}", "-k", COMPILE_ONLY_TESTS], "estimate_s": 190,
                    "test_timeout_s": 180,
                    "shards": 8},
        "gpu": {"args": ["-m", "gpu and not notebook", *gpu_test_files(notebook=False)], "estimate_s": 175,
                "test_timeout_s": 150},
        "notebooks": {"args": ["-m", "gpu and notebook", *gpu_test_files(notebook=True)], "estimate_s": 140,
                      "test_timeout_s": 240},
    }


def read_results(path: Path) -> list[dict[str, object]]:
    """The lane's tests in run order, the last line of each (a test left at "started" was stopped)."""
    rows: dict[str, dict[str, object]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["test"]] = row
    for row in rows.values():
        if row["outcome"] == "started":
            row.update(outcome="stopped", message="the lane was killed while this test ran (lane budget)")
    return list(rows.values())


def run_lane(name: str, lane: dict[str, object], share: float, tmp: Path, env: dict[str, str]) -> dict[str, object]:
    """Run one lane within `share` seconds (+ grace) as `shards` pytest processes side by side (each its own
    process group and slice of the tests, `--shard I/K`: their Triton compiles overlap); its summary."""
    timeout = min(float(lane["test_timeout_s"]), share)
    shards = int(lane.get("shards", 1))
    deadline = time.time() + share
    cmds, procs = [], []
    for i in range(shards):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "lane_plugin",
               "--continue-on-collection-errors", f"--test-timeout={timeout:.0f}", f"--lane-deadline={deadline:.0f}",
               f"--results-jsonl={tmp / f'{name}.{i}.jsonl'}", *(f"--run-last={x}" for x in RUN_LAST),
               *([f"--shard={i}/{shards}", f"--shard-times={SHARD_TIMES}"] if shards > 1 else []), *lane["args"]]
        cmds.append(cmd)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True) for cmd in cmds]
    codes: list[int | str] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(share + GRACE_S - (time.perf_counter() - t0), 1.0)))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            codes.append(f"killed after {share + GRACE_S:.0f} s")
    tests = [t for i in range(shards) for t in read_results(tmp / f"{name}.{i}.jsonl")]
    # pytest exits 5 when a shard collected no test (all deselected): not a failure
    rc: int | str = next((c for c in codes if c not in (0, 5)), 0)
    counts = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped", "stopped")}
    gpu_not_passed = [t["test"] for t in tests if t.get("gpu") and t["outcome"] != "passed"]
    ok = rc == 0 and not (counts["failed"] or counts["error"] or counts["stopped"] or gpu_not_passed)
    return {"command": " ; ".join("python3 -m pytest " + " ".join(cmd[3:]) for cmd in cmds), "returncode": rc,
            "shard_returncodes": codes, "ok": ok, "share_s": round(share), "test_timeout_s": round(timeout),
            "estimate_s": lane["estimate_s"], "seconds": round(time.perf_counter() - t0, 1), **counts,
            "gpu_tests_not_passed": gpu_not_passed, "tests": tests}


def main() -> int:
    every = lanes()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="reports/benchmarks/gpu_check.json", help="where the JSON goes")
    p.add_argument("--lanes", default=",".join(every), help=f"comma-separated subset of {list(every)}")
    p.add_argument("--budget", type=float, default=540,
                   help="seconds for each chain of lanes (kernels; notebooks then gpu), split by their estimates "
                        "(default 540: with the wheel install before it, one device call of <= 10 minutes)")
    args = p.parse_args()
    chosen = [x for x in args.lanes.split(",") if x]
    unknown = [x for x in chosen if x not in every]
    if unknown:
        p.error(f"--lanes: unknown lane(s) {unknown}: choose from {list(every)}")
    if args.budget <= 0:
        p.error(f"--budget {args.budget} must be > 0 seconds")
    chosen.sort(key=lambda x: every[x]["estimate_s"])  # shortest first

    from workbench.core.io import write_json
    from workbench.core.timing import environment

    tmp = Path(tempfile.mkdtemp(prefix="gpu_check."))
    figures = tmp / "figures"
    figures.mkdir()
    # One Inductor compile thread: no worker pool to start cold for the lane's few small compiles.
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", **os.environ, "WORKBENCH_GPU_FIGURES": str(figures),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = "python3 scripts/gpu_check.py " + " ".join(sys.argv[1:])
    result: dict[str, object] = {"command": command, "budget_s": args.budget,
                                 "environment": environment(command), "lanes": {}, "figures": {}, "green": False}
    start = time.perf_counter()
    lock = threading.Lock()

    def chain(names: list[str]) -> None:
        """Run `names` one after another within the budget, recording each lane as it ends."""
        for i, name in enumerate(names):
            left = args.budget - GRACE_S - (time.perf_counter() - start)  # the grace of a killed lane fits too
            pending = sum(every[x]["estimate_s"] for x in names[i:])
            share = max(left * every[name]["estimate_s"] / pending, 5.0)
            lane = run_lane(name, every[name], share, tmp, env)
            with lock:
                result["lanes"][name] = lane
                result["figures"] = {f.stem: json.loads(f.read_text()) for f in sorted(figures.glob("*.json"))}
                result["seconds"] = round(time.perf_counter() - start, 1)
                result["green"] = len(result["lanes"]) == len(every) and all(v["ok"] for v in result["lanes"].values())
                write_json(args.out, result)

    chains = [[x for x in chosen if x == "kernels"], [x for x in chosen if x != "kernels"]]
    threads = [threading.Thread(target=chain, args=(names,)) for names in chains if names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"wrote {args.out} (green: {result['green']}): " + "; ".join(
        f"{k}: {v['passed']} passed, {v['failed'] + v['error']} failed, {v['stopped']} stopped, {v['skipped']} skipped"
        f" in {v['seconds']} s" for k, v in result["lanes"].items()))
    return 0 if result["green"] else 1


if __name__ == "__main__":
    sys.exit(main())
