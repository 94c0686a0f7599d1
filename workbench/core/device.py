"""Where and in which dtype the model runs: one parser for every command and library entry point.

`resolve_device(None)` is cuda when a GPU is visible, else cpu; `parse_dtype("bf16")` is torch.bfloat16;
`check_device_map` accepts accelerate's layer placement ("auto", "balanced", ... or a dict) only with a GPU.
Every refusal names the fix.
"""
from __future__ import annotations

from typing import Any

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


class DeviceError(ValueError):
    """A device, dtype or device map that cannot be used here; the message names the fix."""


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None or "auto" -> cuda when a GPU is visible, else cpu; "cuda" without a GPU is refused."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeviceError(f"device {device!r} is unknown: use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device!r} asked for a GPU but torch sees none "
                              f"(torch.cuda.is_available() is False): use --device cpu or run on a GPU machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) are visible: "
                              f"use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif dev.type not in ("cpu", "mps"):
        raise DeviceError(f"device {device!r} is not supported: use cpu or cuda")
    return dev


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """"float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" or a torch dtype; None -> float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DeviceError(f"dtype {dtype} is not supported: use one of float32, bfloat16, float16")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise DeviceError(f"dtype {dtype!r} is unknown: use one of float32 (fp32), bfloat16 (bf16), float16 (fp16)")
    return DTYPES[key]


def check_device_map(device_map: str | dict[str, Any] | None, device: torch.device) -> str | dict[str, Any] | None:
    """accelerate's layer placement for models larger than one GPU; refused on the CPU (nothing to place)."""
    if device_map is None:
        return None
    if device.type != "cuda":
        raise DeviceError(f"device map {device_map!r} places layers on GPUs but the device is {device.type}: "
                          "leave --device-map out on the CPU, or run with --device cuda on a GPU machine")
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:
        raise DeviceError(f"device map {device_map!r} is unknown: use one of {', '.join(DEVICE_MAPS)} "
                          "(accelerate's placements) or a dict of module name -> device")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise DeviceError("a device map needs the accelerate package: pip install accelerate") from None
    return device_map


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model takes its input ids: the embedding's device (the first device under a device map)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return (emb.weight if emb is not None else next(model.parameters())).device
