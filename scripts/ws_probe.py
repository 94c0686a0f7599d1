"""Exploratory (H200): the warp-specialised Gluon prefill (`workbench_kernels.prefill_ws`) against exact attention,
dense SDPA and the Triton-language loop (`sparse_prefill(..., warp_specialize=False)`), variants side by side
(issue 25, head_dim 128).

Steps, each in its own subprocess with a timeout (a wrong mbarrier phase hangs the GPU: the step is killed and
recorded, the rest go on; a variant that fails or hangs its check is left out of the timings):
  check   per variant: bf16 o / lse against `masked_attention_ref` on dense causal and random block tiles
          (N = 1000, GQA 4:1, B = 2; head_dim 128, and 64 for the first variant)
  dense   N = --dense-n (32768), Llama-3-8B's 32/8/128: every causal block through ws_prefill and sparse_prefill
          vs SDPA(is_causal=True); TFLOP/s over the causal pairs, ratio to SDPA's
  sparse  block-sparse top-k (`index_build.block_index` on the bench's planted inputs, 64-row tiles) at each of
          --lengths: ws vs sparse_prefill, efficiency = physical density x SDPA ms / ms (as the bench)
Variants: cCsS[vV][o][k][g][p][w128|w32] = C consumer warpgroups (1 or 2), S ring stages (vV: V stages, <= S; else S),
o = intra-warpgroup overlap, p = two 64-key items per step (`pair`), k = the
two consumers share one K/V ring (query heads 2j, 2j + 1), w128 = 128 keys per step (`ws_ashape(width=128)`: the
dense and ashape steps only), w32 = 32 keys per item (the block tiles cut by `index_ref.narrow_pieces`: the check,
dense and sparse steps; at head_dim 256 `c2s2w32` holds rings of 2 slots per head), g = items by KV head first
(`kv_major`; the sparse step
also times the persistent loop with it, "sparse_prefill/kv_major", the vs step the loop's default, KV head first,
beside "sparse_prefill/longest_first"): checked on per-KV-head selections, timed on dense causal
and on group-shared top-k (`block_index(group_shared=True)`, expanded per head) against sparse_prefill's
GQA-packed kernel on the group-shared tiles.
  vs      Vertical-Slash (`ws_vertical_slash`; w128: 128-key pieces and strips, a superset of the 64-key tiles'
          keys, its efficiency over the density of `vs_tiles(..., width=128)`): first per --vs-variants a check
          (bf16 o / lse against
          `masked_attention_ref` under `vs_to_tiles`' mask; random columns / offsets with repeats, -1, >= N,
          N = 1000 and 3000, GQA 4:1, B = 2), then VS(--vertical, --slash) from `index_build.vs_index` on the
          bench's planted inputs at each of --lengths: ws vs sparse_prefill on `vs_tiles` of the same index,
          efficiency = physical density of those tiles x SDPA ms / ms (ws computes more: the columns under a
          row block's pieces are masked in its strips, not dropped: `ws_physical_density`). Variants with k take
          the group-shared index (one per KV head, two query heads on a ring) beside the loop's GQA-packed
          kernel on it. `--steps vs` runs only this (~2 min).
  ashape  A-shape (`ws_ashape`; k: share_kv, heads 2j / 2j + 1 alike): a check per --vs-variants (per-head sinks /
          windows, N = 1000, GQA 4:1), then sink --sink, window --window on every head at --lengths: ws vs the
          loop (group-shared tiles, GQA-packed) and `ashape_prefill`'s default, efficiency over the per-head
          tiles' physical density; `--rounds R` adds R back-to-back (SDPA, ashape_prefill) timings, the spread of
          the default's efficiency in one process. `--steps ashape` runs only this.
`--paired R` (sparse, vs, ashape): also dense SDPA and every ws variant timed in turn over R rounds
(`timing.paired_ms`, each round from the next fn: a kernel timed right after SDPA read up to 12 % slower on the
H200, kernels/NOTES.md session 19), recorded as `paired` (ms, efficiency) beside the synced rows.
Writes --out (JSON: environment, per step results) and prints a summary."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import torch

from workbench.core.timing import environment, paired_ms, time_ms

SHAPE = "llama3-8b"  # the bench's shape the steps run at (--shape): Llama-3-8B 32/8/128
PAIRED = 0  # --paired: rounds of the in-turn timings (0: none)


def parse_variant(name: str) -> dict:
    """'c2s3v2okgw128' -> {consumers: 2, stages: 3, v_stages: 2, overlap: True, share_kv: True, kv_major: True,
    width: 128} (no v: as many V stages as K stages); p adds pair: True (two 64-key items per step), r persistent:
    True (one program per SM slot, taking turns)."""
    c, s, vs, o, k, g, p, r, w = re.fullmatch(r"c(\d)s(\d)(?:v(\d))?(o?)(k?)(g?)(p?)(r?)(?:w(\d+))?", name).groups()
    return {"consumers": int(c), "stages": int(s), "v_stages": int(vs) if vs else None, "overlap": bool(o),
            "share_kv": bool(k), "kv_major": bool(g), "width": int(w or 64), **({"pair": True} if p else {}),
            **({"persistent": True} if r else {})}


def shape() -> tuple[int, int, int, float]:
    """(query heads, KV heads, head_dim, rope theta) of --shape."""
    from workbench_benchmarks.kernels_prefill import SHAPES

    return SHAPES[SHAPE]


def timed(fn) -> float:
    """Median ms of 5 calls after 2 warm-up calls (compiles included there), CUDA events."""
    return time_ms(fn, cuda=True, warmup=2, min_reps=5, max_reps=5)


def paired(sdpa_call, calls: dict, density: dict) -> dict:
    """With --paired R: dense SDPA and `calls` (name -> fn) timed in turn over R rounds -> {name: {ms, efficiency
    (density[name] x SDPA ms / ms)}} with SDPA's own row; {} without."""
    if not PAIRED:
        return {}
    ms = paired_ms([sdpa_call, *calls.values()], rounds=PAIRED)
    return {"sdpa": {"ms": ms[0]}, **{name: {"ms": t, "efficiency": density[name] * ms[0] / t}
                                      for name, t in zip(calls, ms[1:])}}


def against_reference(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> dict:
    """The first call of `fn` (-> (o, lse); its compile included) against masked attention under `mask`."""
    from workbench_kernels.prefill_ref import masked_attention_ref

    t0 = time.perf_counter()
    o, lse = fn()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ro, rlse = masked_attention_ref(q, k, v, mask)
    err, lse_err = (o.float() - ro.float()).abs().max().item(), (lse - rlse).abs().max().item()
    return {"max_abs_err_o": err, "max_abs_err_lse": lse_err, "first_call_s": seconds,
            "ok": bool(err < 2e-2 + 2e-2 * ro.float().abs().max().item() and lse_err < 0.1 and torch.isfinite(o).all())}


def dense_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Dense causal SDPA on q `[1, Hq, N, D]`, k / v `[1, Hkv, N, D]` as the bench's ratios divide by it
    (`dense_baseline`: the faster of its two GQA forms on these inputs), as a call to time."""
    from workbench_benchmarks.kernels_prefill import dense_baseline

    G = q.shape[1] // k.shape[1]
    return dense_baseline(q, k, v, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1))[0]


def planted(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The benchmark's planted bf16 inputs at --shape and dense causal SDPA's ms on them."""
    from workbench_benchmarks.kernels_prefill import planted_inputs

    hq, hkv, d, theta = shape()
    q, k, v = planted_inputs(hq, hkv, d, n, theta)
    return q, k, v, timed(dense_call(q, k, v))


def check(variant: str) -> dict:
    """Block tiles through ws_prefill (at --shape's head_dim; w32: in 32-key pieces); a w128 variant: dense causal
    through ws_ashape (its check_ashape covers the band)."""
    from workbench_kernels.index_ref import block_sparse_to_tiles, narrow_pieces, tiles_to_mask
    from workbench_kernels.prefill_ws import ws_ashape, ws_prefill
    from workbench_kernels.tiling import NO_WINDOW

    out = {}
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, n = 2, 8, 2, 1000
    M = -(-n // 64)
    kw = parse_variant(variant.removeprefix("first:"))
    width = kw.pop("width")
    H = Hkv if kw["share_kv"] else Hq  # shared K/V: one selection per KV head, expanded to its query heads
    d0 = shape()[2]
    for d in (d0, 64) if variant.startswith("first:") else (d0,):
        q, k, v = (torch.randn(B, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (Hq, Hkv, Hkv))
        if width == 128:
            causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril().expand(1, Hq, n, n)
            out[f"d{d}/dense"] = against_reference(lambda: ws_ashape(q, k, v, [0] * Hq, [NO_WINDOW] * Hq, width=128,
                                                                     **kw), q, k, v, causal)
            continue
        for keep in (1.0, 0.3):
            idx = torch.where(torch.rand(B, H, M, M, generator=g) < keep, torch.arange(M), -1).to(torch.int32)
            tiles = narrow_pieces(block_sparse_to_tiles(idx.repeat_interleave(Hq // H, 1), n), width, n).to("cuda")
            out[f"d{d}/keep{keep}"] = against_reference(lambda: ws_prefill(q, k, v, tiles, **kw), q, k, v,
                                                        tiles_to_mask(tiles, n))
    return out


def dense(variants: list[str], n: int) -> dict:
    from workbench_kernels.index_ref import narrow_pieces, selected_block_tiles
    from workbench_kernels.prefill import sparse_prefill
    from workbench_kernels.prefill_ws import ws_ashape, ws_prefill
    from workbench_kernels.tiling import NO_WINDOW

    hq, hkv, d, _ = shape()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    M = -(-n // 64)
    m = torch.arange(M, device="cuda")
    table = torch.where(m[None, :] <= m[:, None], m[None, :], -1).to(torch.int32)  # every causal block
    tiles = selected_block_tiles(table.expand(1, hq, M, M))
    flop = 4 * d * hq * n * (n + 1) // 2  # causal pairs
    kx, vx = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    rows = {"sdpa": timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True))}
    ref, _ = sparse_prefill(q, k, v, tiles, warp_specialize=False)
    rows["sparse_prefill"] = timed(lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False))
    out = {"n": n, "shape": [hq, hkv, d], "agreement_max_abs": {}}
    for name in variants:
        kw = parse_variant(name)
        if kw["width"] in (32, 64):
            cut = narrow_pieces(tiles, kw.pop("width"), n)
            call = lambda: ws_prefill(q, k, v, cut, **kw)  # noqa: E731
        else:  # 128 keys per step: dense causal as an A-shape without sinks or band
            call = lambda: ws_ashape(q, k, v, [0] * hq, [NO_WINDOW] * hq, **kw)  # noqa: E731
        out["agreement_max_abs"][name] = (call()[0].float() - ref.float()).abs().max().item()
        rows[f"ws/{name}"] = timed(call)
    out["rows"] = {key: {"ms": ms, "tflops": flop / ms / 1e9, "of_sdpa": rows["sdpa"] / ms} for key, ms in rows.items()}
    return out


def sparse(variants: list[str], lengths: list[int], topk: int) -> dict:
    from workbench_kernels.index_build import block_index
    from workbench_kernels.index_ref import expand_groups, narrow_pieces, selected_block_tiles, tile_area
    from workbench_kernels.prefill import sparse_prefill
    from workbench_kernels.prefill_ws import ws_prefill

    hq, hkv, d, theta = shape()
    out = {}
    for n in lengths:
        q, k, v, sdpa = planted(n)
        for selection in ("per_head", "group_shared"):
            names = [x for x in variants if parse_variant(x)["share_kv"] == (selection == "group_shared")
                     and parse_variant(x)["width"] in (32, 64)]  # (128-key steps: the dense and ashape steps only)
            if not names:
                continue
            tiles = selected_block_tiles(block_index(q, k, topk, group_shared=selection == "group_shared"))
            # sparse_prefill runs group-shared tiles GQA-packed; ws_prefill takes them expanded per query head
            per_head = expand_groups(tiles, hq // tiles.shape[1])
            density = tile_area(per_head, n).sum().item() / (hq * n * (n + 1) // 2)
            ref, _ = sparse_prefill(q, k, v, tiles, warp_specialize=False)
            rows = {"sparse_prefill": timed(lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False)),
                    "sparse_prefill/kv_major": timed(lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False,
                                                                            persistent=True, kv_major=True))}
            agree, calls = {}, {}
            for name in names:
                kw = parse_variant(name)
                cut = narrow_pieces(per_head, kw.pop("width"), n)  # (32 or 64 keys per item)
                o, _ = ws_prefill(q, k, v, cut, **kw)
                agree[name] = (o.float() - ref.float()).abs().max().item()
                calls[f"ws/{name}"] = lambda kw=kw, cut=cut: ws_prefill(q, k, v, cut, **kw)
                rows[f"ws/{name}"] = timed(calls[f"ws/{name}"])
            out[f"{selection}/{n}"] = {
                "physical_density": density, "sdpa_ms": sdpa, "agreement_max_abs": agree,
                "paired": paired(dense_call(q, k, v), calls, dict.fromkeys(calls, density)),
                "rows": {key: {"ms": ms, "efficiency": density * sdpa / ms, "vs_sparse_prefill": rows["sparse_prefill"] / ms}
                         for key, ms in rows.items()}}
        q = k = v = None
        torch.cuda.empty_cache()
    return out


def vs_random_index(B: int, H: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns `[B, H, 300]`, offsets `[B, H, 63]`: repeats, -1, >= n, near the diagonal and scattered."""
    cols = torch.randint(-1, n + 20, (B, H, 300), generator=g)
    cols[..., 1::7] = cols[..., ::7][..., : cols[..., 1::7].shape[-1]]
    near = torch.randint(-1, 200, (B, H, 30), generator=g)
    return cols, torch.cat([near, torch.randint(0, n + 40, (B, H, 30), generator=g), near[..., :3]], -1)


def check_vs(variant: str) -> dict:
    from workbench_kernels.index_ref import expand_groups, tiles_to_mask, vs_to_tiles
    from workbench_kernels.prefill_ws import ws_vertical_slash

    out = {}
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv = 2, 8, 2
    kw = parse_variant(variant)
    share = kw.pop("share_kv")  # k: a group-shared index (one per KV head)
    for n in (1000, 3000):
        q, k, v = (torch.randn(B, h, n, 128, generator=g).to("cuda", torch.bfloat16) for h in (Hq, Hkv, Hkv))
        cols, offs = vs_random_index(B, Hkv if share else Hq, n, g)
        tiles = expand_groups(vs_to_tiles(cols.cuda(), offs.cuda(), n, width=kw["width"]), Hq // Hkv if share else 1)
        out[f"n{n}"] = against_reference(lambda: ws_vertical_slash(q, k, v, cols.cuda(), offs.cuda(), **kw), q, k, v,
                                         tiles_to_mask(tiles, n))
    return out


def loop_kwargs(spec: str) -> dict:
    """'num_warps=8;num_stages=4' -> {'num_warps': 8, 'num_stages': 4} (ints and True / False)."""
    out = {}
    for item in filter(None, spec.split(";")):
        key, value = item.split("=")
        out[key] = {"True": True, "False": False}.get(value) if value in ("True", "False") else int(value)
    return out


def vs(variants: list[str], lengths: list[int], vertical: int, slash: int, loops: list[str]) -> dict:
    from workbench_kernels.index_build import vs_index, vs_slash_tiles, vs_tiles
    from workbench_kernels.index_ref import expand_groups, tile_area
    from workbench_kernels.prefill import sparse_prefill
    from workbench_kernels.prefill_ws import pack_columns, ws_vertical_slash

    hq, hkv, d, theta = shape()
    out = {}
    for n in lengths:
        q, k, v, sdpa = planted(n)
        pairs = hq * n * (n + 1) // 2
        for selection in ("per_head", "group_shared"):
            names = [x for x in variants if parse_variant(x)["share_kv"] == (selection == "group_shared")]
            if not names:
                continue
            cols, offs = vs_index(q, k, 1.0 / d ** 0.5, vertical, min(slash, n), group_shared=selection == "group_shared")
            tiles = vs_tiles(cols, offs, n)  # group-shared: GQA-packed in the loop
            g = hq // tiles.shape[1]
            density = tile_area(expand_groups(tiles, g), n).sum().item() / pairs
            head_cols, head_offs = (x.repeat_interleave(g, 1) for x in (cols, offs))  # what ws packs per query head
            pieces, _, packed = vs_slash_tiles(head_cols, head_offs, n)
            strips = (pack_columns(k, v, packed, hq)[3].long() + 63) // 64
            ws_area = ((pieces.block_count.long() + strips) * 64).sum().item() * 64  # (last row block counted full)
            prep = {"vs_tiles": timed(lambda: vs_tiles(cols, offs, n)),  # sparse_prefill's index conversion
                    "ws_prep": timed(lambda: pack_columns(k, v, vs_slash_tiles(head_cols, head_offs, n)[2], hq))}
            ref, _ = sparse_prefill(q, k, v, tiles, warp_specialize=False)
            rows = {"sparse_prefill": timed(lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False))}
            if selection == "per_head":
                rows["sparse_prefill/longest_first"] = timed(lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False,
                                                                                    kv_major=False))
                for spec in loops:
                    kw = loop_kwargs(spec)
                    rows[f"sparse_prefill/{spec}"] = timed(lambda: sparse_prefill(q, k, v, tiles, warp_specialize=False,
                                                                                  **kw))
            agree, calls = {}, {}
            by_width = {64: density}  # physical density of the tiles whose keys a row keeps (w128: a superset)
            row_width = {}
            for name in names:
                kw = parse_variant(name)
                kw.pop("share_kv")  # group-shared columns share the ring by default
                w = kw["width"]
                if w not in by_width:
                    wide = expand_groups(vs_tiles(cols, offs, n, width=w), g)
                    by_width[w] = tile_area(wide, n).sum().item() / pairs
                    wide = None
                o, _ = ws_vertical_slash(q, k, v, cols, offs, **kw)
                if w == 64:  # (w128 keeps more keys than the loop's tiles: checked in check_vs instead)
                    agree[name] = (o.float() - ref.float()).abs().max().item()
                calls[f"ws/{name}"] = lambda kw=kw: ws_vertical_slash(q, k, v, cols, offs, **kw)
                ms = timed(calls[f"ws/{name}"])  # with its own conversion + packing
                rows[f"ws/{name}"] = ms
                rows[f"ws/{name}-prep"] = ms - prep["ws_prep"]  # the kernel alone (estimate)
                row_width[f"ws/{name}"] = row_width[f"ws/{name}-prep"] = w
            out[f"vs{vertical}_{slash}{'' if selection == 'per_head' else '_group_shared'}/{n}"] = {
                "physical_density": density, "physical_density_by_width": by_width,
                "ws_physical_density": ws_area / pairs, "sdpa_ms": sdpa, "prep_ms": prep, "agreement_max_abs": agree,
                "paired": paired(dense_call(q, k, v), calls, {c: by_width[row_width[c]] for c in calls}),
                "rows": {key: {"ms": ms, "efficiency": by_width[row_width.get(key, 64)] * sdpa / ms,
                               "vs_sparse_prefill": rows["sparse_prefill"] / ms} for key, ms in rows.items()}}
            tiles = ref = None
        q = k = v = None
        torch.cuda.empty_cache()
    return out


def check_ashape(variant: str) -> dict:
    from workbench_kernels.index_ref import ashape_to_tiles, tiles_to_mask
    from workbench_kernels.prefill_ws import ws_ashape
    from workbench_kernels.tiling import NO_WINDOW

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, n = 2, 8, 2, 1000
    kw = parse_variant(variant)
    sink = torch.tensor([0, 4, 64, 100, 4, 0, 130, 700])
    window = torch.tensor([64, 100, 1, 300, NO_WINDOW, 1200, 65, 17])
    if kw["share_kv"]:  # heads 2j and 2j + 1 alike
        sink, window = sink[0::2].repeat_interleave(2), window[1::2].repeat_interleave(2)
    q, k, v = (torch.randn(B, h, n, shape()[2], generator=g).to("cuda", torch.bfloat16) for h in (Hq, Hkv, Hkv))
    mask = tiles_to_mask(ashape_to_tiles(sink, window, n, B, device="cuda"), n, sink.cuda(), window.cuda())
    return {f"n{n}": against_reference(lambda: ws_ashape(q, k, v, sink, window, **kw), q, k, v, mask)}


def ashape(variants: list[str], lengths: list[int], sink: int, window: int, rounds: int = 1) -> dict:
    """Per length: the loop, `ashape_prefill` and each ws_ashape variant, ms and efficiency (density x SDPA ms
    / ms); with rounds > 1 also `rounds` back-to-back pairs (SDPA, ashape_prefill) timed afresh: the spread of
    the default's efficiency within one process."""
    from workbench_kernels.index_ref import ashape_to_tiles, tile_area
    from workbench_kernels.prefill import ashape_prefill, sparse_prefill
    from workbench_kernels.prefill_ws import ws_ashape

    hq, hkv, d, theta = shape()
    out = {}
    for n in lengths:
        q, k, v, sdpa = planted(n)
        sinks, windows = [sink] * hq, [window] * hq
        density = tile_area(ashape_to_tiles(sinks, windows, n), n).sum().item() / (hq * n * (n + 1) // 2)
        shared = ashape_to_tiles(sinks[::hq // hkv], windows[::hq // hkv], n, device="cuda")  # one per KV head
        loop = lambda: sparse_prefill(q, k, v, shared, sink=torch.tensor(sinks), window=torch.tensor(windows))  # noqa: E731
        ref, _ = loop()
        rows = {"sparse_prefill": timed(loop),  # the loop, GQA-packed
                "ashape_prefill": timed(lambda: ashape_prefill(q, k, v, sinks, windows))}  # its default
        agree, calls = {}, {}
        for name in variants:
            kw = parse_variant(name)
            o, _ = ws_ashape(q, k, v, sinks, windows, **kw)
            agree[name] = (o.float() - ref.float()).abs().max().item()
            calls[f"ws/{name}"] = lambda kw=kw: ws_ashape(q, k, v, sinks, windows, **kw)
            rows[f"ws/{name}"] = timed(calls[f"ws/{name}"])
        out[f"ashape{sink}_{window}/{n}"] = {
            "physical_density": density, "sdpa_ms": sdpa, "agreement_max_abs": agree,
            "paired": paired(dense_call(q, k, v), calls, dict.fromkeys(calls, density)),
            "rows": {key: {"ms": ms, "efficiency": density * sdpa / ms, "vs_sparse_prefill": rows["sparse_prefill"] / ms}
                     for key, ms in rows.items()}}
        if rounds > 1:
            sdpa_call = dense_call(q, k, v)
            eff = [density * timed(sdpa_call) / timed(lambda: ashape_prefill(q, k, v, sinks, windows))
                   for _ in range(rounds)]
            out[f"ashape{sink}_{window}/{n}"]["ashape_prefill_rounds"] = {
                "efficiency": eff, "median": statistics.median(eff), "min": min(eff), "max": max(eff)}
            sdpa_call = None
        q = k = v = ref = None
        torch.cuda.empty_cache()
    return out


def child(args: argparse.Namespace) -> None:
    variants = args.variants.split(",")
    if args.child == "check":
        result = check(args.variant)
    elif args.child == "check_vs":
        result = check_vs(args.variant)
    elif args.child == "check_ashape":
        result = check_ashape(args.variant)
    elif args.child == "ashape":
        result = ashape(args.vs_variants.split(","), [int(x) for x in args.lengths.split(",")], args.sink, args.window,
                        args.rounds)
    elif args.child == "vs":
        result = vs(args.vs_variants.split(","), [int(x) for x in args.lengths.split(",")], args.vertical, args.slash,
                    [x for x in args.loop_variants.split(",") if x])
    elif args.child == "dense":
        result = dense(variants, args.dense_n)
    else:
        result = sparse(variants, [int(x) for x in args.lengths.split(",")], args.topk)
    print(json.dumps(result))


def print_paired(n: str, part: dict) -> None:
    for key, row in part.get("paired", {}).items():
        if key != "sdpa":
            print(f"{n} paired {key:20s} {row['ms']:8.2f} ms eff {row['efficiency']:.3f} (SDPA "
                  f"{part['paired']['sdpa']['ms']:.2f} ms)", flush=True)


def run_step(argv: list[str], timeout: float) -> dict:
    """This script as a child (`--child ...`); its JSON, or why there is none."""
    t0 = time.perf_counter()
    try:
        run = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s (hang?)", "seconds": time.perf_counter() - t0}
    if run.returncode:
        return {"error": f"exit {run.returncode}: {run.stderr[-2500:]}", "seconds": time.perf_counter() - t0}
    return {**json.loads(run.stdout.strip().splitlines()[-1]), "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="ws_probe.json")
    p.add_argument("--variants", default="c2s2o,c2s3o,c1s2o,c2s2,c2s3ok,c2s4ok",
                   help="cCsS[vV][o][k][g][p][r][wW], comma-separated")
    p.add_argument("--steps", default="check,dense,sparse",
                   help="any of check,dense,sparse,vs,ashape (vs, ashape: their own checks first)")
    p.add_argument("--vs-variants", default="c2s2o,c1s2o,c2s3o",
                   help="cCsS[vV][o][k][g][p][r][wW] for ws_vertical_slash / ws_ashape")
    p.add_argument("--sink", type=int, default=128, help="A-shape sink tokens")
    p.add_argument("--window", type=int, default=4096, help="A-shape window tokens")
    p.add_argument("--rounds", type=int, default=1, help="ashape step: also time (SDPA, ashape_prefill) this many "
                                                         "times back to back (> 1: median / min / max efficiency)")
    p.add_argument("--vertical", type=int, default=1000, help="VS columns per head")
    p.add_argument("--slash", type=int, default=6096, help="VS slash offsets per head")
    p.add_argument("--vs-timeout", type=float, default=240.0)
    p.add_argument("--loop-variants", default="", help="vs step: the loop also with these sparse_prefill keywords, "
                                                          "e.g. 'num_warps=8;num_stages=4,split=False' (, between rows)")
    p.add_argument("--paired", type=int, default=0, help="sparse / vs / ashape steps: also SDPA and the variants "
                                                         "timed in turn over this many rounds (0: not)")
    p.add_argument("--dense-n", type=int, default=32768)
    p.add_argument("--shape", default="llama3-8b", help="the bench's shape every step runs at (llama3-8b, embedded, ...)")
    p.add_argument("--lengths", default="65536,131072")
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--budget", type=float, default=440.0, help="seconds for all steps (each gets what is left)")
    p.add_argument("--check-timeout", type=float, default=45.0, help="per variant; ~15 s normally (CUDA init, compile)")
    p.add_argument("--dense-timeout", type=float, default=150.0)
    p.add_argument("--sparse-timeout", type=float, default=220.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    global SHAPE, PAIRED
    SHAPE, PAIRED = args.shape, args.paired
    if args.child:
        child(args)
        return
    start = time.perf_counter()
    left = lambda cap: max(1.0, min(cap, args.budget - (time.perf_counter() - start)))  # noqa: E731
    common = ["--shape", args.shape, "--variants", args.variants, "--dense-n", str(args.dense_n), "--lengths", args.lengths,
              "--topk", str(args.topk), "--vertical", str(args.vertical), "--slash", str(args.slash), "--sink", str(args.sink),
              "--window", str(args.window), "--loop-variants", args.loop_variants, "--rounds", str(args.rounds),
              "--paired", str(args.paired)]
    result = {"environment": environment(), "steps": {}}
    save = lambda: json.dump(result, open(args.out, "w"), indent=1)  # noqa: E731
    variants = args.variants.split(",")
    steps = args.steps.split(",")
    if "check" in steps:
        good = []
        for i, name in enumerate(variants):
            tag = f"first:{name}" if i == 0 else name  # the first variant also checks head_dim 64
            r = run_step(["--child", "check", "--variant", tag, *common], left(args.check_timeout))
            result["steps"][f"check/{name}"] = r
            save()
            ok = "error" not in r and all(c["ok"] for k, c in r.items() if k != "seconds")
            print(f"check {name}: {'ok' if ok else 'FAILED'} {r.get('error', '')[:300]}", flush=True)
            if ok:
                good.append(name)
        variants = good
        common[common.index("--variants") + 1] = ",".join(good)
    if not variants:
        print("no variant passed its check: no timings")
    for step, cap in (("dense", args.dense_timeout), ("sparse", args.sparse_timeout)):
        if step not in steps or not variants:
            continue
        r = run_step(["--child", step, *common], left(cap))
        result["steps"][step] = r
        save()
        if "error" in r:
            print(f"{step}: {r['error'][:600]}", flush=True)
        elif step == "dense":
            for key, row in r["rows"].items():
                print(f"dense {r['n']} {key:16s} {row['ms']:8.2f} ms {row['tflops']:6.0f} TFLOP/s "
                      f"{row['of_sdpa']:.3f} of SDPA", flush=True)
        else:
            for n, part in r.items():
                if n == "seconds":
                    continue
                for key, row in part["rows"].items():
                    print(f"top-{args.topk} {n} {key:16s} {row['ms']:8.2f} ms eff {row['efficiency']:.3f} "
                          f"{row['vs_sparse_prefill']:.3f}x sparse_prefill (density {part['physical_density']:.3f})",
                          flush=True)
                print_paired(n, part)
    for step in ("vs", "ashape"):
        if step not in steps:
            continue
        good = []
        for name in args.vs_variants.split(","):
            r = run_step(["--child", f"check_{step}", "--variant", name, *common], left(args.check_timeout))
            result["steps"][f"check_{step}/{name}"] = r
            save()
            ok = "error" not in r and all(c["ok"] for k, c in r.items() if k != "seconds")
            detail = r.get("error", "")[:300] if ok or "error" in r else json.dumps(r)
            print(f"check_{step} {name}: {'ok' if ok else 'FAILED'} {detail}", flush=True)
            if ok:
                good.append(name)
        if not good:
            print(f"no {step} variant passed its check: no {step} timings")
            continue
        r = run_step(["--child", step, "--vs-variants", ",".join(good), *common], left(args.vs_timeout))
        result["steps"][step] = r
        save()
        if "error" in r:
            print(f"{step}: {r['error'][:600]}", flush=True)
        for n, part in r.items():
            if n in ("seconds", "error"):
                continue
            extra = f", ws {part['ws_physical_density']:.3f}; prep ms {part['prep_ms']}" if step == "vs" else ""
            for key, row in part["rows"].items():
                print(f"{n} {key:20s} {row['ms']:8.2f} ms eff {row['efficiency']:.3f} "
                      f"{row['vs_sparse_prefill']:.3f}x sparse_prefill (density {part['physical_density']:.3f}{extra})",
                      flush=True)
            print_paired(n, part)
            if "ashape_prefill_rounds" in part:
                spread = part["ashape_prefill_rounds"]
                print(f"{n} ashape_prefill over {len(spread['efficiency'])} rounds: eff median {spread['median']:.3f}, "
                      f"min {spread['min']:.3f}, max {spread['max']:.3f}", flush=True)
    result["seconds"] = time.perf_counter() - start
    save()


if __name__ == "__main__":
    main()
