"""The newer methods: Tri-shape, dilated, strided, XAttention, FlexPrefill (prefill) and Quest (decode).

Row masks against brute-force definitions at small n, physical tiles covering the mask, the vectorised
index builders against plain loops, adaptive thresholds at 1.0 giving dense, Quest's bound."""
from __future__ import annotations

import math

import pytest
import torch
from workbench_kernels.index_ref import tiles_to_mask

from workbench.patterns.dilated import Dilated, Strided
from workbench.patterns.flexprefill import flexprefill, flexprefill_scores, js_distance
from workbench.patterns.tile_select import cumulative_keep, tile_count
from workbench.patterns.trishape import TriShape
from workbench.patterns.xattention import antidiagonal_block_scores, threshold_blocks, xattention

B = 64


def brute(n: int, rule) -> torch.Tensor:
    """Bool `[n, n]` with rule(i, j) for every causal pair, in plain Python."""
    return torch.tensor([[j <= i and rule(i, j) for j in range(n)] for i in range(n)])


def check_pattern(p, masks: list[torch.Tensor], n: int) -> None:
    got = p.to_mask(n)
    for h, want in enumerate(masks):
        assert torch.equal(got[h], want), f"head {h} of {p}"
    assert torch.equal(p.edges(n), got.sum((1, 2)))
    t, band = p.to_tiles(n, batch=2), p.token_band()
    covered = tiles_to_mask(t, n, *(band or ()))
    assert not (got[None] & ~covered).any(), "tiles miss part of the mask"
    if band is not None:  # tiles under their token band: exactly the mask
        assert torch.equal(covered, got[None].expand_as(covered))
    assert torch.equal(p.tiles(n), tile_count(t)[0])
    q_idx, kv_idx = torch.arange(n)[None, :, None], torch.arange(n)[None, None, :]
    grid = p.mask_mod(n)(0, torch.arange(p.n_heads)[:, None, None], q_idx, kv_idx)
    assert torch.equal(grid.expand_as(got), got), "mask_mod differs from row_mask"


@pytest.mark.parametrize("n", [1, 63, 64, 130, 300])
def test_trishape_mask_edges_tiles(n):
    sink, window, last = torch.tensor([4, 0, 70]), torch.tensor([16, 1, 100]), torch.tensor([20, 0, 130])
    p = TriShape(sink, window, last)
    masks = [brute(n, lambda i, j, h=h: i >= n - int(last[h]) or j < int(sink[h]) or i - j < int(window[h]))
             for h in range(3)]
    check_pattern(p, masks, n)


@pytest.mark.parametrize("n", [1, 65, 300, 777])
def test_trishape_tiles_are_the_ashape_tiles_and_dense_question_rows(n):
    """Exactly what the kernel computes: the A-shape's tiles on every row block, and from row n - last on every
    causal key (dense rows outside the lists), per head and prompt of the batch; the lists stay as wide as the
    A-shape's at any length."""
    from workbench_kernels.index_ref import ashape_to_tiles, tiles_to_mask

    sink, window, last = torch.tensor([4, 0, 70, 64]), torch.tensor([16, 1, 100, 3000]), torch.tensor([20, 0, 130, 1])
    tiles = TriShape(sink, window, last).to_tiles(n, batch=2)
    band = ashape_to_tiles(sink, window, n, 2)
    assert tiles.block_offset.shape == band.block_offset.shape
    question = (torch.arange(n)[None, :] >= n - last[:, None])[None, :, :, None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(tiles_to_mask(tiles, n), torch.where(question, causal, tiles_to_mask(band, n)))


def test_trishape_tiles_at_a_million_tokens_are_as_wide_as_the_band():
    """32 heads at 1M tokens: the question adds no list width (it would be M = 16384 pieces a row block, 34 GB)."""
    n, tri = 1 << 20, TriShape(64, 4096, 64, n_heads=32)
    tiles = tri.to_tiles(n)
    assert tiles.block_offset.shape == (1, 32, n // 64, 65)
    assert tiles.dense_rows == 64 and torch.equal(tiles.dense_from, torch.full((1, 32), n - 64, dtype=torch.int32))
    assert torch.equal(tri.tiles(n), tile_count(tiles)[0])


@pytest.mark.parametrize("n", [1, 64, 200])
def test_dilated_and_strided_masks(n):
    check_pattern(Dilated(torch.tensor([5, 1, 40]), torch.tensor([3, 7, 2])),
                  [brute(n, lambda i, j, w=w, d=d: (i - j) % d == 0 and (i - j) // d < w)
                   for w, d in ((5, 3), (1, 7), (40, 2))], n)
    check_pattern(Strided(torch.tensor([8, 1]), torch.tensor([5, 64])),
                  [brute(n, lambda i, j, w=w, s=s: i - j < w or (i - j) % s == 0) for w, s in ((8, 5), (1, 64))], n)


@pytest.mark.parametrize("cls,params", [
    (TriShape, [{"sink": 4, "window": 16, "last": 20}, {"sink": 0, "window": 1, "last": 0}]),
    (Dilated, [{"window": 5, "dilation": 3}, {"window": 40, "dilation": 2}]),
    (Strided, [{"window": 8, "stride": 5}, {"window": 1, "stride": 64}]),
])
def test_prompt_free_kinds_build_their_layer_tiles_once(cls, params):
    """The prefill's tiles of a kind that reads no prompt: equal to the per-prompt build (`PatternBase`'s), the same
    cached object at the next call whatever q holds, a new one at another length."""
    from workbench.patterns.base import PatternBase

    n = 200
    q, k = torch.randn(2, 2, n, 8), torch.randn(2, 1, n, 8)
    tiles, band = cls.layer_tiles(params, q, k, 0.35, {}, B)
    want, want_band = PatternBase.layer_tiles.__func__(cls, params, q, k, 0.35, {}, B)
    assert (band is None) == (want_band is None) == (cls is not TriShape)
    band = () if band is None else [x.cpu() for x in band]
    assert torch.equal(tiles_to_mask(tiles, n, *band), tiles_to_mask(want, n, *(want_band or ())))
    assert cls.layer_tiles(params, torch.zeros_like(q), k, 0.35, {}, B)[0] is tiles
    assert cls.layer_tiles(params, q[:, :, :150], k[:, :, :150], 0.35, {}, B)[0] is not tiles


@pytest.mark.parametrize("n", [130, 300])
def test_xattention_and_flexprefill_fast_tiles_equal_the_reference_conversion(n):
    """XAttention's tiles (`selected_block_tiles`) and FlexPrefill's (cut lists; with triton the Triton builder)
    hold exactly the keys of the reference conversions (`block_sparse_to_tiles`, `vs_to_tiles`). On the GPU
    where there is one (the Triton builder runs compiled), else on the CPU (interpreted)."""
    from workbench_kernels.index_ref import block_sparse_to_tiles, vs_to_tiles

    torch.manual_seed(n)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k = torch.randn(4, n, 16, device=dev) * 2, torch.randn(2, n, 16, device=dev) * 2
    x = xattention(q, k, 0.25, torch.tensor([0.5, 0.8, 0.95, 1.0]), 8)
    assert torch.equal(tiles_to_mask(x.to_tiles(n, batch=2), n),
                       tiles_to_mask(block_sparse_to_tiles(x.block_index.expand(2, -1, -1, -1), n), n))
    f = flexprefill(q, k, 0.25, torch.tensor([0.5, 0.9, 0.9, 0.95]), torch.tensor([0.0, 1.0, 0.0, 1.0]), 16)
    assert f.use_vs.any() and not f.use_vs.all()
    vs = tiles_to_mask(vs_to_tiles(f.vs.columns[None], f.vs.offsets[None], n), n)
    blocks = tiles_to_mask(block_sparse_to_tiles(f.blocks.block_index[None].int(), n), n)
    want = torch.where(f.use_vs[None, :, None, None], vs, blocks)
    for triton in (False, True):
        f.triton = triton
        assert torch.equal(tiles_to_mask(f.to_tiles(n), n), want), triton


def test_bad_sizes_name_the_field():
    with pytest.raises(ValueError, match="dilation"):
        Dilated(4, 0)
    with pytest.raises(ValueError, match="last"):
        TriShape(4, 16, -1)


def test_cumulative_keep_against_a_loop():
    torch.manual_seed(1)
    w = torch.rand(6, 17) * (torch.rand(6, 17) > 0.3)
    for share in (0.0, 0.3, 0.9, 1.0):
        got = cumulative_keep(w, share, min_keep=2)
        for r in range(6):
            order = sorted(range(17), key=lambda c: -float(w[r, c]))
            want, acc, total = set(), 0.0, float(w[r].sum())
            for rank, c in enumerate(order):
                if rank < 2 or (float(w[r, c]) > 0 and (acc < share * total - 1e-6 or share >= 1)):
                    want.add(c)
                acc += float(w[r, c])
            assert set(got[r].nonzero().flatten().tolist()) == want, (share, r)


def xattn_loop(q, k, scale, stride, n):
    """XAttention block scores with explicit loops over query groups, key groups and the antidiagonal."""
    hq, _, d = q.shape
    g = hq // k.shape[0]
    m = -(-n // B)
    groups = m * B // stride
    qp = torch.nn.functional.pad(q, (0, 0, 0, m * B - n))
    kp = torch.nn.functional.pad(k, (0, 0, 0, m * B - n))
    out = torch.zeros(hq, m, m, dtype=torch.float64)
    for h in range(hq):
        for a in range(groups):
            if a * stride >= n:
                continue
            s = torch.full((groups,), -math.inf, dtype=torch.float64)
            for c in range(a + 1):
                if c * stride < n:
                    s[c] = sum(float(qp[h, a * stride + t] @ kp[h // g, c * stride + stride - 1 - t])
                               for t in range(stride)) * scale / stride
            p = torch.softmax(s, 0)
            for c in range(groups):
                out[h, a * stride // B, c * stride // B] += p[c]
    return out / out.sum(-1, keepdim=True)


@pytest.mark.parametrize("n,stride", [(64, 8), (150, 8), (200, 16), (130, 4)])
def test_xattention_scores_match_loop(n, stride):
    """One pass, and passes of one and of two query blocks' groups (each against the key groups up to its own)."""
    torch.manual_seed(n)
    q, k = torch.randn(4, n, 8), torch.randn(2, n, 8)
    want = xattn_loop(q, k, 0.35, stride, n)
    for chunk in (None, B // stride, 2 * B // stride):
        got = antidiagonal_block_scores(q, k, 0.35, stride, chunk=chunk)
        assert torch.allclose(got.double(), want, atol=1e-5), chunk
    with pytest.raises(ValueError, match="chunk"):
        antidiagonal_block_scores(q, k, 0.35, stride, chunk=B // stride + 1)


def test_xattention_threshold_rule_and_dense_at_one():
    torch.manual_seed(0)
    n = 300
    q, k = torch.randn(3, n, 16) * 2, torch.randn(3, n, 16) * 2
    m = -(-n // B)
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    score = antidiagonal_block_scores(q, k, 0.25, 8)
    keep = threshold_blocks(score, torch.tensor([0.2, 0.6, 1.0]))
    assert torch.equal(keep[2], causal)  # tau = 1 keeps every causal block
    assert keep.diagonal(dim1=1, dim2=2).all() and keep[..., 0].all()
    for h, tau in ((0, 0.2), (1, 0.6)):  # the kept blocks hold >= tau, and dropping the weakest one would not
        held = (score[h] * keep[h]).sum(-1)
        assert (held >= tau - 1e-6).all()
    dense = xattention(q, k, 0.25, 1.0, 8)
    assert torch.equal(dense.to_mask(n), torch.ones(n, n, dtype=torch.bool).tril().expand(3, n, n))


def flex_loop(q, k, scale, n):
    """FlexPrefill's decision inputs in plain loops: last-64-row attention, column and diagonal sums,
    pooled estimate and the JS distance."""
    hq, _, d = q.shape
    g = hq // k.shape[0]
    r = min(B, n)
    m = -(-n // B)
    col, diag = torch.zeros(hq, n, dtype=torch.float64), torch.zeros(hq, n, dtype=torch.float64)
    dist = torch.zeros(hq, dtype=torch.float64)
    for h in range(hq):
        kh = k[h // g].double()
        for i in range(n - r, n):
            p = torch.softmax(kh[: i + 1] @ q[h, i].double() * scale, 0)
            col[h, : i + 1] += p
            for j in range(i + 1):
                diag[h, i - j] += p[j]
        true = torch.stack([col[h, u * B:(u + 1) * B].sum() for u in range(m)]) / r
        kp = torch.stack([kh[u * B:(u + 1) * B].mean(0) for u in range(m)])
        est = torch.softmax(kp @ q[h, n - r:].double().mean(0) * scale, 0)
        mid = (true + est) / 2
        js = 0.5 * sum(float(a * math.log(a / c)) for a, c in zip(true, mid) if a > 0) + \
            0.5 * sum(float(b * math.log(b / c)) for b, c in zip(est, mid) if b > 0)
        dist[h] = math.sqrt(max(js, 0.0))
    return col, diag, dist


@pytest.mark.parametrize("n", [40, 64, 200])
def test_flexprefill_scores_match_loop(n):
    torch.manual_seed(n)
    q, k = torch.randn(4, n, 8), torch.randn(2, n, 8)
    sc = flexprefill_scores(q, k, 0.4)
    col, diag, dist = flex_loop(q, k, 0.4, n)
    assert torch.allclose(sc["column"].double(), col, atol=1e-4)
    assert torch.allclose(sc["diagonal"].double(), diag, atol=1e-4)
    assert torch.allclose(sc["distance"].double(), dist, atol=1e-3)  # sqrt amplifies float noise near 0
    assert torch.allclose(sc["block_score"].sum(-1), torch.ones(4, -(-n // B)), atol=1e-5)


def test_js_distance_bounds():
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    assert torch.allclose(js_distance(p, q), torch.tensor([math.sqrt(math.log(2)), 0.0]), atol=1e-6)


def test_flexprefill_choice_and_dense_at_one():
    torch.manual_seed(0)
    n = 320
    q, k = torch.randn(4, n, 16) * 3, torch.randn(2, n, 16) * 3
    causal = torch.ones(n, n, dtype=torch.bool).tril().expand(4, n, n)
    for tau in (0.0, 1.0):  # tau 0: every head VS; tau 1 (> sqrt(ln 2)): every head query-aware blocks
        f = flexprefill(q, k, 0.25, gamma=1.0, tau=tau, min_budget=0)
        assert bool(f.use_vs.all()) == (tau == 0.0) and bool(f.use_vs.any()) == (tau == 0.0)
        assert torch.equal(f.to_mask(n), causal)
    sparse = flexprefill(q, k, 0.25, gamma=0.3, tau=torch.tensor([0.0, 0.0, 1.0, 1.0]), min_budget=64)
    assert sparse.use_vs.tolist() == [True, True, False, False]
    check_pattern(sparse, list(sparse.to_mask(n)), n)
    assert (sparse.edges(n) < causal[0].sum()).all()
    assert ((sparse.vs.columns >= 0).sum(1) >= 64).all()  # the minimum budget


# ---------------------------------------------------------------------------------------------- Quest

@pytest.mark.parametrize("seed", range(6))
def test_quest_bound_is_at_least_every_page_max(seed):
    """Property: for random keys and queries (any scale, sign and partial last page) the page bound is
    >= the largest true score q . k of the page, and equals it for one-key pages."""
    from workbench.patterns.quest import page_bounds, page_scores

    gen = torch.Generator().manual_seed(seed)
    n, d, page = int(torch.randint(1, 300, (1,), generator=gen)), 16, 64
    k = torch.randn(3, n, d, generator=gen) * float(torch.rand(1, generator=gen) * 10)
    q = torch.randn(3, 5, d, generator=gen) * 3
    lo, hi = page_bounds(k, page)
    bound = page_scores(q, lo, hi)  # [3, 5, P]
    true = q @ k.transpose(-1, -2)  # [3, 5, n]
    for p in range(-(-n // page)):
        top = true[..., p * page:(p + 1) * page].amax(-1)
        assert (bound[..., p] >= top - 1e-4 * top.abs().clamp(min=1)).all()
    lo1, hi1 = page_bounds(k, 1)
    assert torch.allclose(page_scores(q, lo1, hi1), true, atol=1e-4)


def test_quest_select_forces_init_and_local_and_ranks_by_bound():
    from workbench.patterns.infllm import Budget
    from workbench.patterns.quest import group_page_scores, page_bounds, quest_select

    torch.manual_seed(0)
    budget = Budget(init=1, local=1, topk=2)
    k = torch.randn(2, 640, 8)
    q = torch.randn(2, 3, 4, 8)  # [Hkv, G, R, D]
    positions = torch.tensor([100, 320, 639, 639])
    lo, hi = page_bounds(k)
    ids = quest_select(q, lo, hi, positions, budget)
    score = group_page_scores(q, lo, hi)
    for h in range(2):
        for r, pos in enumerate(positions.tolist()):
            cur = pos // 64
            chosen = {i for i in ids[h, r].tolist() if i >= 0}
            assert {0, cur} <= chosen and max(chosen) <= cur
            rest = sorted(range(1, cur), key=lambda p: -float(score[h, r, p]))[:2]
            assert chosen == {0, cur, *rest}


# ------------------------------------------------------------------------------ config and search

def test_config_runs_and_refuses_to_export_the_new_kinds():
    from workbench.config import ConfigError, HeadConfig
    from workbench.patterns import Stack

    cfg = HeadConfig.load("workbench/data/configs/SmolLM2-135M-Instruct.json")
    cfg.edit(3, 0, "xattention", {"tau_milli": 900, "stride": 8}, keep_score=False)
    cfg.edit(3, 4, "trishape", {"sink": 64, "window": 128, "last": 64}, keep_score=False)
    cfg.edit(3, 5, "flexprefill", {"gamma_milli": 950, "tau_milli": 100, "min_budget": 64}, keep_score=False)
    torch.manual_seed(0)
    n = 200
    q, k = torch.randn(9, n, 64), torch.randn(3, n, 64)
    layer = cfg.layer_index(3, q, k, 0.125)
    assert isinstance(layer, Stack) and layer.n_heads == 9
    mask = layer.row_mask(0, n, n)
    assert torch.equal(mask[0], xattention(q, k, 0.125, torch.tensor([0.9] * 9), 8).to_mask(n)[0])
    assert torch.equal(mask[4], TriShape(64, 128, 64).to_mask(n)[0])
    assert torch.equal(mask[5], flexprefill(q, k, 0.125, 0.95, 0.1, 64).to_mask(n)[5])
    with pytest.raises(ConfigError, match="attn_type='xattention'"):
        cfg.to_minference()


def test_search_scores_method_candidates_exactly():
    from workbench.analysis.stats import captured_mass
    from workbench.search.search import Candidate, layer_scores, method_candidates

    torch.manual_seed(1)
    n = 256
    q, k = torch.randn(9, n, 64) * 2, torch.randn(3, n, 64) * 2
    cands = method_candidates(n) + [Candidate("dense")]
    assert {c.pattern for c in cands} == {"trishape", "xattention", "flexprefill", "dense"}
    out = layer_scores(q, k, 0.125, cands)
    tri = TriShape(64, cands[0].sizes[1], 64, n_heads=9)
    assert torch.allclose(out["mass"][:, 0], captured_mass(q, k, 0.125, tri).mean(-1).double(), atol=1e-6)
    assert torch.equal(out["tiles"][:, 0], tri.tiles(n).double())
    assert (out["tail"][:, 0] > 1 - 1e-5).all()  # Tri-shape keeps the answer rows whole
    assert (out["mass"] <= 1).all() and torch.equal(out["mass"][:, -1], torch.ones(9, dtype=torch.float64))


def test_rescore_head_handles_the_new_kinds():
    from workbench.analysis.stats import captured_mass
    from workbench.search.search import Candidate, HeadCache, rescore_head

    torch.manual_seed(2)
    n = 192
    q, k = torch.randn(n, 64) * 2, torch.randn(n, 64) * 2
    from workbench.analysis.metrics import layer_sums

    cache = HeadCache(scale=0.125, q=[q], k=[k], sums=[layer_sums(q[None], k[None], 0.125)])
    got = rescore_head(cache, Candidate("dilated", (16, 2)))
    want = captured_mass(q[None], k[None], 0.125, Dilated(16, 2)).mean()
    assert got["mass"][0] == pytest.approx(float(want), abs=1e-6)
    assert got["tiles"][0] == int(Dilated(16, 2).tiles(n)[0])


def test_quest_pages_append_equals_bounds_of_the_whole_prompt():
    """The decode buffer grown token by token (different lengths per sequence) holds the same bounds as
    `page_bounds` of the keys, and selects what `quest_select` selects."""
    from workbench.decode.quest import QuestPages
    from workbench.patterns.infllm import Budget
    from workbench.patterns.quest import page_bounds, quest_select

    torch.manual_seed(3)
    lengths, extra, hkv, d = [100, 190], 40, 2, 8
    keys = [torch.randn(hkv, n + extra, d) for n in lengths]
    buf = QuestPages(2, hkv, d, 4, "cpu")
    for b, n in enumerate(lengths):
        buf.fill(b, keys[b][:, :n])
    pos = torch.tensor(lengths)
    for _ in range(extra):
        buf.append(torch.stack([keys[b][:, int(pos[b])] for b in range(2)]), pos)
        pos += 1
    budget = Budget(init=1, local=1, topk=1)
    q = torch.randn(2, hkv, 3, d)
    got = buf.select(q, pos - 1, 4, budget)
    for b in range(2):
        lo, hi = page_bounds(keys[b][:, :int(pos[b])])
        p = lo.shape[1]
        assert torch.equal(buf.lo[b, :, :p], lo) and torch.equal(buf.hi[b, :, :p], hi)
        want = quest_select(q[b][:, :, None], lo, hi, pos[b:b + 1] - 1, budget)[:, 0]
        assert torch.equal(got[b], want)
