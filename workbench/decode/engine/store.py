"""Block store: every offloaded layer's KV in 64-token blocks in pinned host memory.

Per layer one flat K buffer and one flat V buffer; `view(batch, n_blocks)` lays them out as
`[batch, Hkv, n_blocks, 64, D]` (any layout whose size fits reuses the same memory), so a store
allocated once serves several batch sizes and contexts. A quantised store (`StoreSpec.quant`: FP8 e4m3 or
INT8) holds one-byte codes and one float32 scale per token row of each head (`scales`), half the bytes of a
bf16 store (plus 4 / D); `workbench_kernels.gather_ref.quantize_rows` defines the codes. Capacity is checked before anything is
allocated: a request that does not fit is refused with the numbers and the fix, and a failed
allocation frees whatever it had taken.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from workbench_kernels import BLOCK

GiB = 1024 ** 3


class StoreCapacityError(ValueError):
    """The store cannot hold what was asked; the message says how much is needed and what to change."""


def host_memory_available() -> int:
    """Bytes the kernel reports as available (MemAvailable in /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable missing from /proc/meminfo: pass an explicit host memory limit")


@dataclass(frozen=True)
class StoreSpec:
    """Size of a block store: `layers` offloaded layers, each holding `batch` sequences of `n_blocks`
    64-token blocks for `kv_heads` heads of `head_dim` (K and V) of a model in `dtype`; `quant`
    (float8_e4m3fn or int8) stores codes and per-row scales instead of `dtype` values."""

    layers: int
    batch: int
    kv_heads: int
    n_blocks: int
    head_dim: int
    dtype: torch.dtype
    quant: torch.dtype | None = None

    @property
    def codes_dtype(self) -> torch.dtype:
        """The dtype of the K/V buffers: `quant` or the model's."""
        return self.quant or self.dtype

    @property
    def layer_elements(self) -> int:
        """Elements of one layer's K (or V) buffer."""
        return self.batch * self.kv_heads * self.n_blocks * BLOCK * self.head_dim

    @property
    def nbytes(self) -> int:
        codes = self.layer_elements * torch.tensor([], dtype=self.codes_dtype).element_size()
        scales = self.layer_elements // self.head_dim * 4 if self.quant else 0
        return 2 * self.layers * (codes + scales)

    @property
    def tokens(self) -> int:
        """Token capacity per sequence."""
        return self.n_blocks * BLOCK


def _register(t: torch.Tensor) -> torch.Tensor:
    """Page-lock an ordinary CPU tensor (cudaHostRegister, portable + mapped): exact size, unlike the
    caching pinned allocator, which rounds each buffer up to a power of two."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 3)
    if int(err) != 0:
        raise StoreCapacityError(f"cudaHostRegister of {t.numel() * t.element_size() / GiB:.1f} GiB failed "
                                 f"(error {int(err)}): the host cannot pin that much; use a smaller store")
    return t


def _release(bufs: list[list[torch.Tensor]], pinned: bool) -> None:
    """Unpin (after the GPU is done with them) and drop the buffers; the lists are emptied in place, so
    the memory goes back as soon as no view of it is left. Runs once: from `close()` or at collection."""
    if pinned and any(bufs):
        torch.cuda.synchronize()
        for t in (t for b in bufs for t in b):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    for b in bufs:
        b.clear()


class BlockStore:
    """Pinned host KV of `spec.layers` layers. `k[i]`, `v[i]`: flat buffers of layer slot i (codes when
    quantised, with their scales in `sk[i]`, `sv[i]`).

    `pinned=None` pins when CUDA is available. `limit_bytes` caps the store (default: 90% of the host's
    available memory); a spec above it raises StoreCapacityError before any allocation. The pinned
    memory is unregistered and freed by `close()`, on `with`-exit, or when the store is collected
    (memory freed while still registered makes the next registration at that address fail, error 712).
    """

    def __init__(self, spec: StoreSpec, *, pinned: bool | None = None, limit_bytes: int | None = None) -> None:
        if min(spec.layers, spec.batch, spec.kv_heads, spec.n_blocks, spec.head_dim) <= 0:
            raise StoreCapacityError(f"every store dimension must be positive, got {spec}")
        limit = int(0.9 * host_memory_available()) if limit_bytes is None else int(limit_bytes)
        if spec.nbytes > limit:
            raise StoreCapacityError(
                f"the KV store needs {spec.nbytes / GiB:.2f} GiB of pinned host memory ({spec.layers} layers x "
                f"batch {spec.batch} x {spec.tokens} tokens) but only {limit / GiB:.2f} GiB may be pinned: "
                f"reduce the batch (--batch) or the prompt length (--length), or offload fewer layers")
        self.spec = spec
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.sk: list[torch.Tensor] = []
        self.sv: list[torch.Tensor] = []
        self._finalizer = weakref.finalize(self, _release, [self.k, self.v, self.sk, self.sv], self.pinned)
        try:
            for _ in range(spec.layers):
                for bufs in (self.k, self.v):
                    t = torch.empty(spec.layer_elements, dtype=spec.codes_dtype)
                    bufs.append(_register(t) if self.pinned else t)
                for bufs in (self.sk, self.sv) if spec.quant else ():
                    t = torch.empty(spec.layer_elements // spec.head_dim, dtype=torch.float32)
                    bufs.append(_register(t) if self.pinned else t)
        except (RuntimeError, StoreCapacityError) as e:
            self.close()
            raise StoreCapacityError(f"allocating the {spec.nbytes / GiB:.2f} GiB KV store failed ({e}); "
                                     "nothing was kept: reduce the batch (--batch) or the prompt length (--length)") from e

    def view(self, layer: int, batch: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer slot `layer` as `[batch, Hkv, n_blocks, 64, D]` views of the same memory."""
        if self.closed:
            raise StoreCapacityError("the block store is closed: make a new one")
        s = self.spec
        need = batch * s.kv_heads * n_blocks * BLOCK * s.head_dim
        if need > s.layer_elements:
            raise StoreCapacityError(f"batch {batch} x {n_blocks * BLOCK} tokens does not fit a store made for "
                                     f"batch {s.batch} x {s.tokens} tokens: make a larger store")
        shape = (batch, s.kv_heads, n_blocks, BLOCK, s.head_dim)
        return self.k[layer][:need].view(shape), self.v[layer][:need].view(shape)

    def scales(self, layer: int, batch: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-row scales of layer slot `layer` as `[batch, Hkv, n_blocks, 64]` float32 (None: not quantised)."""
        if not self.spec.quant:
            return None
        self.view(layer, batch, n_blocks)  # checks the size and that the store is open
        need = batch * self.spec.kv_heads * n_blocks * BLOCK
        shape = (batch, self.spec.kv_heads, n_blocks, BLOCK)
        return self.sk[layer][:need].view(shape), self.sv[layer][:need].view(shape)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unpin and drop the buffers (idempotent); views taken earlier must not be used afterwards."""
        self._finalizer()

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
