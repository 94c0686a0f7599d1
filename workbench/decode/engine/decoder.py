"""Decode loop for a Llama-family model with five KV placements (SparDA's decode schedule and its baselines).

Modes:
- `dense-resident`: all KV on the GPU, every block attended.
- `sparse-resident`: all KV on the GPU, attention over the selected blocks (selector `same-layer` or
  `forecast`).
- `sparse-offload-sync`: layer 0 resident, other layers' KV in the pinned host store; each layer selects
  with its own query (InfLLM-V2), copies its missing blocks into its GPU block cache, then attends.
- `sparse-offload-forecast`: layer l's Forecast head picks layer l+1's blocks; their misses are copied on a
  side stream while layer l computes; layer l+1 waits on an event for its copy.
- `forecast-without-prefetch`: forecast selection, but each layer's copy runs on the main stream just
  before its attention (the ablation: selection without overlap).

The same code runs on the CPU (no streams; PyTorch reference kernels by default), which is how
losslessness is tested: offload modes must produce exactly the tokens of sparse-resident with the same
selector. Shapes: B sequences, Hq query heads, Hkv KV heads, D head_dim, 64-token blocks.
"""
from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench.decode.engine.cache import BlockCache
from workbench.decode.engine.hooks import CopyTimer, StepHooks
from workbench.decode.engine.llama import LlamaLayers
from workbench.decode.engine.select import CompressedKeyBuffer, all_blocks, select_decode
from workbench.decode.engine.store import BLOCK, BlockStore, GiB, StoreCapacityError, StoreSpec, host_memory_available
from workbench.decode.quest import QuestPages
from workbench.patterns.infllm import Budget

MODES = ("dense-resident", "sparse-resident", "sparse-offload-sync", "sparse-offload-forecast",
         "forecast-without-prefetch")
SELECTORS = ("same-layer", "forecast", "quest")  # quest: workbench.decode.quest page bounds
OFFLOAD = MODES[2:]
SelectHook = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EngineConfig:
    """How to decode. `selector` only matters for sparse-resident (offload modes fix their own; "quest"
    also replaces InfLLM-V2 in sparse-offload-sync);
    `cache_blocks` = GPU cache slots per (sequence, KV head), default budget.total; `ctas` = programs of
    the gather kernel; `kernels` = "triton", "torch" (reference) or "auto" (Triton on CUDA)."""

    mode: str = "sparse-offload-forecast"
    budget: Budget = field(default_factory=Budget)
    selector: str = "same-layer"
    cache_blocks: int | None = None
    ctas: int = 16
    kernels: str = "auto"
    splits: int | None = None

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
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels {self.kernels!r}: choose auto, triton or torch")

    @property
    def uses_forecast(self) -> bool:
        return self.mode in ("sparse-offload-forecast", "forecast-without-prefetch") or (
            self.mode == "sparse-resident" and self.selector == "forecast")


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


def kv_bytes(config: EngineConfig, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, batch: int,
             max_tokens: int) -> tuple[int, int]:
    """(GPU bytes, pinned host bytes) a `DecodeEngine` of `config` allocates for `batch` sequences of up to
    `max_tokens` tokens: resident KV (every layer, or layer 0 when offloading), per-layer block caches,
    compressed keys; the host store holds the other layers' KV. Both are linear in `batch`."""
    esize = torch.tensor([], dtype=dtype).element_size()
    nb = math.ceil(max_tokens / BLOCK)
    block_bytes = 2 * BLOCK * head_dim * esize
    offload, sparse = config.mode in OFFLOAD, config.mode != "dense-resident"
    gpu = (1 if offload else layers) * batch * kv_heads * nb * block_bytes
    if offload:
        gpu += (layers - 1) * batch * kv_heads * (config.cache_blocks or config.budget.total) * block_bytes
    if sparse:
        gpu += layers * batch * kv_heads * ((max_tokens // config.budget.stride + 2) * esize + 32 * 4) * head_dim
    host = StoreSpec(layers - 1, batch, kv_heads, nb, head_dim, dtype).nbytes if offload else 0
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
        self.lm = lm = LlamaLayers(model)
        self.config, self.batch, self.select_hook = config, batch, select_hook
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if max_tokens > lm.max_positions:
            raise StoreCapacityError(f"{max_tokens} tokens exceed the model's {lm.max_positions} positions: "
                                     "use a shorter --context or fewer --steps")
        if config.mode != "dense-resident":
            check_budget(config.budget, max_tokens)
        self.device, self.dtype = lm.device, lm.dtype
        self.n_blocks = nb = math.ceil(max_tokens / BLOCK)
        self.max_tokens = nb * BLOCK
        L, Hkv, D = lm.n_layers, lm.n_kv_heads, lm.head_dim
        self.offload = config.mode in OFFLOAD
        self.sparse = config.mode != "dense-resident"
        self.capacity = config.cache_blocks or config.budget.total
        resident_layers = 1 if self.offload else L
        self.block_bytes = 2 * BLOCK * D * torch.tensor([], dtype=self.dtype).element_size()
        gpu_need, self.host_kv_bytes = kv_bytes(config, layers=L, kv_heads=Hkv, head_dim=D, dtype=self.dtype,
                                                batch=batch, max_tokens=max_tokens)
        self.gpu_kv_bytes = gpu_need
        spec = StoreSpec(L - 1, batch, Hkv, nb, D, self.dtype) if self.offload else None
        # --- refuse before allocating anything
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            if gpu_need > free:
                raise StoreCapacityError(f"{config.mode} needs {gpu_need / GiB:.2f} GiB of GPU memory for KV "
                                         f"(batch {batch} x {self.max_tokens} tokens) but {free / GiB:.2f} GiB "
                                         "are free: reduce --batch or --context, or use an offload mode")
        elif not self.offload:
            limit = int(0.9 * host_memory_available()) if host_limit_bytes is None else host_limit_bytes
            if gpu_need > limit:
                raise StoreCapacityError(f"{config.mode} needs {gpu_need / GiB:.2f} GiB for KV but only "
                                         f"{limit / GiB:.2f} GiB of host memory may be used: reduce --batch or --context")
        if self.offload:
            self._own_store = store is None
            if store is None:
                store = BlockStore(spec, limit_bytes=host_limit_bytes)
            elif store.spec.layers < L - 1 or store.spec.kv_heads != Hkv or store.spec.head_dim != D \
                    or store.spec.dtype != self.dtype:
                raise StoreCapacityError(f"the given store {store.spec} does not match {L - 1} layers, {Hkv} heads, "
                                         f"head_dim {D}, {self.dtype}: make a store for this model")
            self.store = store
            self.host = [store.view(i, batch, nb) for i in range(L - 1)]  # checks the size
        self.triton, self._decode, self._gather, self._append = _kernels(config.kernels, self.device)
        dev = self.device
        # --- allocate
        self.kv = [torch.zeros(2, batch, Hkv, nb, BLOCK, D, dtype=self.dtype, device=dev)
                   for _ in range(resident_layers)]
        self.caches = [BlockCache(batch, Hkv, self.capacity, nb, D, self.dtype, dev, fused=self.triton)
                       for _ in range(L - 1)] \
            if self.offload else []
        self.ck = [CompressedKeyBuffer(batch, Hkv, D, self.max_tokens, config.budget, dev, self.dtype) for _ in range(L)] \
            if self.sparse else []
        self.quest = [QuestPages(batch, Hkv, D, nb, dev) for _ in range(L)] \
            if self.sparse and config.selector == "quest" and not config.uses_forecast else []
        self.heads = None
        if config.uses_forecast:
            if heads is None:
                from workbench.core.model import model_shape
                from workbench.decode.forecast.heads import ForecastHeads

                heads = ForecastHeads.from_queries(model, model_shape(model, "engine", fp="-"))
            self.heads = heads.to(dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        row = torch.arange(batch * Hkv, device=dev).view(batch, Hkv, 1)
        self._row_resident = row * nb
        self.cuda = dev.type == "cuda"
        self.side = torch.cuda.Stream(dev) if self.cuda else None
        self.copy_done = [torch.cuda.Event() for _ in range(L)] if self.cuda else []
        self.hooks: list[StepHooks] = []
        self._graph: Any = None  # CUDA graph of one step (captured by `run(graph=True)`)
        self._graph_io: tuple[torch.Tensor, torch.Tensor] | None = None
        self._finalizer = weakref.finalize(self, _release, self.store if self.offload and self._own_store else None)

    # ------------------------------------------------------------------ filling the cache
    def _host_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.host[layer - 1]
        return k.view(-1, self.lm.head_dim), v.view(-1, self.lm.head_dim)

    def _kv_of(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, Hkv, n_blocks * 64, D]` K and V of a layer wherever it lives (resident or host store)."""
        if not self.offload or layer == 0:
            kv = self.kv[layer]
            return kv[0].flatten(2, 3), kv[1].flatten(2, 3)
        k, v = self.host[layer - 1]
        return k.flatten(2, 3), v.flatten(2, 3)

    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor], steps: int, prefilled: list | None = None) -> torch.Tensor:
        """Dense prefill of each prompt `[N_b]` (different lengths allowed) -> first tokens `[B]`.

        Refuses (before writing anything) prompts whose length + `steps` exceeds the engine's capacity.
        `prefilled[b]` may hold `LlamaLayers.prefill(prompts[b])` computed earlier (to compare modes).
        """
        if len(prompts) != self.batch:
            raise ValueError(f"got {len(prompts)} prompts for an engine of batch {self.batch}")
        longest = max(int(p.numel()) for p in prompts)
        if min(int(p.numel()) for p in prompts) < 1:
            raise ValueError("a prompt is empty: give at least one token per sequence")
        if longest + steps > self.max_tokens:
            raise StoreCapacityError(f"the longest prompt ({longest} tokens) + {steps} steps exceeds the engine's "
                                     f"capacity of {self.max_tokens} tokens: make the engine with a larger "
                                     "max_tokens (--context) or decode fewer --steps")
        first = torch.empty(self.batch, dtype=torch.long, device=self.device)
        for b, ids in enumerate(prompts):
            ks, vs, logits = prefilled[b] if prefilled else self.lm.prefill(ids.reshape(-1))
            n = ids.numel()
            for layer, (k, v) in enumerate(zip(ks, vs)):
                dk, dv = self._kv_of(layer)
                dk[b, :, :n] = k.to(dk.device)
                dv[b, :, :n] = v.to(dv.device)
                if self.sparse:
                    self.ck[layer].fill(b, k)
                if self.quest:
                    self.quest[layer].fill(b, k)
            first[b] = logits.argmax()
            self.positions[b] = n
        return first

    @torch.no_grad()
    def fill_synthetic(self, lengths: list[int], seed: int = 0, fill_host: bool = True) -> None:
        """Benchmark start: random KV and compressed keys as if prompts of `lengths` were prefilled.
        `fill_host=False` leaves the host store as it is (a benchmark fills it once)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        if len(lengths) != self.batch or max(lengths) > self.max_tokens:
            raise StoreCapacityError(f"need {self.batch} lengths of at most {self.max_tokens} tokens, got {lengths}")
        for layer in range(self.lm.n_layers):
            if self.offload and layer > 0 and not fill_host:
                continue
            dk, dv = self._kv_of(layer)
            for t in (dk, dv):
                for b in range(self.batch):  # one sequence at a time bounds the staging buffer
                    src = torch.randn(t.shape[1:], generator=g, device=self.device, dtype=torch.float32)
                    t[b].copy_(src.to(self.dtype))
        for ck in self.ck:
            ck.keys.normal_(generator=g)
            ck.tail.normal_(generator=g)
        self.positions.copy_(torch.tensor(lengths, device=self.device))

    # ------------------------------------------------------------------ one decode step
    def _hooked(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        return self.select_hook(layer, blocks, self.positions) if self.select_hook else blocks

    def _forecast(self, target: int, h: torch.Tensor, cosf: torch.Tensor, sinf: torch.Tensor,
                  visible_upto: torch.Tensor) -> torch.Tensor:
        f = self.heads.query(target, h, cosf, sinf)  # [B, Hkv, 1, D]
        return self._hooked(target, select_decode(f, self.ck[target], self.positions, visible_upto, self.n_blocks,
                                                  self.config.budget, fused=self.triton))

    def _copy(self, layer: int, plan: Any) -> None:
        """Gather `plan`'s missing blocks of `layer` from the host store into its cache (current stream)."""
        cache = self.caches[layer - 1]
        hk, hv = self.host[layer - 1]
        src_k, src_v = hk.view(-1, BLOCK * self.lm.head_dim), hv.view(-1, BLOCK * self.lm.head_dim)
        dst_k, dst_v = cache.k.view(cache.k.shape[0], -1), cache.v.view(cache.v.shape[0], -1)
        self._emit("copy_start", layer)
        if self.triton:
            self._gather(src_k, src_v, dst_k, dst_v, plan.src, plan.dst, plan.count, ctas=self.config.ctas)
        else:
            self._gather(src_k, src_v, dst_k, dst_v, plan.src, plan.dst, plan.count)
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
        lm, cfg, pos = self.lm, self.config, self.positions
        B, Hkv, D, L = self.batch, lm.n_kv_heads, lm.head_dim, lm.n_layers
        G = lm.n_heads // Hkv
        x = lm.embed(tokens.view(B, 1))
        cos, sin = lm.rope(pos.view(B, 1))
        cosf, sinf = lm.rope(pos.view(B, 1), torch.float32) if self.heads is not None else (None, None)
        forecast: dict[int, torch.Tensor] = {}
        plans: dict[int, Any] = {}
        prefetch = cfg.mode == "sparse-offload-forecast"
        for layer in range(L):
            self._emit("layer_start", layer)
            h = lm.norm_in(layer, x)
            q, k, v = lm.qkv(layer, h, cos, sin)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, H, D]
            offloaded = self.offload and layer > 0
            if self.heads is not None and layer + 1 < L:
                # Layer l's head picks layer l+1's blocks before layer l+1 has seen this token. Selection and
                # block-map update stay on the main stream; only the copy goes to the side stream.
                forecast[layer + 1] = blocks_next = self._forecast(layer + 1, h, cosf, sinf, pos - 1)
                if prefetch:
                    plans[layer + 1] = plan = self.caches[layer].plan(blocks_next)
                    if self.cuda:
                        self.side.wait_stream(torch.cuda.current_stream())  # selection and plan are ready
                        with torch.cuda.stream(self.side):
                            self._copy(layer + 1, plan)
                            self.copy_done[layer + 1].record(self.side)
                    else:
                        self._copy(layer + 1, plan)
            if self.sparse:  # compressed keys first: the same-layer selection sees the window this token completes
                ck = self.ck[layer]
                self._append(k, v, pos, None, None, tail=ck.tail, ckeys=ck.keys, stride=cfg.budget.stride)
            if self.quest:
                self.quest[layer].append(k, pos)
            # ---- this layer's selection
            if not self.sparse:
                blocks = all_blocks(pos, Hkv, self.n_blocks)
            elif cfg.uses_forecast:
                blocks = forecast[layer] if layer > 0 else self._forecast(0, h, cosf, sinf, pos)
            elif self.quest:
                blocks = self._hooked(layer, self.quest[layer].select(q.view(B, Hkv, G, D), pos, self.n_blocks, cfg.budget))
            else:
                blocks = self._hooked(layer, select_decode(q.view(B, Hkv, G, D), self.ck[layer], pos, pos,
                                                           self.n_blocks, cfg.budget, fused=self.triton))
            # ---- KV in place (blocks copied, the new token written wherever it is read), then attention
            if offloaded:
                cache = self.caches[layer - 1]
                self._emit("wait_start", layer)
                if prefetch:
                    plan = plans[layer]
                    if self.cuda:
                        torch.cuda.current_stream().wait_event(self.copy_done[layer])
                else:
                    plan = cache.plan(blocks)
                    self._copy(layer, plan)
                self._emit("wait_end", layer)
                hk, hv = self.host[layer - 1]
                self._append(k, v, pos, cache.k, cache.v, slot_of=cache.slot_of, host_k=hk.flatten(2, 3),
                             host_v=hv.flatten(2, 3))
                k_pool, v_pool, slots = cache.k, cache.v, plan.slots
            else:
                kv = self.kv[layer]
                k_pool, v_pool = kv[0].view(-1, BLOCK, D), kv[1].view(-1, BLOCK, D)
                self._append(k, v, pos, k_pool, v_pool, n_blocks=self.n_blocks)
                slots = torch.where(blocks >= 0, blocks + self._row_resident, -1)
            if self.triton:
                o = self._decode(q, k_pool, v_pool, blocks, slots, pos + 1, lm.scale, splits=cfg.splits)
            else:
                o = self._decode(q, k_pool, v_pool, blocks, slots, pos + 1, lm.scale)
            x = lm.finish(layer, x, o.reshape(B, 1, -1))
            self._emit("layer_end", layer)
        self.positions += 1
        return lm.logits(x)[:, 0]

    # ------------------------------------------------------------------ generation and timing
    def _counters(self) -> tuple[int, int]:
        if not self.caches:
            return 0, 0
        return int(sum(c.hits for c in self.caches)), int(sum(c.misses for c in self.caches))

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
            gpu_kv_bytes=self.gpu_kv_bytes, host_kv_bytes=self.host_kv_bytes)
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
        self.kv, self.caches, self.ck, self.quest, self.host = [], [], [], [], []
        self.drop_graph()
        self._finalizer()

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
