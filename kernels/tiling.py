"""The tile geometry every kernel and the library share.

`BLOCK` is the tile edge in tokens (64 query rows x 64 keys); `NO_WINDOW` the sliding-window size the
prefill kernel reads as "no window" (heads without a band mask); `band_on` the per-head sink / window as the
kernels read them, `ints_on` any such small per-head integers on the device. The kernels' softmax runs in exp2
units: `LOG2E` turns a softmax scale into them on the host (scale * LOG2E), `LN2` a log2 sum back into a natural-log
LSE inside jitted code.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton.language as tl

BLOCK = 64
NO_WINDOW = 1 << 30
LOG2E = 1.4426950408889634  # log2(e)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2) = 1 / LOG2E


def band_on(sink: torch.Tensor | Sequence[int], window: torch.Tensor | Sequence[int],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head A-shape sink and window (tokens, `[H]`, tensors or int sequences) -> `ints_on` each, both at most
    `NO_WINDOW` (H200, A-shape at 64K through `sparse_prefill`: 9.97 ms of host time per call when each call copied
    host lists against 0.12 with device tensors, scripts/host_overhead.py)."""
    return ints_on(sink, device, NO_WINDOW), ints_on(window, device, NO_WINDOW)


def ints_on(x: torch.Tensor | Sequence[int], device: torch.device, most: int | None = None) -> torch.Tensor:
    """Small integers (per-head sinks, windows, budgets; a tensor or int sequence, clamped to `most`) -> Int32 `[n]`
    on `device`. An Int32 tensor already there passes as it is (no launch; the kernels read values past `most` as
    `most`), another one there is clamped and cast; host values come from a cache of their device copies, since a
    copy from pageable host memory waits for the GPU's queue to drain. The cached tensors are shared: read them,
    never write them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(x, torch.Tensor) and x.device == device:
        if x.dtype != torch.int32 and most is not None:
            x = x.clamp(max=most)
        return x.to(torch.int32).reshape(-1)
    values = torch.as_tensor(x).reshape(-1).tolist()
    return _copy(tuple(int(v) if most is None else min(int(v), most) for v in values), device)


@functools.lru_cache(maxsize=256)
def _copy(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)
