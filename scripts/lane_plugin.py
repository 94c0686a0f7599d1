"""pytest plugin of the GPU lane (`scripts/gpu_check.py` loads it with `-p lane_plugin`): a time limit per
test, a deadline for the whole lane, and one JSON line per test as it starts and ends, so that a lane that
is stopped still reports every test it reached.

--test-timeout S: a test (setup, call and teardown) that runs longer than S seconds fails with its stack at
that moment (SIGALRM in the main thread: a hang inside a C call fails once that call returns to Python;
gpu_check kills the lane's process group as the last resort).
--lane-deadline T: epoch seconds; a test that would start after T is skipped ("lane budget spent") and
no test may run past it.
--results-jsonl F: append {"test", "outcome", "message", "seconds", "gpu"} per test (outcome "started"
when it begins; later lines replace earlier ones).
--run-last NAME (repeatable): tests whose id contains NAME run after all others (cold compiles: a slow one
then cannot starve the rest of the lane).
--shard I/K: run only shard I of K (0-based): the test functions are dealt to K shards (`deal`: the heaviest
function first, each to the lightest shard so far; cases of one function share their kernel compiles), so K
pytest processes of one lane compile and run side by side.
--shard-times F: a lane record (`gpu_check.py`'s JSON) whose per-test seconds weigh the functions (a case it
lacks weighs its median); without it every case weighs 1. At 45fc3b0 the kernels lane's 8 shards dealt by case
count would take 32-216 s by that run's test times, dealt by them ~118 s each.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

PHASE_ORDER = ("failed", "error", "skipped", "passed")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lane", "GPU lane (scripts/gpu_check.py)")
    group.addoption("--test-timeout", type=float, default=0.0, help="seconds per test before it fails (0: none)")
    group.addoption("--lane-deadline", type=float, default=0.0, help="epoch seconds after which no test starts")
    group.addoption("--results-jsonl", default=None, help="append one JSON line per test start and end")
    group.addoption("--run-last", action="append", default=[], help="run tests whose id contains this last")
    group.addoption("--shard", default=None, help="I/K: run only shard I (0-based) of K")
    group.addoption("--shard-times", default=None, help="a gpu_check JSON whose test seconds weigh the shards")


def deal(weights: dict[str, float], count: int) -> list[set[str]]:
    """Groups (name -> weight) dealt to `count` shards: the heaviest first (collection order on ties), each to
    the shard with the least weight so far (the lowest index on ties) -> the names per shard."""
    load = [0.0] * count
    shards: list[set[str]] = [set() for _ in range(count)]
    for name in sorted(weights, key=lambda name: -weights[name]):  # stable
        target = load.index(min(load))
        load[target] += weights[name]
        shards[target].add(name)
    return shards


def recorded_seconds(path: str | None) -> dict[str, float]:
    """Per-test seconds of a gpu_check record (every lane), {} without one."""
    if not path:
        return {}
    lanes = json.loads(Path(path).read_text())["lanes"].values()
    return {t["test"]: float(t["seconds"]) for lane in lanes for t in lane.get("tests", []) if t.get("seconds")}


class Lane:
    def __init__(self, config: pytest.Config):
        self.timeout = config.getoption("--test-timeout")
        self.deadline = config.getoption("--lane-deadline")
        path = config.getoption("--results-jsonl")
        self.path = Path(path) if path else None
        self.last = config.getoption("--run-last")
        self.config = config
        shard = config.getoption("--shard")
        self.shard = tuple(int(x) for x in shard.split("/")) if shard else None
        self.seconds = recorded_seconds(config.getoption("--shard-times"))
        self.outcome: dict[str, tuple[str, str]] = {}
        self.started: dict[str, float] = {}

    def write(self, row: dict[str, object]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def limit(self) -> float:
        """Seconds the next test may run: the per-test timeout, cut to the lane deadline (0: unlimited)."""
        limits = [self.timeout] if self.timeout > 0 else []
        if self.deadline > 0:
            limits.append(max(self.deadline - time.time(), 1.0))
        return min(limits) if limits else 0.0

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self.shard is not None:
            index, count = self.shard
            group = lambda item: f"{item.path}::{getattr(item, 'originalname', item.name)}"  # noqa: E731
            groups: dict[str, list[pytest.Item]] = {}
            for item in items:
                groups.setdefault(group(item), []).append(item)
            known = sorted(self.seconds.values())
            fallback = known[len(known) // 2] if known else 1.0
            mine = deal({key: sum(self.seconds.get(item.nodeid, fallback) for item in group_items)
                         for key, group_items in groups.items()}, count)[index]
            self.config.hook.pytest_deselected(items=[item for item in items if group(item) not in mine])
            items[:] = [item for item in items if group(item) in mine]
        items.sort(key=lambda item: any(name in item.nodeid for name in self.last))  # stable: order kept otherwise

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        gpu = item.get_closest_marker("gpu") is not None
        self.started[item.nodeid] = time.perf_counter()
        self.write({"test": item.nodeid, "outcome": "started", "message": "", "seconds": 0.0, "gpu": gpu})
        if self.deadline > 0 and time.time() > self.deadline:
            item.add_marker(pytest.mark.skip(reason="lane budget spent before this test started"))
        limit = self.limit()

        def expired(_signum, _frame):
            pytest.fail(f"timed out after {limit:.0f} s (lane test timeout or budget)", pytrace=True)

        previous = signal.signal(signal.SIGALRM, expired) if limit else None
        if limit:
            signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            yield
        finally:
            if limit:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        outcome, message = self.outcome.pop(item.nodeid, ("passed", ""))
        self.write({"test": item.nodeid, "outcome": outcome, "message": message, "gpu": gpu,
                    "seconds": round(time.perf_counter() - self.started.pop(item.nodeid), 2)})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """The test's outcome is the worst of its phases (a failing setup or teardown is an error)."""
        if report.passed:
            return
        if report.skipped:
            outcome = "skipped"
            longrepr = report.longrepr
            message = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        else:
            outcome = "failed" if report.when == "call" else "error"
            message = report.longreprtext.strip().splitlines()[-1] if report.longreprtext.strip() else ""
            crash = getattr(report.longrepr, "reprcrash", None)
            message = getattr(crash, "message", None) or message
        old = self.outcome.get(report.nodeid)
        if old is None or PHASE_ORDER.index(outcome) < PHASE_ORDER.index(old[0]):
            self.outcome[report.nodeid] = (outcome, str(message)[:400])


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Lane(config), "lane")
