"""The newer prefill patterns (Tri-shape, dilated, strided, XAttention, FlexPrefill) run on the
existing Triton prefill kernel through `to_tiles`: the kernel equals
exact attention over the tiles (CPU: Triton interpreter, fp32; GPU: bf16), and on XAttention, whose
tiles are exactly its mask, equals the logical pattern."""
from __future__ import annotations

import copy

import pytest
import torch
from workbench_kernels.index_ref import tiles_to_mask
from workbench_kernels.prefill import sparse_prefill
from workbench_kernels.prefill_ref import masked_attention_ref

from workbench.patterns.dilated import Dilated, Strided
from workbench.patterns.flexprefill import flexprefill
from workbench.patterns.trishape import TriShape
from workbench.patterns.xattention import xattention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, TOL = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 2e-5)


@pytest.mark.parametrize("name", ["trishape", "dilated", "strided", "xattention", "flexprefill"])
def test_kernel_runs_each_new_pattern(name):
    n, hq, hkv, d = 200, 4, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (hq, hkv, hkv))
    scale = d ** -0.5
    pattern = {"trishape": lambda: TriShape(torch.tensor([4, 0, 64, 8]), torch.tensor([16, 1, 70, 8]),
                                            torch.tensor([20, 0, 64, 130])),
               "dilated": lambda: Dilated(torch.tensor([5, 1, 40, 9]), torch.tensor([3, 7, 2, 20])),
               "strided": lambda: Strided(torch.tensor([8, 1, 30, 2]), torch.tensor([5, 64, 17, 3])),
               "xattention": lambda: xattention(q[0], k[0], scale, torch.tensor([0.3, 0.6, 0.9, 1.0])),
               "flexprefill": lambda: flexprefill(q[0], k[0], scale, 0.5, torch.tensor([0.0, 1.0, 0.0, 1.0]), 16)}[name]()
    tiles = pattern.to_tiles(n)
    o, _ = sparse_prefill(*(x.to(DEV, DTYPE) for x in (q, k, v)), tiles.to(DEV), scale=scale)
    covered = tiles_to_mask(tiles, n)
    assert not (pattern.to_mask(n)[None] & ~covered).any()
    ref = masked_attention_ref(q.double(), k.double(), v.double(), covered, scale)[0]
    assert torch.allclose(o.double().cpu(), ref, atol=TOL, rtol=TOL)
    if name == "xattention":
        logical = masked_attention_ref(q.double(), k.double(), v.double(), pattern.to_mask(n)[None], scale)[0]
        assert torch.allclose(o.double().cpu(), logical, atol=TOL, rtol=TOL)


@pytest.mark.model
def test_whole_model_on_the_kernel_matches_the_reference(embedded):
    """`workbench compare`'s GPU path (Triton kernel over to_tiles in every layer) against its CPU path
    (row-mask reference) for XAttention, whose tiles are exactly its mask."""
    from workbench.core.attention import attention_override
    from workbench.core.corpus import make_sample
    from workbench.prefill.compare import pattern_attention

    model, tok, shape = embedded  # fp32 on the CPU; a copy runs on the GPU where there is one
    model = model if DEV == "cpu" else copy.deepcopy(model).to(DEV)
    ids = make_sample("passkey", tok, 192, seed=1).input_ids.reshape(1, -1).to(DEV)
    build = lambda layer, q, k, scale: xattention(q, k, scale, 0.8)  # noqa: E731
    logits = []
    for triton in (False, True):
        with attention_override(model, pattern_attention(build, triton=triton)), torch.no_grad():
            logits.append(model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu())
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3)


# ---- every registered kind through SparsePrefill (no name switch in sparse.py) -------------------------------
MIXED = [("dense", {}), ("ashape", {"sink": 4, "window": 40}), ("vs", {"vertical": 12, "slash": 20}),
         ("block", {"topk": 2}), ("trishape", {"sink": 4, "window": 32, "last": 20}),
         ("dilated", {"window": 10, "dilation": 3}), ("strided", {"window": 8, "stride": 17}),
         ("xattention", {"tau_milli": 800, "stride": 8}), ("xattention", {"tau_milli": 600, "stride": 16}),
         ("flexprefill", {"gamma_milli": 900, "tau_milli": 1, "min_budget": 16}),  # distance >= 0.001: VS
         ("flexprefill", {"gamma_milli": 700, "tau_milli": 1000, "min_budget": 64}),  # distance < 1: blocks
         ("vs", {"vertical": 4, "slash": 8}),
         *[("vs_group", {"vertical": 10, "slash": 16})] * 4]  # one whole KV group (G = 4)
PARITY_ABS = 1e-3  # tests/model/test_prefill_parity.py's bar
REF_ABS = 1e-6 if DEV == "cpu" else 1e-4  # the fp32 reference path against float64 (CUDA's fp32 matmuls are looser)


def mixed_prefill(entries, n=200, hkv=4, d=16, seed=0, **kw):
    """(SparsePrefill over one layer of `entries`, q, k, v) for a toy model shape, batch 2."""
    from workbench.config import HeadConfig, HeadEntry
    from workbench.core.model import ModelShape
    from workbench.prefill.sparse import SparsePrefill

    shape = ModelShape("toy", "llama", 1, len(entries), hkv, d, 64, "default", 10000.0, 4096, "toy")
    config = HeadConfig(model=shape.to_dict(), heads=[HeadEntry(0, h, p, a) for h, (p, a) in enumerate(entries)])
    config.proxy.update(sink=2, local=3)  # small forced sets, so the proxies choose at n = 200
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, d, generator=g) for h in (len(entries), hkv, hkv))
    return SparsePrefill(None, shape, config, min_length=0, **kw), config, q, k, v


def run_layer(sp, q, k, v, backend):
    index = sp.layer_index(0, q.to(DEV), k.to(DEV), 0.25, backend)
    return sp.layer_kernel(0, index, q.to(DEV), k.to(DEV), v.to(DEV), 0.25, backend).double().cpu()


def trishape_layer_on_gpu(params, hkv: int, d: int, seed: int):
    """A layer of Tri-shape heads ((sink, window, last) each, N = 1000, bf16 on the GPU, scale 0.1) through
    SparsePrefill's Triton path: (q, k, v, its index, its output, the PyTorch reference path's output in fp32)."""
    sp, _, q, k, v = mixed_prefill([("trishape", {"sink": g, "window": w, "last": t}) for g, w, t in params],
                                   n=1000, hkv=hkv, d=d, seed=seed)
    q, k, v = (x.to("cuda", torch.bfloat16) for x in (q, k, v))
    index = sp.layer_index(0, q, k, 0.1, "triton")
    assert index[0].dense_from is not None
    out = sp.layer_kernel(0, index, q, k, v, 0.1, "triton")
    ref = sp.reference(sp.group_tiles(0, q, k, 0.1, triton=True), q.float(), k.float(), v.float(), 0.1)
    return q, k, v, index, out, ref


def test_every_registered_kind_runs_on_every_backend():
    """One layer mixing every registered kind (GQA 4:1, batch 2, n not a multiple of 64): the Triton
    path (Triton VS/block index, one launch) equals the PyTorch reference path, and both equal exact
    attention under the heads' own patterns (`HeadConfig.layer_index` -> to_tiles + token_band)."""
    from workbench_kernels.index_ref import tiles_to_mask

    from workbench.patterns import PATTERNS

    assert {p for p, _ in MIXED} == set(PATTERNS)  # a newly registered kind must join this test
    sp, config, q, k, v = mixed_prefill(MIXED)
    ref = run_layer(sp, q, k, v, "torch")
    tri = run_layer(sp, q, k, v, "triton")  # fp32 as the parity test (a bf16 index may break near-ties otherwise)
    assert float((ref - tri).abs().max()) <= PARITY_ABS
    n = q.shape[2]
    for b in range(q.shape[0]):
        stack = config.layer_index(0, q[b], k[b], 0.25)
        band = stack.token_band()
        mask = tiles_to_mask(stack.to_tiles(n), n, *(band or (None, None)))
        kk, vv = (x[b:b + 1].repeat_interleave(q.shape[1] // k.shape[1], 1).double() for x in (k, v))
        want = masked_attention_ref(q[b:b + 1].double(), kk, vv, mask, 0.25)[0]
        assert torch.allclose(ref[b], want, atol=1e-6), f"prompt {b}: the reference is not the heads' own patterns"


@pytest.mark.parametrize("group,hkv,d", [(4, 2, 16), (3, 2, 16), (4, 1, 256)], ids=["g4", "g3", "gemma"])
def test_a_layer_of_group_shared_vs_runs_its_tiles_per_kv_head(group, hkv, d):
    """A layer whose heads all take `vs_group` (KV groups with different budgets; Gemma-3's shape: one KV head,
    head_dim 256): the Triton path keeps one list per KV head (GQA-packed for G = 4; G = 3 runs per head) and equals
    the PyTorch reference, which equals exact attention under each group's shared index (every head of a group reads
    the same keys)."""
    from workbench_kernels.index_ref import tiles_to_mask

    sizes = [{"vertical": 10, "slash": 16}, {"vertical": 4, "slash": 30}]
    entries = [("vs_group", sizes[g % 2]) for g in range(hkv) for _ in range(group)]
    sp, config, q, k, v = mixed_prefill(entries, n=190, hkv=hkv, d=d)
    index = sp.layer_index(0, q.to(DEV), k.to(DEV), 0.25, "triton")
    assert index[0].shape[1] == hkv  # tiles per KV head
    ref = run_layer(sp, q, k, v, "torch")
    assert float((ref - run_layer(sp, q, k, v, "triton")).abs().max()) <= PARITY_ABS
    n = q.shape[2]
    for b in range(q.shape[0]):
        stack = config.layer_index(0, q[b], k[b], 0.25)
        keys = stack.row_mask(0, n, n)
        assert torch.equal(keys[0], keys[group - 1]) and (hkv == 1 or not torch.equal(keys[0], keys[group]))
        mask = tiles_to_mask(stack.to_tiles(n), n)
        kk, vv = (x[b:b + 1].repeat_interleave(group, 1).double() for x in (k, v))
        want = masked_attention_ref(q[b:b + 1].double(), kk, vv, mask, 0.25)[0]
        assert torch.allclose(ref[b], want, atol=REF_ABS), (
            f"prompt {b}: the fp32 reference is {float((ref[b] - want).abs().max()):.2e} from exact attention")


def test_flex_backend_runs_every_kind():
    pytest.importorskip("torch.nn.attention.flex_attention")
    sp, _, q, k, v = mixed_prefill(MIXED, n=128, seed=1)
    ref = run_layer(sp, q, k, v, "torch")
    flex = run_layer(sp, q, k, v, "flex")
    assert float((ref - flex).abs().max()) <= PARITY_ABS


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_adaptive_kinds_at_threshold_one_are_dense(backend):
    """XAttention at tau 1 and FlexPrefill at gamma 1 (either branch) through SparsePrefill give dense."""
    entries = [("xattention", {"tau_milli": 1000, "stride": 8}), ("xattention", {"tau_milli": 1000, "stride": 32}),
               ("flexprefill", {"gamma_milli": 1000, "tau_milli": 1, "min_budget": 1}),
               ("flexprefill", {"gamma_milli": 1000, "tau_milli": 1000, "min_budget": 1})]
    sp, _, q, k, v = mixed_prefill(entries, n=150, hkv=2)
    got = run_layer(sp, q, k, v, backend)
    dense = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                                             scale=0.25, enable_gqa=True)
    assert float((got - dense).abs().max()) <= PARITY_ABS


@pytest.mark.model
def test_compare_kernel_path_runs_on_the_models_device(embedded):
    """`workbench compare --device cuda`'s kernel lane (every point's index on the device, the Triton
    kernel, the searched config through the deployed Triton path) at a tiny size; on the CPU under the
    Triton interpreter (the times mean nothing there, the path and the report fields do)."""
    from workbench.analysis.compare import default_methods
    from workbench.config import HeadConfig
    from workbench.prefill.compare import SEARCHED, compare

    model, tok, shape = embedded
    model = model if DEV == "cpu" else copy.deepcopy(model).to(DEV)
    methods = [m for m in default_methods() if m.name in ("tri-shape", "vertical-slash", "xattention", "flexprefill")]
    config = HeadConfig.load("workbench/data/configs/SmolLM2-135M-Instruct.json", shape)
    rep = compare(model, tok, shape, tasks=["passkey"], lengths=[256], layers=[3], methods=methods, config=config,
                  rows=64, quality="none", progress=False, kernels=True, reps=1)
    pts = rep["points"]
    assert len(pts) == 3 * len(methods) + 1
    for p in pts:
        assert p["kernel_ms"] > 0 and p["dense_kernel_ms"] > 0
        online = p["method"] != "tri-shape"
        assert (p["gpu_index_ms"] is not None) == online and (not online or p["gpu_index_ms"] > 0)
    assert pts[-1]["method"] == SEARCHED and pts[-1]["gpu_index_ms"] > 0  # the deployed Triton index, timed
    front = rep["pareto_ms"]["passkey@256"]
    assert front and all(a["ms"] < b["ms"] and a["mass"] < b["mass"] for a, b in zip(front, front[1:]))
