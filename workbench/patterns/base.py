"""The `Pattern` protocol every sparse pattern implements, its registry and a per-head stack of patterns.

A pattern object holds the index of all H heads of one layer for one prompt and owns its geometry once:

- logical: `row_mask(r0, r1, n)` (only the rows asked for: the exact statistics walk rows in chunks),
  `edges(n)`, and `mask_mod(n)` (the same mask as a FlexAttention `mask_mod`);
- physical: `to_tiles(n)` (the `VSTiles` the Triton prefill kernel runs, plus `token_band()`, the
  per-token A-shape mask the kernel applies on top), `tiles(n)` and the latency `cost(n, rates)`;
- pictures: `shapes(head, n)`, polygons whose lattice points are exactly the kept causal pairs.

A pattern class also says everything the rest of the workbench asks about its kind (`PatternBase`):
its config params, default sizes, search grid, evidence (captured mass, answer-row mass and oracle of
candidates, from exact reductions), `workbench compare` sweep and MInference names.

All counts exclude non-causal entries (j > i). Config kinds ("ashape", "vs", "block", "dense", ...) map
to pattern classes through `PATTERNS`, filled by the `register_pattern` class decorator and kept in the
classes' `order`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from workbench_kernels.index_ref import VSTiles, merge_tiles
from workbench_kernels.tiling import BLOCK, NO_WINDOW, ints_on

from workbench.patterns.tile_select import stack_batch

MAX_MASK_N = 4096  # to_mask() refuses longer prompts: an n x n mask per head is for tests and pictures

Polygon = list[tuple[float, float]]  # (x = key j, y = query i) vertices in token coordinates
Shapes = dict[str, list[Polygon]]  # overlay part name ("window", "columns", ...) -> polygons
MaskMod = Callable[[Any, Any, Any, Any], Any]  # FlexAttention (b, h, q_idx, kv_idx) -> bool
Rates = dict[str, dict[str, float]]  # {kind: {"per_tile_ms", "index_ms"}} (`prefill.latency.tile_rates`)
Band = tuple[torch.Tensor, torch.Tensor]  # (sink, window) integer `[H]` tokens: the kernel's per-token A-shape mask
Scores = dict[str, torch.Tensor]  # EVIDENCE name -> float64 `[H, C]` on the CPU (heads x candidates)
EVIDENCE = ("mass", "tail", "oracle", "tiles", "edges")  # what `evidence` returns for each candidate


class Reductions(Protocol):
    """One layer of one prompt and the exact reductions of its dense attention, each computed once when
    first read: what a pattern's `evidence` reads (`workbench.analysis.metrics.LayerReductions`).

    q `[Hq, N, D]`, k `[Hkv, N, D]` (query head h reads KV head h // (Hq // Hkv)); `proxy`: the online
    proxy settings (config `proxy`); `sums` / `tail`: `LayerSums` of all query rows and of the answer rows
    `tail_rows` (the last 64): column, diagonal and 64x64 tile masses in units of rows, and lse."""

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    proxy: dict[str, Any]

    @property
    def n(self) -> int: ...

    @property
    def tail_rows(self) -> tuple[int, int]: ...

    @property
    def sums(self) -> Any: ...

    @property
    def tail(self) -> Any: ...

    def offset_mass(self, column_sets: list[torch.Tensor], prefixes: list[list[int]] | None = None,
                    rows: int | tuple[int, int] | None = None) -> list[torch.Tensor]:
        """`metrics.column_offset_mass` of this layer: mass each column set holds at each offset (rows)."""

    def captured(self, pattern: Pattern) -> torch.Tensor:
        """`[Hq, N]`: exact captured mass of `pattern` per query row (one pass over the rows)."""


@dataclass(frozen=True)
class Sweep:
    """How `workbench compare` sweeps a pattern: its `name` in reports, the `knob` and its `values`, the
    config params at a value (`params(value)`), `adaptive` (a threshold the index meets per prompt, not a
    budget) and `online` (the index is built from the prompt's q and k, so its build is timed)."""

    name: str
    knob: str
    values: tuple[float, ...]
    params: Callable[[float], dict[str, int]]
    adaptive: bool = False
    online: bool = True


def default_budget(n: int) -> int:
    """Keys per query a head gets when switched to a kind at prompt length n: n / 16 (at least 64)."""
    return max(64, n // 16)


def search_budgets(n: int) -> list[int]:
    """The search grid's budgets at prompt length n: n/64 .. n/4 keys per query (at least 64), ascending."""
    return sorted({max(64, round(n / f)) for f in (64, 32, 16, 8, 4)})


class Pattern(Protocol):
    """A sparse attention index for H heads of one layer (see the module docstring). What a registered
    pattern class says about its kind (`kind`, `params`, defaults, grid, evidence, ...): `PatternBase`."""

    kind: ClassVar[str]
    params: ClassVar[tuple[str, ...]]
    bench_kernel: ClassVar[str | None]
    n_heads: int

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        """Bool `[H, r1-r0, n]`: True where query row i (r0 <= i < r1) may read key j (always j <= i)."""

    def edges(self, n: int) -> torch.Tensor:
        """Long `[H]`: logical edge count (causal query-key pairs read, duplicates once)."""

    def tiles(self, n: int) -> torch.Tensor:
        """Long `[H]`: physical 64x64 tiles the kernel computes (pieces plus 64-wide column strips)."""

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        """The kernel's tiles `[batch, H, ceil(n / 64)]`, covering at least `row_mask` once the kernel
        applies `token_band()` and causality."""

    def token_band(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sink, window) Long `[H]` tokens: the A-shape mask the kernel applies on top of `to_tiles`
        (j < sink or i - j < window); None when the tiles need none."""

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        """`(b, h, q_idx, kv_idx) -> bool` of `row_mask` for FlexAttention's `create_block_mask` (b ignored)."""

    def shapes(self, head: int, n: int) -> Shapes:
        """Polygons of one head's index: the lattice points (j, i) inside them, intersected with j <= i,
        are exactly its `row_mask`."""

    def cost(self, n: int, rates: Rates) -> torch.Tensor:
        """Float `[H]`: estimated ms per head from benchmark rates (tiles x per-tile time + index build)."""

    def head(self, h: int) -> Pattern:
        """The one-head pattern of head h."""

    @classmethod
    def for_heads(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, scale: float,
                  proxy: dict[str, Any], block: int, triton: bool = False) -> Pattern:
        """One pattern over the H heads whose config `params` are given (all of this kind, vectorised over
        heads, on q's device), indexed online from q `[H, N, D]` and k `[H, N, D]` (each query head's own
        KV head: the caller resolves GQA). `triton`: its Triton index builders where it has them (its index and
        its `to_tiles`)."""

    @classmethod
    def build(cls, params: Sequence[dict[str, int] | None], q: torch.Tensor, k: torch.Tensor, scale: float,
              proxy: dict[str, Any], block: int) -> dict[int, Pattern]:
        """One-head patterns for the query heads whose `params` are given (None: another kind), indexed
        online from one layer's q `[Hq, N, D]`, k `[Hkv, N, D]` -> {head: pattern}."""

    @classmethod
    def layer_tiles(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, scale: float,
                    proxy: dict[str, Any], block: int, triton: bool = False) -> tuple[VSTiles, Band | None]:
        """The kernel's input for the H heads of this kind in one layer of a batch: (tiles `[B, H, M]`,
        token band or None), both on q's device. q, k `[B, H, N, D]` (k: each query head's own KV head).
        `triton`: use the kind's Triton index builder where it has one."""

    @classmethod
    def layer_attention(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor | None:
        """A kernel of this kind's own for a layer whose query heads are all of it (Triton backend): o
        `[B, Hq, N, D]` from q `[B, Hq, N, D]`, k / v `[B, Hkv, N, D]`; None: the layer's one launch over
        `layer_tiles`."""


PATTERNS: dict[str, type] = {}  # config kind -> pattern class, in the classes' `order`
_OWN = ("kind", "title", "params", "order")  # what each registered class sets in its own body
# what a class may take from PatternBase (safe defaults) but never from another registered kind
_NOT_FROM_ANOTHER_KIND = ("bench_kernel", "minference_name", "minference_attn_type", "default_search", "at_budget",
                          "grid", "evidence", "sweep", "layer_attention")


def register_pattern(cls: type) -> type:
    """Class decorator: make `cls` the pattern of config kind `cls.kind` (PATTERNS[cls.kind] = cls, the
    registry kept in `order`). Refuses a class that misses one of `_OWN` in its own body, or that would
    inherit a kind-specific member (`_NOT_FROM_ANOTHER_KIND`) from another registered kind."""
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{cls.__name__} needs a class attribute `kind` (its config name) to be registered")
    if PATTERNS.get(kind, cls) is not cls:
        raise ValueError(f"pattern kind {kind!r} is already {PATTERNS[kind].__name__}: pick another `kind`")
    missing = [name for name in _OWN if name not in cls.__dict__]
    if missing:
        raise ValueError(f"{cls.__name__} (kind {kind!r}) must set {missing} in its own body: see the note in "
                         "workbench/patterns/__init__.py")
    if all(getattr(cls, name).__func__ is getattr(PatternBase, name).__func__ for name in ("at_budget", "defaults")):
        raise ValueError(f"{cls.__name__} (kind {kind!r}) sets no sizes: define `at_budget(budget, n)` (a kind with a "
                         "key budget) or `defaults(n)`")
    for name in _NOT_FROM_ANOTHER_KIND:
        owner = next(c for c in cls.__mro__ if name in c.__dict__)
        if owner is not cls and PATTERNS.get(owner.__dict__.get("kind")) is owner:
            raise ValueError(f"{cls.__name__} would inherit `{name}` from {owner.__name__} (kind {owner.kind!r}): "
                             f"set it in {cls.__name__}'s own body")
    clash = [other.__name__ for k, other in PATTERNS.items() if other.order == cls.order and k != kind]
    if clash:
        raise ValueError(f"{cls.__name__}.order = {cls.order} is already {clash[0]}'s: pick an unused `order`")
    ordered = sorted({**PATTERNS, kind: cls}.items(), key=lambda item: item[1].order)
    PATTERNS.clear()
    PATTERNS.update(ordered)
    return cls


def pattern_class(kind: str) -> type:
    """The registered pattern class of a config kind."""
    if kind not in PATTERNS:
        raise ValueError(f"unknown pattern {kind!r}: registered kinds are {sorted(PATTERNS)} (a new pattern "
                         "module registers with @register_pattern and is imported in workbench/patterns/__init__.py)")
    return PATTERNS[kind]


def default_params(kind: str, n: int) -> dict[str, int]:
    """Sizes a head gets when a user switches it to `kind` at prompt length n (`cls.defaults(n)`)."""
    return pattern_class(kind).defaults(n)


# ----------------------------------------------------------------------------- shared geometry

def causal_rows(r0: int, r1: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool `[r1-r0, n]`: the causal mask of rows r0..r1-1 on `device` (None: the current default device,
    a `with torch.device(...)` block's included). Cached (the dashboard asks for the same 8K x 8K mask on
    every edit): read it, never write into it."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "cuda" and device.index is None:  # one cached copy for "cuda" and "cuda:0"
        device = torch.device("cuda", torch.cuda.current_device())
    return _causal_rows(r0, r1, n, device)


@functools.lru_cache(maxsize=4)
def _causal_rows(r0: int, r1: int, n: int, device: torch.device) -> torch.Tensor:
    return torch.ones(r1 - r0, n, dtype=torch.bool, device=device).tril_(r0)


def toeplitz_rows(diag: torch.Tensor, r0: int, r1: int, n: int) -> torch.Tensor:
    """Bool `[H, r1-r0, n]`: [h, i - r0, j] = diag[h, i - j] for j <= i, False above the diagonal
    (diag Bool `[H, n]`, indexed by offset). A strided view, no index tensor of size n x n."""
    h = diag.shape[0]
    g = torch.cat([diag.flip(-1), diag.new_zeros(h, n)], -1)  # row i reads g[n-1-i : 2n-1-i]
    return g.as_strided((h, r1 - r0, n), (2 * n, 1, 1), n - r1).flip(1)  # rows r1-1 .. r0, flipped


def per_head(params: Sequence[dict[str, int]], key: str) -> torch.Tensor:
    """Long `[H]`: one config field of each head's params (on the CPU: config values are host ints)."""
    return torch.tensor([p[key] for p in params], dtype=torch.long)


def budgets_on(params: Sequence[dict[str, int]], key: str, device: torch.device | str
               ) -> tuple[int, torch.Tensor | None]:
    """(largest budget, per-head budgets Int32 `[H]` on `device`, or None when every head has the largest:
    the cut would keep everything) from the config's host ints: no reduction, sync or copy per call (the
    per-head tensor is `tiling.ints_on`'s cached copy: read it, never write into it), so a CUDA graph can capture
    the index that reads it."""
    sizes = [int(p[key]) for p in params]
    top = max(sizes)
    return top, None if all(s == top for s in sizes) else ints_on(sizes, device)


@functools.lru_cache(maxsize=64)
def _prompt_free_tiles(cls: type, params: tuple, n: int, batch: int, block: int,
                       device: torch.device) -> tuple[VSTiles, Band | None]:
    """`PromptFree.layer_tiles`' cache: params as sorted (name, value) tuples per head."""
    pattern = cls.for_heads([dict(p) for p in params], None, None, 0.0, {}, block)
    band = pattern.token_band()
    tiles = pattern.to_tiles(n, batch).to(device)
    return tiles, None if band is None else (ints_on(band[0], device), ints_on(band[1], device))


def check_rows(r0: int, r1: int, n: int) -> None:
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"rows [{r0}, {r1}) are not inside a prompt of {n} tokens: need 0 <= r0 <= r1 <= n")


def check_head(pattern: Any, head: int) -> None:
    if not 0 <= head < pattern.n_heads:
        raise ValueError(f"head {head} is out of range: the pattern has heads 0..{pattern.n_heads - 1}")


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, stop)] of the True runs of a Bool `[n]`."""
    m = torch.nn.functional.pad(mask.to(torch.int8), (1, 1))
    edges = (m[1:] != m[:-1]).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def column_poly(a: int, b: int, n: int) -> Polygon:
    """Keys a..b-1 from their own row down: {(j, i): a <= j < b, j <= i < n}; top edge on y = x - 0.5."""
    e = n - 0.5
    return [(a - 0.5, a - 1), (b - 0.5, b - 1), (b - 0.5, e), (a - 0.5, e)]


def band_poly(a: int, b: int, n: int) -> Polygon:
    """Offsets a..b-1: {(j, i): a <= i - j < b}, between the lines y - x = a - 0.5 and y - x = b - 0.5."""
    e = n - 0.5
    return [(-0.5, a - 1), (e - a + 0.5, e), (e - b + 0.5, e), (-0.5, b - 1)]


def to_mask(pattern: Pattern, n: int) -> torch.Tensor:
    """Bool `[H, n, n]` of any pattern; small n only (tests and pictures)."""
    if n > MAX_MASK_N:
        raise ValueError(f"to_mask(n={n}) would build {n}x{n} per head: use n <= {MAX_MASK_N}, or "
                         "row_mask(r0, r1, n) / workbench.analysis.stats for long prompts")
    return pattern.row_mask(0, n, n)


def causal_tiles(n: int, block: int = BLOCK) -> int:
    """Number of 64x64 tiles that hold at least one causal entry (the dense kernel's work)."""
    m = -(-n // block)
    return m * (m + 1) // 2


def causal_edges(n: int) -> int:
    return n * (n + 1) // 2


def stack_scores(parts: Sequence[dict[str, torch.Tensor]]) -> Scores:
    """One candidate's scores `[H]` each -> `EVIDENCE` name -> float64 `[H, C]` on the CPU."""
    return {name: torch.stack([p[name].double().cpu() for p in parts], -1) for name in EVIDENCE}


def generic_evidence(cls: type, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
    """`evidence` of any kind, one exact pass per candidate: its index built online over all heads (as the
    prefill builds it), then its captured mass per query row (`sums.captured`), whose mean over all rows
    is the mass and over the answer rows the tail. No same-budget oracle is known: oracle = mass."""
    hq, n = sums.q.shape[0], sums.n
    k = sums.k.repeat_interleave(hq // sums.k.shape[0], 0)  # each query head's own KV head
    r0, r1 = sums.tail_rows
    parts = []
    for p in params:
        index = cls.for_heads([p] * hq, sums.q, k, sums.scale, sums.proxy, BLOCK)
        rows = sums.captured(index).double()
        parts.append({"mass": rows.mean(-1), "tail": rows[:, r0:r1].mean(-1), "oracle": rows.mean(-1),
                      "tiles": index.tiles(n), "edges": index.edges(n)})
    return stack_scores(parts)


class PatternBase:
    """What every pattern computes the same way from its other parts, and what the workbench asks a
    pattern class about its kind (each registered class sets the starred ones in its own body):

    - `kind`*, `title`*, `params`* (config name, the name pages and reports show, and the names of its
      per-head sizes), `order`* (its place in every list of kinds: schema, menus, search grids, sweeps,
      the colours of figures);
    - `at_budget(budget, n)`: its sizes at a budget of keys per query row (None: the kind has no key budget),
      and `defaults(n)`: the sizes a head gets when a user switches it to this kind at prompt length n (by
      default `at_budget(default_budget(n), n)`); each class sets one of the two;
    - `grid(n)`: its search candidates at length n, part of `default_candidates` when `default_search`,
      else of `method_candidates` (default: none);
    - `evidence(params, sums)`: the scores of those candidates on one layer (default: one exact pass
      each, `generic_evidence`);
    - `sweep`: its `workbench compare` sweep (`Sweep`, or None);
    - `bench_kernel` (its row in `workbench bench kernels`), `minference_name` (its per-head name in an
      MInference config) and `minference_attn_type` (the model-wide `attn_type` MInference runs it as),
      None where there is none.

    `static`: `layer_tiles` reads only q's shape and device (not its values, nor k's): no online index, so
    the prefill neither gathers q/k for these heads nor rebuilds their tiles per call, and its mask is its token
    band plus its tiles' dense rows (what a FlexAttention export writes: A-shape, dense, Tri-shape).

    `kv_shared`: one index per KV head, read by all its query heads (`GroupVerticalSlash`). A config gives such a
    kind to whole KV groups with one size (`HeadConfig.check`; `HeadConfig.edit` moves the group), the search
    chooses it per group (`search.choose`), and `for_heads` / `layer_tiles` get k of the groups' KV heads
    (`[H / G, N, D]`, query heads grouped in order; `layer_tiles` then returns tiles per KV head)."""

    n_heads: int
    kind: ClassVar[str]
    title: ClassVar[str]
    params: ClassVar[tuple[str, ...]]
    order: ClassVar[int]
    static: ClassVar[bool] = False
    kv_shared: ClassVar[bool] = False
    bench_kernel: ClassVar[str | None] = None
    minference_name: ClassVar[str | None] = None
    minference_attn_type: ClassVar[str | None] = None
    default_search: ClassVar[bool] = False
    sweep: ClassVar[Sweep | None] = None

    @classmethod
    def at_budget(cls, budget: int, n: int) -> dict[str, int] | None:
        """Config params of this kind at a budget of `budget` keys per query row, prompt length n: the one knob
        that puts kinds side by side (search grids, `analyze`'s equal-budget fits, the notebooks' slider).
        None: the kind has no key budget (dense; adaptive thresholds)."""
        return None

    @classmethod
    def budget_of(cls, params: dict[str, int], n: int, hint: int | None = None) -> int | None:
        """A budget whose `at_budget` gives exactly `params` at prompt length n, or None: tried in turn `hint`,
        `default_budget(n)`, each size, and each size in 64-token blocks (the inverse a size editor shows)."""
        tried = (hint, default_budget(n), *params.values(), *(BLOCK * v for v in params.values()))
        return next((b for b in tried if b is not None and b > 0 and cls.at_budget(b, n) == dict(params)), None)

    @classmethod
    def defaults(cls, n: int) -> dict[str, int]:
        """Config params of a head switched to this kind at prompt length n: the kind's sizes at
        `default_budget(n)` (n / 16 keys per query); a kind without a key budget sets its own."""
        params = cls.at_budget(default_budget(n), n)
        if params is None:
            raise NotImplementedError(f"{cls.__name__} has no key budget: define `defaults(n)`")
        return params

    @classmethod
    def minference_sizes(cls, params: dict[str, int]) -> tuple[int, int]:
        """(vertical_size, slash_size) of its MInference entry (kinds with a `minference_name`)."""
        raise NotImplementedError(f"{cls.__name__} has no MInference entry")

    @classmethod
    def from_minference_sizes(cls, vertical: int, slash: int) -> dict[str, int]:
        """Config params of an MInference entry of this kind (sizes checked >= 0)."""
        raise NotImplementedError(f"{cls.__name__} has no MInference entry")

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """Config params of this kind's search candidates at prompt length n (none by default)."""
        return []

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        """Scores of C candidates of this kind (their config `params`) on all Hq heads of one layer: each
        `EVIDENCE` name -> float64 `[Hq, C]` on the CPU. mass = exact captured fraction of the index the
        candidate runs online (what the prefill runs), tail = the same over the answer rows
        (`sums.tail_rows`), oracle = the best known index of the same budget chosen from full attention
        (= mass where none is known), tiles = physical 64x64 tiles, edges = logical edges (causal pairs)."""
        return generic_evidence(cls, params, sums)

    @classmethod
    def layer_attention(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        scale: float) -> torch.Tensor | None:
        return None

    def to_mask(self, n: int) -> torch.Tensor:
        return to_mask(self, n)

    def token_band(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    @classmethod
    def build(cls, params: Sequence[dict[str, int] | None], q: torch.Tensor, k: torch.Tensor, scale: float,
              proxy: dict[str, Any], block: int) -> dict[int, Pattern]:
        heads = [h for h, p in enumerate(params) if p is not None]
        if not heads:
            return {}
        h = torch.tensor(heads, device=q.device)
        kv = h // (q.shape[0] // k.shape[0])
        pattern = cls.for_heads([params[i] for i in heads], q[h], k[kv.unique() if cls.kv_shared else kv], scale,
                                proxy, block)
        return {head: pattern.head(i) for i, head in enumerate(heads)}

    @classmethod
    def layer_tiles(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, scale: float,
                    proxy: dict[str, Any], block: int, triton: bool = False) -> tuple[VSTiles, Band | None]:
        n = q.shape[2]
        parts = [cls.for_heads(params, q[b], k[b], scale, proxy, block, triton) for b in range(q.shape[0])]
        band = parts[0].token_band()  # static patterns only: the same for every prompt of the batch
        tiles = stack_batch([p.to_tiles(n).to(q.device) for p in parts])
        return tiles, None if band is None else (band[0].to(q.device), band[1].to(q.device))

    def cost(self, n: int, rates: Rates) -> torch.Tensor:
        if self.kind not in rates:
            raise ValueError(f"no rate for pattern {self.kind!r}: the benchmark measured {sorted(rates)}")
        r = rates[self.kind]
        return self.tiles(n).double() * r["per_tile_ms"] + r["index_ms"]


class PromptFree(PatternBase):
    """A kind whose index reads only its config and the prompt length (Tri-shape, dilated, strided): `for_heads`
    builds it from the params alone (its constructor takes them in `params` order, then `n_heads`), and a layer's
    tiles are built once per (kind, params, n, batch, block, device) and cached, so a prefill makes no op and no
    copy for them after its first layer (H200, Llama 32/8/128 at 64K: a Tri-shape layer took 708 ms a call when
    each call built its tiles on the CPU, against a dense layer's 69 ms; scripts/host_overhead.py --layers).
    Read the cached tiles, never write into them."""

    @classmethod
    def for_heads(cls, params: Sequence[dict[str, int]], q: Any, k: Any, scale: float, proxy: dict[str, Any],
                  block: int, triton: bool = False) -> Pattern:
        return cls(*(per_head(params, name) for name in cls.params), n_heads=len(params))

    @classmethod
    def layer_tiles(cls, params: Sequence[dict[str, int]], q: torch.Tensor, k: torch.Tensor, scale: float,
                    proxy: dict[str, Any], block: int, triton: bool = False) -> tuple[VSTiles, Band | None]:
        key = tuple(tuple(sorted((name, int(v)) for name, v in p.items())) for p in params)
        return _prompt_free_tiles(cls, key, q.shape[2], q.shape[0], block, q.device)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-head results of parts that may live on different devices (static patterns build on
    the CPU, online ones on q's device) on the device of the first."""
    return torch.cat([p.to(parts[0].device) for p in parts])


class Stack(PatternBase):
    """Heads of one layer that use different patterns: `parts[0]` covers the first heads, and so on.
    (The composite of the protocol: it has no config kind.)"""

    def __init__(self, parts: Sequence[Pattern]):
        if not parts:
            raise ValueError("Stack needs at least one pattern")
        self.parts = list(parts)
        self.n_heads = sum(p.n_heads for p in self.parts)
        self.starts = [sum(p.n_heads for p in self.parts[:i]) for i in range(len(self.parts))]

    def head_part(self, head: int) -> tuple[Pattern, int]:
        """The part that holds `head` and the head's index inside it."""
        check_head(self, head)
        i = max(i for i, s in enumerate(self.starts) if s <= head)
        return self.parts[i], head - self.starts[i]

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        return _cat([p.row_mask(r0, r1, n) for p in self.parts])

    def edges(self, n: int) -> torch.Tensor:
        return _cat([p.edges(n) for p in self.parts])

    def tiles(self, n: int) -> torch.Tensor:
        return _cat([p.tiles(n) for p in self.parts])

    def cost(self, n: int, rates: Rates) -> torch.Tensor:
        return _cat([p.cost(n, rates) for p in self.parts])

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        if len(self.parts) == 1:
            return self.parts[0].to_tiles(n, batch)
        return merge_tiles([(list(range(s, s + p.n_heads)), p.to_tiles(n, batch))
                            for s, p in zip(self.starts, self.parts)], self.n_heads)

    def token_band(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        bands = [p.token_band() for p in self.parts]
        if all(b is None for b in bands):
            return None
        full = [(torch.zeros(p.n_heads, dtype=torch.long), torch.full((p.n_heads,), NO_WINDOW))
                if b is None else b for p, b in zip(self.parts, bands)]
        return torch.cat([s for s, _ in full]), torch.cat([w for _, w in full])

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        mods = [(p.mask_mod(n, device), s, p.n_heads) for s, p in zip(self.starts, self.parts)]

        def mask_mod(b, h, q_idx, kv_idx):
            out = None
            for mod, start, count in mods:  # every part on its clamped local head, kept where h is its own
                mine = (h >= start) & (h < start + count) & mod(b, (h - start).clamp(0, count - 1), q_idx, kv_idx)
                out = mine if out is None else out | mine
            return out
        return mask_mod

    def shapes(self, head: int, n: int) -> Shapes:
        part, local = self.head_part(head)
        return part.shapes(local, n)

    def __repr__(self) -> str:
        return f"Stack({self.parts!r})"
