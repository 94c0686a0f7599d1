"""The tile geometry every kernel and the library share.

`BLOCK` is the tile edge in tokens (64 query rows x 64 keys); `NO_WINDOW` the sliding-window size the
prefill kernel reads as "no window" (heads without a band mask); `band_on` the per-head sink / window as the
kernels read them.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

BLOCK = 64
NO_WINDOW = 1 << 30


def band_on(sink: torch.Tensor | Sequence[int], window: torch.Tensor | Sequence[int],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head A-shape sink and window (tokens, `[H]`, tensors or int sequences) -> Int32 `[H]` each on `device`,
    both at most `NO_WINDOW`. Tensors already there are cast; host values come from a cache of their device
    copies, since a copy from pageable host memory waits for the GPU's queue to drain (H200, A-shape at 64K through
    `sparse_prefill`: 9.97 ms of host time per call with lists against 0.12 with device tensors,
    scripts/host_overhead.py). The cached tensors are shared: read them, never write them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _on(sink, device), _on(window, device)


def _on(x: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.device == device:
        return x.clamp(max=NO_WINDOW).to(torch.int32).reshape(-1)
    return _copy(tuple(min(int(v), NO_WINDOW) for v in torch.as_tensor(x).reshape(-1).tolist()), device)


@functools.lru_cache(maxsize=256)
def _copy(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)
