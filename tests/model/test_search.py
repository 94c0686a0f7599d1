"""Per-head search: exact candidate scores, oracle >= proxy, additive evidence, deterministic choice, CLI."""
from __future__ import annotations

import json

import pytest
import torch

from workbench.analysis.metrics import LayerReductions, layer_sums
from workbench.analysis.stats import captured_mass
from workbench.config import HeadConfig
from workbench.patterns import AShape, BlockSparse, Dense, Stack, VerticalSlash, block_proxy, membership, pattern_class, vs_proxy
from workbench.patterns.proxy import top_blocks, top_positions
from workbench.patterns.vertical_slash import vs_oracle
from workbench.search.search import (
    TAIL_ROWS,
    Candidate,
    Evidence,
    HeadCache,
    choose,
    default_candidates,
    evaluate_config,
    layer_scores,
    method_candidates,
    pattern_fits,
    rescore_head,
    search_heads,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # every test here on one torch thread


CANDS = [Candidate("ashape", (16, 40)), Candidate("ashape", (4, 100)), Candidate("vs", (8, 20)),
         Candidate("vs", (20, 60)), Candidate("block", (2,)), Candidate("block", (3,)), Candidate("dense")]
OVERSIZED = [Candidate("vs", (400, 500)), Candidate("ashape", (500, 600)), Candidate("block", (9,))]  # > n = 300


def structured_qk(n: int = 300, seed: int = 0):
    """Random q/k with a sink key and a few heavy columns, so the patterns differ."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(6, n, 16, generator=g), torch.randn(2, n, 16, generator=g)
    k[:, 0] *= 3
    k[:, [57, 140, n - 9]] += 2 * q.mean((0, 1))
    return q, k


def index_of(cand: Candidate, q, k, scale) -> object:
    if cand.pattern == "ashape":
        return AShape(*cand.sizes, n_heads=q.shape[0])
    if cand.pattern == "vs":
        return VerticalSlash(*vs_proxy(q, k, scale, *cand.sizes))
    if cand.pattern == "block":
        return BlockSparse(block_proxy(q, k, cand.sizes[0]))
    return Dense(q.shape[0])


def explicit_mass(q, k, scale, mask, rows=slice(None)):
    """Dense softmax, then the masked sum over `rows`, one head at a time: [H]."""
    g = q.shape[0] // k.shape[0]
    out = []
    for h in range(q.shape[0]):
        s = (q[h] @ k[h // g].T) * scale
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
        out.append((torch.softmax(s, -1) * mask[h]).sum(-1)[rows].mean())
    return torch.stack(out).double()


def test_layer_scores_are_exact():
    q, k = structured_qk()
    scale = 0.3
    sc = layer_scores(q, k, scale, CANDS + OVERSIZED)
    for c, cand in enumerate(CANDS + OVERSIZED):
        index = index_of(cand, q, k, scale)
        torch.testing.assert_close(sc["mass"][:, c], explicit_mass(q, k, scale, index.to_mask(300)), atol=1e-5, rtol=0)
        torch.testing.assert_close(sc["mass"][:, c], captured_mass(q, k, scale, index).mean(-1).double(), atol=1e-5, rtol=0)
        torch.testing.assert_close(sc["tail"][:, c], explicit_mass(q, k, scale, index.to_mask(300), slice(-TAIL_ROWS, None)),
                                   atol=1e-5, rtol=0)
        assert torch.equal(sc["tiles"][:, c], index.tiles(300).double())
        assert torch.equal(sc["edges"][:, c], index.edges(300).double())
    assert (sc["oracle"] >= sc["mass"] - 1e-9).all()
    torch.testing.assert_close(sc["mass"][:, len(CANDS):], torch.ones(6, 3, dtype=torch.float64))  # every key
    # the planted heavy key at 57 is far from the last rows: a short window keeps most of all rows' mass
    # but loses more of the answer rows' mass
    short = CANDS.index(Candidate("ashape", (16, 40)))
    assert (sc["tail"][:, short] < sc["mass"][:, short]).any()


def dense_probs(q, k, scale) -> torch.Tensor:
    """Float64 causal softmax `[Hq, N, N]` (query head h reads KV head h // (Hq // Hkv))."""
    n, g = q.shape[1], q.shape[0] // k.shape[0]
    s = (q.double() @ k.double().repeat_interleave(g, 0).transpose(1, 2)) * scale
    return torch.softmax(s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), -1)


def expected_scores(p, q, k, scale, cand: Candidate) -> dict[str, torch.Tensor]:
    """mass, tail, oracle `[Hq]` of a candidate from the dense softmax `p`, by definition: the kept
    probability of the index the candidate runs online (mean over all rows / the last 64), and of the
    best same-budget index (VS: the proxy's or the heaviest columns, each with the offsets holding the most
    mass off those columns; block-sparse: the heaviest key blocks per query block; else the index itself)."""
    hq, n = q.shape[0], q.shape[1]
    kept = lambda mask: (p * mask).sum(-1)  # noqa: E731  [Hq, N]
    if cand.pattern == "vs":
        v, s = cand.sizes
        cols, offs = vs_proxy(q, k, scale, v, s)
        rows = kept(VerticalSlash(cols, offs).to_mask(n))
        oracle = rows.mean(-1)
        for c in (cols, top_positions(p.sum(1), 0, v)):
            off_columns = p * ~membership(c, n)[:, None, :]
            by_offset = torch.stack([off_columns.diagonal(-d, 1, 2).sum(-1) for d in range(n)], -1)
            best = kept(VerticalSlash(c, top_positions(by_offset, 1, s)).to_mask(n)).mean(-1)
            oracle = torch.maximum(oracle, best)
    elif cand.pattern == "vs_group":  # one index per KV group; its oracle is the group's best known shared index
        v, s = cand.sizes
        g = hq // k.shape[0]
        heads = lambda x: x.repeat_interleave(g, 0)  # noqa: E731
        group = lambda x: x.unflatten(0, (-1, g)).sum(1)  # noqa: E731
        cols, offs = vs_proxy(q, k, scale, v, s, group_shared=True)
        rows = kept(VerticalSlash(heads(cols), heads(offs)).to_mask(n))
        best = rows.mean(-1)
        for c in (cols, top_positions(group(p.sum(1)), 0, v)):
            off_columns = p * ~membership(heads(c), n)[:, None, :]
            by_offset = torch.stack([off_columns.diagonal(-d, 1, 2).sum(-1) for d in range(n)], -1)
            other = kept(VerticalSlash(heads(c), heads(top_positions(group(by_offset), 1, s))).to_mask(n)).mean(-1)
            best = torch.where(heads(group(other) > group(best)), other, best)
        oracle = torch.maximum(rows.mean(-1), best)
    elif cand.pattern == "block":
        rows = kept(BlockSparse(block_proxy(q, k, cand.sizes[0])).to_mask(n))
        m = -(-n // 64)
        tiles = torch.nn.functional.pad(p, (0, m * 64 - n, 0, m * 64 - n)).reshape(hq, m, 64, m, 64).sum((2, 4))
        oracle = kept(BlockSparse(top_blocks(tiles, cand.sizes[0])).to_mask(n)).mean(-1)
    else:
        built = pattern_class(cand.pattern).build([cand.params] * hq, q, k, scale, {}, 64)
        rows = kept(Stack([built[h] for h in range(hq)]).to_mask(n))
        oracle = rows.mean(-1)
    return {"mass": rows.mean(-1), "tail": rows[:, -TAIL_ROWS:].mean(-1), "oracle": oracle}


EXTRA = [Candidate("ashape", (0, 50)), Candidate("ashape", (16, 40)), Candidate("ashape", (4, 100)),
         Candidate("vs", (0, 30)), Candidate("vs", (8, 20)), Candidate("vs", (20, 60)), Candidate("vs", (20, 100)),
         Candidate("block", (3,)), Candidate("dilated", (32, 2)), Candidate("strided", (16, 8)),
         Candidate("flexprefill", (900, 100, 64))]


def check_against_dense(q, k, scale, head: int = 4):
    """layer_scores and rescore_head of every default, method and extra candidate equal the dense
    softmax's values within 1e-6."""
    n, g = q.shape[1], q.shape[0] // k.shape[0]
    cands = list(dict.fromkeys(default_candidates(n) + method_candidates(n) + EXTRA + OVERSIZED))
    sc, p = layer_scores(q, k, scale, cands), dense_probs(q, k, scale)
    cache = HeadCache(scale, [q[head]], [k[head // g]], [layer_sums(q[head][None], k[head // g][None], scale)],
                      group_q=[q[head - head % g:head - head % g + g]], member=head % g)
    for c, cand in enumerate(cands):
        want = expected_scores(p, q, k, scale, cand)
        again = rescore_head(cache, cand)
        for name in ("mass", "tail", "oracle"):
            torch.testing.assert_close(sc[name][:, c], want[name].clamp(max=1), atol=1e-6, rtol=0,
                                       msg=lambda m: f"{cand.label()} {name}: {m}")
            assert again[name][0] == pytest.approx(float(want[name][head].clamp(max=1)), abs=1e-6), (cand, name)
        assert again["tiles"][0] == sc["tiles"][head, c]


@pytest.mark.parametrize("hq,hkv,n", [(6, 2, 300), (8, 2, 200)])
def test_scores_equal_the_dense_softmax_gqa(hq, hkv, n):
    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(hq, n, 16, generator=g), torch.randn(hkv, n, 16, generator=g)
    k[:, 0] *= 3
    k[:, [57, 140, n - 9]] += 2 * q.mean((0, 1))
    check_against_dense(q, k, 0.3)


@pytest.mark.model
def test_scores_equal_the_dense_softmax_real(capture_256):
    for layer in (0, 15):
        q, k, _ = capture_256.layer_qkv(layer)
        check_against_dense(q, k, capture_256.scale)


@pytest.mark.gpu
def test_scores_on_the_gpu_equal_the_cpu():
    """layer_scores on CUDA (every kind's evidence on q's device) equals the CPU's within 1e-5."""
    q, k = structured_qk(1000)
    cands = list(dict.fromkeys(default_candidates(1000) + method_candidates(1000) + EXTRA))
    cpu, gpu = layer_scores(q, k, 0.3, cands), layer_scores(q.cuda(), k.cuda(), 0.3, cands)
    for name in ("mass", "tail", "oracle", "tiles", "edges"):
        torch.testing.assert_close(gpu[name], cpu[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_scores_in_head_groups_equal_all_heads_at_once(monkeypatch):
    """Long prompts score heads in GQA-aligned groups (the VS proxy's last-row scores, the block proxy's
    [M, M] scores): groups of one head give the same scores as all heads at once."""
    from workbench.patterns import proxy

    assert proxy.head_groups(8, 2, 10, budget=25) == [(slice(0, 2), slice(0, 1)), (slice(2, 4), slice(0, 1)),
                                                      (slice(4, 6), slice(1, 2)), (slice(6, 8), slice(1, 2))]
    assert proxy.head_groups(12, 4, 10, budget=70) == [(slice(0, 6), slice(0, 2)), (slice(6, 12), slice(2, 4))]
    assert proxy.head_groups(8, 2, 10, budget=100) == [(slice(0, 8), slice(0, 2))]
    q, k = structured_qk(300)
    cands = list(dict.fromkeys(default_candidates(300) + CANDS + OVERSIZED))
    whole = layer_scores(q, k, 0.3, cands)
    monkeypatch.setattr(proxy, "GROUP_ELEMENTS", 1)
    assert len(proxy.head_groups(6, 2, 300 * 64)) == 6
    apart = layer_scores(q, k, 0.3, cands)
    for name in ("mass", "tail", "oracle", "tiles", "edges"):
        torch.testing.assert_close(apart[name], whole[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_scoring_memory_is_linear_in_the_length():
    """layer_scores' peak CUDA memory beyond q/k (Llama-3-8B attention: 32 q / 8 KV heads, d 128, bf16) grows
    about linearly from 32K to 64K tokens and stays under 1 GB at 64K (quadratic tile lists took 16 GB)."""
    peaks = {}
    for n in (32768, 65536):
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k = (torch.randn(h, n, 128, generator=g, device="cuda").to(torch.bfloat16) for h in (32, 8))
        cands = default_candidates(n)
        layer_scores(q, k, 128 ** -0.5, cands)  # compile and warm up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        layer_scores(q, k, 128 ** -0.5, cands)
        torch.cuda.synchronize()
        peaks[n] = (torch.cuda.max_memory_allocated() - base) / 1e9
        del q, k
    assert peaks[65536] < 1.0, peaks
    assert peaks[65536] < 2.3 * peaks[32768], peaks


def test_layer_sums_match_stats():
    from workbench.analysis.stats import layer_stats

    q, k = structured_qk(200)
    ours, ref = layer_sums(q, k, 0.3), layer_stats(q, k, 0.3)
    for name in ("column_mass", "diag_mass", "block_mass"):
        torch.testing.assert_close(getattr(ours, name), getattr(ref, name), atol=1e-5, rtol=1e-5)
    g = q.shape[0] // k.shape[0]
    s = (q[4, 150] @ k[4 // g, :151].T) * 0.3
    assert ours.lse[4, 150].item() == pytest.approx(torch.logsumexp(s, 0).item(), abs=1e-5)


@pytest.mark.model
def test_vs_tile_count_equals_the_built_tiles_of_real_proxies(capture_256):
    """The count-only tile count equals the tiles of `vs_to_tiles` on the proxy indexes of real heads."""
    from workbench_kernels.index_ref import vs_tile_count, vs_to_tiles

    n = capture_256.n
    for layer in (0, 15):
        q, k, _ = capture_256.layer_qkv(layer)
        for vertical, slash in ((30, 50), (64, 100), (8, 200)):
            cols, offs = (x[None] for x in vs_proxy(q, k, capture_256.scale, vertical, slash))
            t = vs_to_tiles(cols, offs, n)
            want = t.block_count.long().sum(-1) + (-(-t.column_count.long() // 64)).sum(-1)
            assert torch.equal(vs_tile_count(cols, offs, n), want)
            assert torch.equal(vs_tile_count(cols, offs, n, budget=3), want)


@pytest.mark.model
def test_oracle_beats_proxy_on_real_attention(capture_256):
    """At equal budget the oracle keeps at least the proxy's mass (VS and block-sparse), on real heads."""
    cands = [Candidate("vs", (30, 50)), Candidate("vs", (64, 100)), Candidate("block", (2,))]
    for layer in (0, 7, 15, 29):
        q, k, _ = capture_256.layer_qkv(layer)
        sc = layer_scores(q, k, capture_256.scale, cands)
        assert (sc["oracle"] >= sc["mass"] - 1e-9).all()
        cols, offs, mass = vs_oracle(LayerReductions(q, k, capture_256.scale), 30, 50)
        truth = captured_mass(q, k, capture_256.scale, VerticalSlash(cols, offs)).mean(-1).double()
        torch.testing.assert_close(mass.double(), truth, atol=1e-5, rtol=0)


def test_candidates():
    small, big = default_candidates(4096), default_candidates(16384)
    assert small[-1] == Candidate("dense") and big[-1] == Candidate("dense")
    for a, b in zip(small, big):
        if a.pattern == "vs":
            assert b.sizes == (a.sizes[0] * 4, a.sizes[1] * 4)  # budgets scale with n
    assert Candidate.from_dict(Candidate("vs", (3, 4)).to_dict()) == Candidate("vs", (3, 4))
    with pytest.raises(ValueError, match=r"vs\('vertical', 'slash'\)"):
        Candidate("vs", (3,))
    with pytest.raises(ValueError, match="topk = 0 must be >= 1"):
        Candidate("block", (0,))
    with pytest.raises(ValueError, match="missing \\['window'\\]"):
        Candidate.from_dict({"pattern": "ashape", "params": {"sink": 4}})


def fake_evidence(mass: list[list[float]], tiles: list[float], tail: list[list[float]] | None = None) -> Evidence:
    """One layer, one head; mass[s][c] (and answer-row mass tail[s][c], default = mass) per sample and candidate."""
    cands = [Candidate("ashape", (1, 1)), Candidate("vs", (1, 1)), Candidate("block", (1,)), Candidate("dense")]
    ev = Evidence.empty(cands, [{"task": "x"}] * len(mass), [128] * len(mass), 1, 1)
    for s, row in enumerate(mass):
        ev.fill(s, 0, {"mass": torch.tensor([row]), "tail": torch.tensor([tail[s] if tail else row]),
                       "oracle": torch.tensor([row]), "tiles": torch.tensor([tiles]), "edges": torch.tensor([tiles])})
    return ev


def test_choose_cheapest_that_meets_target_on_worst_sample():
    # candidate 0 is cheapest but fails on sample 1; candidate 2 passes everywhere and is cheaper than 1
    ev = fake_evidence([[0.99, 0.97, 0.96, 1.0], [0.90, 0.96, 0.951, 1.0]], [2, 6, 4, 10])
    assert choose(ev, 0.95).tolist() == [[2]]
    assert choose(ev, 0.955).tolist() == [[1]]
    assert choose(ev, 0.99).tolist() == [[3]]  # nothing reaches 0.99 on both: dense fallback
    tie = fake_evidence([[0.96, 0.98, 0.5, 1.0]], [3, 3, 1, 10])
    assert choose(tie, 0.95).tolist() == [[1]]  # equal cost: the higher worst-sample mass wins
    with pytest.raises(ValueError, match="target"):
        choose(ev, 1.5)
    # candidate 2 keeps the mass of all rows but loses the answer rows of sample 0: the next cheapest wins
    tailed = fake_evidence([[0.99, 0.97, 0.96, 1.0], [0.90, 0.96, 0.951, 1.0]], [2, 6, 4, 10],
                           tail=[[0.99, 0.97, 0.80, 1.0], [0.90, 0.96, 0.951, 1.0]])
    assert choose(tailed, 0.95).tolist() == [[1]]
    assert choose(tailed, 0.95, tail_target=0.8).tolist() == [[2]]
    with pytest.raises(ValueError, match="tail_target"):
        choose(ev, 0.95, tail_target=-0.1)
    assert choose(ev, 0.95, latency={"ashape": {"per_tile_ms": 1.0}, "vs": {"per_tile_ms": 0.1},
                                      "block": {"per_tile_ms": 1.0}, "dense": {"per_tile_ms": 1.0}}).tolist() == [[1]]


def test_evidence_is_additive_across_workers():
    q, k = structured_qk(200)
    whole = Evidence.empty(CANDS, [{"s": 0}, {"s": 1}], [200, 200], 2, 6)
    parts = [Evidence.empty(CANDS, [{"s": 0}, {"s": 1}], [200, 200], 2, 6) for _ in range(2)]
    for s in range(2):
        for layer in range(2):
            scores = layer_scores(q * (1 + s), k * (1 + layer), 0.3, CANDS)
            whole.fill(s, layer, scores)
            parts[(s + layer) % 2].fill(s, layer, scores)
    with pytest.raises(ValueError, match="incomplete"):
        choose(parts[0])
    merged = parts[0] + parts[1]
    for name in ("mass", "tail", "oracle", "tiles", "edges", "done"):
        assert torch.equal(getattr(merged, name), getattr(whole, name))
    assert torch.equal(choose(merged), choose(whole))


@pytest.mark.model
def test_search_end_to_end_is_deterministic(embedded, capture_256, tmp_path):
    from workbench.core.corpus import make_sample

    model, tok, shape = embedded
    samples = [make_sample("passkey", tok, 128, seed=0), make_sample("code", tok, 128, seed=0)]
    cands = [Candidate("ashape", (64, 64)), Candidate("vs", (32, 64)), Candidate("block", (2,)), Candidate("dense")]
    cfg, ev = search_heads(model, tok, shape, samples, candidates=cands, progress=False)
    cfg.validate(shape)
    again, _ = search_heads(model, tok, shape, samples, candidates=cands, progress=False)
    assert [(e.pattern, e.params) for e in again.heads] == [(e.pattern, e.params) for e in cfg.heads]
    for e in cfg.heads:
        assert e.pattern == "dense" or e.recall["worst"] >= 0.95
        assert len(e.evidence["mass_mean"]) == len(cands)
    back = HeadConfig.load(cfg.save(tmp_path / "c.json"), shape)
    assert back.to_dict() == cfg.to_dict()
    # the recall of the shipped indexes on another prompt is the exact captured mass
    result = evaluate_config(cfg, capture_256)
    q, k, _ = capture_256.layer_qkv(3)
    rows = captured_mass(q, k, capture_256.scale, cfg.layer_index(3, q, k, capture_256.scale))
    torch.testing.assert_close(result["mass"][3], rows.mean(-1).double())
    assert (result["oracle"] >= result["mass"] - 1e-6).all()


@pytest.mark.model
def test_rescore_head_matches_layer_scores(capture_256):
    cache = HeadCache.from_captures([capture_256], layer=5, head=4)
    q, k, _ = capture_256.layer_qkv(5)
    sc = layer_scores(q, k, capture_256.scale, CANDS)
    for c, cand in enumerate(CANDS):
        r = rescore_head(cache, cand)
        assert r["mass"][0] == pytest.approx(float(sc["mass"][4, c]), abs=1e-5)
        assert r["oracle"][0] == pytest.approx(float(sc["oracle"][4, c]), abs=1e-5)
        assert r["tiles"][0] == sc["tiles"][4, c]


@pytest.mark.model
def test_cli_search_and_export(embedded, tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "cfg.json"
    cands = tmp_path / "cands.json"
    cands.write_text(json.dumps([{"pattern": "ashape", "params": {"sink": 64, "window": 64}}]))
    assert main(["search", "--lengths", "128", "--tasks", "passkey@0.3", "--holdout", "code", "--candidates", str(cands),
                 "--tail-target", "0.9", "--out", str(out), "--no-progress"]) == 0
    cfg = HeadConfig.load(out, embedded[2])
    assert set(cfg.summary()) >= {"ashape", "dense"} and cfg.provenance["holdout"]["sample"]["task"] == "code"
    assert cfg.provenance["calibration"][0]["depth"] == 0.3 and cfg.provenance["tail_target"] == 0.9
    mi = tmp_path / "mi.json"
    assert main(["export", str(out), "--format", "minference", "--out", str(mi)]) == 0
    data = json.loads(mi.read_text())
    assert len(data) == 30 and all(len(layer) == 9 for layer in data)
    assert main(["export", str(mi), "--from", "minference", "--shape", "SmolLM2-135M-Instruct", "--format", "minference",
                 "--out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text()) == data
    assert main(["search", "--lengths", "64", "--tasks", "code", "--holdout", "code"]) == 2
    assert "also a calibration task" in capsys.readouterr().err
    assert main(["search", "--lengths", "64", "--tasks", "passkey@1.5"]) == 2
    assert "passkey@0.1" in capsys.readouterr().err  # the error shows the fix


@pytest.mark.model
def test_pattern_fits_report(embedded, tmp_path):
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample

    model, tok, shape = embedded
    cap = capture_attention(model, shape, make_sample("vartrack", tok, 192).input_ids, layers=[0, 9], progress=False)
    cfg = HeadConfig.from_minference([{"0": ["stream_llm", 64, 64, 1.0]}] * shape.n_layers, shape, fill_missing=True)
    fits = pattern_fits(cap, config=cfg)
    assert len(fits["heads"]) == 2 * shape.n_heads and [r["layer"] for r in fits["layers"]] == [0, 9]
    for r in fits["heads"]:
        assert r["vs_oracle"] >= r["vs_proxy"] - 1e-4 and r["block_oracle"] >= r["block_proxy"] - 1e-4
        assert 0 < r["fit_density"] <= 1 and 0 < r["config_mass"] <= 1
    json.dumps(fits)  # plain JSON
    s = fits["summary"]
    assert s["vs_gap"] >= 0 and sum(s["fits"].values()) == 2 * shape.n_heads
    assert s["config_mass_worst"] == min(r["config_mass"] for r in fits["heads"]) > 0


def test_sharded_collection_sums_to_the_whole(capture_256):
    """Two ranks score disjoint (sample, layer) slices; their sum is the single-process evidence."""
    from workbench.search.search import collect_evidence

    cands = [Candidate("ashape", (64, 64)), Candidate("dense")]
    capture = type(capture_256)(**{**capture_256.__dict__, "layers": (0, 1, 2),
                                   "q": capture_256.q[:3], "k": capture_256.k[:3], "v": capture_256.v[:3]})
    args = ([{"s": 0}, {"s": 1}], [256, 256], cands, 3, 9)
    whole = collect_evidence([capture, capture], *args, progress=False)
    parts = [collect_evidence([capture, capture], *args, progress=False, shard=(r, 2)) for r in range(2)]
    assert parts[0].done.sum() == 3 and parts[1].done.sum() == 3
    merged = parts[0] + parts[1]
    assert torch.equal(merged.mass, whole.mass) and torch.equal(choose(merged), choose(whole))
    with pytest.raises(ValueError, match="rank"):
        collect_evidence([capture], *args, shard=(2, 2))


def test_a_search_gives_the_model_back_its_own_attention(embedded):
    """search_heads streams each sample layer by layer; when it returns, the model runs its own attention
    again (a later prefill, quality run or dashboard job must not meet the streaming runner's hook)."""
    from workbench.core.corpus import make_sample
    from workbench.search.search import search_heads

    model, tok, shape = embedded
    before = model.config._attn_implementation
    sample = make_sample("passkey", tok, 256, seed=0)
    search_heads(model, tok, shape, [sample], candidates=[Candidate("ashape", (4, 64)), Candidate("dense")],
                 progress=False)
    assert model.config._attn_implementation == before
    with torch.no_grad():  # the whole prompt in one call: a stale runner would fail on its buffer sizes
        model(make_sample("passkey", tok, 300, seed=1).input_ids[None], use_cache=False)
