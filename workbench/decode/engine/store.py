"""Block store: every offloaded layer's KV in 64-token blocks in pinned host memory.

Per layer one flat K buffer and one flat V buffer; `view(batch, n_blocks)` lays them out as
`[batch, Hkv, n_blocks, 64, D]` (any layout whose size fits reuses the same memory), so a store
allocated once serves several batch sizes and contexts. A quantised store (`StoreSpec.quant`: FP8 e4m3 or
INT8) holds one-byte codes and one float32 scale per token row of each head (`scales`), half the bytes of a
bf16 store (plus 4 / D); an INT4 store (`quant` = `gather_ref.INT4`, uint8) holds D / 2 bytes of packed 4-bit
codes and D / 32 float16 scales per row, a quarter (plus 1 / 16: 72 bytes a 128-dim row); "int8k-int4v" (`quant` the
pair (int8, INT4)) keeps K as INT8 rows and V as INT4 groups (132 + 72 bytes a 128-dim row, 0.77x FP8's);
`workbench_kernels.gather_ref.quantize_rows` defines the codes. Capacity is checked before anything is
allocated: a request that does not fit is refused with the numbers and the fix, and a failed
allocation frees whatever it had taken.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from workbench_kernels.gather_ref import INT4, SCALE_DTYPE, kv_quant, row_layout
from workbench_kernels.tiling import BLOCK

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
class RowFormat:
    """How one part (K or V) of a store keeps a token row of one head of `head_dim`: `quant` codes (float8_e4m3fn or
    int8: `head_dim` codes and one float32 scale; `INT4`: head_dim / 2 bytes and head_dim / 32 float16 scales) or,
    with `quant` None, the model's `dtype` values."""

    quant: torch.dtype | None
    head_dim: int
    dtype: torch.dtype

    @property
    def codes_dtype(self) -> torch.dtype:
        """The dtype of the part's buffers: `quant` or the model's."""
        return self.quant or self.dtype

    @property
    def codes(self) -> int:
        """Elements of one row in the part's buffer: head_dim (INT4: head_dim / 2 bytes)."""
        return row_layout(self.quant, self.head_dim)[0] if self.quant else self.head_dim

    @property
    def scales(self) -> int:
        """Scales per row: 0 (model dtype), 1 (FP8 / INT8), head_dim / 32 (INT4)."""
        return row_layout(self.quant, self.head_dim)[1] if self.quant else 0

    @property
    def scale_dtype(self) -> torch.dtype | None:
        return SCALE_DTYPE[self.quant] if self.quant else None

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Trailing shape of a row's scales: () per row (FP8 / INT8), (head_dim / 32,) per group (INT4)."""
        return (self.scales,) if self.quant == INT4 else ()

    @property
    def bytes(self) -> int:
        """Bytes of one row: codes plus scales."""
        return self.codes * self.codes_dtype.itemsize + (self.scales * self.scale_dtype.itemsize if self.quant else 0)


@dataclass(frozen=True)
class StoreSpec:
    """Size of a block store: `layers` offloaded layers, each holding `batch` sequences of `n_blocks`
    64-token blocks for `kv_heads` heads of `head_dim` (K and V) of a model in `dtype`; `quant`
    (float8_e4m3fn, int8 or `INT4`, or a (K, V) pair of them: `gather_ref.kv_quant`) stores codes and scales
    instead of `dtype` values (an INT4 part needs a power-of-two head_dim >= 32: ValueError otherwise)."""

    layers: int
    batch: int
    kv_heads: int
    n_blocks: int
    head_dim: int
    dtype: torch.dtype
    quant: torch.dtype | tuple[torch.dtype, torch.dtype] | None = None

    def __post_init__(self) -> None:
        qk, qv = kv_quant(self.quant)
        if (qk is None) != (qv is None):
            raise ValueError(f"a store keeps codes for both K and V or for neither, got {self.quant}")
        for q in (qk, qv) if qk is not None else ():
            row_layout(q, self.head_dim)

    @property
    def parts(self) -> tuple[RowFormat, RowFormat]:
        """The K and the V rows' formats."""
        return tuple(RowFormat(q, self.head_dim, self.dtype) for q in kv_quant(self.quant))

    @property
    def layer_rows(self) -> int:
        """Token rows of one layer's K (or V) buffer (every sequence and KV head)."""
        return self.batch * self.kv_heads * self.n_blocks * BLOCK

    @property
    def block_bytes(self) -> int:
        """Bytes the gather moves per 64-token block of one head, K + V (codes and scales)."""
        return BLOCK * sum(p.bytes for p in self.parts)

    @property
    def nbytes(self) -> int:
        return self.layers * self.layer_rows * sum(p.bytes for p in self.parts)

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
                for bufs, part in zip((self.k, self.v), spec.parts):
                    t = torch.empty(spec.layer_rows * part.codes, dtype=part.codes_dtype)
                    bufs.append(_register(t) if self.pinned else t)
                for bufs, part in zip((self.sk, self.sv), spec.parts) if spec.quant else ():
                    t = torch.empty(spec.layer_rows * part.scales, dtype=part.scale_dtype)
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
        rows = batch * s.kv_heads * n_blocks * BLOCK
        if rows > s.layer_rows:
            raise StoreCapacityError(f"batch {batch} x {n_blocks * BLOCK} tokens does not fit a store made for "
                                     f"batch {s.batch} x {s.tokens} tokens: make a larger store")
        return tuple(t[layer][:rows * p.codes].view(batch, s.kv_heads, n_blocks, BLOCK, p.codes)
                     for t, p in zip((self.k, self.v), s.parts))

    def scales(self, layer: int, batch: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Scales of layer slot `layer` as `[batch, Hkv, n_blocks, 64]` float32 (FP8 / INT8: per row) or
        `[batch, Hkv, n_blocks, 64, D / 32]` float16 (INT4: per group of 32), each part its own; None: not
        quantised."""
        s = self.spec
        if not s.quant:
            return None
        self.view(layer, batch, n_blocks)  # checks the size and that the store is open
        rows = batch * s.kv_heads * n_blocks * BLOCK
        return tuple(t[layer][:rows * p.scales].view(batch, s.kv_heads, n_blocks, BLOCK, *p.scale_shape)
                     for t, p in zip((self.sk, self.sv), s.parts))

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
