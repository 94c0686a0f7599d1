"""Block store: every offloaded layer's KV in 64-token blocks in pinned host memory.

Per layer one flat K buffer and one flat V buffer; `view(batch, n_blocks)` lays them out as
`[batch, Hkv, n_blocks, 64, D]` (any layout whose size fits reuses the same memory), so a store
allocated once serves several batch sizes and contexts. A quantised store (`StoreSpec.quant`: FP8 e4m3 or
INT8) holds one-byte codes and one float32 scale per token row of each head (`scales`), half the bytes of a
bf16 store (plus 4 / D); an INT4 store (`quant` = `gather_ref.INT4`, uint8) holds D / 2 bytes of packed 4-bit
codes and D / 32 float16 scales per row, a quarter (plus 1 / 16: 72 bytes a 128-dim row);
`workbench_kernels.gather_ref.quantize_rows` defines the codes. Capacity is checked before anything is
allocated: a request that does not fit is refused with the numbers and the fix, and a failed
allocation frees whatever it had taken.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from workbench_kernels import BLOCK
from workbench_kernels.gather_ref import INT4, SCALE_DTYPE, row_layout

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
    (float8_e4m3fn, int8 or `INT4`) stores codes and scales instead of `dtype` values (an INT4 store needs a
    power-of-two head_dim >= 32: ValueError otherwise)."""

    layers: int
    batch: int
    kv_heads: int
    n_blocks: int
    head_dim: int
    dtype: torch.dtype
    quant: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.quant is not None:
            row_layout(self.quant, self.head_dim)

    @property
    def codes_dtype(self) -> torch.dtype:
        """The dtype of the K/V buffers: `quant` or the model's."""
        return self.quant or self.dtype

    @property
    def row_codes(self) -> int:
        """Elements of one token row of one head in the K/V buffers: head_dim (INT4: head_dim / 2 bytes)."""
        return row_layout(self.quant, self.head_dim)[0] if self.quant else self.head_dim

    @property
    def row_scales(self) -> int:
        """Scales per token row of one head: 0 (model dtype), 1 (FP8 / INT8), head_dim / 32 (INT4)."""
        return row_layout(self.quant, self.head_dim)[1] if self.quant else 0

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Trailing shape of a row's scales: () per row (FP8 / INT8), (head_dim / 32,) per group (INT4)."""
        return (self.row_scales,) if self.quant == INT4 else ()

    @property
    def layer_rows(self) -> int:
        """Token rows of one layer's K (or V) buffer (every sequence and KV head)."""
        return self.batch * self.kv_heads * self.n_blocks * BLOCK

    @property
    def layer_elements(self) -> int:
        """Elements of one layer's K (or V) buffer."""
        return self.layer_rows * self.row_codes

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of one head, K or V: codes plus scales."""
        return self.row_codes * self.codes_dtype.itemsize + (self.row_scales * SCALE_DTYPE[self.quant].itemsize
                                                             if self.quant else 0)

    @property
    def block_bytes(self) -> int:
        """Bytes the gather moves per 64-token block of one head, K + V (codes and scales)."""
        return 2 * BLOCK * self.row_bytes

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.layer_rows * self.row_bytes

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
                    t = torch.empty(spec.layer_rows * spec.row_scales, dtype=SCALE_DTYPE[spec.quant])
                    bufs.append(_register(t) if self.pinned else t)
        except (RuntimeError, StoreCapacityError) as e:
            self.close()
            raise StoreCapacityError(f"allocating the {spec.nbytes / GiB:.2f} GiB KV store failed ({e}); "
                                     "nothing was kept: reduce the batch (--batch) or the prompt length (--length)") from e

    def view(self, layer: int, batch: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer slot `layer` as `[batch, Hkv, n_blocks, 64, D]` views of the same memory (INT4 codes:
        `[..., D / 2]` uint8)."""
        if self.closed:
            raise StoreCapacityError("the block store is closed: make a new one")
        s = self.spec
        need = batch * s.kv_heads * n_blocks * BLOCK * s.row_codes
        if need > s.layer_elements:
            raise StoreCapacityError(f"batch {batch} x {n_blocks * BLOCK} tokens does not fit a store made for "
                                     f"batch {s.batch} x {s.tokens} tokens: make a larger store")
        shape = (batch, s.kv_heads, n_blocks, BLOCK, s.row_codes)
        return self.k[layer][:need].view(shape), self.v[layer][:need].view(shape)

    def scales(self, layer: int, batch: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Scales of layer slot `layer` as `[batch, Hkv, n_blocks, 64]` float32 (FP8 / INT8: per row) or
        `[batch, Hkv, n_blocks, 64, D / 32]` float16 (INT4: per group of 32); None: not quantised."""
        s = self.spec
        if not s.quant:
            return None
        self.view(layer, batch, n_blocks)  # checks the size and that the store is open
        need = batch * s.kv_heads * n_blocks * BLOCK * s.row_scales
        shape = (batch, s.kv_heads, n_blocks, BLOCK, *s.scale_shape)
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
