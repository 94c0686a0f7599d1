"""Sparse prefill of a whole transformers model from a HeadConfig, through `attention_override`.

`SparsePrefill(model, shape, config)` is a context manager: inside it, every attention call of a
prefill (query length = key length = n >= `min_length`) builds the online index of each head as the
config prescribes and runs sparse attention; everything else runs the model's dense SDPA:

- decode steps (query length 1) and chunked prefill over a cached prefix (query length < key length);
- prompts shorter than `min_length` (dense wins below the crossover measured on the H200);
- layers outside `layers` (diagnostic mode: sparsity on a chosen set of layers only);
- layers whose heads are all "dense" in the config;
- calls that carry an explicit attention mask (padding): the sparse kernels are causal-only.

Layers the model fixes (sliding window, e.g. 15 of Gemma-3-270M's 18) carry the model's window mask; their
config entries are the same window (`HeadEntry.model_fixed`: A-shape, no sink), so they run sparse through
the same kernels, exactly as the model does, as long as the mask is that window and nothing else (batch 1,
no padding: checked per row); otherwise they run the model's own attention.

The model's own projections, RoPE and KV cache are untouched, so the full KV cache is still written.
Backends: on CUDA the Triton kernels over physical tiles (`workbench_kernels.prefill.sparse_prefill`, index from
the Triton VS builder and the pooled block proxy): a layer of one kind in one launch on that kind's route, a layer of
several kinds in one launch over the merged tiles, or one launch per kind where an A-shape head would keep that
launch off the Gluon kernel (`kinds_attention`, `per_kind`); on CPU an exact PyTorch reference (SDPA under the
config's row masks, row chunk by row chunk, over only the keys some head of the chunk reads).

`timing=True` records, per layer of the last prefill, T_proj (q/k/v/o projections), T_index, T_sparse
(the attention kernel; dense SDPA on dense layers) and T_other (the rest of the layer: norms, RoPE,
cache update, MLP, residuals), with CUDA events on a GPU and wall time on the CPU.
"""
from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from workbench_kernels.index_ref import expand_groups, merge_tiles, widened, write_heads
from workbench_kernels.tiling import NO_WINDOW

from workbench.config import HeadConfig
from workbench.core.attention import attention_override, dense_attention
from workbench.core.device import model_device
from workbench.core.model import ModelShape
from workbench.core.timing import stamp
from workbench.patterns import Dense, pattern_class
from workbench.patterns.base import Band
from workbench.prefill.index_graph import IndexGraphs
from workbench.prefill.tiles import band_mask, tile_rows

# Prefill length below which prompts run dense: the first measured length at which the sparse model
# (block-sparse top-100 and A-shape configs, Llama-3-8B shape, bf16, H200) beats dense SDPA end to end;
# interpolated crossovers are 22K-25K tokens (assets/benchmarks/prefill_e2e_h200.json).
DEFAULT_MIN_LENGTH = 32768
ROW_CHUNK = 256


@dataclass
class LayerPlan:
    """One layer's query heads grouped by config kind (in order of first appearance), with each head's
    config params. Every registered pattern kind runs through its class's `layer_tiles`."""

    heads: dict[str, list[int]]
    params: dict[str, list[dict[str, int]]]

    @property
    def all_dense(self) -> bool:
        return all(pattern_class(kind) is Dense for kind in self.heads)

    @functools.cached_property
    def online(self) -> bool:
        """Whether some kind builds an online index from q / k (not `PatternBase.static`)."""
        return any(not getattr(pattern_class(kind), "static", False) for kind in self.heads)

    @classmethod
    def from_config(cls, config: HeadConfig, layer: int) -> LayerPlan:
        heads: dict[str, list[int]] = {}
        params: dict[str, list[dict[str, int]]] = {}
        for h, e in enumerate(config.layer(layer)):
            heads.setdefault(e.pattern, []).append(h)
            params.setdefault(e.pattern, []).append(e.params)
        return cls(heads, params)


class SparsePrefill:
    """Run `model` with the sparse prefill `config` prescribes (use as `with SparsePrefill(...) as sp:`).

    config: a HeadConfig validated against `shape` (a mismatch raises ConfigError naming the field).
    min_length: prompts shorter than this run dense (default `DEFAULT_MIN_LENGTH`; 0 = always sparse).
    layers: the layers that run sparse (default all; diagnostic mode localises quality loss).
    backend: "auto" (Triton on CUDA, PyTorch reference on CPU), "triton", "torch" or "flex"
    (flex_attention over the same tiles: `workbench.prefill.flex`).
    compare: also run dense attention on every sparse layer and record the cosine of the two outputs
    (`cosine[layer]`, one value per query head; costs a dense attention per layer).
    timing: record the per-layer time breakdown of each prefill (`breakdown()`).
    record_density: keep each sparse layer's physical density (tile area / causal pairs, `density[layer]`;
    every backend). num_stages: the kernel's pipeline stages (None: the kernel's choice per head_dim,
    `workbench_kernels.prefill.default_config`).
    per_kind: True runs a layer of several kinds one launch per kind, each on its own route (`kinds_attention`: the
    Gluon kernel for its VS, block-sparse and A-shape heads, dense SDPA for its dense heads); False one launch over the
    merged tiles (the loop wherever a head carries an A-shape band: the Gluon kernel takes no band); None (default)
    per kind where a head carries a band and the Gluon kernel takes each kind alone (`launch_per_kind`).
    graph_index: on a GPU, replay each sparse layer's online index from a CUDA graph (`index_graph.IndexGraphs`:
    an index of a few heads is launch-bound; q and k are copied into the graph's buffers per call, its outputs live
    until the next layer's index). None (default): captured on a layer's second call at the same input shapes
    and kept only where its replay measured faster than the eager build (a length seen once runs eagerly; the last
    two lengths' graphs are kept); True: captured on the first call and kept; False: never.
    After use, `calls` counts attention calls per (mode, reason). `model=None` gives only the per-layer
    methods (`layer_index`, `layer_kernel`) on captured q/k/v, without entering the context.
    """

    def __init__(self, model: torch.nn.Module | None, shape: ModelShape, config: HeadConfig, *,
                 min_length: int = DEFAULT_MIN_LENGTH, layers: Iterable[int] | None = None,
                 backend: str = "auto", compare: bool = False, timing: bool = False,
                 record_density: bool = False, num_stages: int | None = None, strict_weights: bool = False,
                 graph_index: bool | None = None, per_kind: bool | None = None):
        config.validate(shape, strict_weights=strict_weights)
        if backend not in ("auto", "triton", "torch", "flex"):
            raise ValueError(f"backend={backend!r} is unknown: use 'auto', 'triton', 'torch' or 'flex'")
        if per_kind not in (None, True, False):
            raise ValueError(f"per_kind={per_kind!r} must be True (one launch per kind), False (one merged launch) or "
                             "None (per kind where that is faster)")
        if min_length < 0:
            raise ValueError(f"min_length={min_length} must be >= 0 tokens (0 = sparse at every length)")
        self.model, self.shape, self.config = model, shape, config
        self.min_length, self.backend, self.compare, self.num_stages = min_length, backend, compare, num_stages
        self.per_kind = per_kind
        self.layers = set(range(shape.n_layers)) if layers is None else {shape.check_layer(l) for l in layers}
        self.plans = [LayerPlan.from_config(config, l) for l in range(shape.n_layers)]
        self.calls: Counter[tuple[str, str]] = Counter()
        self.cosine: dict[int, torch.Tensor] = {}
        self.record_density = record_density
        self.density: dict[int, float] = {}
        self.timer = LayerTimer(model) if timing else None
        self._stack: contextlib.ExitStack | None = None
        self._head_index: dict[tuple, tuple[slice | torch.Tensor, slice | torch.Tensor]] = {}
        self._static: dict[tuple, Any] = {}  # per layer: what its static kinds add to the merged launch
        self.index_graphs = (None if graph_index is False else IndexGraphs(after=0) if graph_index
                             else IndexGraphs(after=1, keep_slower=False))

    # ---- context manager -----------------------------------------------------------------------
    def __enter__(self) -> SparsePrefill:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(attention_override(self.model, self.attention))
        if self.timer is not None:
            self._stack.enter_context(self.timer)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    def breakdown(self) -> list[dict[str, Any]]:
        """Per layer of the last prefill: proj/index/sparse/other/layer milliseconds and the mode."""
        if self.timer is None:
            raise ValueError("timing was off: create SparsePrefill(..., timing=True) to get a breakdown")
        return self.timer.breakdown()

    # ---- dispatch ------------------------------------------------------------------------------
    def mode(self, layer: int, q_len: int, k_len: int) -> tuple[str, str]:
        """("sparse" | "dense", reason) for one attention call."""
        if q_len != k_len or q_len == 1:
            return "dense", "decode" if q_len == 1 else "cached prefix"
        if q_len < self.min_length:
            return "dense", "short"
        if layer not in self.layers:
            return "dense", "layer off"
        if self.plans[layer].all_dense:
            return "dense", "dense layer"
        return "sparse", "prefill"

    def attention(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """Same contract as `dense_attention`: q `[B, Hq, N, D]`, k/v `[B, Hkv, Nk, D]` -> `[B, N, Hq, D]`."""
        layer = module.layer_idx
        mode, reason = self.mode(layer, query.shape[2], key.shape[2])
        if mode == "sparse" and self.config.window(layer) is not None:
            if self.window_only(layer, attention_mask):
                reason = "fixed window"
            else:
                mode, reason = "dense", "attention mask"
        elif mode == "sparse" and attention_mask is not None:  # padding or a custom mask: the kernels are causal-only
            mode, reason = "dense", "attention mask"
        self.calls[(mode, reason)] += 1
        timer = self.timer
        if mode == "dense":
            if timer:
                timer.mark(layer, "attn_start")
                timer.mark(layer, "index_end")
            out = dense_attention(module, query, key, value, attention_mask, **kwargs)
            if timer:
                timer.mark(layer, "attn_end", mode="dense", reason=reason)
            return out
        scale = kwargs.get("scaling") or module.scaling
        if timer:
            timer.mark(layer, "attn_start")
        backend = self.resolve_backend(query)
        index = self.layer_index(layer, query, key, scale, backend)
        if timer:
            timer.mark(layer, "index_end")
        o = self.layer_kernel(layer, index, query, key, value, scale, backend)
        if timer:
            timer.mark(layer, "attn_end", mode="sparse", reason=backend)
        if self.compare:
            ref = dense_attention(module, query, key, value, attention_mask, **kwargs)[0].transpose(1, 2)
            self.cosine[layer] = torch.nn.functional.cosine_similarity(
                o.float().flatten(2), ref.float().flatten(2), dim=-1).mean(0).cpu()
        return o.transpose(1, 2).contiguous(), None

    def window_only(self, layer: int, mask: torch.Tensor | None) -> bool:
        """Whether a fixed layer's mask `[1, 1, N, N]` (bool) is its sliding window and nothing else: row i
        keeps min(i + 1, window) keys (transformers builds it as causal AND window AND padding, so the count
        only falls short when padding removes keys)."""
        if mask is None or mask.dtype != torch.bool or mask.shape[0] != 1 or mask.shape[1] != 1:
            return False
        n = mask.shape[-1]
        keep = torch.arange(1, n + 1, device=mask.device).clamp(max=self.config.window(layer))
        return bool(torch.equal(mask[0, 0].sum(-1), keep))

    # ---- one layer: online index, then the kernel (also timed apart by `latency.time_model_layer`) ------
    def resolve_backend(self, q: torch.Tensor) -> str:
        """The backend this call runs: "auto" is Triton on CUDA, the PyTorch reference on the CPU."""
        return self.backend if self.backend != "auto" else ("triton" if q.is_cuda else "torch")

    def layer_index(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float, backend: str) -> Any:
        """The online index of one layer as `backend` consumes it: triton / flex -> (VSTiles over all
        heads, sink, window) for one launch; torch, and triton where `launch_per_kind` says -> the kinds' tiles
        (`group_tiles`)."""
        triton = backend == "triton" or (backend == "flex" and q.is_cuda)
        if backend == "torch":
            return self.group_tiles(layer, q, k, scale, triton=triton)

        def build(q: torch.Tensor, k: torch.Tensor) -> Any:
            groups = self.group_tiles(layer, q, k, scale, triton=triton)
            return groups if self.launch_per_kind(groups, q, backend) else self.merge(groups, q, layer)

        if self.index_graphs is not None and q.is_cuda and self.plans[layer].online:
            return self.index_graphs((layer, scale, triton), build, q, k)
        return build(q, k)

    def layer_kernel(self, layer: int, index: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float, backend: str) -> torch.Tensor:
        """Sparse attention of one layer under `layer_index`'s result -> o `[B, Hq, N, D]`: one launch over the
        merged tiles, or one per kind for the kinds' tiles (`kinds_attention`); a layer of one kind runs that kind's
        own kernel where it has one and takes the layer (`PatternBase.layer_attention`: A-shape's Gluon kernel, two
        heads on one K/V ring) unless `num_stages` is set."""
        if self.record_density:  # tile area / causal pairs; tiles per KV head serve its G query heads
            from workbench_kernels.index_ref import tile_area

            n = q.shape[2]
            parts = ([(len(h), t) for h, t, _ in index.values()] if isinstance(index, dict)
                     else [(q.shape[1], index[0])])
            area = sum(float(tile_area(t, n).sum()) * (h // t.shape[1]) for h, t in parts)
            self.density[layer] = area / (q.shape[0] * q.shape[1] * n * (n + 1) / 2)
        if backend == "torch":
            return self.reference(index, q, k, v, scale)
        if isinstance(index, dict):
            return self.kinds_attention(layer, index, q, k, v, scale)
        tiles, sink, window = index
        if backend == "flex":
            from workbench.prefill.flex import tiles_attention

            return tiles_attention(q, k, v, expand_groups(tiles, q.shape[1] // tiles.shape[1]), sink, window, scale)
        plan = self.plans[layer]
        if len(plan.heads) == 1:  # one kind: it may have a kernel of its own
            return self.kind_attention(layer, next(iter(plan.heads)), tiles, None if sink is None else (sink, window),
                                       q, k, v, scale)
        from workbench_kernels.prefill import sparse_prefill

        return sparse_prefill(q, k, v, tiles, sink=sink, window=window, scale=scale, num_stages=self.num_stages)[0]

    # ---- the index: physical tiles of one layer ---------------------------------------------------
    def _heads_on(self, layer: int, kind: str, heads: list[int], group: int, device: torch.device):
        """(query-head index, KV-head index) of one kind on `device`, each a slice where the heads are a
        contiguous run (a view, no gather) or a Long tensor copied there once and cached."""
        key = (layer, kind, group, device)
        if key not in self._head_index:
            def index(ids: list[int]) -> slice | torch.Tensor:
                if ids == list(range(ids[0], ids[0] + len(ids))):
                    return slice(ids[0], ids[0] + len(ids))
                return torch.tensor(ids, dtype=torch.long, device=device)
            self._head_index[key] = (index(heads), index([h // group for h in heads]))
        return self._head_index[key]

    def _groups_on(self, layer: int, kind: str, heads: list[int], group: int,
                   device: torch.device) -> slice | torch.Tensor:
        """The KV heads of a kind's query heads, each once, ascending (`_heads_on`'s slice or cached index)."""
        return self._heads_on(layer, (kind, "kv"), sorted({h // group for h in heads}), 1, device)[0]

    @torch.no_grad()
    def group_tiles(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float,
                    triton: bool = True) -> dict[str, tuple[list[int], Any, Band | None]]:
        """Per config kind of the layer: (its query heads, their tiles `[B, h, M]`, their token band or
        None), from the kind's pattern class (`layer_tiles`: online index on q's device, the Triton
        builders with `triton` where the kind has them). Tiles are the keys the kernel computes (the
        logical index plus its tile expansion). q `[B, Hq, N, D]`, k `[B, Hkv, N, D]`.
        Static kinds (`PatternBase.static`: A-shape, dense) get views of q's shape, no gather. Kinds that share an
        index per KV head (`PatternBase.kv_shared`) get their groups' KV heads and keep their tiles per KV head
        when they are the layer's one kind on the Triton path (the kernel runs them GQA-packed or on one K/V ring);
        otherwise their tiles are expanded per query head."""
        plan, G = self.plans[layer], q.shape[1] // k.shape[1]
        out = {}
        for kind, heads in plan.heads.items():
            cls = pattern_class(kind)
            if len(heads) == q.shape[1] and (G == 1 or cls.kv_shared):
                qh, kh = q, k
            elif getattr(cls, "static", False):  # reads q's shape and device only
                shape = (q.shape[0], len(heads), *q.shape[2:])
                qh, kh = q[:, :1].expand(shape), k[:, :1].expand(shape[:3] + k.shape[3:])
            elif cls.kv_shared:  # whole KV groups (the config's rule): q of their heads, k of their KV heads
                h, _ = self._heads_on(layer, kind, heads, G, q.device)
                qh, kh = q[:, h], k[:, self._groups_on(layer, kind, heads, G, q.device)]
            else:
                h, hk = self._heads_on(layer, kind, heads, G, q.device)
                qh, kh = q[:, h], k[:, hk]
            tiles, band = cls.layer_tiles(plan.params[kind], qh, kh, scale, self.config.proxy, self.config.block,
                                          triton=triton)
            if tiles.shape[1] != len(heads) and not (triton and len(plan.heads) == 1):
                tiles = expand_groups(tiles, len(heads) // tiles.shape[1])
            out[kind] = (heads, tiles, band)
        return out

    def launch_per_kind(self, groups: dict[str, tuple[list[int], Any, Band | None]], q: torch.Tensor,
                        backend: str) -> bool:
        """Whether a layer of several kinds (`group_tiles`' groups) runs one launch per kind (`kinds_attention`)
        instead of one over the merged tiles, on the Triton backend, as `per_kind` says; None: where some kind
        carries a token band (A-shape), which keeps the merged launch off the Gluon kernel, and the Gluon kernel
        takes each kind alone (`workbench_kernels.prefill.gluon_takes_kinds`)."""
        if backend != "triton" or len(groups) < 2:
            return False
        if self.per_kind is not None:
            return self.per_kind
        from workbench_kernels.prefill import gluon_takes_kinds

        return any(band is not None for _, _, band in groups.values()) and gluon_takes_kinds(q)

    def kinds_attention(self, layer: int, groups: dict[str, tuple[list[int], Any, Band | None]], q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """A layer of several kinds as one launch per kind, each on the route a layer of that kind alone takes (its
        `layer_attention` where it has one, else `sparse_prefill` over its tiles, so VS and block-sparse heads reach
        the Gluon kernel, which takes no A-shape masks): each kind's query heads gathered with their KV heads (the
        kind's KV groups where it holds them whole, else one KV head per query head), outputs written back.
        -> o `[B, Hq, N, D]`."""
        G = q.shape[1] // k.shape[1]
        o = torch.empty_like(q)
        for kind, (heads, tiles, band) in groups.items():
            h, hk = self._heads_on(layer, kind, heads, G, q.device)
            if len(heads) == G * len({x // G for x in heads}):  # whole groups (heads ascending): G heads to each
                hk = self._groups_on(layer, kind, heads, G, q.device)
            o[:, h] = self.kind_attention(layer, kind, tiles, band, q[:, h], k[:, hk], v[:, hk], scale)
        return o

    def kind_attention(self, layer: int, kind: str, tiles: Any, band: Band | None, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, scale: float) -> torch.Tensor:
        """The heads of one kind (q `[B, h, N, D]`, k / v their KV heads) on the route a layer of that kind alone
        takes: the kind's own kernel where it has one and takes them (`PatternBase.layer_attention`) unless
        `num_stages` is set, else `sparse_prefill` over `tiles` under `band` -> o `[B, h, N, D]`."""
        if self.num_stages is None:
            o = pattern_class(kind).layer_attention(self.plans[layer].params[kind], q, k, v, scale)
            if o is not None:
                return o
        from workbench_kernels.prefill import sparse_prefill

        sink, window = band if band is not None else (None, None)
        return sparse_prefill(q, k, v, tiles, sink=sink, window=window, scale=scale, num_stages=self.num_stages)[0]

    def merge(self, groups: dict[str, tuple[list[int], Any, Band | None]], q: torch.Tensor, layer: int | None = None):
        """One launch's (VSTiles over all Hq heads, sink `[Hq]` | None, window `[Hq]` | None): the kinds'
        tiles scattered into head order; heads without a band get none (sink 0, window NO_WINDOW).

        With `layer`, what the layer's static kinds contribute (their tiles scattered into a full-width
        layout, and the whole sink / window, which only static kinds set) is built once per (layer, batch,
        length, device) and cached: a call then clones that layout and writes the online kinds into it."""
        B, hq, n = q.shape[:3]
        dev = q.device
        parts = [(heads, tiles) for heads, tiles, _ in groups.values()]
        bands = [(heads, band) for heads, _, band in groups.values() if band is not None]
        static = [] if layer is None else [kind for kind in groups if getattr(pattern_class(kind), "static", False)]
        cached_band = bool(static) and all(getattr(pattern_class(kind), "static", False)
                                           for kind, (_, _, band) in groups.items() if band is not None)

        def band_of() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if not bands:
                return None, None
            if not cached_band:
                return self._bands(bands, hq, dev, head_index)
            key = (layer, "band", dev)
            if key not in self._static:
                self._static[key] = self._bands(bands, hq, dev, head_index)
            return self._static[key]

        def head_index(ids: list[int]) -> slice | torch.Tensor:  # cached on the device per layer and head set
            return self._heads_on(layer, ("heads", tuple(ids)), ids, 1, dev)[0]

        if len(parts) == 1:
            return (parts[0][1], *band_of())
        if not static:
            return (merge_tiles(parts, hq, head_index=None if layer is None else head_index), *band_of())
        t0 = parts[0][1]
        key = (layer, B, n, t0.block, t0.piece, dev)
        if key not in self._static:
            self._static[key] = merge_tiles([groups[kind][:2] for kind in static], hq, cover=False,
                                            head_index=None if layer is None else head_index)
        base = self._static[key]
        online = [(kind, *groups[kind][:2]) for kind in groups if kind not in static]
        if not online:
            return (base, *band_of())
        tiles = widened(base, [t for _, _, t in online])
        for kind, heads, t in online:
            if t.shape != (B, len(heads), base.shape[2]):
                raise ValueError(f"tiles for heads {heads} have shape {t.shape}, expected {(B, len(heads), base.shape[2])}")
            write_heads(tiles, self._heads_on(layer, kind, heads, 1, dev)[0], t)
        return (tiles, *band_of())

    @staticmethod
    def _bands(bands: list[tuple[list[int], Band]], hq: int, device: torch.device,
               head_index: Callable[[list[int]], slice | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sink / window Int32 `[hq]` on `device` from the kinds' bands (`head_index`: a kind's heads there, cached)."""
        sink = torch.zeros(hq, dtype=torch.int32, device=device)
        window = torch.full((hq,), NO_WINDOW, dtype=torch.int32, device=device)
        for heads, band in bands:
            h = head_index(heads)
            sink[h], window[h] = band[0].to(device, torch.int32), band[1].to(device, torch.int32)
        return sink, window

    @torch.no_grad()
    def reference(self, groups: dict[str, tuple[list[int], Any, Band | None]], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, scale: float) -> torch.Tensor:
        """The kernel's result in PyTorch, one config kind at a time: exact SDPA under its tiles' row masks
        (and its token band). -> o `[B, Hq, N, D]`."""
        G = q.shape[1] // k.shape[1]
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        for heads, tiles, band in groups.values():
            h = torch.tensor(heads, device=q.device)

            rows = functools.partial(tile_rows, tiles, band=band)
            o[:, h] = masked_prefill(q[:, h], k[:, h // G], v[:, h // G], rows, scale)
        return o


def band_rows(sink: torch.Tensor, window: torch.Tensor, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The A-shape mask of rows r0..r1-1 (j <= i and (j < sink or i - j < window)) over the keys some
    head reads: (keys Long `[K]`, mask Bool `[H, r1 - r0, K]`)."""
    lo = max(0, r0 - int(window.max()) + 1)
    keys = torch.cat([torch.arange(min(int(sink.max()), lo)), torch.arange(lo, r1)])
    causal = keys[None, :] <= torch.arange(r0, r1)[:, None]
    return keys, causal & band_mask(sink, window, keys, r0, r1)


@torch.no_grad()
def masked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], scale: float,
                   chunk: int = ROW_CHUNK) -> torch.Tensor:
    """Exact attention under a row mask, in PyTorch (the CPU reference of the sparse kernel).

    q `[B, Hq, N, D]`, k/v `[B, Hkv, N, D]`; `rows(r0, r1)` -> (keys Long `[K]`, mask Bool `[B or 1, Hq,
    r1 - r0, K]` or `[Hq, r1 - r0, K]`): the keys rows r0..r1-1 may read and which of them each head
    reads. Returns o `[B, Hq, N, D]`; rows go `chunk` at a time (SDPA under the mask over the gathered
    keys, GQA without repeating k/v)."""
    n = q.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for r0 in range(0, n, chunk):
        r1 = min(r0 + chunk, n)
        keys, mask = rows(r0, r1)
        keys, mask = keys.to(q.device), mask.to(q.device)  # band_rows builds its small masks on the CPU
        out[:, :, r0:r1] = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, r0:r1], k[:, :, keys], v[:, :, keys], attn_mask=mask, scale=scale, enable_gqa=True)
    return out


class LayerTimer:
    """Per-layer event marks of one forward: layer start/end (decoder layer hooks), the four projections
    (hooks on q/k/v/o_proj), and attention start / index end / attention end (marked by the caller).
    CUDA events on a GPU (no sync until `breakdown`), perf_counter on the CPU."""

    PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, model: torch.nn.Module):
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or not all(hasattr(layers[0].self_attn, p) for p in self.PROJ):
            raise ValueError(f"timing needs decoder layers with self_attn.{{q,k,v,o}}_proj; "
                             f"{type(model).__name__} has other names: run without timing")
        self.layers = layers
        self.cuda = next(model.parameters()).is_cuda
        self.marks: dict[int, dict[str, Any]] = {}
        self.info: dict[int, dict[str, str]] = {}
        self._handles: list[Any] = []

    def _now(self) -> Any:
        return stamp(self.cuda)

    def mark(self, layer: int, name: str, **info: str) -> None:
        self.marks.setdefault(layer, {}).setdefault(name, []).append(self._now())
        if info:
            self.info[layer] = info

    def __enter__(self) -> LayerTimer:
        for i, layer in enumerate(self.layers):
            def start(_m, _a, i=i):
                if i == 0:
                    self.marks.clear()
                    self.info.clear()
                self.mark(i, "layer_start")

            self._handles.append(layer.register_forward_pre_hook(start))
            self._handles.append(layer.register_forward_hook(lambda _m, _a, _o, i=i: self.mark(i, "layer_end")))
            for p in self.PROJ:
                mod = getattr(layer.self_attn, p)
                self._handles.append(mod.register_forward_pre_hook(lambda _m, _a, i=i, p=p: self.mark(i, p + "_start")))
                self._handles.append(mod.register_forward_hook(lambda _m, _a, _o, i=i, p=p: self.mark(i, p + "_end")))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def breakdown(self) -> list[dict[str, Any]]:
        """[{layer, mode, reason, proj_ms, index_ms, sparse_ms, other_ms, layer_ms}] of the last forward."""
        if self.cuda:
            torch.cuda.synchronize()
        rows = []
        for layer in sorted(self.marks):
            m = {name: v[-1] for name, v in self.marks[layer].items()}
            if "layer_end" not in m or "attn_end" not in m:
                continue
            total = self._ms(m["layer_start"], m["layer_end"])
            proj = sum(self._ms(m[p + "_start"], m[p + "_end"]) for p in self.PROJ)
            index = self._ms(m["attn_start"], m["index_end"])
            attn = self._ms(m["index_end"], m["attn_end"])
            rows.append({"layer": layer, **self.info.get(layer, {}), "proj_ms": proj, "index_ms": index,
                         "sparse_ms": attn, "other_ms": total - proj - index - attn, "layer_ms": total})
        return rows


def generate_greedy(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with the model's KV cache: prefill `input_ids` `[N]`, then one token at a time.
    Returns (new token ids `[T]`, the prefill's next-token logits `[vocab]` in fp32)."""
    import inspect

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    device = model_device(model)
    with torch.no_grad():
        out = model(input_ids.reshape(1, -1).to(device), use_cache=True, logits_to_keep=1)
        first = out.logits[0, -1].float()
        cache = out.past_key_values
        tokens = [int(first.argmax())]
        for _ in range(max_new_tokens - 1):
            if eos_token_id is not None and tokens[-1] == eos_token_id:
                break
            out = model(torch.tensor([[tokens[-1]]], device=device), use_cache=True, **{cache_kw: cache})
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return torch.tensor(tokens), first.cpu()

