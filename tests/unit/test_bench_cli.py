"""`workbench bench`: every benchmark parses its --help; the prefill names say what they time; a tiny
CPU benchmark run writes JSON with the environment record."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.cli import build_parser
from workbench.cli.bench import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("what", sorted(BENCHMARKS))
def test_every_benchmark_help_parses(what, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", what, "--help"])
    assert e.value.code == 0
    assert "--out" in capsys.readouterr().out


def test_one_command_per_benchmark(capsys):
    assert {"analysis", "kernels", "prefill", "decode", "search", "dashboard", "notebooks", "foundation"} == set(BENCHMARKS)
    for argv in (["prefill", "bench"], ["search", "--bench-json", "x.json"]):  # the old spellings are gone
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 2
    capsys.readouterr()


def test_each_benchmark_module_runs_standalone():
    """`python -m workbench_benchmarks.MODULE --help` is the same parser."""
    for module, _ in BENCHMARKS.values():
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "--out" in out.stdout


def test_tiny_search_benchmark_writes_environment(tmp_path):
    """A one-rank gloo job searching a 1-layer tiny random Llama (seconds on the CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    out = tmp_path / "search.json"
    cmd = [sys.executable, "-m", "workbench", "bench", "search", "--random-llama", "--tiny", "--layers", "1",
           "--length", "256", "--samples", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    e = data["environment"]
    assert e["command"] == ("workbench bench search --random-llama --tiny --layers 1 --length 256 --samples 1 "
                            f"--out {out}")
    assert {"gpu", "torch", "triton", "transformers", "python", "cpu", "cores", "load_average_1_5_15"} <= set(e)
    assert data["world_size"] == 1 and data["model"]["n_layers"] == 1 and len(data["heads_sha256"]) == 64


def test_prefill_bench_configs_are_valid_and_run():
    """Each `bench prefill` config is a valid head config of a Llama-shaped model (whole KV groups for
    `vs_group`) and runs through `SparsePrefill`; at 512 tokens its budgets cover every key, so the logits
    equal dense attention's."""
    import torch
    from workbench_benchmarks.prefill_e2e import CONFIGS, _config
    from workbench_benchmarks.shapes import random_llama

    from workbench.prefill.sparse import SparsePrefill

    model, shape = random_llama(1, tiny=True, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(ids, logits_to_keep=1).logits
    for name, make in CONFIGS.items():
        config = _config(shape, make)
        config.check(name)
        with torch.no_grad(), SparsePrefill(model, shape, config, min_length=0) as sp:
            out = model(ids, logits_to_keep=1).logits
        assert sp.calls[("sparse", "prefill")] == 1, (name, dict(sp.calls))
        torch.testing.assert_close(out, dense, msg=name)


def test_kernel_bench_times_each_kind_on_its_route_in_turn_with_dense(tmp_path):
    """`workbench bench kernels` on the CPU (Triton interpreter, tiny length: the path, not the times): every
    kind's row names the route a model's prefill takes and its program, carries dense SDPA's
    median from the same rounds, and its ratio to dense is computed at that dense time; the dense row's time is
    the median of those."""
    import statistics

    out = tmp_path / "kernels.json"
    cmd = [sys.executable, "-m", "workbench", "bench", "kernels", "--device", "cpu", "--lengths", "128", "--shapes",
           "embedded", "--no-flex", "--blocks", "64", "--slash-small", "0", "--vertical", "8", "--slash", "32",
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    dense = next(r for r in rows if r["kernel"] == "dense_sdpa")
    kinds = {r["kernel"]: r for r in rows if r is not dense}
    assert {"vertical_slash", "vertical_slash_group_shared", "block_sparse", "a_shape", "a_shape_per_head",
            "mixed_layer_one_launch", "mixed_layer_per_kind"} == set(kinds)
    per_kind = kinds["mixed_layer_per_kind"]  # `SparsePrefill.kinds_attention`, the deployed route of that layer
    assert per_kind["route"] == "per kind" and per_kind["max_abs_diff_to_one_launch"] <= 1e-5
    assert per_kind["physical_density"] == kinds["mixed_layer_one_launch"]["physical_density"]
    single = {kind: r for kind, r in kinds.items() if r is not per_kind}
    for kind, r in single.items():  # A-shape's Gluon route where it takes the layer, else the tiles a model runs
        assert r["route"] == ("ashape_prefill" if kind.startswith("a_shape") and r["program"] != "loop"
                              else "sparse_prefill")
    assert {r["program"] for r in single.values()} == {"loop"}  # the Gluon kernel needs an sm_90 GPU
    for r in kinds.values():
        assert r["ratio_to_dense_tflops"] == pytest.approx(r["physical_density"] * r["paired_dense_ms"] / r["time_ms"])
    assert dense["time_ms"] == pytest.approx(statistics.median(r["paired_dense_ms"] for r in kinds.values()))
    assert dense["unpaired_ms"] > 0


def test_prefill_breakdown_times_a_second_forward_and_keeps_the_first_ones_density():
    """`bench prefill`'s per-layer breakdown comes from the second of two forwards on one `SparsePrefill`: the first
    records the density (host syncs per kind), the timed one records none, and the breakdown has a row per layer."""
    import torch
    from workbench_benchmarks.prefill_e2e import CONFIGS, _breakdown, _config
    from workbench_benchmarks.shapes import random_llama

    from workbench.prefill.sparse import SparsePrefill

    model, shape = random_llama(2, tiny=True, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), SparsePrefill(model, shape, _config(shape, CONFIGS["mixed_thirds"]), min_length=0,
                                        timing=True, record_density=True) as sp:
        layers = _breakdown(model, ids, sp)
    assert sp.calls[("sparse", "prefill")] == 2 * 2, dict(sp.calls)  # two forwards of two layers
    assert not sp.record_density and sorted(sp.density) == [0, 1]
    assert all(d > 0 for d in sp.density.values())  # tile area / causal pairs (diagonal tiles whole: > 1 at 256)
    assert len(layers) == 2 and all(r["sparse_ms"] > 0 and r["layer_ms"] >= r["sparse_ms"] for r in layers)


def test_prefill_bench_times_outside_the_layers_what_the_model_computes_without_them():
    """`bench prefill` extrapolates to 32 layers from the forward's total less `outside_layers`: that work must be
    the forward's own outside its decoder layers, so it equals the model's logits with the layers removed."""
    import torch
    from workbench_benchmarks.prefill_e2e import outside_layers
    from workbench_benchmarks.shapes import random_llama

    model, _ = random_llama(2, tiny=True, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = outside_layers(model, ids)
        with_layers = model(ids, use_cache=False, logits_to_keep=1).logits
        model.model.layers = torch.nn.ModuleList()
        without = model(ids, use_cache=False, logits_to_keep=1).logits
    assert ours.shape == without.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(ours, without)
    assert not torch.allclose(ours, with_layers)  # the layers' work is not in it
