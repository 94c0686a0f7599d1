"""Layer-major forward: the model's own decoder layers, one at a time over the whole prompt, in query chunks.

`capture_attention` runs the model once and keeps q/k/v of every layer (~51 GB at 128K for an 8B model).
Here layer l runs over the prompt chunk by chunk before layer l + 1 starts: its attention sees q of the
chunk and the layer's keys/values of [0, end), so after the last chunk the layer's full q, k and v are
in one buffer each, ready to be reduced (statistics, search evidence) and overwritten by the next layer.
Peak memory is the model + one hidden state `[N, hidden]` + one layer's q/k/v + one chunk's work (the
MLP of a 1M-token prompt at once would need 57 GB for Llama-3-8B; per 32K chunk it needs ~3 GB).

Nothing of the model is re-implemented: the per-layer inputs (position embeddings, position ids, masks)
come from the model's own forward, run once with recording stand-ins for its decoder layers, and each
chunk calls the model's decoder-layer module. Masks are not materialised (a [32K, 1M] mask is 32 GB):
each layer receives the model's own mask function (`ModelMask`), checked against what the attention
here computes - causal with the chunk's offset (lower-right aligned), within the layer's
`sliding_window` (Gemma-3, Mistral) - and a model whose mask differs (bidirectional, chunked) is refused.
On a GPU a full layer's chunk runs as two fused attention calls (cuDNN's, else flash attention's: the
keys before the chunk unmasked, the chunk's own keys causal) merged by their row log-sum-exps, which the
runner keeps for the kept layers (`row_lse`): the statistics and the search then skip their first pass.

- `LayerRunner(model).layers(ids, keep)`: yields (layer, q, k, v) of the kept layers, in order.
- `LayerRunner(model).steps(ids)`: yields (layer, hidden state) after each layer (no analysis: the dense
  prefill); `.forward(ids)` the final normed hidden state.
- `stream_capture(model, shape, ids, layers)`: a `Capture`-like view whose `layer_qkv(layer)` runs the
  forward up to that layer; `collect_evidence`, `pattern_fits` and `evaluate_config` read it as a Capture.
- `check_memory(...)`: refuses, before the forward, a prompt whose estimated peak does not fit.
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from workbench_kernels.prefill_ref import masked_attention_ref

from workbench.core.attention import attention_override, dense_attention
from workbench.core.capture import Capture
from workbench.core.device import model_device
from workbench.core.model import ModelError, ModelShape

GPU_CHUNK = 32768  # query rows per chunk on a GPU: the MLP of a chunk of Llama-3-8B is ~3 GB in bf16
CPU_CHUNK = 4096   # on the CPU: up to this length one chunk, i.e. exactly the model's own forward
GIB = 2 ** 30


class RunStopped(ModelError):
    """A streaming run stopped midway (Ctrl-C, out of memory); the message says where."""


def default_chunk(device: torch.device | str) -> int:
    return GPU_CHUNK if torch.device(device).type == "cuda" else CPU_CHUNK


class _Recorded(Exception):
    """Raised by the last recording stand-in: the model's forward stops before its final norm."""


class _Record(torch.nn.Module):
    """Stands in for decoder layer `index` during one forward: keeps the arguments the model passes it."""

    def __init__(self, index: int, store: list[Any], last: int):
        super().__init__()
        self.index, self.store, self.last = index, store, last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.store[self.index] = (args, kwargs)
        if self.index == self.last:
            raise _Recorded
        return hidden_states


@dataclass(frozen=True)
class ModelMask:
    """What the model asked its mask builder for (its mask function of (batch, head, query, key)), kept in
    place of the `[N, N]` tensor: the attention checks it against causal / sliding-window attention."""

    mask_function: Callable[..., Any] | None


def _model_mask(*args: Any, **kwargs: Any) -> ModelMask:
    return ModelMask(kwargs.get("mask_function"))


def check_mask(mask: Any, window: int | None, n: int) -> None:
    """Refuse a layer whose own mask function (`ModelMask`) is not causal attention (row i sees keys
    (i - window, i] with a sliding `window`) at probe positions of an n-token prompt: the streaming forward
    computes exactly that, without the mask tensor."""
    fn = getattr(mask, "mask_function", None)
    if fn is None:
        return
    w = window or n
    rows = torch.tensor(sorted({r for r in (0, 1, w - 1, w, w + 1, n // 2, n - 1) if 0 <= r < n}))[:, None]
    cols = (rows + torch.tensor([-w - 1, -w, 1 - w, -1, 0, 1, n])).clamp(0, n - 1)
    cols = torch.cat([cols, torch.zeros_like(rows)], 1)
    want = (cols <= rows) & (cols > rows - w)
    got = torch.as_tensor(fn(torch.tensor(0), torch.tensor(0), rows, cols)).to(torch.bool).expand_as(want).cpu()
    if not torch.equal(got, want):
        raise ModelError("this model's attention mask is not causal" + (f" with a {window}-token window" if window else "")
                         + " (bidirectional or chunked attention, packed prompts?): the streaming forward cannot "
                         "run it; use capture_attention on a shorter prompt")


def _tokens(obj: Any, n: int, start: int, end: int) -> Any:
    """`obj` with every tensor cut to tokens [start, end) along its first dimension of size n (position
    ids `[1, N]`, cos/sin `[1, N, D]`, cache positions `[N]`); tuples, lists and dicts are followed."""
    if isinstance(obj, torch.Tensor):
        dims = [d for d, size in enumerate(obj.shape) if size == n]
        return obj.narrow(dims[0], start, end - start) if dims else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_tokens(x, n, start, end) for x in obj)
    if isinstance(obj, dict):
        return {key: _tokens(x, n, start, end) for key, x in obj.items()}
    return obj


LseAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def _cudnn_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3])


def _flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3])


_LSE_OPS: dict[tuple[Any, ...], LseAttention | None] = {}  # input kind -> the fused kernel that takes it
FUSED_DTYPES = (torch.float16, torch.bfloat16)  # what the fused kernels compute in (SDPA sends them nothing else)
PROBE_TOKENS = 16  # rows and keys of the probe that a fused kernel must get right before it is used


def agrees_with_softmax(attend: LseAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        scale: float) -> bool:
    """Whether `attend` gives causal attention and its row lse on these inputs (`[1, H, T, D]`, T tokens),
    within the dtype's rounding: called directly, the fused ops skip SDPA's input checks, so one may run on
    inputs it does not support and return NaN or wrong values instead of raising."""
    out, lse = attend(query, key, value, True, scale)
    t = query.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril().expand(1, query.shape[1], t, t)
    want, want_lse = masked_attention_ref(query, key, value, causal, scale)
    return bool(torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2)
                and torch.allclose(lse.float(), want_lse, atol=2e-2, rtol=1e-2))


def lse_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> LseAttention | None:
    """A fused attention kernel that also returns each row's log-sum-exp, for inputs like these: called as
    `attend(q, k, v, causal, scale)` -> (out `[1, Hq, C, D]`, lse `[1, Hq, C]` fp32, natural log of the
    scaled scores), GQA-native, `causal` for a square block. cuDNN's where it takes these inputs (on the
    H200 1.8x flash attention's speed at 1M keys), else flash attention's; None on the CPU, in fp32 (flash
    raises; cuDNN's op, called directly, runs on fp32 inputs and returns non-finite values: H200, torch 2.11,
    which made Gemma-3's fp32 search at 32K stop on NaN q / k) or where neither agrees with plain attention on
    the first PROBE_TOKENS tokens. Probed once per kind of input (device, dtype, heads, head_dim)."""
    if not query.is_cuda or query.dtype not in FUSED_DTYPES:
        return None
    kind = (query.device, query.dtype, query.shape[1], key.shape[1], query.shape[-1])
    if kind not in _LSE_OPS:
        _LSE_OPS[kind] = None
        t = min(PROBE_TOKENS, query.shape[2], key.shape[2])
        for op in (_cudnn_lse, _flash_lse):
            try:
                ok = agrees_with_softmax(op, query[:, :, :t], key[:, :, :t], value[:, :, :t], scale)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:  # this kernel does not take these inputs (dtype, head_dim, GQA, GPU)
                continue
            if ok:
                _LSE_OPS[kind] = op
                break
    return _LSE_OPS[kind]


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of A and B together from attention over each: out `[..., C, D]` and lse
    `[..., C]` (natural log) of both -> (out in out_a's dtype, lse fp32), weights exp(lse_x - lse)."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    out = out_a.float().mul_((lse_a - lse).exp_()[..., None])
    out.add_(out_b.float().mul_((lse_b - lse).exp_()[..., None]))
    return out.to(out_a.dtype), lse


def split_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int, scale: float,
                           attend: LseAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of rows [start, start + C) over keys [0, start + C) as two calls of `attend`: the
    chunk's own keys (a causal square) and, from the second chunk on, the keys before it (no mask), merged
    by their log-sum-exps. query `[1, Hq, C, D]`, key/value `[1, Hkv, start + C, D]` -> (out `[1, Hq, C, D]`,
    lse `[1, Hq, C]` fp32)."""
    own = attend(query, key[:, :, start:], value[:, :, start:], True, scale)
    if start == 0:
        return own
    return merge_partials(*attend(query, key[:, :, :start], value[:, :, :start], False, scale), *own)


def chunk_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    start: int, window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of query rows [start, start + C) over keys [0, start + C).

    query `[1, Hq, C, D]`, key/value `[1, Hkv, start + C, D]` -> (`[1, C, Hq, D]`, the rows' lse `[1, Hq, C]`
    or None). `window` (a sliding layer): row i sees keys (i - window, i], through SDPA with a mask. A full
    layer on a GPU: `split_causal_attention` on the fused kernel of `lse_kernel` (no mask tensor; the
    lse comes free and spares the statistics their first pass). Elsewhere the first chunk is the model's
    own SDPA call and later chunks are lower-right causal SDPA, with no lse."""
    from torch.nn.attention.bias import causal_lower_right

    c, e = query.shape[2], key.shape[2]
    if window is not None and window < e:
        k0 = max(0, start - window + 1)  # the first key any row of this chunk sees
        rows = torch.arange(start, e, device=query.device)[:, None]
        cols = torch.arange(k0, e, device=query.device)[None]
        mask = (cols <= rows) & (cols > rows - window)
        return dense_attention(module, query, key[:, :, k0:], value[:, :, k0:], mask[None, None], **kwargs)[0], None
    scale = kwargs.get("scaling") or module.scaling
    attend = lse_kernel(query, key, value, scale)
    if attend is not None:
        out, lse = split_causal_attention(query, key, value, start, scale, attend)
        return out.transpose(1, 2).contiguous(), lse
    if start == 0:
        return dense_attention(module, query, key, value, None, **kwargs)[0], None
    gqa = query.shape[1] != key.shape[1]
    if gqa and query.is_cuda:
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        if not can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, True)):
            group = query.shape[1] // key.shape[1]  # flash cannot take these inputs: no GQA in the other kernels
            key, value, gqa = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), False
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(c, e),
                                                           scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


@dataclass
class _LayerState:
    """What the attention function of the running layer writes: the chunk offset and the layer's buffers."""

    start: int = 0
    keep_q: bool = False
    q: torch.Tensor | None = None  # [1, Hq, N, D]
    k: torch.Tensor | None = None  # [1, Hkv, N, D]
    v: torch.Tensor | None = None
    lse: torch.Tensor | None = None  # [1, Hq, N] fp32: the kept layer's row log-sum-exps, when every chunk gave them
    lse_ok: bool = False

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in (("q", self.q), ("k", self.k), ("v", self.v), ("lse", self.lse))
                if t is not None}


# The buffers of the last finished run, by weak reference: alive only while a caller still holds a layer's
# tensors (e.g. the last q/k of the previous sample), and then reused by the next run instead of a second copy.
_spare: dict[str, weakref.ref] = {}


def _buffer(old: torch.Tensor | None, like: torch.Tensor, n: int) -> torch.Tensor:
    shape = (like.shape[0], like.shape[1], n, *like.shape[3:])
    if old is not None and old.shape == shape and old.dtype == like.dtype and old.device == like.device:
        return old
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def spare_bytes(device: torch.device) -> int:
    """Bytes of the last run's buffers on `device` that callers still hold (the next run reuses them)."""
    alive = [ref() for ref in _spare.values()]
    return sum(t.numel() * t.element_size() for t in alive if t is not None and t.device == device)


@dataclass
class LayerRunner:
    """Runs `model`'s decoder layers one at a time over a whole prompt, `chunk` query rows per call.

    `position` is (layer, token) of the work in progress, for messages when a run stops midway;
    `forward_seconds` the wall time spent in the forward (the consumer's work between layers excluded).
    """

    model: torch.nn.Module
    chunk: int | None = None
    progress: bool = True
    position: tuple[int, int] = (0, 0)
    forward_seconds: float = 0.0
    setup_seconds: float = 0.0
    layer_seconds: list[float] = field(default_factory=list)
    _state: _LayerState = field(default_factory=_LayerState)

    def __post_init__(self):
        self.device = model_device(self.model)
        self.chunk = default_chunk(self.device) if self.chunk is None else self.chunk
        if self.chunk < 1:
            raise ModelError(f"chunk={self.chunk}: give a positive number of query rows per chunk (--chunk)")

    @property
    def decoder(self) -> Any:
        return self.model.model

    @property
    def row_lse(self) -> torch.Tensor | None:
        """`[Hq, N]` fp32: the log-sum-exp of each query row's scaled scores (natural log) of the kept layer
        just yielded, as the forward's attention computed it (`chunk_attention`); None where it gave none
        (the CPU, a sliding-window layer, inputs the fused kernels do not take). The statistics and the
        search read it instead of their first pass. Valid until the next layer is asked for."""
        st = self._state
        return st.lse[0] if st.keep_q and st.lse_ok and st.lse is not None else None

    def _attend(self, module, query, key, value, attention_mask, **kwargs):
        st = self._state
        s, e = st.start, st.start + query.shape[2]
        n = self._n
        st.k, st.v = _buffer(st.k, key, n), _buffer(st.v, value, n)
        st.k[:, :, s:e] = key
        st.v[:, :, s:e] = value
        if st.keep_q:
            st.q = _buffer(st.q, query, n)
            st.q[:, :, s:e] = query
        window = kwargs.pop("sliding_window", None) or getattr(module, "sliding_window", None)
        if s == 0:
            check_mask(attention_mask, window, n)
        out, lse = chunk_attention(module, query, st.k[:, :, :e], st.v[:, :, :e], s, window, **kwargs)
        if st.keep_q:
            st.lse_ok = (st.lse_ok or s == 0) and lse is not None
            if st.lse_ok:
                st.lse = _buffer(st.lse, lse, n)
                st.lse[:, :, s:e] = lse
        return out, None

    def _layer_inputs(self, hidden: torch.Tensor, last: int) -> list[Any]:
        """(args, kwargs) the model's own forward passes to decoder layers 0..last (hidden state left out)."""
        store: list[Any] = [None] * (last + 1)
        layers = self.decoder.layers
        self.decoder.layers = torch.nn.ModuleList(_Record(i, store, last) for i in range(len(layers)))
        try:
            self.decoder(inputs_embeds=hidden, use_cache=False)
        except _Recorded:
            pass
        finally:
            self.decoder.layers = layers
        return store

    def _sync(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.no_grad()
    def steps(self, input_ids: torch.Tensor, keep: Sequence[int] = (), last: int | None = None
              ) -> Iterator[tuple[int, torch.Tensor]]:
        """Run decoder layers 0..`last` (default: all) over `input_ids` (`[N]`); after each, yield (layer,
        hidden state `[1, N, hidden]` leaving it). The layers of `keep` also keep their q (`layers` reads it).

        Times (wall, synchronised on a GPU): `setup_seconds` (embedding and the recorded layer inputs),
        `layer_seconds[i]` (layer i over all chunks), `forward_seconds` (their sum over every run)."""
        last = len(self.decoder.layers) - 1 if last is None else last
        ids = input_ids.reshape(1, -1).to(self.device)
        n = self._n = ids.shape[1]
        keep = set(keep)
        bar = tqdm(total=(last + 1) * n, unit="tok", unit_scale=True, disable=not self.progress, leave=False,
                   desc=f"layer 0/{last + 1}")
        self._state = st = _LayerState(**{name: ref() for name, ref in _spare.items()})
        _spare.clear()
        self.layer_seconds = []
        try:
            with attention_override(self.model, self._attend, mask=_model_mask):
                t0 = time.perf_counter()
                hidden = self.decoder.embed_tokens(ids)  # the running hidden state, updated in place chunk by chunk
                inputs = self._layer_inputs(hidden, last)
                t1 = self._sync()
                self.setup_seconds = t1 - t0
                self.forward_seconds += t1 - t0
                for layer in range(last + 1):
                    bar.set_description(f"layer {layer + 1}/{last + 1}")
                    args, kwargs = inputs[layer]
                    module = self.decoder.layers[layer]
                    st.keep_q = layer in keep
                    for s in range(0, n, self.chunk):
                        e = min(n, s + self.chunk)
                        st.start, self.position = s, (layer, s)
                        out = module(hidden[:, s:e], *_tokens(args, n, s, e), **_tokens(kwargs, n, s, e))
                        hidden[:, s:e] = (out[0] if isinstance(out, tuple) else out).to(hidden.device)
                        bar.update(e - s)
                    self.position = (layer, n)
                    t2 = self._sync()
                    self.layer_seconds.append(t2 - t1)
                    self.forward_seconds += t2 - t1
                    yield layer, hidden
                    t1 = time.perf_counter()
        finally:
            bar.close()
            _spare.update({name: weakref.ref(t) for name, t in st.buffers().items()})
            self._state = _LayerState()  # the buffers live on only where a caller holds a layer's tensors

    def layers(self, input_ids: torch.Tensor, keep: Sequence[int]
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Yield (layer, q `[Hq, N, D]`, k `[Hkv, N, D]`, v) for each layer of `keep`, in order (its row lse:
        `row_lse`); the forward stops after the last. The tensors are reused: they hold a layer until the next
        is asked for."""
        keep = sorted(set(keep))
        for layer, _ in self.steps(input_ids, keep, keep[-1]):
            if layer in keep:
                st = self._state
                yield layer, st.q[0], st.k[0], st.v[0]

    @torch.no_grad()  # (as `steps`: the final norm would otherwise keep its fp32 intermediates for a backward)
    def forward(self, input_ids: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """The model's final normed hidden state `[1, N, hidden]` (of the `last` positions only, if given),
        layer by layer with no analysis: the dense prefill of this runner."""
        _, hidden = deque(self.steps(input_ids), maxlen=1)[0]
        return self.decoder.norm(hidden if last is None else hidden[:, -last:])


# ---- a Capture whose layers are computed on demand -------------------------------------------------------

LayerFn = Callable[..., Any]  # fn(layer, q, k, v, lse=`[Hq, N]` or None)


class StreamCapture:
    """A `Capture` of one prompt whose q/k/v are computed when asked, one layer at a time.

    Reads like a Capture (`layers`, `n`, `scale`, `shape`, `input_ids`, `layer_qkv`, `head_qkv`) for code that
    visits layers in order (`collect_evidence`, `pattern_fits`, `evaluate_config`): asking for a layer runs
    the forward up to it; asking for an earlier one starts a new forward (`passes` counts them). A layer's
    tensors are valid until the next layer is asked for, of this or of another streaming capture (one
    streaming forward at a time: asking another capture for a layer ends this one's forward and its buffers
    are reused). `on_layer(fn)` calls fn(layer, q, k, v, lse=`layer_lse(layer)`) once per layer when the
    forward first reaches it (e.g. the statistics, computed in the same pass as the evidence).
    """

    def __init__(self, model: torch.nn.Module, shape: ModelShape, input_ids: torch.Tensor,
                 layers: Sequence[int], *, chunk: int | None = None, progress: bool = True):
        self.model, self.shape = model, shape
        self.input_ids = input_ids.reshape(-1).cpu()
        self.layers = tuple(layers)
        self.runner = LayerRunner(model, chunk=chunk, progress=progress)
        self.scale = float(model.model.layers[self.layers[0]].self_attn.scaling)
        self.hidden = None
        self.meta: dict[str, Any] = {"streamed": True, "chunk": self.runner.chunk}
        self.passes = 0
        self._observers: list[LayerFn] = []
        self._seen: set[int] = set()
        self._stream: Iterator[Any] | None = None
        self._current: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def n(self) -> int:
        return int(self.input_ids.numel())

    def on_layer(self, fn: LayerFn) -> None:
        self._observers.append(fn)

    def index(self, layer: int) -> int:
        if layer not in self.layers:
            raise ModelError(f"layer {layer} was not captured: captured layers are {list(self.layers)}")
        return self.layers.index(layer)

    def layer_qkv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[Hq, N, D]`, k and v `[Hkv, N, D]` of one model layer (runs the forward up to it)."""
        global _active
        self.index(layer)
        if _active is not None and _active is not self:
            _active.close()  # one streaming forward at a time: the other capture's buffers are handed over
        _active = self
        if self._current is None or self._current[0] > layer:
            self.close()
            self._stream = self.runner.layers(self.input_ids, self.layers)
            self.passes += 1
        while self._current is None or self._current[0] < layer:
            self._current = None  # drop the previous layer's tensors before the next is computed
            self._current = next(self._stream)
            if self._current[0] not in self._seen:
                self._seen.add(self._current[0])
                for fn in self._observers:
                    fn(*self._current, lse=self.runner.row_lse)
        return self._current[1], self._current[2], self._current[3]

    def layer_lse(self, layer: int) -> torch.Tensor | None:
        """`[Hq, N]` fp32 row log-sum-exps of `layer` from the forward's attention (`LayerRunner.row_lse`), or
        None: only for the layer `layer_qkv` returned last."""
        if self._current is None or self._current[0] != layer:
            return None
        return self.runner.row_lse

    head_qkv = Capture.head_qkv  # one head's view of `layer_qkv`, as a Capture gives it

    def run(self) -> None:
        """Visit every layer once (for observers that need no consumer)."""
        for layer in self.layers:
            self.layer_qkv(layer)
        self.close()

    def close(self) -> None:
        """End the forward and free its buffers."""
        self._current = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def where(self) -> str:
        """Where the forward is: for a message when a run stops midway."""
        layer, token = self.runner.position
        of = f"layers 0..{self.shape.n_layers - 1}, {self.n}-token prompt, forward pass {self.passes}"
        if token >= self.n:
            return f"while analysing layer {layer} ({of})"
        return f"in layer {layer} at token {token} ({of})"


_active: StreamCapture | None = None  # the capture whose layers were asked for last (where a run stopped)


@contextlib.contextmanager
def stopped_midway(what: str = "nothing was written") -> Iterator[None]:
    """Turn Ctrl-C and out-of-memory inside the block into `RunStopped` saying which layer the streaming
    run had reached and `what` (e.g. "no report was written": outputs are written after the block)."""
    try:
        yield
    except KeyboardInterrupt:
        raise RunStopped(f"interrupted {_where()}: {what}") from None
    except (torch.cuda.OutOfMemoryError, MemoryError) as e:
        chunk = _active.runner.chunk if _active else None
        raise RunStopped(f"out of memory {_where()}: {what}. Use a smaller --chunk (now {chunk}) or a shorter "
                         f"--length ({str(e).splitlines()[0][:200]})") from None


def _where() -> str:
    return _active.where() if _active is not None else "before the first layer"


def stream_capture(model: torch.nn.Module, shape: ModelShape, input_ids: torch.Tensor,
                   layers: Sequence[int] | None = None, *, chunk: int | None = None, progress: bool = True,
                   analysis: str | None = "evidence") -> StreamCapture:
    """`capture_attention`'s streaming counterpart: checks the length, the layers and the memory (with the
    workspace of `analysis`, as in `peak_bytes`) before anything runs, then returns a `StreamCapture`."""
    n = shape.check_length(int(input_ids.numel()))
    layers = tuple(range(shape.n_layers)) if layers is None else tuple(sorted({shape.check_layer(l) for l in layers}))
    if not layers:
        raise ModelError("no layers to capture: give at least one layer index")
    cap = StreamCapture(model, shape, input_ids, layers, chunk=chunk, progress=progress)
    if _active is not None:
        _active.close()  # its buffers count as free: this capture's forward reuses them
    check_memory(model, shape, n, cap.runner.chunk, analysis=analysis)
    return cap


# ---- will it fit? ---------------------------------------------------------------------------------------

def _intermediate(model: torch.nn.Module, shape: ModelShape) -> int:
    return int(getattr(model.config, "intermediate_size", None) or 4 * shape.hidden_size)


ANALYSES = (None, "stats", "evidence")


def peak_bytes(shape: ModelShape, n: int, chunk: int, *, intermediate: int, dtype_bytes: int, cuda: bool,
               analysis: str | None = "evidence") -> dict[str, int]:
    """Estimated peak memory of a streaming run beyond the model's weights, by part (bytes).

    hidden state `[N, hidden]`; one layer's q/k/v; RoPE tables; one chunk's projections, MLP and attention
    (flash attention's row sums; on the CPU, when the prompt takes several chunks, a `[C, N]` mask and
    `[Hq, C, N]` fp32 scores); the workspace of `analysis` (None: a plain
    forward; "stats": the head profiles; "evidence": also the search's per-layer sums): on a GPU the O(n)
    reductions of the statistics kernels (fp32 `[Hq, N]` maps and row sums, the profile's tile masses
    (`tile_size`), for evidence the 64-token tile masses `[Hq, N/64, N/64]`), on the CPU the torch
    reference's `[Hq, 256, N]` probability rows besides."""
    if analysis not in ANALYSES:
        raise ValueError(f"analysis={analysis!r}: use one of {ANALYSES}")
    b, hq, hkv, d = dtype_bytes, shape.n_heads, shape.n_kv_heads, shape.head_dim
    c = min(chunk, n)
    parts = {
        "hidden": n * shape.hidden_size * b,
        "qkv": n * (hq + 2 * hkv) * d * b,
        "rope": 4 * n * d * 4,
        "chunk": c * (6 * shape.hidden_size + 3 * intermediate + 2 * (hq + 2 * hkv) * d) * b
        + (c * n * (4 * hq + 5) if c < n and not cuda else c * hq * (8 + 8 * d)),  # CPU chunks after the first:
        # mask, scores; a GPU's: the row sums and two fp32 partial outputs (`merge_partials`)
    }
    if analysis:
        tiles = math.ceil(n / tile_size(n)) ** 2 + (math.ceil(n / 64) ** 2 if analysis == "evidence" else 0)
        rows = GIB if cuda else 4 * hq * 256 * n * 4
        parts["analysis"] = 17 * hq * n * 4 + hq * tiles * 4 + rows  # + the forward's row lse
    return parts


def tile_size(n: int, max_tiles: int = 4096) -> int:
    """Side of the tiles whose masses the per-layer profile keeps: 64, doubled until at most `max_tiles`
    tiles span the prompt (a 64-token tile map of a 1M prompt would be 34 GB per layer)."""
    size = 64
    while math.ceil(n / size) > max_tiles:
        size *= 2
    return size


def free_bytes(device: torch.device) -> int:
    """Memory a run can still use on `device`: free GPU memory plus torch's unused cache, or the
    system's available memory on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info.get("MemFree", 0))


def check_memory(model: torch.nn.Module, shape: ModelShape, n: int, chunk: int, *,
                 analysis: str | None = "evidence", free: int | None = None) -> dict[str, int]:
    """Refuse (ModelError naming the length that fits and the flags) a streaming run of n tokens whose
    estimated peak (`peak_bytes`) exceeds the free memory of the model's device; returns the estimate."""
    device = model_device(model)
    param = next(model.parameters())
    kw = dict(intermediate=_intermediate(model, shape), dtype_bytes=param.element_size(), cuda=device.type == "cuda",
              analysis=analysis)
    parts = peak_bytes(shape, n, chunk, **kw)
    free = free_bytes(device) + spare_bytes(device) if free is None else free
    if sum(parts.values()) <= free:
        return parts
    lo, hi = 0, n  # the longest prompt whose estimate fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(peak_bytes(shape, mid, chunk, **kw).values()) <= free else (lo, mid - 1)
    detail = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
    raise ModelError(
        f"a {n}-token prompt needs about {sum(parts.values()) / GIB:.1f} GiB on {device} beyond the model's "
        f"weights ({detail} GiB) but {free / GIB:.1f} GiB are free: at most {lo} tokens fit. Use --length <= {lo}, "
        f"a smaller --chunk (now {chunk}), or --dtype bf16 (halves the activations)")
