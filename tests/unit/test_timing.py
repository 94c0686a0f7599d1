"""workbench.core.timing: repetition rules, CPU stamps, the command line and the environment record."""
import collections
import types

import pytest
import torch

from workbench.core import timing


def counter():
    calls = []
    return calls, lambda: calls.append(1)


def test_measure_warms_up_then_repeats_within_bounds():
    calls, fn = counter()
    t = timing.measure(fn, cuda=False, warmup=2, min_reps=3, max_reps=5, budget_ms=0.0)
    assert len(t.times_ms) == 3 and len(calls) == 2 + 3  # no budget: exactly min_reps after the warm-up
    calls, fn = counter()
    t = timing.measure(fn, cuda=False, warmup=0, min_reps=2, max_reps=7, budget_ms=1e9)
    assert len(t.times_ms) == 7 and len(calls) == 7  # a huge budget: max_reps
    assert t.min_ms <= t.median_ms and all(x >= 0 for x in t.times_ms)
    assert t.to_dict()["reps"] == 7


def test_timing_median_and_min():
    t = timing.Timing([5.0, 1.0, 3.0, 9.0])
    assert t.median_ms == 4.0 and t.min_ms == 1.0


def test_measure_refuses_bad_repetitions():
    with pytest.raises(ValueError, match="min_reps"):
        timing.measure(lambda: None, cuda=False, min_reps=0)
    with pytest.raises(ValueError, match="max_reps"):
        timing.measure(lambda: None, cuda=False, min_reps=5, max_reps=2)


def test_queued_ms_sizes_the_run_from_one_call_and_divides_by_it():
    import time

    calls = []
    ms = timing.queued_ms(lambda: (calls.append(1), time.sleep(0.002)), cuda=False, min_reps=2, max_reps=6,
                          budget_ms=1e9)
    assert len(calls) == 2 + 6 and 2.0 <= ms < 50  # warm-up + max_reps, per call
    calls.clear()
    timing.queued_ms(lambda: (calls.append(1), time.sleep(0.002)), cuda=False, min_reps=4, max_reps=6, budget_ms=0)
    assert len(calls) == 2 + 4
    with pytest.raises(ValueError, match="min_reps"):
        timing.queued_ms(lambda: None, cuda=False, min_reps=0)


def test_paired_ms_interleaves_the_fns_in_a_balanced_sequence():
    import time

    order = []
    short = lambda: (order.append("a"), time.sleep(0.002))  # noqa: E731
    long = lambda: (order.append("b"), time.sleep(0.008))  # noqa: E731
    a_ms, b_ms = timing.paired_ms([short, long], cuda=False, rounds=3, batch_ms=100.0, max_reps=4)
    assert 2.0 <= a_ms < b_ms and b_ms >= 8.0  # per call, each its own
    # a warm-up and a sizing call each, an unrecorded batch of b (the sequence's last), then batches of a and b in
    # turn (100 ms / call, at most 4), 3 each
    assert "".join(order) == "aabb" + "bbbb" + "aaaabbbb" * 3
    calls = []
    fns = [lambda i=i: calls.append(i) for i in range(3)]
    timing.paired_ms(fns, cuda=False, rounds=5, batch_ms=0.0, max_reps=1)
    batches = calls[6:]  # after the warm-up and sizing calls: one unrecorded batch, then 6 of each fn
    assert len(batches) == 1 + 18 and all(batches[1:].count(i) == 6 for i in range(3))
    follows = collections.Counter(zip(batches, batches[1:]))  # each recorded batch after its predecessor
    assert set(follows) == {(a, b) for a in range(3) for b in range(3) if a != b}
    assert set(follows.values()) == {3}, follows  # fn 1 not mostly after fn 0
    with pytest.raises(ValueError, match="rounds"):
        timing.paired_ms([short], cuda=False, rounds=0)


@pytest.mark.parametrize("k", range(1, 8))
def test_balanced_sequence_puts_every_fn_after_every_other_once(k):
    seq = timing.balanced_sequence(k)
    assert len(seq) == max(k * (k - 1), 1) and all(seq.count(i) == max(k - 1, 1) for i in range(k))
    follows = collections.Counter(zip(seq, seq[1:] + seq[:1]))  # cyclic: the last before the first
    if k > 1:
        assert set(follows) == {(a, b) for a in range(k) for b in range(k) if a != b}
        assert set(follows.values()) == {1}, follows


def test_cpu_stamps_give_milliseconds():
    a = timing.stamp(False)
    b = timing.stamp(False)
    assert isinstance(a, float) and timing.elapsed_ms(a, b) >= 0
    assert timing.elapsed_ms(1.0, 1.5) == pytest.approx(500.0)


@pytest.mark.parametrize("spec,argv,expected", [
    (None, ["/venv/bin/workbench", "bench", "kernels", "--lengths", "1024,2048"],
     "workbench bench kernels --lengths 1024,2048"),
    ("workbench.__main__", ["/repo/workbench/__main__.py", "bench", "prefill", "--out", "a b.json"],
     "workbench bench prefill --out 'a b.json'"),
    ("workbench_benchmarks.decode", ["/repo/benchmarks/decode.py", "--out", "x.json"],
     "python -m workbench_benchmarks.decode --out x.json"),
    (None, ["scripts/render_assets.py", "--html"], "python scripts/render_assets.py --html"),
])
def test_command_line(monkeypatch, spec, argv, expected):
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=spec) if spec else None
    monkeypatch.setitem(__import__("sys").modules, "__main__", main)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert timing.command_line(argv) == expected


def test_command_line_under_torchrun(monkeypatch):
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="workbench.__main__")
    monkeypatch.setitem(__import__("sys").modules, "__main__", main)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    got = timing.command_line(["/repo/workbench/__main__.py", "bench", "search", "--random-llama"])
    assert got == "torchrun --nproc_per_node 2 -m workbench bench search --random-llama"


def test_environment_fields():
    env = timing.environment(command="workbench bench foundation")
    assert env["command"] == "workbench bench foundation"
    for key in ("gpu", "torch", "triton", "transformers", "python", "cpu", "cores", "torch_threads",
                "load_average_1_5_15", "commit"):
        assert key in env
    assert env["torch"] and env["python"] and len(env["load_average_1_5_15"]) == 3
    if env["gpu"] is not None:
        assert {"driver", "gpus", "gpu_memory_gib", "sms", "cuda"} <= set(env)


@pytest.mark.parametrize("name,tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"),
                                      ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"), ("", "cpu")])
def test_gpu_tag_names_the_model_for_file_names(name, tag):
    assert timing.gpu_tag(name) == tag
    assert timing.gpu_tag() == (timing.gpu_tag(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu")
