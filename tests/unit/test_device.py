"""--device / --dtype / --device-map: one parser for every command; bad input names the fix; the dense
cache of the quality report is keyed by device and dtype."""
from __future__ import annotations

import pytest
import torch

from workbench.core.device import DeviceError, check_device_map, parse_dtype, resolve_device

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def test_dtype_names_and_refusal():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    assert parse_dtype(None) is torch.float32 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(DeviceError, match="float32 .*bfloat16"):
        parse_dtype("fp8")


def test_default_device_follows_the_machine():
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceError, match="use cpu, cuda"):
        resolve_device("tpu:0")


@no_gpu
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(DeviceError, match="--device cpu"):
        resolve_device("cuda")


def test_device_map_on_the_cpu_is_refused():
    with pytest.raises(DeviceError, match="leave --device-map out"):
        check_device_map("auto", torch.device("cpu"))
    assert check_device_map(None, torch.device("cpu")) is None


@no_gpu
@pytest.mark.parametrize("argv", [
    ["search", "--device", "cuda"],
    ["prefill", "quality", "--device", "cuda"],
    ["analyze", "--device", "cuda"],
    ["analyze", "--dtype", "int3"],
    ["search", "--device", "cpu", "--device-map", "auto"],
    ["forecast", "report", "--device", "cuda"],
    ["decode", "--device", "cuda"],
])
def test_every_model_command_refuses_bad_device_input_before_loading(argv, capsys):
    from workbench.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and ("--device" in err or "dtype" in err)


def test_dense_cache_is_keyed_by_device_and_dtype():
    from types import SimpleNamespace

    from workbench.prefill.quality import dense_cache_path

    shape = SimpleNamespace(fingerprint="0123456789abcdef")
    sample = SimpleNamespace(sha="s", length=8)
    fp32, bf16 = torch.nn.Embedding(4, 2), torch.nn.Embedding(4, 2).to(torch.bfloat16)
    a, b = (dense_cache_path(m, shape, sample, 8) for m in (fp32, bf16))
    assert a != b and "cpu-float32" in str(a) and "cpu-bfloat16" in str(b)
