"""`workbench bench kernels`: sparse prefill kernels vs dense SDPA and FlexAttention on one GPU.

Inputs are synthetic (random weights, no model): q/k/v of a real attention shape with planted structure
(RoPE locality from a shared q/k component, attention sinks, vertical keys, slashes at fixed offsets,
topical key blocks) so that the online indexes find realistic patterns instead of uniformly random ones.
Per (shape, length) it times dense causal SDPA, then for each pattern (Vertical-Slash from the Triton online index,
Block-Sparse from pooled top-k, A-shape with one band per KV group and with two, window and window / 2 in turn
per query head: `a_shape_per_head`) the index build, our kernel through the route a model's prefill deploys (VS
tiles with their columns per head, as `VerticalSlash.layer_tiles` builds them; A-shape through `ashape_prefill`
where a Gluon kernel takes the layer, as `AShape.layer_attention`, else its tiles), timed in turn with dense
SDPA (`paired_ms`: both see the GPU's clock and power state of the moment), and FlexAttention with a BlockMask over
the same 64x64 tiles. A mixed layer (a third of the heads each VS, block-sparse, A-shape) runs as one launch over the merged
tiles (`mixed_layer_one_launch`) and as one launch per kind on that kind's own route (`mixed_layer_per_kind`: heads
gathered, K/V per query head, outputs scattered back, all timed; what `SparsePrefill` deploys on sm_90 at head_dim
128 and 256, `prefill.gluon_takes_kinds`). Rows go to a JSON
file as they are measured.

Row fields: logical_density = attended (query, key) pairs / causal pairs; physical_density = computed tile area
(pieces x width + packed columns, per row block) / causal pairs; effective_tflops = 4 * head_dim * tile area / time;
program: the kernel the route ran (the warp-specialised Gluon kernel, row-block pairs or the Triton-language loop:
`prefill.default_program`, `prefill.ashape_program`); time_ms is the kernel's median in rounds taken in turn with
dense SDPA (the faster of its two GQA forms, K/V repeated per query head or `enable_gqa`: `dense_form`, both timed
alone in `dense_forms_ms`), whose median in the same rounds is `paired_dense_ms`; ratio_to_dense_tflops divides by
dense's causal TFLOP/s at paired_dense_ms. Where the program is not the loop, the loop on the same tiles is timed in
the same rounds: loop_ms, loop_ratio_to_dense_tflops, speedup_vs_loop. The dense_sdpa row's time_ms is the median
of its rows' paired_dense_ms (`unpaired_ms`: alone). In `--minference` rows, paired_ratio_to_dense_tflops is the
same for the default, and route_paired_ratio_to_dense_tflops (A-shape) for `ashape_prefill`; index_ms = building
the index and its tiles for all heads of the layer (no host sync);
flex_* = FlexAttention on a BlockMask of the 64-aligned blocks our tiles touch (VS: exact logical
mask via mask_mod, since Flex cannot gather columns), compile time reported separately.

`--minference PATH` runs instead the side-by-side comparison with MInference's own Triton kernels, read
from the user's MInference source checkout (never copied here): both kernels on the same block table and
the same (columns, offsets), MInference's VS index converted by its own CUDA extension (built with
torch's cpp_extension when the checkout has csrc/), per-head and group-shared indexes, index build times
beside MInference's pool + topk, and output agreement in bf16.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from workbench.core.timing import elapsed_ms, gpu_tag, paired_ms, queued_ms, stamp, time_ms
from workbench.core.timing import environment as timing_environment

SHAPES = {  # name: (query heads, KV heads, head_dim, rope theta)
    "llama3-8b": (32, 8, 128, 500000.0),
    "embedded": (9, 3, 64, 100000.0),
    "gemma3-270m": (4, 1, 256, 1000000.0),  # Gemma-3-270M's global layers
}


VARIANTS = {  # --variants: our kernels timed side by side on the same tiles (`sparse_prefill` keyword arguments)
    "default": {},  # the library's choice: the Gluon kernel where it takes the tiles at head_dim 128, else the
    # Triton-language loop at `loop_variant` (split / TMA per program shape) and `default_config`
    "loop": {"warp_specialize": False},  # the Triton-language loop at its defaults
    "split": {"split": True, "tma": False, "persistent": False, "warp_specialize": False},  # masked prefix /
    # unmasked interior / masked suffix, pointer loads
    "tma": {"split": True, "tma": True, "persistent": False, "warp_specialize": False},  # split, every K/V tile
    # (and a per-head program's Q/O) through TMA
    "single": {"split": False, "persistent": False, "warp_specialize": False},  # one loop masking the pieces on
    # an edge
    "persistent": {"persistent": True, "warp_specialize": False},  # the loop on a persistent grid, most pieces first
    "ws": {"warp_specialize": True},  # the warp-specialised Gluon kernel (`prefill_ws`, sm_90; where it takes the
    # tiles)
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="16384,32768,65536,131072", help="comma-separated sequence lengths")
    p.add_argument("--shapes", default="llama3-8b,embedded", help=f"comma-separated, from {sorted(SHAPES)}")
    p.add_argument("--vertical", type=int, default=1000, help="VS columns per head (MInference default 1000)")
    p.add_argument("--slash", type=int, default=6096, help="VS slash offsets per head (MInference default 6096)")
    p.add_argument("--topk", type=int, default=100, help="block-sparse key blocks per query block")
    p.add_argument("--sink", type=int, default=128, help="A-shape sink tokens")
    p.add_argument("--window", type=int, default=4096, help="A-shape window tokens")
    p.add_argument("--slash-small", type=int, default=512, help="a second, smaller VS slash budget (0: none)")
    p.add_argument("--blocks", default="64,128,128x64", help="tile shapes to run: ROWS or ROWSxPIECE_WIDTH "
                   "(64 = the index's native block)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--sweep", action="store_true", help="sweep num_warps/num_stages/block/order at the first "
                   "length and shape instead of the full benchmark")
    p.add_argument("--tuned", default=None, help="a --sweep JSON: use its fastest (num_warps, num_stages, order) "
                   "per (pattern, block) instead of the kernel defaults")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds; later FlexAttention runs are skipped")
    p.add_argument("--device", default="cuda", help="cuda (benchmark) or cpu (a dry run of the code path under "
                   "TRITON_INTERPRET=1 at tiny lengths; timings meaningless)")
    p.add_argument("--out", default="reports/benchmarks/prefill_<gpu>.json",
                   help="JSON output path; <gpu>: this machine's GPU as `timing.gpu_tag` names it (h100, h200, ...; cpu)")
    p.add_argument("--minference", default=None, metavar="PATH",
                   help="a MInference source checkout: run only the side-by-side comparison with its own kernels "
                        "on the same indices (first shape of --shapes, each of --lengths)")
    p.add_argument("--minference-out", default="reports/benchmarks/prefill_minference_<gpu>.json",
                   help="JSON output path of the --minference comparison (<gpu> as in --out)")
    p.add_argument("--variants", default="default,loop,ws",
                   help=f"--minference: our kernel variants timed side by side on the same tiles, on every shape, some "
                        f"of {list(VARIANTS)} (default: the library's choice; loop: the Triton-language loop at its "
                        f"defaults; split: masked prefix / unmasked interior / masked suffix piece loops; tma: split "
                        f"with every K/V tile through TMA (Hopper); single: one loop masking edge pieces; persistent: "
                        f"the loop on a persistent longest-first grid; ws: the warp-specialised Gluon kernel where it "
                        f"takes the tiles, checked in a subprocess first); a row's time is its "
                        f"fastest variant, `default_ms` what the library runs")


def environment() -> dict:
    return {**timing_environment(), "inputs": "synthetic bf16 q/k/v (random, no model weights) with planted sinks, "
                                              "verticals, slashes, topical blocks and RoPE locality; batch 1"}


def planted_inputs(hq: int, hkv: int, d: int, n: int, theta: float, seed: int = 0, dev: str = "cuda",
                   dtype=None):
    """Synthetic post-RoPE q `[1, Hq, n, d]`, k/v `[1, Hkv, n, d]` (bf16, cuda) with planted structure.
    Logit boosts: local band 8 (decaying to ~1 at 16K tokens), sinks (keys 0-3) 10, 48 vertical keys
    6, 12 slashes 5, topical blocks 3."""
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    unit = lambda *s: torch.nn.functional.normalize(rnd(*s), dim=-1)  # noqa: E731
    G = hq // hkv
    rd = math.sqrt(d)
    # Locality: a component shared by q and k, equal on every RoPE pair with a wavelength >= 64 tokens
    # (log-uniformly spaced; unit length per pair, random phase): q_i.k_j = 8 logits at i = j, decaying
    # to ~1 logit at 16K tokens.
    inv = theta ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
    phase = rnd(hkv, 1, d // 2)
    shared = torch.cat([phase.cos(), phase.sin()], -1) * (2 * math.pi / inv >= 64).repeat(2)
    shared = torch.nn.functional.normalize(shared, dim=-1) * math.sqrt(8 * rd)
    k_own = 0.7 * rnd(1, hkv, n, d)  # each key's private part (the slashes are planted on it)
    k = k_own + shared
    q = 0.7 * rnd(1, hq, n, d) + shared.repeat_interleave(G, 0)
    # topical blocks: 3% of key blocks carry one of 32 topics; every query block asks for one topic
    m = -(-n // 64)
    topics = unit(32, d) * math.sqrt(3 * rd)
    key_topic = torch.randint(0, 32, (hkv, m), generator=g, device=dev)
    salient = torch.rand(hkv, m, generator=g, device=dev) < 0.03
    kt = torch.where(salient[..., None], topics[key_topic], 0).repeat_interleave(64, 1)[:, :n]
    qt = topics[torch.randint(0, 32, (hq, m), generator=g, device=dev)].repeat_interleave(64, 1)[:, :n]
    k, q = k + kt, q + qt
    # RoPE
    ang = torch.arange(n, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = lambda x: x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin  # noqa: E731
    q, k, k_own = rot(q), rot(k), rot(k_own)
    # sinks and verticals (position-free, after RoPE)
    u_sink = unit(hkv, d)
    k[0, :, :4] += 10 * rd * u_sink[:, None]
    q[0] += u_sink.repeat_interleave(G, 0)[:, None]
    u_vert = unit(hkv, d)
    cols = torch.randint(0, n, (hkv, 48), generator=g, device=dev)
    for h in range(hkv):
        k[0, h, cols[h]] += 6 * rd * u_vert[h]
    q[0] += u_vert.repeat_interleave(G, 0)[:, None]
    # slashes: q_i leans towards k_{i - delta}
    kn = k_own * (rd / k_own.pow(2).sum(-1, keepdim=True))
    for h in range(hkv):
        for delta in torch.randint(256, max(257, n // 2), (12,), generator=g, device=dev).tolist():
            if delta < n:
                q[0, h * G:(h + 1) * G, delta:] += 5 * kn[0, h, : n - delta]
    v = rnd(1, hkv, n, d)
    dtype = dtype or torch.bfloat16
    return q.to(dtype), k.to(dtype), v.to(dtype)


def one_kind_layer(shape: str, kind: str, params: dict[str, int]):
    """`bench_layer` whose query heads all take `kind` at `params`."""
    return bench_layer(shape, lambda h: (kind, params))


def bench_layer(shape: str, entry_of):
    """(ModelShape, HeadConfig) of a one-layer random-weight model of SHAPES[shape] whose query head h takes
    `entry_of(h)` = (kind, params): what `SparsePrefill` needs to run a bench shape's layer as the model path does."""
    from workbench.config import HeadConfig, HeadEntry
    from workbench.core.model import ModelShape

    hq, hkv, d, theta = SHAPES[shape]
    model = ModelShape(shape, "llama", 1, hq, hkv, d, hq * d, "default", theta, 1 << 20, "random")
    return model, HeadConfig(model=model.to_dict(), heads=[HeadEntry(0, h, *entry_of(h)) for h in range(hq)])


def dense_baseline(q, k, v, kx, vx):
    """The faster of dense causal SDPA's two GQA forms on these inputs (the baseline every ratio divides by): over
    K/V repeated per query head (`kx`, `vx` `[B, Hq, N, D]`) or on k / v `[B, Hkv, N, D]` with `enable_gqa` ->
    (its fn, its form, {form: median ms})."""
    import torch

    sdpa = torch.nn.functional.scaled_dot_product_attention
    forms = {"repeat_kv": lambda: sdpa(q, kx, vx, is_causal=True),
             "enable_gqa": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True)}
    ms = {form: time_ms(fn) for form, fn in forms.items()}
    best = min(ms, key=ms.get)
    return forms[best], best, ms


def touched_blocks(tiles, n: int):
    """Bool `[B, H, M, M]`: 64-aligned key blocks that any piece or column of each row block touches."""
    import torch

    B, H, M = tiles.shape
    b = tiles.block
    M64 = -(-n // 64)
    t = torch.arange(tiles.block_offset.shape[-1], device=tiles.block_offset.device)
    live = t < tiles.block_count.unsqueeze(-1)
    p = tiles.block_offset.long()
    out = torch.zeros(B, H, M, M64 + 1, dtype=torch.bool, device=p.device)
    for shift in range(0, b + 64, 64):  # every 64-block a b-wide piece overlaps
        idx = torch.div(p + min(shift, b - 1), 64, rounding_mode="floor").clamp(0, M64 - 1)
        out.scatter_(-1, torch.where(live, idx, M64), True)
    c = tiles.column_index.long()
    tc = torch.arange(c.shape[-1], device=c.device)
    out.scatter_(-1, torch.where(tc < tiles.column_count.unsqueeze(-1), c // 64, M64), True)
    out = out[..., :M64]
    if b != 64:
        out = out.repeat_interleave(b // 64, 2)[:, :, :M64]
    return out & torch.ones(M64, M64, dtype=torch.bool, device=p.device).tril()


def flex_block_mask(touched, full, mask_mod, n: int):
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    def lists(sel):
        num = sel.sum(-1).to(torch.int32)
        idx = (~sel).to(torch.int8).argsort(dim=-1, stable=True).to(torch.int32)
        return num.contiguous(), idx.contiguous()

    partial = touched & ~full
    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=64, mask_mod=mask_mod,
                                        seq_lengths=(n, n), compute_q_blocks=False)
    except TypeError:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=64, mask_mod=mask_mod,
                                        seq_lengths=(n, n))


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm
    from workbench_kernels import masks
    from workbench_kernels.index_build import block_index, vs_index, vs_tiles
    from workbench_kernels.index_ref import (
        ashape_to_tiles,
        block_sparse_to_tiles,
        expand_groups,
        merge_tiles,
        selected_block_tiles,
        tile_area,
    )
    from workbench_kernels.prefill import ashape_prefill, ashape_program, default_program, sparse_prefill
    from workbench_kernels.tiling import NO_WINDOW

    from workbench.core.io import write_json
    from workbench.patterns import AShape, BlockSparse, VerticalSlash
    from workbench.prefill.sparse import SparsePrefill

    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise ValueError("workbench bench kernels needs a CUDA GPU (none found); run it on the GPU machine, "
                         "or use --device cpu with TRITON_INTERPRET=1 for a dry run")
    args.out, args.minference_out = (x.replace("<gpu>", gpu_tag()) for x in (args.out, args.minference_out))
    if args.minference:
        return compare_minference(args)
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"--shapes: unknown shape {s!r}; use some of {sorted(SHAPES)}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    blocks = [x.strip() for x in args.blocks.split(",") if x.strip()]
    shape_of = {"64": (64, 0), "128": (128, 0), "128x64": (128, 64)}
    if any(b not in shape_of for b in blocks):
        raise ValueError(f"--blocks: use some of {sorted(shape_of)}, got {blocks}")
    t_start = time.time()
    env = environment()
    result = {"environment": env, "settings": {k: v for k, v in vars(args).items() if k != "func"}, "rows": []}
    rows = result["rows"]

    def save():
        write_json(args.out, result)

    def sync_ms(fn):  # one call: (its output, ms)
        a = stamp(dev == "cuda")
        out = fn()
        return out, elapsed_ms(a, stamp(dev == "cuda"))

    torch._dynamo.config.cache_size_limit = 256
    from torch.nn.attention.flex_attention import flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    flex_jobs = []  # deferred: (row, q, k, v, touched, full, mask_mod, reference output)

    tuned = {}
    if args.tuned:
        import json

        for r in json.load(open(args.tuned))["rows"]:
            key = (r["kernel"], r.get("block"))
            if r.get("num_warps") and r.get("time_ms") and (key not in tuned or r["time_ms"] < tuned[key]["time_ms"]):
                tuned[key] = r
        tuned = {k: {"num_warps": r["num_warps"], "num_stages": r["num_stages"], "longest_first": r["longest_first"]}
                 for k, r in tuned.items()}
        result["tuned"] = {f"{k[0]}/{k[1]}": v for k, v in tuned.items()}
    todo = [(s, n) for s in shapes for n in lengths]
    if args.sweep:
        todo = todo[:1]
    for shape, n in tqdm(todo, desc="prefill bench"):
        hq, hkv, d, theta = SHAPES[shape]
        q, k, v = planted_inputs(hq, hkv, d, n, theta, dev=dev,
                                 dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
        scale = 1.0 / math.sqrt(d)
        causal_pairs = n * (n + 1) // 2
        tile_shapes = [b for b in blocks if d <= 128 or b != "128"]  # 128x128 tiles of head_dim 256 overflow smem
        kx, vx = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        dense, dense_form, dense_forms = dense_baseline(q, k, v, kx, vx)
        if dense_form != "repeat_kv":
            kx = vx = None  # free the expanded copies
        base = {"shape": shape, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "n": n}
        dense_row = {**base, "kernel": "dense_sdpa", "unpaired_ms": dense_forms[dense_form], "dense_form": dense_form,
                     "dense_forms_ms": dense_forms, "time_ms": dense_forms[dense_form]}
        rows.append(dense_row)
        paired_dense = []  # dense SDPA's median in each kind's rounds

        def timed(fn, area: float, loop=None) -> dict:
            """fn and dense SDPA (and `loop`, the same tiles on the Triton-language loop, if given) timed in turn: the
            row's time fields, ratios at the same moment's dense (the dense row's time: the median of dense's so far,
            so that a partial JSON is whole)."""
            dense_ms, ms, *loop_ms = paired_ms([dense, fn] + ([loop] if loop else []))
            paired_dense.append(dense_ms)
            dense_row["time_ms"] = statistics.median(paired_dense)
            dense_row["tflops"] = 4 * d * hq * causal_pairs / dense_row["time_ms"] / 1e9
            tf = 4 * d * area / ms / 1e9
            out = {"time_ms": ms, "paired_dense_ms": dense_ms, "effective_tflops": tf,
                   "ratio_to_dense_tflops": tf / (4 * d * hq * causal_pairs / dense_ms / 1e9),
                   "speedup_vs_dense": dense_ms / ms}
            if loop_ms:
                out.update(loop_ms=loop_ms[0], loop_ratio_to_dense_tflops=out["ratio_to_dense_tflops"] * ms / loop_ms[0],
                           speedup_vs_loop=loop_ms[0] / ms)
            return out

        # indexes (timed: all heads of the layer, no host sync inside)
        indexes = {}
        vs_budgets = {"vertical_slash": (args.vertical, min(args.slash, n))}
        if args.slash_small:
            vs_budgets[f"vertical_slash@{args.slash_small}"] = (args.vertical, min(args.slash_small, n))
        vs_sets = {}
        for name, (nv, ns) in vs_budgets.items():
            (vs_cols, vs_offs), t_vs_idx = sync_ms(lambda: vs_index(q, k, scale, nv, ns))
            _, t_vs_idx = sync_ms(lambda: vs_index(q, k, scale, nv, ns))  # warm
            vs_sets[name] = (vs_cols, vs_offs)
            for blk in tile_shapes:
                rb, pw = shape_of[blk]
                # with the columns per head, as `VerticalSlash.layer_tiles` deploys them (the Gluon kernel's form)
                tiles, t_vs_tiles = sync_ms(lambda: vs_tiles(vs_cols, vs_offs, n, rb, pw, head_columns=True))
                _, t_vs_tiles = sync_ms(lambda: vs_tiles(vs_cols, vs_offs, n, rb, pw, head_columns=True))
                indexes[(name, blk)] = (tiles, t_vs_idx + t_vs_tiles, None)
        vs_cols, vs_offs = vs_sets["vertical_slash"]
        # vs_group: one index per KV head (`index_build.vs_index(group_shared=True)`), the tiles `SparsePrefill` runs
        # for a layer of it (per KV head, with columns per head: the Gluon kernel's shared ring on sm_90)
        nv, ns = vs_budgets["vertical_slash"]
        (g_cols, g_offs), t_g_idx = sync_ms(lambda: vs_index(q, k, scale, nv, ns, group_shared=True))
        _, t_g_idx = sync_ms(lambda: vs_index(q, k, scale, nv, ns, group_shared=True))  # warm
        if "64" in tile_shapes:
            tiles, t_g_tiles = sync_ms(lambda: vs_tiles(g_cols, g_offs, n, 64, 0, head_columns=True))
            _, t_g_tiles = sync_ms(lambda: vs_tiles(g_cols, g_offs, n, 64, 0, head_columns=True))
            indexes[("vertical_slash_group_shared", "64")] = (tiles, t_g_idx + t_g_tiles, None)
            vs_budgets["vertical_slash_group_shared"] = (nv, ns)
        bidx, t_bs_idx = sync_ms(lambda: block_index(q, k, args.topk))
        bidx, t_bs_idx = sync_ms(lambda: block_index(q, k, args.topk))
        for blk in tile_shapes:
            rb, pw = shape_of[blk]
            # the 64-row tiles of a table that is already clean need no sort (selected_block_tiles)
            convert = (lambda: selected_block_tiles(bidx)) if blk == "64" else (
                lambda: block_sparse_to_tiles(bidx, n, rb, pw))
            tiles, t_bs_tiles = sync_ms(convert)
            _, t_bs_tiles = sync_ms(convert)
            indexes[("block_sparse", blk)] = (tiles, t_bs_idx + t_bs_tiles, None)
            # every head has the same sink and window: group-shared tiles (their area; `ashape_prefill` runs the
            # Gluon shared ring where it takes the layer, else these tiles GQA-packed)
            tiles, t_a = sync_ms(lambda: ashape_to_tiles([args.sink] * hkv, [args.window] * hkv, n, 1, rb, dev, pw))
            _, t_a = sync_ms(lambda: ashape_to_tiles([args.sink] * hkv, [args.window] * hkv, n, 1, rb, dev, pw))
            indexes[("a_shape", blk)] = (tiles, t_a, ([args.sink] * hq, [args.window] * hq))
            # the heads of a group in two bands (window, window / 2 in turn): per-head tiles, no GQA packing
            halves = [args.window // (1 + h % 2) for h in range(hq)]
            tiles, t_a = sync_ms(lambda: ashape_to_tiles([args.sink] * hq, halves, n, 1, rb, dev, pw))
            _, t_a = sync_ms(lambda: ashape_to_tiles([args.sink] * hq, halves, n, 1, rb, dev, pw))
            indexes[("a_shape_per_head", blk)] = (tiles, t_a, ([args.sink] * hq, halves))
        layer_patterns = {"vertical_slash": VerticalSlash(vs_cols[0], vs_offs[0]), "block_sparse": BlockSparse(bidx[0]),
                          "a_shape": AShape(args.sink, args.window, hq),
                          "a_shape_per_head": AShape(args.sink, torch.tensor(halves), hq)}
        logical = {
            **{name: VerticalSlash(c[0], o[0]).edges(n).sum().item() for name, (c, o) in vs_sets.items()},
            "vertical_slash_group_shared": VerticalSlash(*(x[0].repeat_interleave(hq // hkv, 0) for x in (g_cols, g_offs))
                                                         ).edges(n).sum().item(),
            **{name: p.edges(n).sum().item() for name, p in layer_patterns.items() if name != "vertical_slash"},
        }

        if args.sweep:
            sweep = {"64": [(4, 2), (4, 3), (4, 4), (4, 5)], "128": [(8, 2), (8, 3)],
                     "128x64": [(4, 2), (4, 3), (8, 2), (8, 3), (8, 4)]}
            for (pattern, blk), (tiles, _, _width) in indexes.items():
                if pattern not in ("vertical_slash", "block_sparse"):
                    continue
                area = tile_area(tiles, n).sum().item()
                for warps, stages in sweep[blk]:
                    for lf in ((True, False) if (blk, stages) == ("64", 3) else (True,)):
                        try:
                            ms = time_ms(lambda: sparse_prefill(q, k, v, tiles, scale=scale, num_warps=warps,
                                                                num_stages=stages, longest_first=lf))
                            tf = 4 * d * area / ms / 1e9
                            err = None
                        except Exception as e:  # noqa: BLE001 - record the failing config and go on
                            ms, tf, err = None, None, f"{type(e).__name__}: {e}"[:300]
                        rows.append({**base, "kernel": pattern, "block": blk, "num_warps": warps,
                                     "num_stages": stages, "longest_first": lf, "time_ms": ms,
                                     "effective_tflops": tf, "ratio_to_dense_tflops":
                                     tf * dense_row["unpaired_ms"] / (4 * d * hq * causal_pairs / 1e9) if tf else None,
                                     "error": err})
                        print(rows[-1], flush=True)
                        save()
            continue

        for (pattern, blk), (tiles, t_index, aw) in indexes.items():
            sink, window = (aw if aw else (None, None))
            family = "vertical_slash" if pattern.startswith("vertical_slash") else "block_sparse"
            cfg = tuned.get((pattern, blk), tuned.get((family, blk), {}))
            rb, pw = shape_of[blk]
            program = ashape_program(q, k, *(torch.tensor(x, dtype=torch.int32) for x in (sink, window)), rb, pw) if (
                pattern.startswith("a_shape") and not cfg) else "loop"
            if program != "loop":  # `AShape.layer_attention`'s route (elsewhere a model runs the cached tiles, as below)
                route = "ashape_prefill"
                fn = lambda: ashape_prefill(q, k, v, sink, window, scale=scale, block=rb, width=pw)  # noqa: E731
            else:
                route, program = "sparse_prefill", default_program(q, tiles, sink)
                fn = lambda: sparse_prefill(q, k, v, tiles, sink=sink, window=window, scale=scale, **cfg)  # noqa: E731
            loop = None if program == "loop" or cfg else (  # the same tiles on the loop, in the same rounds
                lambda: sparse_prefill(q, k, v, tiles, sink=sink, window=window, scale=scale, warp_specialize=False))
            area = tile_area(tiles, n).sum().item() * (hq // tiles.shape[1])  # group-shared tiles serve G heads
            budget = vs_budgets.get(pattern) or ((args.topk,) if pattern == "block_sparse" else
                                                 (args.sink, args.window, args.window // 2) if pattern == "a_shape_per_head"
                                                 else (args.sink, args.window))
            row = {**base, "kernel": pattern, "block": blk, "route": route, "program": program,
                   "budget": list(budget), **cfg,
                   **timed(fn, area, loop), "index_ms": t_index,
                   "logical_density": logical[pattern] / (hq * causal_pairs),
                   "physical_density": area / (hq * causal_pairs)}
            row.update(index_share_of_kernel=t_index / row["time_ms"], speedup_vs_dense_with_index=(
                row["paired_dense_ms"] / (row["time_ms"] + t_index)))
            rows.append(row)
            print(row, flush=True)
            save()
            if blk == "64" and pattern in ("vertical_slash", "block_sparse", "a_shape") and not args.no_flex:
                touched = touched_blocks(expand_groups(tiles, hq // tiles.shape[1]), n)
                M = touched.shape[-1]
                eye = torch.eye(M, dtype=torch.bool, device=dev)
                mask_mod = layer_patterns[pattern].mask_mod(n, dev)  # the pattern's logical mask (batch 1)
                if pattern == "vertical_slash":
                    full = torch.zeros_like(touched)
                elif pattern == "block_sparse":
                    full = touched & ~eye
                else:
                    first = torch.arange(M, device=dev) * 64  # full: every key a sink, or the farthest pair in the window
                    full = touched & ~eye & (masks.sink(first[None, :] + 63, args.sink)
                                             | masks.window(first[:, None] + 63, first[None, :], args.window))
                ref = fn()[0] if pattern != "vertical_slash" else None
                flex_jobs.append((row, shape, n, q, k, v, touched, full, mask_mod, ref, scale))
        # one mixed layer (a third of the heads per pattern): each kind's tiles of its heads (all fields, head
        # columns included), as `SparsePrefill.group_tiles` gives them
        thirds = [list(range(i, hq, 3)) for i in range(3)]
        heads_t = [torch.tensor(h, device=dev) for h in thirds]
        sinks = torch.zeros(hq, dtype=torch.int32)
        windows = torch.full((hq,), NO_WINDOW, dtype=torch.int32)
        sinks[thirds[2]], windows[thirds[2]] = args.sink, args.window
        kinds = [("vs", {"vertical": args.vertical, "slash": args.slash}), ("block", {"topk": args.topk}),
                 ("ashape", {"sink": args.sink, "window": args.window})]
        layer_tiles = (indexes[("vertical_slash", "64")][0], indexes[("block_sparse", "64")][0],
                       expand_groups(indexes[("a_shape", "64")][0], hq // hkv))
        groups = {kind: (h, t.map(lambda x, i=i: x[:, i]), band) for (kind, _), h, i, t, band in zip(
            kinds, thirds, heads_t, layer_tiles, (None, None, (sinks[thirds[2]], windows[thirds[2]])))}
        # in a single launch over the merged tiles
        mixed = merge_tiles([(h, t) for h, t, _ in groups.values()], hq)
        cfg = tuned.get(("vertical_slash", "64"), {})
        area = tile_area(mixed, n).sum().item()
        rows.append({**base, "kernel": "mixed_layer_one_launch", "block": "64", "route": "sparse_prefill", "program": "loop",
                     **timed(lambda: sparse_prefill(q, k, v, mixed, sink=sinks, window=windows, scale=scale, **cfg),
                             area), "physical_density": area / (hq * causal_pairs)})
        print(rows[-1], flush=True)
        save()
        # the same layer as one launch per kind on each kind's own route, as `SparsePrefill` deploys it
        # (`kinds_attention`: heads gathered, K/V per query head, outputs scattered back, all timed)
        sp = SparsePrefill(None, *bench_layer(shape, lambda h: kinds[h % 3]), min_length=0)
        per_kind = lambda: (sp.kinds_attention(0, groups, q, k, v, scale), None)  # noqa: E731
        one = sparse_prefill(q, k, v, mixed, sink=sinks, window=windows, scale=scale, **cfg)[0]
        gap = (per_kind()[0].float() - one.float()).abs().max().item()
        one = None
        rows.append({**base, "kernel": "mixed_layer_per_kind", "block": "64", "route": "per kind",
                     **timed(per_kind, area), "physical_density": area / (hq * causal_pairs),
                     "max_abs_diff_to_one_launch": gap})
        print(rows[-1], flush=True)
        save()
        kx = vx = dense = None

    flex_jobs.sort(key=lambda job: (job[1] != "llama3-8b", -job[2]))  # the long Llama rows first
    for row, _shape, n, q, k, v, touched, full, mask_mod, ref, scale in tqdm(flex_jobs, desc="flex"):
        if time.time() - t_start > args.time_limit:
            row["flex_skipped"] = "time limit"
            continue
        try:
            bm, t_mask = sync_ms(lambda: flex_block_mask(touched, full, mask_mod, n))
            opts = {"BLOCK_M": 64, "BLOCK_N": 64}
            call = lambda: flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True,  # noqa: E731
                                kernel_options=opts)
            try:
                out, t_first = sync_ms(call)
            except Exception as e:  # noqa: BLE001 - fall back to flex's own tile sizes
                row["flex_note"] = f"64x64 kernel options failed ({type(e).__name__}); flex defaults used"
                opts = None
                out, t_first = sync_ms(call)
            ms = time_ms(call)
            blocks_computed = (touched.sum().item()) * 64 * 64
            row.update({"flex_time_ms": ms, "flex_compile_ms": t_first - ms, "flex_block_mask_ms": t_mask,
                        "flex_physical_density": blocks_computed / (row["q_heads"] * n * (n + 1) / 2),
                        "speedup_vs_flex": ms / row["time_ms"]})
            if ref is not None:
                row["max_abs_diff_vs_flex"] = (out.float() - ref.float()).abs().max().item()
        except Exception as e:  # noqa: BLE001 - keep the kernel rows, say why flex is missing
            row["flex_error"] = f"{type(e).__name__}: {e}"[:400]
        print({k_: row.get(k_) for k_ in ("shape", "n", "kernel", "time_ms", "flex_time_ms", "flex_error")}, flush=True)
        save()
        if dev == "cuda":
            torch.cuda.empty_cache()
    result["elapsed_s"] = time.time() - t_start
    save()
    print(f"wrote {args.out} ({len(rows)} rows, {result['elapsed_s']:.0f} s)")
    return 0


# ---- MInference's own kernels on the same indices (`--minference PATH`) --------------------------------------


def load_minference(path: str) -> dict:
    """MInference's Triton kernels from a local source checkout (its `minference/ops` files, never copied
    into this repo) and, when `csrc/` is there and a CUDA compiler works, its VS index conversion built
    with torch's cpp_extension in a background thread (nvcc takes ~1 minute; the benchmark goes on
    meanwhile). Returns {"block": module, "vs": module, "convert": Future of (fn | None, note, seconds)}."""
    import concurrent.futures
    import importlib
    import types
    from pathlib import Path

    root = Path(path)
    ops = root / "minference" / "ops"
    need = [ops / "block_sparse_flash_attention.py", ops / "pit_sparse_flash_attention_v2.py"]
    if not all(f.exists() for f in need):
        raise ValueError(f"--minference {path}: expected a MInference source checkout with {need[0].relative_to(root)} "
                         f"and {need[1].relative_to(root)}; clone github.com/microsoft/MInference and pass its root")
    csrc = root / "csrc"

    def build():
        t0 = time.time()
        if not (csrc / "vertical_slash_index.cu").exists():
            return None, "no csrc/ in the checkout: MInference's kernel ran on our VS tiles", 0.0
        try:
            from torch.utils.cpp_extension import load

            ext = load("minference_vs_index", [str(csrc / "kernels.cpp"), str(csrc / "vertical_slash_index.cu")],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)
            return (ext.convert_vertical_slash_indexes, "MInference's own VS index conversion (CUDA extension)",
                    time.time() - t0)
        except Exception as e:  # noqa: BLE001 - fall back to our tiles, say why
            return (None, f"CUDA extension build failed ({type(e).__name__}: {str(e)[:200]}): MInference's kernel "
                          f"ran on our VS tiles", time.time() - t0)

    pool = concurrent.futures.ThreadPoolExecutor(1)
    convert = pool.submit(build)
    pool.shutdown(wait=False)
    for name, sub in (("minference", root / "minference"), ("minference.ops", ops)):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(sub)]  # a namespace: its __init__ (which imports the whole package) never runs
        sys.modules[name] = pkg
    cuda = types.ModuleType("minference.cuda")
    cuda.convert_vertical_slash_indexes = None  # imported by pit_sparse_flash_attention_v2; the kernel never calls it
    sys.modules["minference.cuda"] = cuda
    return {"block": importlib.import_module("minference.ops.block_sparse_flash_attention"),
            "vs": importlib.import_module("minference.ops.pit_sparse_flash_attention_v2"), "convert": convert}


def agreement(a, b) -> dict:
    """max |a - b| and ||a - b|| / ||b|| (fp32) of two outputs."""
    d = (a.float() - b.float())
    return {"max_abs_diff": d.abs().max().item(), "rel_err": (d.norm() / b.float().norm()).item()}


def compiles_apart(kwargs: dict, d: int) -> str | None:
    """None if `sparse_prefill(**kwargs)` compiles and runs on a tiny bf16 input in a fresh process, else
    its last error line: a compiler crash or a hang of the Gluon kernel must not take the benchmark down."""
    import subprocess

    code = ("import torch\nfrom workbench_kernels.index_ref import block_sparse_to_tiles\n"
            "from workbench_kernels.prefill import sparse_prefill\n"
            f"q = torch.randn(1, 2, 256, {d}, device='cuda', dtype=torch.bfloat16)\n"
            f"k = torch.randn(1, 1, 256, {d}, device='cuda', dtype=torch.bfloat16)\n"
            "tiles = block_sparse_to_tiles(torch.zeros(1, 2, 4, 1, dtype=torch.int32, device='cuda'), 256)\n"
            f"sparse_prefill(q, k, k, tiles, **{kwargs!r})\ntorch.cuda.synchronize()\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "compile check timed out (180 s)"
    return None if r.returncode == 0 else ((r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1])[:300]


def compare_minference(args: argparse.Namespace) -> int:
    """Ours vs MInference's kernels on the same indices, for each shape of --shapes and length of --lengths:
    dense SDPA; block-sparse (per-head and group-shared tables; index: pooled scores + selection beside
    MInference's pool + topk); A-shape (3 tile shapes, ours only); Vertical-Slash (per head, 128-row tiles,
    group-shared; the tiles beside MInference's CUDA conversion; a same-work run with contiguous column
    strips bounds what gathering the columns into a packed buffer could gain); FlexAttention on the same
    64-aligned blocks (per-head rows of the first shape). Each of our rows times every --variants entry
    on the same tiles, on every shape (the Gluon kernel's Vertical-Slash and A-shape entries on their own
    prepared inputs). Vertical-Slash's default is the deployed route: `vs_tiles(head_columns=True)`, which
    `sparse_prefill` hands the Gluon kernel on sm_90 at head_dim 128 (packing the columns in the timed call);
    "ws_prepacked" is `ws_vertical_slash` at the same launch (`HEAD_LAUNCH`) on columns packed beforehand.
    MInference's kernels have no GQA: they read K/V repeated to Hq heads, and take head_dim <= 128 only. `bars`
    sums up the issue's ratios."""
    import torch
    from workbench_kernels.index_build import block_index, block_tiles, pooled_scores, select_blocks, vs_index, vs_tiles
    from workbench_kernels.index_ref import VSTiles, ashape_to_tiles, expand_groups, selected_block_tiles, tile_area
    from workbench_kernels.prefill import ashape_prefill, default_config, default_program, loop_variant, sparse_prefill
    from workbench_kernels.prefill_ws import (
        ASHAPE_LAUNCH,
        HEAD_LAUNCH,
        pack_vertical_slash,
        ws_ashape,
        ws_takes,
        ws_vertical_slash,
    )

    from workbench.core.io import write_json
    from workbench.patterns import AShape, BlockSparse, VerticalSlash
    from workbench.prefill.index_graph import IndexGraphs

    dev = args.device
    t_start = time.time()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"--shapes: unknown shape(s) {unknown}; use some of {sorted(SHAPES)}")
    variants = [x for x in args.variants.split(",") if x]
    if not variants or any(x not in VARIANTS for x in variants):
        raise ValueError(f"--variants: use some of {sorted(VARIANTS)}, got {args.variants!r}")
    t0 = time.time()
    mi = load_minference(args.minference)
    hopper = dev == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    result = {"environment": environment(), "settings": {k: v for k, v in vars(args).items() if k != "func"},
              "minference": {"path": args.minference, "load_s": time.time() - t0,
                             "kernels": "minference/ops/block_sparse_flash_attention.py "
                                        "(_triton_block_sparse_attention), pit_sparse_flash_attention_v2.py "
                                        "(_triton_mixed_sparse_attention), both at their own settings "
                                        "(64x64 tiles, num_warps 4, num_stages 2)"},
              "variants": {v: VARIANTS[v] for v in variants}, "skipped": {}, "rows": [], "bars": {}}
    rows = result["rows"]
    ws_check = None  # the warp-specialised variant compiles in a fresh process first (meanwhile the rest runs)
    if "ws" in variants and dev == "cuda":
        import concurrent.futures

        pool = concurrent.futures.ThreadPoolExecutor(1)
        ws_check = pool.submit(compiles_apart, VARIANTS["ws"], SHAPES[shapes[0]][2])
        pool.shutdown(wait=False)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # MInference's kernels take 16-bit inputs only
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = 256
        flex = torch.compile(flex_attention, dynamic=False)

    def save():
        result["elapsed_s"] = time.time() - t_start
        write_json(args.minference_out, result)

    def sync_ms(fn):  # one call: (its output, ms)
        a = stamp(dev == "cuda")
        out = fn()
        return out, elapsed_ms(a, stamp(dev == "cuda"))

    for si, shape in enumerate(shapes):
        hq, hkv, d, theta = SHAPES[shape]
        G = hq // hkv
        with_mi = d <= 128
        for n in [int(x) for x in args.lengths.split(",") if x]:
            q, k, v = planted_inputs(hq, hkv, d, n, theta, dev=dev, dtype=dtype)
            scale = 1.0 / math.sqrt(d)
            causal = n * (n + 1) // 2
            kx, vx = k.repeat_interleave(G, 1).contiguous(), v.repeat_interleave(G, 1).contiguous()
            seqlens = torch.tensor([n], dtype=torch.int32, device=dev)
            dense, dense_form, dense_forms = dense_baseline(q, k, v, kx, vx)
            dense_ms = dense_forms[dense_form]
            dense_tflops = 4 * d * hq * causal / dense_ms / 1e9
            dense_queued = queued_ms(dense)
            base = {"shape": shape, "n": n, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "dense_ms": dense_ms,
                    "dense_tflops": dense_tflops, "dense_queued_ms": dense_queued, "dense_form": dense_form,
                    "dense_forms_ms": dense_forms}
            found = {}  # pattern -> row, for the bars

            def ours(tiles, only=None, **kw):
                """The variants (`only` of them if given) on these tiles -> ({variant: ms or error}, best
                variant, default's output). A variant that resolves to the default's kernel, or a loop variant
                that resolves to the loop's defaults, is not run twice."""
                pack = hq // tiles.shape[1]
                rows_per_program = (128 if d <= 128 else 64) // pack if pack > 1 else tiles.block
                split, tma, persistent = loop_variant(pack, tiles.column_index.shape[-1] > 1 and kw.get("sink") is None,
                                                      hopper, d)
                ws_fits = hopper and ws_takes(q, tiles, kw.get("sink"))
                program = default_program(q, tiles, kw.get("sink"))  # sparse_prefill's own choice
                same = {"split": split and not tma and not persistent, "tma": split and tma and not persistent,
                        "single": not split and not persistent, "persistent": persistent,
                        "loop": program == "loop", "ws": program == "gluon" or not ws_fits}
                times = {}
                for name in variants if only is None else [x for x in variants if x in only]:
                    if name == "ws" and ws_check is not None and ws_check.result():
                        result["skipped"]["ws"] = ws_check.result()
                        continue
                    if same.get(name):
                        continue  # the default's kernel or the loop's defaults (ws: also where it does not fit)
                    try:
                        times[name] = time_ms(lambda: sparse_prefill(q, k, v, tiles, scale=scale, **VARIANTS[name],
                                                                     **kw))
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile here: say why
                        times[name] = f"{type(e).__name__}: {str(e)[:200]}"
                timed = {name: ms for name, ms in times.items() if isinstance(ms, float)}
                if not timed:  # every variant failed: say why, leave the row out
                    print(f"{shape} {n}: every variant failed on these tiles: {times}", flush=True)
                    result.setdefault("failed", []).append({"shape": shape, "n": n, "variant_ms": times})
                    return times, None, None
                out = sparse_prefill(q, k, v, tiles, scale=scale, **kw)[0]
                warps, stages = default_config(d, rows_per_program, pack, tiles.piece)
                times["default_is"] = ({"kernel": "ws" if program == "gluon" else program} if program != "loop" else
                                       {"kernel": "loop", "split": split, "tma": tma and split, "persistent": persistent,
                                        "num_warps": warps, "num_stages": stages})
                default = lambda: sparse_prefill(q, k, v, tiles, scale=scale, **kw)  # noqa: E731
                times["default_is"]["queued_ms"] = queued_ms(default)
                times["default_is"]["paired_dense_ms"], times["default_is"]["paired_ms"] = paired_ms([dense, default])
                return times, min(timed, key=timed.get), out

            def gluon(times, fn, out, name="ws"):
                """Time `fn` (a `prefill_ws` entry on prepared inputs) as variant `name` where the Gluon kernel runs
                (sm_90, head_dim 64 / 128, "ws" in --variants, its check passed) -> (best variant, extras)."""
                if "ws" not in variants or not hopper or d not in (64, 128) or (ws_check and ws_check.result()):
                    return min((x for x in times if isinstance(times[x], float)), key=times.get), {}
                try:
                    times[name] = time_ms(fn)
                    extra = {f"{name}_vs_loop_output": agreement(fn()[0], out)}
                except Exception as e:  # noqa: BLE001 - keep the row, say why the Gluon kernel is missing
                    times[name] = f"{type(e).__name__}: {str(e)[:200]}"
                    extra = {}
                return min((x for x in times if isinstance(times[x], float)), key=times.get), extra

            def row(pattern, tiles, times, best, mi_ms=None, area=None, mi_queued=None, **extra):
                """One row: `times` per variant (best: `best`); queued: the default's (`ours`) and MInference's
                time per call queued back to back (`queued_ms`: the host's launch overhead hidden)."""
                area = area if area is not None else tile_area(tiles, n).sum().item() * (hq // tiles.shape[1])
                ms = times[best]
                tf = 4 * d * area / ms / 1e9
                r = {**base, "pattern": pattern, "block": f"{tiles.block}x{tiles.piece}",
                     "physical_density": area / (hq * causal), "time_ms": ms, "best_variant": best,
                     "default_ms": times.get("default") if isinstance(times.get("default"), float) else None,
                     "variant_ms": times, "effective_tflops": tf, "ratio_to_dense_tflops": tf / dense_tflops,
                     "speedup_vs_dense": dense_ms / ms, **extra}
                queued = times.get("default_is", {}).get("queued_ms")
                if queued is not None:
                    r.update({"queued_ms": queued,
                              "queued_ratio_to_dense_tflops": area / queued / (hq * causal / dense_queued)})
                paired = times.get("default_is", {}).get("paired_ms")
                if paired is not None:  # the default and dense SDPA timed in turn, in rounds (`paired_ms`)
                    r["paired_ratio_to_dense_tflops"] = (area / paired
                                                         / (hq * causal / times["default_is"]["paired_dense_ms"]))
                if mi_ms is not None:
                    r.update({"minference_ms": mi_ms, "speedup_vs_minference": mi_ms / ms})
                if mi_queued is not None:
                    r["minference_queued_ms"] = mi_queued
                    if queued is not None:
                        r["queued_speedup_vs_minference"] = mi_queued / queued
                rows.append(r)
                found[pattern] = r
                print({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in r.items()
                       if k_ not in ("variant_ms", "q_heads", "kv_heads", "head_dim", "shape", "dense_tflops")},
                      flush=True)
                save()
                return r

            def with_flex(r, tiles, pattern, mask_mod, **kw):
                """FlexAttention on the 64-aligned blocks these per-head tiles touch, the pattern's exact mask."""
                if flex is None or si or time.time() - t_start > args.time_limit:
                    return
                try:
                    touched = touched_blocks(tiles, n)
                    blocks = touched.shape[-1]
                    eye = torch.eye(blocks, dtype=torch.bool, device=dev)
                    full = torch.zeros_like(touched) if pattern.startswith("vertical") else touched & ~eye
                    if pattern.startswith("a_shape"):
                        mb = torch.arange(blocks, device=dev)
                        in_window = mb[None, :] * 64 >= mb[:, None] * 64 + 63 - args.window + 1
                        full = full & (((mb[None, :] * 64 + 63) < args.sink) | in_window)
                    bm = flex_block_mask(touched, full, mask_mod, n)
                    call = lambda: flex(q, k, v, block_mask=bm, scale=scale, enable_gqa=True,  # noqa: E731
                                        kernel_options={"BLOCK_M": 64, "BLOCK_N": 64})
                    out, first_ms = sync_ms(call)
                    ms = time_ms(call)
                    r.update({"flex_ms": ms, "flex_compile_s": (first_ms - ms) / 1e3, "speedup_vs_flex": ms / r["time_ms"],
                              "vs_flex_output": agreement(out, sparse_prefill(q, k, v, tiles, scale=scale, **kw)[0])})
                except Exception as e:  # noqa: BLE001 - keep the row, say why flex is missing
                    r["flex_error"] = f"{type(e).__name__}: {e}"[:300]
                save()

            # block-sparse: our index (pooled scores + selection) vs MInference's pool + topk, both kernels on our table
            score_ms = time_ms(lambda: pooled_scores(q, k))
            score_ieee_ms = time_ms(lambda: pooled_scores(q, k, precision="ieee"))
            score = pooled_scores(q, k)
            select_ms = time_ms(lambda: select_blocks(score, args.topk))
            score = None
            our_index_of = lambda a, b: block_tiles(a, b, args.topk)  # noqa: E731 - what `BlockSparse.layer_tiles` runs
            our_index = lambda: our_index_of(q, k)  # noqa: E731
            idx_ms = time_ms(our_index)
            table_idx_ms = time_ms(lambda: selected_block_tiles(block_index(q, k, args.topk)))
            mi_index_of = lambda a, b: mi["block"]._build_block_index(a, b, args.topk, 64, 64)  # noqa: E731
            mi_index = lambda: mi_index_of(q, kx)  # noqa: E731
            mi_idx_ms = time_ms(mi_index) if with_mi else None
            index = {"index_ms": idx_ms, "table_then_tiles_ms": table_idx_ms, "pool_and_score_ms": score_ms,
                     "pool_and_score_ieee_ms": score_ieee_ms, "select_ms": select_ms,
                     "minference_index_ms": mi_idx_ms,
                     "index_ratio_to_minference": idx_ms / mi_idx_ms if mi_idx_ms else None,
                     "index_queued_ms": queued_ms(our_index)}
            if dev == "cuda":  # as `SparsePrefill` replays it by default: the q / k copy into the graph included
                graphs = IndexGraphs(after=0)
                index["index_graph_ms"] = time_ms(lambda: graphs("ours", our_index_of, q, k))
            if with_mi:
                index["minference_index_queued_ms"] = queued_ms(mi_index)
                index["index_queued_ratio_to_minference"] = index["index_queued_ms"] / index["minference_index_queued_ms"]
                if dev == "cuda":
                    index["index_graph_ratio_to_minference_eager"] = index["index_graph_ms"] / mi_idx_ms
                    index["minference_index_graph_ms"] = time_ms(lambda: graphs("minference", mi_index_of, q, kx))
                    index["index_graph_ratio_to_minference"] = (index["index_graph_ms"]
                                                                / index["minference_index_graph_ms"])
            if dev == "cuda":
                index["graph_failures"] = dict(graphs.failures) or None
            for shared in (False, True):
                table = block_index(q, k, args.topk, group_shared=shared)
                tiles = selected_block_tiles(table)
                times, best, out = ours(tiles)
                if best is None:
                    continue
                mi_ms, extra = None, {}
                if with_mi:
                    full_table = table.repeat_interleave(G, 1).contiguous() if shared else table
                    mi_fn = lambda: mi["block"]._triton_block_sparse_attention(q, kx, vx, seqlens, full_table, scale)  # noqa: E731
                    mi_ms = time_ms(mi_fn)
                    extra.update(mi_queued=queued_ms(mi_fn),
                                 vs_minference_output={**agreement(out, mi_fn()), "key_sets": "identical (same table)"})
                r = row("block_sparse" + ("_group_shared" if shared else ""), tiles, times, best, mi_ms,
                        **({} if shared else index), **extra)
                if not shared:
                    with_flex(r, tiles, "block_sparse", BlockSparse(table[0]).mask_mod(n, dev))
                del out, table

            # A-shape: per-head tiles vs group-shared (all heads share sink/window: packed, no quality change)
            sink, window = [args.sink] * hq, [args.window] * hq
            for shared, block, width in ((False, 64, 0), (True, 64, 0), (True, 128, 0)):
                if d > 128 and block * (width or block) > 128 * 64:
                    continue  # 128x128 tiles of head_dim 256 do not fit shared memory
                h = hkv if shared else hq
                t_a = time_ms(lambda: ashape_to_tiles([args.sink] * h, [args.window] * h, n, 1, block, dev, width))
                tiles = ashape_to_tiles([args.sink] * h, [args.window] * h, n, 1, block, dev, width)
                times, best, out = ours(tiles, sink=sink, window=window)
                if best is None:
                    continue
                ws = {}
                if not shared:  # the Gluon kernel on the same per-head tiles: one ring per row block, and two
                    # heads on one ring (ashape_prefill's choice on the H200)
                    best, ws = gluon(times, lambda t=tiles: ws_ashape(q, k, v, sink, window, scale=scale, tiles=t),
                                     out)
                    if hq // hkv % 2 == 0:
                        wide = ashape_to_tiles(sink, window, n, 1, block, dev, ASHAPE_LAUNCH["width"])  # the launch's step
                        best, shared_ring = gluon(times, lambda t=wide: ws_ashape(q, k, v, sink, window, scale=scale,
                                                                                  tiles=t, **ASHAPE_LAUNCH),
                                                  out, "ws_shared")
                        ws.update(shared_ring)
                r = row("a_shape" + ("_packed" if shared else ""), tiles, times, best, index_ms=t_a, **ws)
                if not shared:  # the deployed route (`ashape_prefill`: the shared ring on the H200) in turn with dense
                    paired_dense, r["route_paired_ms"] = paired_ms(
                        [dense, lambda: ashape_prefill(q, k, v, sink, window, scale=scale)])
                    r["route_paired_ratio_to_dense_tflops"] = r["physical_density"] * paired_dense / r["route_paired_ms"]
                    with_flex(r, tiles, "a_shape", AShape(args.sink, args.window, hq).mask_mod(n, dev), sink=sink,
                              window=window)
                del out

            # Vertical-Slash: the same (columns, offsets) to both; MInference converts them with its own extension
            for shared in (False, True):
                slash = min(args.slash, n)
                cols, offs = vs_index(q, k, scale, args.vertical, slash, group_shared=shared)
                t_idx = time_ms(lambda: vs_index(q, k, scale, args.vertical, slash, group_shared=shared))
                tiles = vs_tiles(cols, offs, n, head_columns=True)  # what `VerticalSlash.layer_tiles` builds
                t_tiles = time_ms(lambda: vs_tiles(cols, offs, n, head_columns=True))
                times, best, out = ours(tiles)
                if best is None:
                    continue
                mi_ms, extra = None, {"index_ms": t_idx + t_tiles, "tiles_ms": t_tiles}
                if not shared and hopper and d in (64, 128):  # the Gluon kernel: its own tiles + packed columns
                    packed = pack_vertical_slash(k, v, cols, offs, hq)
                    best, ws = gluon(times, lambda: ws_vertical_slash(q, k, v, cols, offs, scale=scale, packed=packed,
                                                                      **HEAD_LAUNCH), out, "ws_prepacked")
                    extra.update(ws, ws_tiles_and_pack_ms=time_ms(lambda: pack_vertical_slash(k, v, cols, offs, hq)))
                    packed = None
                if with_mi:
                    full_c = cols.repeat_interleave(G, 1) if shared else cols
                    full_o = offs.repeat_interleave(G, 1) if shared else offs
                    convert, note, build_s = mi["convert"].result()
                    result["minference"].update(vs_index=note, vs_index_build_s=build_s)
                    if convert is not None:
                        v_idx = full_c.to(torch.int32).sort(-1).values.contiguous()
                        s_idx = full_o.to(torch.int32).sort(-1, descending=True).values.contiguous()
                        conv = lambda: convert(seqlens, v_idx, s_idx, n, 64, 64)  # noqa: E731
                        mi_tiles_ms = time_ms(conv)
                        bc, bo, cc, ci = conv()
                        mi_area = (bc.long().sum() * 64 * 64 + cc.long().sum() * 64).item()
                    else:
                        t = expand_groups(tiles, G) if shared else tiles
                        bc, bo, cc, ci = t.block_count, t.block_offset, t.column_count, t.column_index
                        mi_tiles_ms, mi_area = None, tile_area(t, n).sum().item()
                    mi_fn = lambda: mi["vs"]._triton_mixed_sparse_attention(q, kx, vx, seqlens, bc, bo, cc, ci, scale)  # noqa: E731
                    mi_ms = time_ms(mi_fn)
                    extra.update({"mi_queued": queued_ms(mi_fn), "minference_tiles_ms": mi_tiles_ms,
                                  "tiles_ratio_to_minference": t_tiles / mi_tiles_ms if mi_tiles_ms else None,
                                  "minference_physical_density": mi_area / (hq * causal),
                                  "vs_minference_output": {**agreement(out, mi_fn()),
                                                           "key_sets": "both cover the logical VS set; the physical "
                                                                       "extras differ (ours: the fewest 64-wide "
                                                                       "pieces, greedy from the diagonal; theirs: "
                                                                       "64-wide steps from each range's start)"}})
                    del bc, bo, cc, ci
                name = "vertical_slash" + ("_group_shared" if shared else "")
                r = row(name, tiles, times, best, mi_ms, **extra)
                del out
                if shared:
                    continue
                with_flex(r, tiles, "vertical_slash", VerticalSlash(cols[0], offs[0]).mask_mod(n, dev))
                # the same work with contiguous column strips (positions 0.. of each row block: a wrong
                # output, the time a packed column buffer could at best reach)
                strips = torch.arange(tiles.column_index.shape[-1], device=dev, dtype=torch.int32)
                packed = VSTiles(tiles.block_count, tiles.block_offset, tiles.column_count,
                                 strips.expand_as(tiles.column_index).contiguous(), tiles.block, tiles.width,
                                 tiles.disjoint)
                contiguous_ms = time_ms(lambda: sparse_prefill(q, k, v, packed, scale=scale))
                strip_share = (tiles.column_count.long().sum() / (tiles.column_count.long().sum()
                               + tiles.block_count.long().sum() * tiles.piece)).item()
                loop_ms = next((x for x in (times.get("loop"), r["default_ms"]) if isinstance(x, float)), None)
                r.update({"contiguous_columns_ms": contiguous_ms,  # (against the loop on the column lists)
                          "contiguous_columns_gain": loop_ms / contiguous_ms if loop_ms else None,
                          "column_share_of_keys": strip_share})
                save()
                packed = None
                # 128-row tiles over 64-wide pieces (the greedy cover of each 128-row block's ranges)
                tiles = vs_tiles(cols, offs, n, 128, 64)
                times, best, out = ours(tiles, only=("default", "tma"))
                if best is not None:
                    row(name + "_128x64", tiles, times, best, mi_ms)
                del out, tiles
                # 64-row tiles over 128-key pieces and strips, per-head rings of 2 K + 1 V stages (the Gluon kernel
                # at FA3's step; no intra-warpgroup overlap, which spills there): a superset of the 64-key tiles'
                # keys, so its row's density and TFLOP/s are over its own tiles; its time beside MInference's
                if hopper and d == 128 and "ws" in variants:
                    wide = vs_tiles(cols, offs, n, 64, 128)
                    packed = pack_vertical_slash(k, v, cols, offs, hq, 128)
                    call = lambda: ws_vertical_slash(q, k, v, cols, offs, scale=scale, packed=packed,  # noqa: E731
                                                     stages=2, v_stages=1, overlap=False, width=128)
                    try:
                        times = {"ws_keys128": time_ms(call)}
                    except Exception as e:  # noqa: BLE001 - keep the bench going, say why the row is missing
                        result.setdefault("failed", []).append({"shape": shape, "n": n, "pattern": name + "_64x128",
                                                                "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    else:
                        row(name + "_64x128", wide, times, "ws_keys128", mi_ms,
                            ws_keys128_tiles_and_pack_ms=time_ms(lambda: pack_vertical_slash(k, v, cols, offs, hq,
                                                                                             128)))
                    wide = packed = None
            result["bars"].setdefault(shape, {})[n] = bars(found)
            save()
            q = k = v = kx = vx = None  # free this length's tensors before the next
            if dev == "cuda":
                torch.cuda.empty_cache()
    save()
    print(f"wrote {args.minference_out} ({len(rows)} rows, {time.time() - t_start:.0f} s)")
    return 0


BARS = {  # the issue's ratios: name -> (row pattern, row key); "queued": the defaults' calls queued back to back
    "vs_ratio_to_dense": ("vertical_slash", "ratio_to_dense_tflops"),
    "vs_speedup_vs_minference": ("vertical_slash", "speedup_vs_minference"),
    "vs_queued_ratio_to_dense": ("vertical_slash", "queued_ratio_to_dense_tflops"),
    "vs_queued_speedup_vs_minference": ("vertical_slash", "queued_speedup_vs_minference"),
    "vs_128x64_ratio_to_dense": ("vertical_slash_128x64", "ratio_to_dense_tflops"),
    "vs_64x128_ratio_to_dense": ("vertical_slash_64x128", "ratio_to_dense_tflops"),
    "vs_64x128_speedup_vs_minference": ("vertical_slash_64x128", "speedup_vs_minference"),
    "vs_64x128_physical_density": ("vertical_slash_64x128", "physical_density"),
    "vs_group_shared_ratio_to_dense": ("vertical_slash_group_shared", "ratio_to_dense_tflops"),
    "vs_paired_ratio_to_dense": ("vertical_slash", "paired_ratio_to_dense_tflops"),
    "vs_speedup_vs_dense": ("vertical_slash", "speedup_vs_dense"),
    "vs_physical_density": ("vertical_slash", "physical_density"),
    "ashape_route_paired_ratio_to_dense": ("a_shape", "route_paired_ratio_to_dense_tflops"),
    "block_ratio_to_dense": ("block_sparse", "ratio_to_dense_tflops"),
    "block_paired_ratio_to_dense": ("block_sparse", "paired_ratio_to_dense_tflops"),
    "block_speedup_vs_minference": ("block_sparse", "speedup_vs_minference"),
    "block_queued_ratio_to_dense": ("block_sparse", "queued_ratio_to_dense_tflops"),
    "block_queued_speedup_vs_minference": ("block_sparse", "queued_speedup_vs_minference"),
    "block_group_shared_ratio_to_dense": ("block_sparse_group_shared", "ratio_to_dense_tflops"),
    "vs_tiles_ratio_to_minference": ("vertical_slash", "tiles_ratio_to_minference"),
    "block_index_ratio_to_minference": ("block_sparse", "index_ratio_to_minference"),
    "block_index_queued_ratio_to_minference": ("block_sparse", "index_queued_ratio_to_minference"),
    "block_index_graph_ratio_to_minference": ("block_sparse", "index_graph_ratio_to_minference"),
    "block_index_graph_ratio_to_minference_eager": ("block_sparse", "index_graph_ratio_to_minference_eager"),
}


def bars(found: dict[str, dict]) -> dict[str, float | None]:
    """The issue's ratios at one (shape, length) from its rows (best variant each; `BARS`), and the best A-shape
    row's ratio to dense, synced, queued and paired (the default timed in turn with dense SDPA)."""
    out = {name: found.get(pattern, {}).get(key) for name, (pattern, key) in BARS.items()}
    for name, key in (("ashape_best_ratio_to_dense", "ratio_to_dense_tflops"),
                      ("ashape_best_queued_ratio_to_dense", "queued_ratio_to_dense_tflops"),
                      ("ashape_best_paired_ratio_to_dense", "paired_ratio_to_dense_tflops")):
        ratios = [r[key] for pattern, r in found.items() if pattern.startswith("a_shape") and key in r]
        out[name] = max(ratios) if ratios else None
    return out


if __name__ == "__main__":
    from workbench_benchmarks import standalone

    raise SystemExit(standalone(add_arguments, run, __doc__))
