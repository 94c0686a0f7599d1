"""Decode loop for a Llama-family or Gemma-3 model with five KV placements (SparDA's decode schedule and its
baselines).

Modes:
- `dense-resident`: all KV on the GPU, every block attended.
- `sparse-resident`: all KV on the GPU, attention over the selected blocks (selector `same-layer`,
  `forecast` or `quest`).
- `sparse-offload-sync`: layer 0 resident, other layers' KV in the pinned host store; each layer selects
  with its own query (InfLLM-V2), copies its missing blocks into its GPU block cache, then attends.
- `sparse-offload-forecast`: layer l's Forecast head picks layer l+1's blocks; their misses are copied on a
  side stream (high priority) while layer l computes; layer l+1 waits on an event for its copy.
- `forecast-without-prefetch`: forecast selection, but each layer's copy runs on the main stream just
  before its attention (the ablation: selection without overlap).

Sliding-window layers (Gemma-3's local layers) are part of the model, not a choice: in every mode they keep
a ring of the blocks their window spans on the GPU and attend to exactly their window. Only full-attention
layers are selected from, offloaded and forecast.

`store_dtype` "fp8" / "int8" keeps the offloaded layers' host KV as one-byte codes with per-row scales (half
the PCIe bytes of bf16), "int4" as 4-bit codes with a float16 scale per 32 elements (0.28x bf16's bytes at
head_dim 128; needs a power-of-two head_dim >= 32; clearly lossier than FP8: on SmolLM2-135M dense@int4 top-1
0.857, KL 0.072 vs FP8's 0.952, 0.0057, kernels/NOTES.md "INT4 host store"), dequantised by the gather kernel;
resident modes then round the same layers' KV through the same codes, so that each offload mode still reproduces
its resident reference token for token, and the quality cost of the store is the resident mode's distance from
dense ("model" keeps the model dtype). "int8k-int4v" keeps the keys as INT8 rows and the values as INT4 groups
(0.77x FP8's bytes; on the real model KL 0.0070 vs FP8's 0.0079, where INT4 keys cost 0.092: kernels/NOTES.md
"Which 4-bit KV to build next").

The same code runs on the CPU (no streams; PyTorch reference kernels and the model's own modules by
default), which is how losslessness is tested: offload modes must produce exactly the tokens of
sparse-resident with the same selector and store dtype. On CUDA, Llama-family layers run through
`layer_ops.FusedOps` (~15 launches per layer and step). Shapes: B sequences, Hq query heads, Hkv KV heads,
D head_dim, 64-token blocks.
"""
from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from workbench_kernels.gather_ref import GATHER_WARPS, INT4, kv_quant

from workbench.decode.engine.adapters import decoder_layers
from workbench.decode.engine.cache import BlockCache, CopyPlan
from workbench.decode.engine.hooks import CopyTimer, StepHooks
from workbench.decode.engine.layer_ops import FusedOps, ModuleOps
from workbench.decode.engine.select import CompressedKeyBuffer, select_decode
from workbench.decode.engine.store import BLOCK, BlockStore, GiB, StoreCapacityError, StoreSpec, host_memory_available
from workbench.decode.quest import QuestPages
from workbench.patterns.infllm import Budget

MODES = ("dense-resident", "sparse-resident", "sparse-offload-sync", "sparse-offload-forecast",
         "forecast-without-prefetch")
SELECTORS = ("same-layer", "forecast", "quest")  # quest: workbench.decode.quest page bounds
OFFLOAD = MODES[2:]
STORE_DTYPES = {"model": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8, "int4": INT4,
                "int8k-int4v": (torch.int8, INT4)}  # (key codes, value codes): `gather_ref.kv_quant`
SelectHook = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EngineConfig:
    """How to decode. `selector` only matters for sparse-resident (offload modes fix their own; "quest"
    also replaces InfLLM-V2 in sparse-offload-sync);
    `cache_blocks` = GPU cache slots per (sequence, KV head), default budget.total; `ctas` = programs of
    the gather kernel (None: `gather_ctas`, 32 for a model-dtype store, 64 for FP8 / INT8 / INT4), `gather_warps`
    its warps per program; `splits` = programs per (sequence, KV head) of the decode kernel (None:
    `decode.default_splits`); `kernels` =
    "triton", "torch" (reference) or "auto" (Triton on CUDA); `store_dtype` =
    "model", "fp8", "int8", "int4" or "int8k-int4v": how the offloadable layers' KV is kept (see the module
    docstring)."""

    mode: str = "sparse-offload-forecast"
    budget: Budget = field(default_factory=Budget)
    selector: str = "same-layer"
    cache_blocks: int | None = None
    ctas: int | None = None
    gather_warps: int = 4
    kernels: str = "auto"
    splits: int | None = None
    store_dtype: str = "model"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown: choose one of {', '.join(MODES)}")
        if self.selector not in SELECTORS:
            raise ValueError(f"selector {self.selector!r} is unknown: choose one of {', '.join(SELECTORS)}")
        if self.budget.block != BLOCK:
            raise ValueError(f"the engine moves {BLOCK}-token blocks: budget.block must be {BLOCK}")
        if self.budget.local < 1:
            raise ValueError("budget.local must be >= 1: the block being written must always be selected")
        if self.cache_blocks is not None and self.cache_blocks < self.budget.total:
            raise ValueError(f"cache_blocks={self.cache_blocks} is below the selection size {self.budget.total}")
        if self.gather_warps not in GATHER_WARPS:
            raise ValueError(f"gather_warps must be 1, 2, 4 or 8, got {self.gather_warps}")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels {self.kernels!r}: choose auto, triton or torch")
        if self.store_dtype not in STORE_DTYPES:
            raise ValueError(f"store_dtype {self.store_dtype!r} is unknown: choose one of {', '.join(STORE_DTYPES)}")

    @property
    def uses_forecast(self) -> bool:
        return self.mode in ("sparse-offload-forecast", "forecast-without-prefetch") or (
            self.mode == "sparse-resident" and self.selector == "forecast")

    @property
    def quant(self) -> torch.dtype | tuple[torch.dtype, torch.dtype] | None:
        """The store's code dtype (None: the model's dtype; "int4": `gather_ref.INT4`, uint8 bytes of two codes), or
        its (key, value) pair ("int8k-int4v": (int8, INT4))."""
        return STORE_DTYPES[self.store_dtype]


@dataclass
class DecodeStats:
    """What one timed run measured. Bytes are host->GPU KV traffic; rates in GB/s (1e9)."""

    mode: str
    batch: int
    steps: int
    seconds: float
    tokens_per_s: float
    bytes_moved_per_step: float
    hit_rate: float | None
    copy_seconds: float | None = None
    stall_seconds: float | None = None
    hidden_fraction: float | None = None
    copy_gbps: float | None = None
    peak_gpu_bytes: int | None = None
    gpu_kv_bytes: int = 0
    host_kv_bytes: int = 0
    store_dtype: str = "model"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _kernels(kind: str, device: torch.device):
    use_triton = kind == "triton" or (kind == "auto" and device.type == "cuda")
    if use_triton:
        from workbench_kernels.cache_plan import append_token
        from workbench_kernels.decode import sparse_decode
        from workbench_kernels.gather import gather_blocks
    else:
        from workbench_kernels.cache_plan_ref import append_token_ref as append_token
        from workbench_kernels.decode_ref import sparse_decode_ref as sparse_decode
        from workbench_kernels.gather_ref import gather_blocks_ref as gather_blocks
    return use_triton, sparse_decode, gather_blocks, append_token


def ring_blocks(window: int, n_blocks: int) -> int:
    """Blocks a sliding layer of `window` tokens keeps per (sequence, KV head): every block its window can
    span (the current one included), at most the sequence's."""
    return min(n_blocks, (window - 1) // BLOCK + 2)


def layer_roles(windows: Sequence[int | None], offload: bool) -> tuple[list[int], list[int]]:
    """(full-attention layers, offloaded layers): offload modes keep layer 0 and sliding layers on the GPU."""
    full = [i for i, w in enumerate(windows) if w is None]
    return full, [i for i in full if i > 0] if offload else []


def kv_bytes(config: EngineConfig, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int,
             max_tokens: int, windows: Sequence[int | None] | None = None) -> tuple[int, int]:
    """(GPU bytes, pinned host bytes) a `DecodeEngine` of `config` allocates for `batch` sequences of up to
    `max_tokens` tokens: resident KV (every layer, or layer 0 and sliding layers when offloading; a sliding
    layer keeps its window's ring), per-layer block caches, compressed keys; the host store holds the other
    layers' KV (codes and scales for an FP8 / INT8 / INT4 store). Both are linear in `batch`."""
    windows = list(windows) if windows is not None else [None] * layers
    esize = torch.tensor([], dtype=dtype).element_size()
    nb = math.ceil(max_tokens / BLOCK)
    block_bytes = 2 * BLOCK * head_dim * esize
    offload, sparse = config.mode in OFFLOAD, config.mode != "dense-resident"
    full, offloaded = layer_roles(windows, offload)
    rows = batch * kv_heads
    gpu = sum(rows * ring_blocks(w, nb) * block_bytes for w in windows if w is not None)
    gpu += (len(full) - len(offloaded)) * rows * nb * block_bytes
    gpu += len(offloaded) * rows * (config.cache_blocks or config.budget.total) * block_bytes
    if sparse:
        gpu += len(full) * rows * ((max_tokens // config.budget.stride + 2) * esize + 32 * 4) * head_dim
    host = StoreSpec(len(offloaded), batch, kv_heads, nb, head_dim, dtype, config.quant).nbytes if offloaded else 0
    return gpu, host


def check_budget(budget: Budget, max_tokens: int) -> None:
    """Refuse a budget that selects more blocks than sequences of `max_tokens` tokens have: every block
    buffer of the engine is sized by K = init + local + topk, so a huge top-k would allocate (and attend)
    K blocks per head per layer for nothing. Raises ValueError naming the field and its largest useful value."""
    n_blocks = math.ceil(max_tokens / BLOCK)
    if budget.init + budget.local > n_blocks:
        raise ValueError(f"budget init + local = {budget.init + budget.local} blocks, but sequences of up to "
                         f"{max_tokens} tokens have {n_blocks} blocks of {BLOCK}: lower budget local to at most "
                         f"{max(1, n_blocks - budget.init)}")
    if budget.total > n_blocks:
        raise ValueError(f"budget topk={budget.topk} selects more blocks than exist: sequences of up to {max_tokens} "
                         f"tokens have {n_blocks} blocks of {BLOCK}, so topk can be at most "
                         f"{n_blocks - budget.init - budget.local} (init + local + topk <= {n_blocks}); "
                         "selecting every block is dense attention (dense-resident)")


def _release(store: BlockStore | None) -> None:
    """Finaliser of an engine: unpin and free the host store it made (runs once)."""
    if store is not None:
        store.close()


class DecodeEngine:
    """Batched greedy decoding of `model` under `config`, for sequences of up to `max_tokens` tokens.

    Everything is sized and checked before it is allocated: host store (offload modes) against
    `host_limit_bytes` (default 90% of available host memory), GPU KV/caches against free GPU memory.
    `store` may be a larger existing BlockStore to reuse. `heads` are the Forecast heads (default: the
    group-mean warm start from the model's query projections). `select_hook(layer, blocks, positions)`
    may replace a selection (benchmarks use it to impose a block reuse rate). `hooks` holds `StepHooks`
    called at the timing points of eager steps (`workbench.decode.engine.hooks`). `close()`, a `with`
    block or garbage collection frees the GPU buffers and unpins the host store the engine made.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, *, batch: int, max_tokens: int,
                 heads: Any = None, store: BlockStore | None = None, host_limit_bytes: int | None = None,
                 select_hook: SelectHook | None = None) -> None:
        self.lm = lm = decoder_layers(model)
        self.config, self.batch, self.select_hook = config, batch, select_hook
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if max_tokens > lm.max_positions:
            raise StoreCapacityError(f"{max_tokens} tokens exceed the model's {lm.max_positions} positions: "
                                     "use a shorter --length or fewer --steps")
        if config.mode != "dense-resident":
            check_budget(config.budget, max_tokens)
        self.device, self.dtype = lm.device, lm.dtype
        self.n_blocks = nb = math.ceil(max_tokens / BLOCK)
        self.max_tokens = nb * BLOCK
        L, Hkv, D = lm.n_layers, lm.n_kv_heads, lm.head_dim
        self.offload = config.mode in OFFLOAD
        self.sparse = config.mode != "dense-resident"
        self.capacity = config.cache_blocks or config.budget.total
        self.windows = lm.windows
        self.full, offloaded = layer_roles(self.windows, self.offload)
        self.slot = {layer: i for i, layer in enumerate(offloaded)}  # offloaded layer -> store / cache slot
        self.quant = config.quant
        self.quantised = {i for i in self.full if i > 0} if self.quant else set()
        self.triton, self._decode, self._gather, self._append = _kernels(config.kernels, self.device)
        self.fused = self.triton and FusedOps.supports(lm)
        self.block_bytes = StoreSpec(1, 1, 1, 1, D, self.dtype, self.quant).block_bytes  # moved per block
        # (checks an INT4 store's head_dim before anything is allocated)
        gpu_need, self.host_kv_bytes = kv_bytes(config, layers=L, kv_heads=Hkv, head_dim=D, dtype=self.dtype,
                                                batch=batch, max_tokens=max_tokens, windows=self.windows)
        self.gpu_kv_bytes = gpu_need
        spec = StoreSpec(len(offloaded), batch, Hkv, nb, D, self.dtype, self.quant) if offloaded else None
        # --- refuse before allocating anything (the fused path also packs a copy of the q/k/v/forecast weights)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            heads_rows = (L * lm.n_heads + 2 * L * Hkv + (len(self.full) * Hkv if config.uses_forecast else 0)) * D
            packed = heads_rows * lm.hidden_size * torch.tensor([], dtype=self.dtype).element_size() if self.fused else 0
            if gpu_need + packed > free:
                raise StoreCapacityError(f"{config.mode} needs {gpu_need / GiB:.2f} GiB of GPU memory for KV "
                                         f"(batch {batch} x {self.max_tokens} tokens) and {packed / GiB:.2f} GiB of "
                                         f"packed weights but {free / GiB:.2f} GiB are free: reduce the batch (--batch) or "
                                         "the prompt length (--length), or use an offload mode")
        elif not self.offload:
            limit = int(0.9 * host_memory_available()) if host_limit_bytes is None else host_limit_bytes
            if gpu_need > limit:
                raise StoreCapacityError(f"{config.mode} needs {gpu_need / GiB:.2f} GiB for KV but only "
                                         f"{limit / GiB:.2f} GiB of host memory may be used: reduce the batch (--batch) or "
                                         "the prompt length (--length)")
        self._own_store = False
        self.store, self.host, self.host_scales = None, {}, {}
        if offloaded:
            self._own_store = store is None
            if store is None:
                store = BlockStore(spec, limit_bytes=host_limit_bytes)
            elif store.spec.layers < len(offloaded) or store.spec.kv_heads != Hkv or store.spec.head_dim != D \
                    or store.spec.dtype != self.dtype or store.spec.quant != self.quant:
                raise StoreCapacityError(f"the given store {store.spec} does not match {len(offloaded)} layers, {Hkv} "
                                         f"heads, head_dim {D}, {self.dtype}, store dtype {config.store_dtype}: make a "
                                         "store for this model")
            self.store = store
            self.host = {layer: store.view(i, batch, nb) for layer, i in self.slot.items()}  # checks the size
            if self.quant:
                self.host_scales = {layer: store.scales(i, batch, nb) for layer, i in self.slot.items()}
        dev = self.device
        # --- allocate: per layer a resident pool `[B * Hkv * row_blocks, 64, D]` (K, V) or a block cache
        self.row_blocks = {i: ring_blocks(w, nb) if w is not None else nb for i, w in enumerate(self.windows)}
        self.kv = {i: torch.zeros(2, batch * Hkv * self.row_blocks[i], BLOCK, D, dtype=self.dtype, device=dev)
                   for i in range(L) if i not in self.slot}
        self.caches = {layer: BlockCache(batch, Hkv, self.capacity, nb, D, self.dtype, dev, fused=self.triton)
                       for layer in self.slot}
        self.ck = {i: CompressedKeyBuffer(batch, Hkv, D, self.max_tokens, config.budget, dev, self.dtype)
                   for i in self.full} if self.sparse else {}
        self.quest = {i: QuestPages(batch, Hkv, D, nb, dev) for i in self.full} \
            if self.sparse and config.selector == "quest" and not config.uses_forecast else {}
        self.heads = None
        targets: dict[int, list[int]] = {}
        if config.uses_forecast:
            if heads is None:
                from workbench.core.model import model_shape
                from workbench.decode.forecast.heads import ForecastHeads

                heads = ForecastHeads.from_queries(model, model_shape(model, "engine", fp="-"))
            self.heads = heads.to(dev)
            for t in self.full:
                targets.setdefault(heads.source(t), []).append(t)
        self.ops = FusedOps(lm, self.heads, targets) if self.fused else ModuleOps(lm, self._append, self.heads, targets)
        self.kv_out = (torch.empty(batch, Hkv, D, dtype=self.dtype, device=dev),
                       torch.empty(batch, Hkv, D, dtype=self.dtype, device=dev)) if self.quant else None
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        rope_types = getattr(lm.inner.rotary_emb, "rope_type", "default")
        self._rope_dynamic = "dynamic" in (rope_types.values() if isinstance(rope_types, dict) else [rope_types])
        self._rope_tables: dict[torch.dtype, dict] = {}
        for dtype in (self.dtype, torch.float32) if self.heads is not None else (self.dtype,):
            self._rope(self.positions, dtype)  # tables made now, not inside a CUDA-graph capture
        self.cuda = dev.type == "cuda"
        self.side = torch.cuda.Stream(dev, priority=-1) if self.cuda else None  # copies before compute
        self.copy_done = {layer: torch.cuda.Event() for layer in self.slot} if self.cuda else {}
        self.hooks: list[StepHooks] = []
        self._graph: Any = None  # CUDA graph of one step (captured by `run(graph=True)`)
        self._graph_io: tuple[torch.Tensor, torch.Tensor] | None = None
        self._finalizer = weakref.finalize(self, _release, self.store if self._own_store else None)

    # ------------------------------------------------------------------ filling the cache
    def _write_prefix(self, layer: int, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """KV of sequence b's first n tokens `[Hkv, n, D]` into the layer's resident pool, ring or host store
        (codes and scales for a quantised layer; resident quantised layers keep the dequantised values)."""
        from workbench_kernels.gather_ref import dequantize_rows, quantize_rows

        n, Hkv, D = k.shape[1], self.lm.n_kv_heads, self.lm.head_dim
        parts = [(x, None, None) for x in (k, v)]  # (values, codes, scales) of K and V
        if layer in self.quantised:
            parts = [(x, *quantize_rows(x, q)) for x, q in zip((k, v), kv_quant(self.quant))]
        if layer in self.slot:
            for part, (x, codes, scale) in enumerate(parts):
                self.host[layer][part][b].flatten(1, 2)[:, :n] = (x if codes is None else codes).cpu()
                if codes is not None:
                    self.host_scales[layer][part][b].flatten(1, 2)[:, :n] = scale.cpu()
            return
        k, v = (x if codes is None else dequantize_rows(codes, scale, self.dtype) for x, codes, scale in parts)
        R = self.row_blocks[layer]
        first = max(0, (n - 1) // BLOCK - R + 1) * BLOCK  # a ring keeps the last R blocks
        pos = torch.arange(first, n, device=self.device)
        pool = self.kv[layer].view(2, self.batch, Hkv, R * BLOCK, D)
        rows = (pos // BLOCK) % R * BLOCK + pos % BLOCK
        pool[0, b][:, rows] = k[:, first:].to(self.device, self.dtype)
        pool[1, b][:, rows] = v[:, first:].to(self.device, self.dtype)

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor], steps: int, prefilled: list | None = None) -> torch.Tensor:
        """Dense prefill of each prompt `[N_b]` (different lengths allowed) -> first tokens `[B]`.

        Refuses (before writing anything) prompts whose length + `steps` exceeds the engine's capacity.
        `prefilled[b]` may hold `decoder_layers(model).prefill(prompts[b])` computed earlier (to compare modes).
        """
        if len(prompts) != self.batch:
            raise ValueError(f"got {len(prompts)} prompts for an engine of batch {self.batch}")
        longest = max(int(p.numel()) for p in prompts)
        if min(int(p.numel()) for p in prompts) < 1:
            raise ValueError("a prompt is empty: give at least one token per sequence")
        if longest + steps > self.max_tokens:
            raise StoreCapacityError(f"the longest prompt ({longest} tokens) + {steps} steps exceeds the engine's "
                                     f"capacity of {self.max_tokens} tokens: make the engine with a larger "
                                     "max_tokens (--length) or decode fewer --steps")
        first = torch.empty(self.batch, dtype=torch.long, device=self.device)
        for b, ids in enumerate(prompts):
            ks, vs, logits = prefilled[b] if prefilled else self.lm.prefill(ids.reshape(-1))
            for layer, (k, v) in enumerate(zip(ks, vs)):
                self._write_prefix(layer, b, k, v)
                if layer in self.ck:
                    self.ck[layer].fill(b, k)
                if layer in self.quest:
                    self.quest[layer].fill(b, k)
            first[b] = logits.argmax()
            self.positions[b] = ids.numel()
        return first

    @torch.no_grad()
    def fill_synthetic(self, lengths: list[int], seed: int = 0, fill_host: bool = True) -> None:
        """Benchmark start: random KV and compressed keys as if prompts of `lengths` were prefilled.
        Every draw (one sequence's K or V of one layer, one layer's compressed keys) has its own seed, so a layer
        holds the same numbers whether it is resident or in the host store, in every mode and on every device.
        `fill_host=False` leaves the host store as it is (a benchmark fills it once)."""
        from workbench_kernels.gather_ref import dequantize_rows, quantize_rows

        def draw(shape: tuple[int, ...], *key: int) -> torch.Tensor:
            g = torch.Generator(device=self.device).manual_seed(hash((seed, *key)) & (2**63 - 1))
            return torch.randn(shape, generator=g, device=self.device)

        if len(lengths) != self.batch or max(lengths) > self.max_tokens:
            raise StoreCapacityError(f"need {self.batch} lengths of at most {self.max_tokens} tokens, got {lengths}")
        Hkv, D = self.lm.n_kv_heads, self.lm.head_dim
        quant = kv_quant(self.quant)  # (K's codes, V's codes)
        for layer, t in self.kv.items():
            pool = t.view(2, self.batch, Hkv, -1, BLOCK, D)
            for part in range(2):
                for b in range(self.batch):
                    x = draw(pool.shape[2:], layer, part, b)
                    if layer in self.quantised:  # what the quantised store would give back
                        x = dequantize_rows(*quantize_rows(x, quant[part]), torch.float32)
                    pool[part, b].copy_(x.to(self.dtype))
        for layer in self.slot if fill_host else ():
            for part, t in enumerate(self.host[layer]):
                for b in range(self.batch):
                    x = draw((*t.shape[1:-1], D), layer, part, b)
                    if self.quant:
                        codes, scale = quantize_rows(x, quant[part])
                        t[b].copy_(codes)
                        self.host_scales[layer][part][b].copy_(scale)
                    else:
                        t[b].copy_(x.to(self.dtype))
        for layer, ck in self.ck.items():
            ck.keys.copy_(draw(ck.keys.shape, layer, 2))
            ck.tail.copy_(draw(ck.tail.shape, layer, 3))
        self.positions.copy_(torch.tensor(lengths, device=self.device))

    # ------------------------------------------------------------------ one decode step
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """The model's RoPE tables at `positions` `[B]` -> {layer type: (cos, sin) `[B, 1, D]`}: rows of tables made
        once for every position (the same numbers the rotary module computes per step, in 2 launches instead of
        ~7 per table), unless the model's RoPE changes with the length seen (dynamic scaling)."""
        B = positions.shape[0]
        if self._rope_dynamic:
            return self.lm.rope(positions.view(B, 1), dtype)
        if dtype not in self._rope_tables:
            self._rope_tables[dtype] = self.lm.rope(torch.arange(self.max_tokens, device=self.device)[None], dtype)
        return {t: (c[0][positions].view(B, 1, -1), s[0][positions].view(B, 1, -1))
                for t, (c, s) in self._rope_tables[dtype].items()}

    def _select(self, layer: int, query: torch.Tensor, visible: torch.Tensor, cache: BlockCache | None
                ) -> tuple[torch.Tensor, CopyPlan | None]:
        """InfLLM-V2 blocks of `layer` for `query` `[B, Hkv, G, D]` (keys visible up to `visible`), admitted into
        `cache` when given (in the selection's launch on the Triton path, unless a select hook edits them)."""
        budget = self.config.budget
        fuse = self.triton and cache is not None and self.select_hook is None
        out = select_decode(query, self.ck[layer], self.positions, visible, self.n_blocks, budget, fused=self.triton,
                            cache=cache if fuse else None)
        if fuse:
            blocks, slots, src, dst = out
            return blocks, cache.admitted(slots, src, dst)
        blocks = self.select_hook(layer, out, self.positions) if self.select_hook else out
        return blocks, cache.plan(blocks) if cache is not None else None

    def _copy(self, layer: int, plan: CopyPlan) -> None:
        """Gather `plan`'s missing blocks of `layer` from the host store into its cache (current stream)."""
        cache = self.caches[layer]
        src = tuple(t.flatten(0, 2).flatten(1) for t in self.host[layer])  # [B * Hkv * nb, 64 * D] (INT4: 32 * D)
        dst = cache.k.view(cache.k.shape[0], -1), cache.v.view(cache.v.shape[0], -1)
        scales = tuple(s.flatten(0, 2).flatten(1) for s in self.host_scales[layer]) if self.quant else (None, None)
        self._emit("copy_start", layer)
        kw = {"ctas": self.config.ctas, "warps": self.config.gather_warps} if self.triton else {}
        self._gather(*src, *dst, plan.src, plan.dst, plan.count, scale_k=scales[0], scale_v=scales[1], **kw)
        self._emit("copy_end", layer)

    def _emit(self, point: str, layer: int) -> None:
        for h in self.hooks:
            getattr(h, point)(layer)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this DecodeEngine is closed: make a new one")

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence `[B]` at the current positions -> next-token logits `[B, V]`."""
        self._check_open()
        lm, cfg, ops, pos = self.lm, self.config, self.ops, self.positions
        B, Hkv, D, L = self.batch, lm.n_kv_heads, lm.head_dim, lm.n_layers
        G = lm.n_heads // Hkv
        lengths = pos + 1
        earlier = pos - 1 if self.heads is not None else None  # a forecast runs before its layer sees the token
        rope = self._rope(pos, self.dtype)
        rope_f = self._rope(pos, torch.float32) if self.heads is not None else None
        x, delta = ops.embed(tokens), None
        forecast: dict[int, torch.Tensor] = {}
        plans: dict[int, CopyPlan] = {}
        prefetch = cfg.mode == "sparse-offload-forecast"
        for layer in range(L):
            self._emit("layer_start", layer)
            x, h = ops.attn_in(layer, x, delta)
            # ---- the token's KV goes (with RoPE, in one launch on the fused path) to the host store, quantised or
            # not, and the compressed keys; the attended copy goes through the decode kernel (k_new / v_new) once
            # this layer's blocks are in place
            quant = self.quant if layer in self.quantised else None
            kw: dict[str, Any] = {}
            if layer in self.slot:
                hk, hv = self.host[layer]
                kw.update(host_k=hk.flatten(2, 3), host_v=hv.flatten(2, 3))
                if quant:
                    sk, sv = self.host_scales[layer]
                    kw.update(host_scale_k=sk.flatten(2, 3), host_scale_v=sv.flatten(2, 3))
            if quant:
                kw.update(quant=quant, k_out=self.kv_out[0], v_out=self.kv_out[1])
            if layer in self.ck:  # compressed keys first: the same-layer selection sees the window this token completes
                kw.update(tail=self.ck[layer].tail, ckeys=self.ck[layer].keys, stride=cfg.budget.stride)
            q, k, v, queries = ops.project(layer, h, rope, rope_f, pos, kw)
            k_new, v_new = self.kv_out if quant else (k, v)
            # Layer l's heads pick later layers' blocks before those layers have seen this token. Selection and
            # block-map update stay on the main stream; only the copy goes to the side stream.
            for target, f in queries.items():
                if target == layer:
                    continue
                cache = self.caches.get(target)  # admitted now (one launch with the selection), copied now or later
                forecast[target], plan = self._select(target, f[:, :, None], earlier, cache)
                if plan is not None:
                    plans[target] = plan
                if plan is not None and prefetch:
                    if self.cuda:
                        self.side.wait_stream(torch.cuda.current_stream())  # selection and plan are ready
                        with torch.cuda.stream(self.side):
                            self._copy(target, plan)
                            self.copy_done[target].record(self.side)
                    else:
                        self._copy(target, plan)
            if layer in self.quest:
                self.quest[layer].append(k, pos)
            # ---- this layer's selection and its blocks in place
            blocks = plan = None
            cache = self.caches.get(layer)
            if self.sparse and layer in self.ck:
                if cfg.uses_forecast:
                    if layer in forecast:
                        blocks, plan = forecast[layer], plans.get(layer)
                    else:  # the first layer's head reads its own input and sees the new token
                        blocks, plan = self._select(layer, queries[layer][:, :, None], pos, None)
                elif self.quest:
                    blocks = self.quest[layer].select(q.view(B, Hkv, G, D), pos, self.n_blocks, cfg.budget)
                    blocks = self.select_hook(layer, blocks, pos) if self.select_hook else blocks
                else:
                    blocks, plan = self._select(layer, q.view(B, Hkv, G, D), pos, cache)
            if cache is not None:
                self._emit("wait_start", layer)
                if prefetch:
                    if self.cuda:
                        torch.cuda.current_stream().wait_event(self.copy_done[layer])
                else:
                    plan = plan or cache.plan(blocks)
                    self._copy(layer, plan)
                self._emit("wait_end", layer)
                k_pool, v_pool = cache.k, cache.v
                where = {"blocks": blocks, "slots": plan.slots}
            else:
                k_pool, v_pool = self.kv[layer][0], self.kv[layer][1]
                where = {"blocks": blocks, "row_blocks": self.row_blocks[layer], "kv_heads": Hkv,
                         "window": self.windows[layer] or 0}
            extra = {"splits": cfg.splits} if self.triton else {}
            o = self._decode(q, k_pool, v_pool, lengths, lm.scale, k_new=k_new, v_new=v_new, **where, **extra)
            x, delta = ops.attn_out(layer, x, o)
            self._emit("layer_end", layer)
        self.positions += 1
        return ops.logits(x, delta)

    # ------------------------------------------------------------------ generation and timing
    def _counters(self) -> tuple[int, int]:
        if not self.caches:
            return 0, 0
        return int(sum(c.hits for c in self.caches.values())), int(sum(c.misses for c in self.caches.values()))

    def _capture(self) -> None:
        """Record one whole step (both streams) as a CUDA graph; replays then cost no Python or launch time.
        Everything a step touches lives in fixed buffers and is updated in place, so a replay is a step."""
        tok = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.step(tok)
        self._graph, self._graph_io = graph, (tok, logits)

    def _graph_step(self, tokens: torch.Tensor) -> torch.Tensor:
        tok, logits = self._graph_io
        tok.copy_(tokens)
        self._graph.replay()
        return logits

    def drop_graph(self) -> None:
        """Forget the captured step (the next graph run captures again)."""
        self._graph, self._graph_io = None, None

    @torch.no_grad()
    def run(self, first: torch.Tensor, steps: int, *, force: torch.Tensor | None = None, keep_logits: bool = False,
            timing: bool = False, graph: bool | None = None, progress: bool = True,
            on_step: Callable[[int, int], None] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, DecodeStats]:
        """Greedy decode `steps` tokens starting from `first` `[B]` (or feed `force` `[B, steps]`, teacher
        forcing) -> tokens `[B, steps]`, logits `[B, steps, V]` (if keep_logits, on the CPU), stats.

        `graph` (default: on CUDA unless `timing` or hooks are set) runs the first step eagerly, captures the
        next as a CUDA graph and replays it from then on. `timing` (CUDA, eager) records CUDA events around
        every copy and every wait (copy time, stall, hidden fraction). `on_step(done, steps)` is called after
        each step (progress indicators).
        """
        self._check_open()
        if int(self.positions.max()) + steps > self.max_tokens:
            raise StoreCapacityError(f"{steps} more steps would pass the capacity of {self.max_tokens} tokens")
        if graph is None:
            graph = self.cuda and not timing and not self.hooks
        if graph and (timing or self.hooks or not self.cuda):
            raise ValueError("graph=True needs CUDA and runs no Python per step: no timing=True, no hooks")
        timer = CopyTimer() if timing and self.cuda else None
        if timer:
            self.hooks.append(timer)
        h0, m0 = self._counters()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tokens = torch.empty(self.batch, steps, dtype=torch.long, device=self.device)
        kept = []
        t0 = time.perf_counter()
        tok = first
        try:
            for s in tqdm(range(steps), desc=self.config.mode, unit="step", disable=not progress, leave=False):
                if graph and self._graph is not None:
                    logits = self._graph_step(tok)
                else:
                    logits = self.step(tok)
                    if graph:
                        self._capture()
                tokens[:, s] = logits.argmax(-1)
                if keep_logits:
                    kept.append(logits.float().cpu())
                tok = force[:, s].to(self.device) if force is not None else tokens[:, s]
                if on_step:
                    on_step(s + 1, steps)
            if self.cuda:
                torch.cuda.synchronize()
        finally:
            if timer:
                self.hooks.remove(timer)
        seconds = time.perf_counter() - t0
        h1, m1 = self._counters()
        hits, misses = h1 - h0, m1 - m0
        stats = DecodeStats(
            mode=self.config.mode, batch=self.batch, steps=steps, seconds=seconds,
            tokens_per_s=self.batch * steps / seconds, bytes_moved_per_step=misses * self.block_bytes / steps,
            hit_rate=hits / (hits + misses) if hits + misses else None,
            peak_gpu_bytes=torch.cuda.max_memory_allocated() if self.cuda else None,
            gpu_kv_bytes=self.gpu_kv_bytes, host_kv_bytes=self.host_kv_bytes, store_dtype=self.config.store_dtype)
        if timer and timer.spans["copy"]:
            copy, stall = timer.seconds("copy"), timer.seconds("stall")
            stats.copy_seconds, stats.stall_seconds = copy, stall
            stats.hidden_fraction = max(0.0, 1 - stall / copy) if copy > 0 else None
            stats.copy_gbps = misses * self.block_bytes / copy / 1e9 if copy > 0 else None
        return tokens, (torch.stack(kept, 1) if keep_logits else None), stats

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Drop the GPU buffers and the CUDA graph, and unpin and free the host store if this engine made it
        (idempotent; also done on `with`-exit and when the engine is garbage collected)."""
        if self.cuda:
            torch.cuda.synchronize()
        self.kv, self.caches, self.ck, self.quest, self.host, self.host_scales = {}, {}, {}, {}, {}, {}
        self.drop_graph()
        self._finalizer()

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
