"""`--device`, `--dtype` and `--device-map` for every command that runs the model (one helper, one meaning)."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from workbench.core.device import DTYPES, check_device_map, parse_dtype, resolve_device


def add_device_arguments(p: argparse.ArgumentParser, device_map: bool = False) -> None:
    """Add --device (default: cuda when available), --dtype (default float32) and, with `device_map`,
    --device-map (accelerate's layer placement, for models larger than one GPU)."""
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when a GPU is visible)")
    p.add_argument("--dtype", default=None, help=f"model dtype: {', '.join(DTYPES)} (default float32, or the "
                   "command's GPU default)")
    if device_map:
        p.add_argument("--device-map", default=None,
                       help="place the model's layers over several GPUs with accelerate (auto, balanced, ...)")


def resolve_device_args(args: argparse.Namespace, gpu_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """{device, dtype, device_map} for `load_model`, validated (bad input raises naming the fix); without
    --dtype: float32 on the CPU, `gpu_dtype` on a GPU."""
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype) if args.dtype else (gpu_dtype if device.type == "cuda" else torch.float32)
    device_map = check_device_map(getattr(args, "device_map", None), device)
    return {"device": device, "dtype": dtype, "device_map": device_map}
