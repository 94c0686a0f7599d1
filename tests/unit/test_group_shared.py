"""Group-shared Vertical-Slash (`vs_group`): one index per KV head, given to whole KV groups by the config, chosen
per group by the search, re-scored per head on its whole group."""
from __future__ import annotations

import pytest
import torch

from workbench.analysis.metrics import LayerReductions
from workbench.analysis.stats import captured_mass
from workbench.config import PROXY_DEFAULTS, ConfigError, HeadConfig, HeadEntry
from workbench.core.model import ModelShape
from workbench.patterns import GroupVerticalSlash, VerticalSlash, vs_proxy
from workbench.search.search import Candidate, Evidence, HeadCache, choose, edit_head, layer_scores, rescore_head

SHAPE = ModelShape(name="tiny", architecture="llama", n_layers=1, n_heads=6, n_kv_heads=2, head_dim=16,
                   hidden_size=96, rope_type="default", rope_theta=10000.0, max_positions=1024, fingerprint="abc")
VS = {"vertical": 30, "slash": 50}


def qk(n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(6, n, 16, generator=g), torch.randn(2, n, 16, generator=g)
    k[:, n // 3] += 2 * q.mean((0, 1))
    return q, k


def config(kinds: list[tuple[str, dict[str, int]]]) -> HeadConfig:
    return HeadConfig(model=SHAPE.to_dict(), heads=[HeadEntry(0, h, p, dict(a)) for h, (p, a) in enumerate(kinds)])


def test_the_proxy_shares_the_summed_group_scores():
    """`vs_proxy(group_shared=True)` selects from the column and diagonal scores added over each KV group: equal to
    the per-head proxy of a head whose scores are that sum (a group of one, q repeated), budgets per KV head."""
    q, k = qk()
    cols, offs = vs_proxy(q, k, 0.25, torch.tensor([20, 7]), 30, group_shared=True, sink=2, local=3)
    assert cols.shape == (2, 20) and offs.shape == (2, 30)
    assert ((cols >= 0).sum(-1) == torch.tensor([20, 7])).all()
    single = vs_proxy(q[:3], k[:1], 0.25, 20, 30, group_shared=True, sink=2, local=3)
    assert torch.equal(single[0][0], cols[0]) and torch.equal(single[1][0], offs[0])
    per_head = vs_proxy(q[:3], k[:1], 0.25, 20, 30, sink=2, local=3)[0]
    assert not all(torch.equal(per_head[h], cols[0]) for h in range(3))  # the shared index is not any head's own


def test_a_config_gives_it_to_whole_kv_groups_only():
    whole = config([("vs_group", VS)] * 3 + [("vs", VS)] * 3)
    whole.check("test")
    with pytest.raises(ConfigError, match=r"heads\[0\] \(layer 0, head 0\) is vs_group.*head 2 is vs\(.*heads 0\.\.2"):
        config([("vs_group", VS)] * 2 + [("vs", VS)] * 4).check("test")
    with pytest.raises(ConfigError, match="head 1 is vs_group\\(vertical=31"):
        config([("vs_group", VS), ("vs_group", {**VS, "vertical": 31}), ("vs_group", VS)] + [("dense", {})] * 3).check("t")


def test_edit_moves_the_whole_group_and_a_refused_edit_changes_nothing():
    cfg = config([("vs", VS)] * 6)
    cfg.edit(0, 4, "vs_group", VS, keep_score=False)
    assert [e.pattern for e in cfg.heads] == ["vs"] * 3 + ["vs_group"] * 3
    cfg.edit(0, 3, "dense", {}, keep_score=False)  # leaving the shared kind: the group leaves together
    assert [e.pattern for e in cfg.heads] == ["vs"] * 3 + ["dense"] * 3
    before = cfg.to_dict()
    with pytest.raises(ConfigError, match="vertical"):
        cfg.edit(0, 1, "vs_group", {**VS, "vertical": 5000}, keep_score=False)  # above max_positions
    assert cfg.to_dict() == before


def test_evidence_is_the_mass_of_the_shared_index_the_prefill_runs():
    q, k = qk(300, 1)
    cands = [Candidate("vs_group", (30, 50)), Candidate("vs", (30, 50))]
    sc = layer_scores(q, k, 0.25, cands)
    built = GroupVerticalSlash.build([VS] * 6, q, k, 0.25, dict(PROXY_DEFAULTS), 64)
    for h in range(6):
        assert torch.equal(built[h].columns, built[h - h % 3].columns)
        want = captured_mass(q[h:h + 1], k[h // 3:h // 3 + 1], 0.25, built[h]).double().mean()
        assert float(sc["mass"][h, 0]) == pytest.approx(float(want), abs=1e-5)
    assert (sc["oracle"][:, 0] >= sc["mass"][:, 0] - 1e-9).all()
    # one head's re-score (the dashboard's edit) reads its whole group: the same numbers as the layer's
    cache = HeadCache(scale=0.25, q=[q[4]], k=[k[1]], sums=[LayerReductions(q[4:5], k[1:2], 0.25).sums],
                      group_q=[q[3:6]], member=1)
    got = rescore_head(cache, cands[0])
    assert got["mass"][0] == pytest.approx(float(sc["mass"][4, 0]), abs=1e-6)
    assert got["tiles"][0] == int(sc["tiles"][4, 0])
    alone = rescore_head(cache, cands[1])  # a per-head kind: the head alone
    assert alone["mass"][0] == pytest.approx(float(sc["mass"][4, 1]), abs=1e-6)


def test_edit_head_rescores_every_head_the_edit_moved():
    """`search.edit_head` (the notebooks' and the dashboard's edit): switching head 4 to `vs_group` moves and
    re-scores heads 3..5 on their own samples, each entry's recall being its `rescore_head` mass; a per-head edit
    re-scores the head alone; a re-score that fails leaves the config as it was."""
    qs, ks = zip(qk(300, 1), qk(300, 2))
    caches = {h: HeadCache(scale=0.25, q=[q[h] for q in qs], k=[k[h // 3] for k in ks],
                           sums=[LayerReductions(q[h:h + 1], k[h // 3:h // 3 + 1], 0.25).sums for q, k in zip(qs, ks)],
                           group_q=[q[h - h % 3:h - h % 3 + 3] for q in qs], member=h % 3) for h in range(6)}
    cfg = config([("vs", VS)] * 6)
    got = edit_head(cfg, 0, 4, Candidate("vs_group", (30, 50)), caches.__getitem__)
    assert sorted(got) == [3, 4, 5] and [e.pattern for e in cfg.heads] == ["vs"] * 3 + ["vs_group"] * 3
    for h in (3, 4, 5):
        want = rescore_head(caches[h], Candidate("vs_group", (30, 50)))
        e = cfg.entry(0, h)
        assert e.recall == {"mean": round(want["mean"], 6), "worst": round(want["worst"], 6)}
        assert e.oracle == round(sum(want["oracle"]) / 2, 6) and 0 < e.density["physical"] <= 1
    assert cfg.entry(0, 0).recall is None  # heads the edit did not move keep their entries
    assert sorted(edit_head(cfg, 0, 1, Candidate("dense"), caches.__getitem__)) == [1]
    assert cfg.entry(0, 1).recall == {"mean": 1.0, "worst": 1.0}
    before = cfg.to_dict()

    def broken(h: int) -> HeadCache:
        raise RuntimeError("no capture")

    with pytest.raises(RuntimeError, match="no capture"):
        edit_head(cfg, 0, 0, Candidate("vs_group", (30, 50)), broken)
    assert cfg.to_dict() == before


def evidence(mass: list[list[float]], cost: list[list[float]], group: int = 3) -> Evidence:
    """One layer of 6 heads, candidates vs / vs_group / dense, worst mass and tiles as given per head."""
    cands = [Candidate("vs", (30, 50)), Candidate("vs_group", (30, 50)), Candidate("dense")]
    ev = Evidence.empty(cands, [{"s": 0}], [1024], 1, 6, group)
    ev.fill(0, 0, {"mass": torch.tensor(mass, dtype=torch.float64), "tail": torch.tensor(mass, dtype=torch.float64),
                   "oracle": torch.tensor(mass, dtype=torch.float64), "tiles": torch.tensor(cost, dtype=torch.float64),
                   "edges": torch.ones(6, 3, dtype=torch.float64)})
    return ev


def test_the_search_gives_a_group_the_shared_kind_only_where_every_head_fits_and_it_is_cheaper():
    ok, low = [0.97, 0.96, 1.0], [0.97, 0.90, 1.0]
    cheaper, dearer = [100.0, 90.0, 500.0], [100.0, 110.0, 500.0]
    # group 0: every head fits and the shared kind costs less -> all three take it; group 1: head 4 misses the target
    got = choose(evidence([ok, ok, ok, ok, low, ok], [cheaper] * 6))[0].tolist()
    assert got == [1, 1, 1, 0, 0, 0]
    assert choose(evidence([ok] * 6, [dearer] * 6))[0].tolist() == [0] * 6  # dearer: per head
    # a head whose own choice is dense still joins when the group's total falls
    worse = [0.5, 0.96, 1.0]
    assert choose(evidence([worse, ok, ok, ok, ok, ok], [cheaper] * 6))[0].tolist() == [1, 1, 1, 1, 1, 1]
    cfg_heads = ["vs_group"] * 3 + ["vs"] * 3
    from workbench.search.search import build_config

    ev = evidence([ok, ok, ok, ok, low, ok], [cheaper] * 6)
    cfg = build_config(ev, choose(ev), SHAPE.to_dict(), target=0.95)
    assert [e.pattern for e in cfg.heads] == cfg_heads  # a config the group rule accepts
    with pytest.raises(ValueError, match="different candidate grids, samples or models"):
        evidence([ok] * 6, [cheaper] * 6) + evidence([ok] * 6, [cheaper] * 6, group=2)


def test_per_head_vs_stays_what_it_was():
    """VS keeps its per-head index: the group-shared kind is a separate choice."""
    q, k = qk(200, 2)
    per = VerticalSlash.build([VS] * 6, q, k, 0.25, dict(PROXY_DEFAULTS), 64)
    cols, _ = vs_proxy(q, k, 0.25, 30, 50, **PROXY_DEFAULTS)
    assert all(torch.equal(per[h].columns[0], cols[h]) for h in range(6))


def test_latency_rates_read_the_minference_comparison_rows():
    """A `kernels_prefill --minference` result (rows keyed by "pattern", blocks "64x64", the dense time in each row)
    gives the same per-tile rates as its rows say, `vs_group`'s included, so `workbench search --group-shared
    --latency` can weigh the shared kernel's speed."""
    import statistics

    from workbench.patterns import causal_tiles
    from workbench.prefill.latency import load_bench, tile_rates

    path = "assets/benchmarks/prefill_minference_eff4416_h200.json"
    bench = load_bench(path)
    rates = tile_rates(bench, "llama3-8b")
    assert {"ashape", "vs", "vs_group", "block", "dense"} <= set(rates)
    for kind, name in (("vs_group", "vertical_slash_group_shared"), ("vs", "vertical_slash")):
        rows = [r for r in bench["rows"] if r["shape"] == "llama3-8b" and r["pattern"] == name]
        assert rows and rates[kind]["per_tile_ms"] == pytest.approx(statistics.median(
            r["time_ms"] / (causal_tiles(r["n"]) * r["q_heads"] * r["physical_density"]) for r in rows))
        assert rates[kind]["index_ms"] == pytest.approx(statistics.median(r["index_ms"] / r["q_heads"] for r in rows))
    dense = [r["dense_ms"] / (causal_tiles(r["n"]) * r["q_heads"]) for r in bench["rows"]
             if r["shape"] == "llama3-8b" and r["pattern"] == "vertical_slash"]
    assert rates["dense"]["per_tile_ms"] == pytest.approx(statistics.median(dense))


def test_compare_sweeps_it_on_whole_groups_and_times_its_tiles_per_kv_head():
    """`workbench compare`'s vertical-slash-group row builds the shared index from the KV heads (not one group per
    query head), and its kernel lane gets tiles per KV head, as `SparsePrefill` runs a layer of it."""
    from workbench.analysis.compare import default_methods
    from workbench.prefill.compare import pattern_tiles

    q, k = qk(200, 3)
    method = next(m for m in default_methods() if m.name == "vertical-slash-group")
    got = method.build(q, k, 0.25, 64)
    want = GroupVerticalSlash.build([method_params(64)] * 6, q, k, 0.25, {}, 64)
    assert all(torch.equal(got.columns[h], want[h].columns[0]) for h in range(6))
    tiles, _, _ = pattern_tiles(lambda qc, kc: method.build(qc, kc, 0.25, 64))(q[None], k[None])
    assert tiles.shape == (1, 2, 4)
    per_head = got.to_tiles(200)
    assert torch.equal(tiles.block_count, per_head.block_count[:, ::3])


def method_params(value: int) -> dict[str, int]:
    return GroupVerticalSlash.sweep.params(value)


def test_record_density_is_the_same_on_the_reference_and_the_merged_tiles():
    """`SparsePrefill(record_density=True)` on the PyTorch reference (tiles per kind) and on FlexAttention (the
    layer's merged tiles, as the Triton launch gets them): one density per layer, strictly between 0 and 1 for a
    layer mixing a `vs_group` group, per-head VS and A-shape, and the same outputs."""
    from workbench_benchmarks.shapes import random_llama

    from workbench.prefill.sparse import SparsePrefill

    model, shape = random_llama(2, tiny=True, device="cpu", dtype=torch.float32)
    kinds = [("vs_group", {"vertical": 30, "slash": 60})] * 2 + [("vs", {"vertical": 40, "slash": 50}),
                                                                ("ashape", {"sink": 16, "window": 96})]
    cfg = HeadConfig(model=shape.to_dict(), heads=[HeadEntry(l, h, *kinds[h]) for l in range(2) for h in range(4)])
    ids = torch.randint(0, model.config.vocab_size, (1, 700), generator=torch.Generator().manual_seed(0))
    got = {}
    for backend in ("torch", "flex"):
        with torch.no_grad(), SparsePrefill(model, shape, cfg, min_length=0, backend=backend, record_density=True) as sp:
            got[backend] = (model(ids, logits_to_keep=1).logits, dict(sp.density))
    (ref, density), (flex, merged) = got["torch"], got["flex"]
    assert sorted(density) == [0, 1] and all(0.1 < d < 0.9 for d in density.values())
    assert density == pytest.approx(merged, rel=1e-9)
    torch.testing.assert_close(flex, ref, atol=2e-4, rtol=2e-4)
