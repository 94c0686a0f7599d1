"""A head config as FlexAttention masks: run a searched config with `torch.nn.attention.flex_attention`.

Two key sets, both per layer and per prompt length n:

- physical (`tiles_mask_mod`, `SparsePrefill(backend="flex")`): the keys the Triton prefill kernel
  computes, i.e. the physical 64x64 tiles of the layer's index (for Vertical-Slash the slash ranges
  chopped into 64-wide pieces plus the remaining columns, a superset of the logical index) with the
  A-shape token mask on top. Flex on these tiles gives the Triton kernel's output and the CPU
  reference's (same keys, exact softmax).
- logical (`block_mask(config, layer, n, ...)`, the default): the patterns' own `mask_mod` (the
  candidate set of each pattern's definition, what MInference means by the pattern);
  `block_mask(..., physical=True)` gives the physical set from the patterns' `to_tiles` / `token_band`.

Vertical-Slash and block-sparse heads are indexed online from the prompt: their masks need that prompt's
q and k (`block_mask(..., q=, k=)`), as in the Triton path. A-shape, Tri-shape and dense heads need nothing: a layer
whose heads are all static gets its mask from the config alone (`static_layers`); that is what
`workbench export --format flex` writes (`save_masks` / `load_masks`); layers with online heads are listed
there as needing a prompt.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from workbench_kernels import masks

from workbench.config import ConfigError, HeadConfig
from workbench.patterns import PATTERNS
from workbench.prefill.tiles import tile_rows

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ROW_BLOCKS = 64  # row blocks per chunk when packing tiles into bits (bounds the temporary mask)
FORMAT = "workbench.flex_masks"


@torch.no_grad()
def tile_bits(tiles: Any, n: int) -> torch.Tensor:
    """Pack the physical key set of `tiles` (VSTiles, batch 1) into bits: UInt8 `[H, M, ceil(n/8)]`,
    bit j % 8 of byte j // 8 set when row block m's pieces or columns contain key j (before the causal
    and A-shape token masks; dense rows are not in the bits)."""

    B, H, M = tiles.shape
    if B != 1:
        raise ValueError(f"tile_bits wants the tiles of one prompt (batch 1), got batch {B}: pass tiles[b]")
    tiles = dataclasses.replace(tiles, dense_from=None, dense_rows=0)  # the lists only: mask_mods add dense rows
    b = tiles.block
    width = -(-n // 8) * 8
    bits = torch.zeros(H, M, width // 8, dtype=torch.uint8, device=tiles.block_count.device)
    weights = (1 << torch.arange(8, device=bits.device)).to(torch.uint8)
    for m0 in range(0, M, ROW_BLOCKS):
        m1 = min(m0 + ROW_BLOCKS, M)
        r0, r1 = m0 * b, min(m1 * b, n)
        keys, rows = tile_rows(tiles, r0, r1)  # rows [1, H, r1 - r0, K]; a block's last row sees all its keys
        last = torch.clamp(torch.arange(m0, m1, device=rows.device) * b + b - 1, max=n - 1) - r0
        full = torch.zeros(H, m1 - m0, width, dtype=torch.bool, device=rows.device)
        full[:, :, keys] = rows[0][:, last]
        bits[:, m0:m1] = (full.view(H, m1 - m0, width // 8, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)
    return bits


def tiles_mask_mod(tiles: Any, n: int, sink: torch.Tensor | None = None,
                   window: torch.Tensor | None = None) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) of the keys the Triton kernel computes for `tiles` (VSTiles over
    one layer's H heads, batch 1): causal, inside a piece or column of q's row block, and, with
    per-head `sink` / `window` Int `[H]` (tokens; window 2**30 = none), the A-shape token mask; or any causal
    key in a dense row (`tiles.dense_from`)."""
    bits = tile_bits(tiles, n)
    block = tiles.block
    if window is None:
        def listed(b, h, q_idx, kv_idx):
            word = bits[h, q_idx // block, kv_idx // 8].to(torch.int32)
            return masks.causal(q_idx, kv_idx) & (((word >> (kv_idx % 8)) & 1) == 1)
    else:
        sink = sink.to(bits.device)
        window = window.to(bits.device)

        def listed(b, h, q_idx, kv_idx):
            word = bits[h, q_idx // block, kv_idx // 8].to(torch.int32)
            return masks.ashape(q_idx, kv_idx, sink[h], window[h]) & (((word >> (kv_idx % 8)) & 1) == 1)
    if tiles.dense_from is None:
        return listed
    start = tiles.dense_from[0].to(bits.device)

    def listed_or_dense(b, h, q_idx, kv_idx):
        return listed(b, h, q_idx, kv_idx) | masks.dense_rows(q_idx, kv_idx, start[h])
    return listed_or_dense


def make_block_mask(mask_mod: MaskMod, n_heads: int, n: int, device: torch.device | str,
                    compile: bool | None = None) -> Any:
    """A FlexAttention BlockMask over `n_heads` heads and n x n positions. compile: build it with
    torch.compile (default: on CUDA); eager materialises the `[n_heads, n, n]` mask (small n only)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = torch.device(device)
    if compile if compile is not None else device.type == "cuda":
        return _compiled(create_block_mask)(mask_mod, None, n_heads, n, n, device=device)
    return create_block_mask(mask_mod, None, n_heads, n, n, device=device)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any, scale: float,
         compile: bool | None = None) -> torch.Tensor:
    """flex_attention with GQA: q `[B, Hq, N, D]`, k/v `[B, Hkv, N, D]` -> o `[B, Hq, N, D]`. compile:
    torch.compile (dynamic=False, default: on CUDA); eager materialises `[B, Hq, N, N]` scores (small N
    only: the CPU, and GPU tests where the mask, not the compiler, is the point)."""
    from torch.nn.attention.flex_attention import flex_attention

    gqa = q.shape[1] != k.shape[1]
    if compile if compile is not None else q.is_cuda:
        return _compiled(flex_attention)(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():  # eager is the intended (small-n) use here
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


_COMPILED: dict[Callable[..., Any], Any] = {}


def _compiled(fn: Callable[..., Any]) -> Any:
    """`torch.compile(fn, dynamic=False)`, made once per process (recompiles only for new shapes/dtypes)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


@torch.no_grad()
def tiles_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: Any, sink: torch.Tensor | None,
                    window: torch.Tensor | None, scale: float, compile: bool | None = None) -> torch.Tensor:
    """The Triton prefill kernel's result through flex_attention: same tiles (VSTiles `[B, Hq, M]`), same
    A-shape token mask, exact softmax. q `[B, Hq, N, D]`, k/v `[B, Hkv, N, D]` -> o `[B, Hq, N, D]`.
    compile: see `flex` (default: compiled on CUDA)."""
    B, H, n, _ = q.shape
    out = torch.empty_like(q)
    for b in range(B):  # the index depends on the prompt: one mask per batch row
        one = tiles.map(lambda t: t[b:b + 1])
        mask = make_block_mask(tiles_mask_mod(one, n, sink, window), H, n, q.device, compile)
        out[b:b + 1] = flex(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask, scale, compile)
    return out


STATIC_KINDS = tuple(kind for kind, cls in PATTERNS.items() if cls.static)  # masks from the config alone


def online_heads(config: HeadConfig, layer: int) -> list[int]:
    """Heads of `layer` whose index is built from the prompt (any kind outside `STATIC_KINDS`)."""
    return [e.head for e in config.layer(layer) if e.pattern not in STATIC_KINDS]


def static_layers(config: HeadConfig) -> list[int]:
    """Layers whose every head has a prompt-independent mask (A-shape, Tri-shape, dense)."""
    return [l for l in range(config.model["n_layers"]) if not online_heads(config, l)]


def layer_index(config: HeadConfig, layer: int, n: int, q: torch.Tensor | None = None,
                k: torch.Tensor | None = None, scale: float | None = None) -> Any:
    """The config's index (a Stack of patterns) of one layer for one prompt of n tokens. q `[Hq, N, D]`,
    k `[Hkv, N, D]` (the layer's post-RoPE projections, e.g. `Capture.layer_qkv`) are needed when the
    layer has online heads; a static layer needs none."""
    heads = online_heads(config, layer)
    if heads and (q is None or k is None):
        raise ConfigError(f"layer {layer} heads {heads} are indexed from the prompt (Vertical-Slash / block-sparse): "
                          "pass this prompt's q and k (e.g. Capture.layer_qkv), or use a static layer "
                          f"(static: {static_layers(config)[:10]})")
    if q is None or k is None:  # static layer: the index needs only the head counts and the length
        q, k = torch.zeros(config.model["n_heads"], n, 1), torch.zeros(config.model["n_kv_heads"], n, 1)
    if q.shape[1] != n:
        raise ValueError(f"q covers {q.shape[1]} positions but n={n}: pass the prompt's q/k of length n")
    return config.layer_index(layer, q, k, scale if scale is not None else q.shape[-1] ** -0.5)


def block_mask(config: HeadConfig, layer: int, n: int, device: torch.device | str = "cpu",
               q: torch.Tensor | None = None, k: torch.Tensor | None = None, scale: float | None = None,
               physical: bool = False) -> tuple[Any, MaskMod]:
    """(BlockMask, mask_mod) of one layer at length n, for `flex_attention(q, k, v, block_mask=...,
    enable_gqa=True)` over the layer's query heads. physical=False: the patterns' own logical mask_mod;
    physical=True: the Triton kernel's key set (its tiles and A-shape token band), i.e. what
    `SparsePrefill` computes. q/k: see `layer_index`."""
    index = layer_index(config, layer, n, q, k, scale)
    if physical:
        band = index.token_band()
        sink, window = band if band is not None else (None, None)
        mask_mod = tiles_mask_mod(index.to_tiles(n).to(device), n, sink, window)
    else:
        mask_mod = index.mask_mod(n, device)
    return make_block_mask(mask_mod, config.model["n_heads"], n, device), mask_mod


def save_masks(config: HeadConfig, n: int, path: str | Path) -> dict[str, Any]:
    """Write the static layers' masks at length n (per head sink / window tokens, dense heads no window; `first`, the
    first row that reads every causal key: Tri-shape's question, n where none) and the online layers' heads to `path`
    (torch.save; `load_masks` rebuilds the BlockMasks)."""
    from workbench.core.io import atomic_path

    layers = {}
    for l in static_layers(config):
        index = layer_index(config, l, n)
        band, start = index.token_band(), index.to_tiles(n).dense_from
        h = config.model["n_heads"]
        sink, window = band if band is not None else (torch.zeros(h, dtype=torch.long), torch.full((h,), n))
        first = torch.full((h,), n) if start is None else start[0].long().clamp(max=n)
        layers[l] = {"sink": sink.long(), "window": window.long(), "first": first}
    data = {"format": FORMAT, "n": n, "n_heads": config.model["n_heads"], "model": config.model["name"],
            "layers": layers,
            "online": {l: online_heads(config, l) for l in range(config.model["n_layers"]) if l not in layers},
            "note": "online layers need the prompt's q/k: workbench.prefill.flex.block_mask(config, layer, n, q=, k=)"}
    with atomic_path(Path(path)) as tmp:
        torch.save(data, tmp)
    return data


def load_masks(path: str | Path, device: torch.device | str = "cpu") -> dict[int, Any]:
    """{layer: BlockMask} of the static layers written by `save_masks` (`workbench export --format flex`)."""
    data = torch.load(path, weights_only=True)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a flex mask file: write one with `workbench export CONFIG --format flex`")
    out = {}
    for l, d in data["layers"].items():
        sink, window = d["sink"].to(device), d["window"].to(device)
        first = d.get("first", torch.full_like(d["sink"], data["n"])).to(device)  # files before Tri-shape: none

        def mask_mod(b, h, q_idx, kv_idx, sink=sink, window=window, first=first):
            return masks.ashape(q_idx, kv_idx, sink[h], window[h]) | masks.dense_rows(q_idx, kv_idx, first[h])
        out[l] = make_block_mask(mask_mod, data["n_heads"], data["n"], device)
    return out
