"""The one way this project times code and records where it ran.

- `measure(fn)` / `time_ms(fn)`: fn() repeated after a warm-up, median (and min) in milliseconds; CUDA
  events around each call on a GPU, `time.perf_counter` on the CPU; at least `min_reps` calls, more
  while the total stays under `budget_ms`, at most `max_reps`.
- `queued_ms(fn)`: the time per call of fn() called back to back with one sync at the end: the GPU's time where
  the host keeps ahead of it (as between a model's layers); `time_ms` also counts the host's launch overhead,
  since the GPU idles at the start of each call.
- `paired_ms(fns)`: each fn's time per call over rounds that time every fn in turn, so that the fns compared see
  the same clock and power state (a ratio of two times taken minutes apart drifts by several per cent on a GPU),
  each fn after every other one equally often (`balanced_sequence`).
- `stamp(cuda)` / `elapsed_ms(a, b)`: marks for per-phase breakdowns (a CUDA event recorded on the
  current stream, no host sync until read; a perf_counter reading on the CPU).
- `environment()`: GPU, driver, versions, CPU, load and the exact command line, for benchmark JSON.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Stamp = Any  # torch.cuda.Event (recorded) or float seconds


def stamp(cuda: bool) -> Stamp:
    """Now: a CUDA event recorded on the current stream (`cuda`), else perf_counter seconds."""
    if cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def elapsed_ms(a: Stamp, b: Stamp) -> float:
    """Milliseconds from stamp `a` to stamp `b` (waits for b's event on a GPU)."""
    if isinstance(a, float):
        return (b - a) * 1e3
    b.synchronize()
    return a.elapsed_time(b)


@dataclass(frozen=True)
class Timing:
    """Times of the timed calls, in ms, in call order."""

    times_ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    def to_dict(self) -> dict[str, float]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "reps": len(self.times_ms)}


def measure(fn: Callable[[], Any], *, cuda: bool | None = None, warmup: int = 1, min_reps: int = 3,
            max_reps: int = 20, budget_ms: float = 300.0) -> Timing:
    """Call fn() `warmup` times (compiles, caches), then time it: `min_reps` calls, more while the sum
    is under `budget_ms`, at most `max_reps`. `cuda` (default: a GPU is present) times each call with
    CUDA events on the current stream, otherwise with perf_counter."""
    if not 1 <= min_reps <= max_reps:
        raise ValueError(f"need 1 <= min_reps <= max_reps, got min_reps={min_reps}, max_reps={max_reps}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < min_reps or (len(times) < max_reps and sum(times) < budget_ms):
        a = stamp(cuda)
        fn()
        times.append(elapsed_ms(a, stamp(cuda)))
    return Timing(times)


def time_ms(fn: Callable[[], Any], **kwargs: Any) -> float:
    """Median ms of fn() (see `measure` for the keyword arguments)."""
    return measure(fn, **kwargs).median_ms


def queued_ms(fn: Callable[[], Any], *, cuda: bool | None = None, min_reps: int = 3, max_reps: int = 50,
              budget_ms: float = 300.0) -> float:
    """Mean ms per call of fn() queued back to back: a warm-up call, then one timed call (synced) sizes the run
    to about `budget_ms` (`min_reps`..`max_reps` calls), then a stamp before the first call and after the last,
    one sync.
    On the CPU (`cuda` False) the same loop under perf_counter."""
    if not 1 <= min_reps <= max_reps:
        raise ValueError(f"need 1 <= min_reps <= max_reps, got min_reps={min_reps}, max_reps={max_reps}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    one = measure(fn, cuda=cuda, warmup=1, min_reps=1, max_reps=1).median_ms
    return _batch_ms(fn, int(min(max(budget_ms // max(one, 1e-3), min_reps), max_reps)), cuda)


def _batch_ms(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    """ms per call of `reps` calls of fn() queued back to back between two stamps."""
    a = stamp(cuda)
    for _ in range(reps):
        fn()
    return elapsed_ms(a, stamp(cuda)) / reps


def balanced_sequence(k: int) -> list[int]:
    """A cyclic order of fns 0..k-1, k (k - 1) entries (one for k = 1), in which every fn directly follows every other
    one exactly once, the last entry before the first included (an Euler circuit of the complete directed graph, by
    Hierholzer's walk); each fn appears k - 1 times."""
    if k == 1:
        return [0]
    left = {a: [b for b in range(k) if b != a] for a in range(k)}  # the transitions a -> b not yet walked
    stack, circuit = [0], []
    while stack:
        if left[stack[-1]]:
            stack.append(left[stack[-1]].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1][:-1]  # the walk ends where it started: drop the repeat


def paired_ms(fns: list[Callable[[], Any]], *, cuda: bool | None = None, rounds: int = 5,
              batch_ms: float = 50.0, max_reps: int = 20) -> list[float]:
    """Median of each fn's ms per call over `rounds` or more batches, the fns interleaved: a batch of calls queued
    back to back (as `queued_ms`; reps sized from one synced call to about `batch_ms`, 1..`max_reps`) in the order of
    `balanced_sequence(len(fns))`, repeated until each fn has `rounds` batches (k - 1 a pass: 6 for 3 fns at the
    default), after one unrecorded batch of its last fn, so that every recorded batch follows every other fn equally
    often. A kernel timed right after dense SDPA runs at the clock dense's power left (H200, 128K: 7-21 % slower,
    kernels/NOTES.md session 22); with rounds that only started one fn later each time, the fn listed after dense
    took that slot in most of them (H100, Llama 64K / 128K: a kernel 2-8 % slower than the same kernel listed later,
    session 38)."""
    if rounds < 1 or max_reps < 1:
        raise ValueError(f"need rounds >= 1 and max_reps >= 1, got rounds={rounds}, max_reps={max_reps}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    one = [measure(fn, cuda=cuda, warmup=1, min_reps=1, max_reps=1).median_ms for fn in fns]
    reps = [int(min(max(batch_ms // max(ms, 1e-3), 1), max_reps)) for ms in one]
    times: list[list[float]] = [[] for _ in fns]
    sequence = balanced_sequence(len(fns))
    _batch_ms(fns[sequence[-1]], reps[sequence[-1]], cuda)  # the first recorded batch follows it, as in every pass
    for _ in range(-(-rounds // max(len(fns) - 1, 1))):
        for j in sequence:
            times[j].append(_batch_ms(fns[j], reps[j], cuda))
    return [statistics.median(t) for t in times]


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process, as a user would type it: `workbench ...` for the CLI (also
    when run as `python -m workbench`), `python -m MODULE ...` for other modules, `python SCRIPT ...`,
    prefixed by `torchrun --nproc_per_node N` inside a torchrun job."""
    argv = sys.argv if argv is None else argv
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = os.path.basename(argv[0]) if argv else ""
    if name == "workbench" or (spec is not None and spec.name == "workbench.__main__"):
        prog = ["workbench"]
    elif spec is not None and spec.name:
        prog = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        prog = ["python", argv[0]] if argv else ["python"]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        prog = ["torchrun", "--nproc_per_node", os.environ.get("LOCAL_WORLD_SIZE", "?"), "-m",
                "workbench" if prog == ["workbench"] else prog[-1]]
    return shlex.join(prog + list(argv[1:]))


def nvidia_smi(field: str) -> str | None:
    """One `nvidia-smi --query-gpu` field of the first GPU (e.g. driver_version), or None without it."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0].strip() if out else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The checkout's commit; $WORKBENCH_COMMIT where a copy of the tree runs whose .git says otherwise (the GPU machine)."""
    if os.environ.get("WORKBENCH_COMMIT"):
        return os.environ["WORKBENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def gpu_tag(name: str | None = None) -> str:
    """A short name of a GPU for file names (`name`: a CUDA device name; None: this machine's first GPU): its model
    ("NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100"), else the whole name in lower case with
    other characters as '-'; "cpu" without a GPU."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if not name:
        return "cpu"
    low = name.lower()
    model = re.search(r"\b[a-z]+\d+[a-z]*\b", low)  # letters then digits: h100, a100, l40s, t4
    return model.group() if model else re.sub(r"[^a-z0-9]+", "-", low).strip("-")


def environment(command: str | None = None) -> dict[str, Any]:
    """Where and how a measurement ran: GPU (name, count, memory, SMs, driver, CUDA), torch / triton /
    transformers versions, python, CPU, cores, torch threads, load average (what else ran), git commit,
    and the exact command line (`command` overrides it)."""
    env: dict[str, Any] = {"command": command or command_line()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                   driver=nvidia_smi("driver_version"), cuda=torch.version.cuda)
    else:
        env["gpu"] = None
    env.update(torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
               python=platform.python_version(), cpu=platform.processor() or platform.machine(),
               cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
               load_average_1_5_15=[round(x, 2) for x in os.getloadavg()], commit=_commit())
    return env
