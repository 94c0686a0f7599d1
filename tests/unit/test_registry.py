"""The pattern registry is the only list of kinds: every registered kind walks config -> search -> export ->
dashboard edit from its class alone, so a new kind that misses a part fails here."""
from __future__ import annotations

import pytest
import torch

from workbench.analysis.stats import captured_mass
from workbench.config import PARAMS, SCHEMA, ConfigError, HeadConfig, HeadEntry
from workbench.config.head_config import MINFERENCE_ATTN_TYPES, MINFERENCE_NAMES
from workbench.core.model import ModelShape
from workbench.patterns import PATTERNS, default_params, pattern_class
from workbench.search.search import Candidate, default_candidates, layer_scores, method_candidates

KINDS = list(PATTERNS)
SHAPE = ModelShape(name="tiny", architecture="llama", n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16,
                   hidden_size=96, rope_type="default", rope_theta=10000.0, max_positions=1024, fingerprint="abc")


pytestmark = pytest.mark.usefixtures("one_thread")  # every test here on one torch thread


def qk(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA 3:1 q/k with a sink key and a heavy column, so patterns differ."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(6, n, 16, generator=g), torch.randn(2, n, 16, generator=g)
    k[:, 0] *= 3
    k[:, n // 3] += 2 * q.mean((0, 1))
    return q, k


def config_with(kind: str, params: dict[str, int]) -> HeadConfig:
    """Dense everywhere but heads (1, 0) and (1, 4), which get `kind` (with their KV groups, 0-2 and 3-5, where the
    kind shares one index per KV head)."""
    group = SHAPE.n_heads // SHAPE.n_kv_heads if pattern_class(kind).kv_shared else 1
    mine = {(1, h) for h0 in (0, 4) for h in range(h0 - h0 % group, h0 - h0 % group + group)}
    heads = [HeadEntry(l, h, kind if (l, h) in mine else "dense", dict(params) if (l, h) in mine else {})
             for l in range(SHAPE.n_layers) for h in range(SHAPE.n_heads)]
    return HeadConfig(model=SHAPE.to_dict(), heads=heads)


def test_everything_that_names_kinds_derives_from_the_registry():
    assert list(PARAMS) == KINDS and all(PARAMS[k] == pattern_class(k).params for k in KINDS)
    assert SCHEMA["properties"]["heads"]["items"]["properties"]["pattern"]["enum"] == KINDS
    assert MINFERENCE_NAMES == {k: c.minference_name for k, c in PATTERNS.items() if c.minference_name}
    assert MINFERENCE_ATTN_TYPES == {k: c.minference_attn_type for k, c in PATTERNS.items() if c.minference_attn_type}
    grid = [c.pattern for c in default_candidates(4096) + method_candidates(4096)]
    assert grid == [k for k, c in PATTERNS.items() if c.default_search for _ in c.grid(4096)] + \
        [k for k, c in PATTERNS.items() if not c.default_search for _ in c.grid(4096)]
    from workbench.analysis.compare import default_methods

    assert [m.name for m in default_methods()] == [c.sweep.name for c in PATTERNS.values() if c.sweep]
    from workbench.prefill.flex import STATIC_KINDS

    assert set(STATIC_KINDS) == {k for k, c in PATTERNS.items() if c.static}


@pytest.mark.parametrize("kind", KINDS)
def test_defaults_are_real_budgets_below_a_quarter(kind):
    """A head switched to a kind at 1K / 4K / 8K tokens keeps well under n / 4 keys per query (adaptive
    kinds: their thresholds are not budgets), and its sizes are what the config accepts."""
    cls = pattern_class(kind)
    for n in (1024, 4096, 8192):
        params = default_params(kind, n)
        assert set(params) == set(cls.params) and all(isinstance(v, int) and v >= 0 for v in params.values())
        Candidate.from_dict({"pattern": kind, "params": params})  # the search's own checks
        if kind == "dense" or (cls.sweep is not None and cls.sweep.adaptive):
            continue
        q, k = qk(n)
        index = cls.for_heads([params] * 6, q, k.repeat_interleave(3, 0), 0.25, {}, 64)
        assert (index.edges(n) < n * n // 4).all(), (kind, n, params)  # mean keys per query below n / 4


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_through_config_search_and_export(kind, tmp_path):
    cls, n = pattern_class(kind), 200
    params = default_params(kind, n)
    # config: check, save / load exactly, the layer index it prescribes
    cfg = config_with(kind, params)
    cfg.check("test")
    path = cfg.save(tmp_path / "c.json")
    assert HeadConfig.load(path, SHAPE).to_dict() == cfg.to_dict()
    q, k = qk(n, 1)
    layer = cfg.layer_index(1, q, k, 0.25)
    # search: the kind's evidence is the exact captured mass of what it runs, its tiles and edges
    cands = [Candidate.from_dict({"pattern": kind, "params": p}) for p in [params, *cls.grid(n)]]
    sc = layer_scores(q, k, 0.25, cands)
    built = cls.build([params] * 6, q, k, 0.25, cfg.proxy, 64)
    for h in (0, 4):
        want = captured_mass(q[h:h + 1], k[h // 3:h // 3 + 1], 0.25, built[h]).double()
        assert torch.equal(layer.row_mask(0, n, n)[h], built[h].row_mask(0, n, n)[0])
        assert float(sc["mass"][h, 0]) == pytest.approx(float(want.mean()), abs=1e-5)
        assert float(sc["tail"][h, 0]) == pytest.approx(float(want[0, -64:].mean()), abs=1e-5)
        assert float(sc["tiles"][h, 0]) == float(built[h].tiles(n)[0])
        assert float(sc["edges"][h, 0]) == float(built[h].edges(n)[0])
    assert (sc["oracle"] >= sc["mass"] - 1e-6).all() and (sc["mass"] > 0).all()
    # export: MInference where the kind has a name there, else a refusal that says what MInference runs
    if cls.minference_name is not None or kind == "dense":
        back = HeadConfig.from_minference(cfg.to_minference(), SHAPE)
        assert [(e.pattern, e.params) for e in back.heads] == [(e.pattern, e.params) for e in cfg.heads]
    else:
        with pytest.raises(ConfigError, match=f"attn_type={cls.minference_attn_type!r}" if cls.minference_attn_type
                           else "no equivalent"):
            cfg.to_minference()


@pytest.mark.model
def test_each_kind_through_a_dashboard_edit(tmp_path):
    """The dashboard's head editor switches one head through every kind: default sizes at this length,
    then explicit sizes; the numbers are the search's own (`rescore_head`)."""
    import time

    from workbench.views.dashboard.state import Session, Settings
    from workbench.views.dashboard.tab_state import HeadState

    s = Session(Settings(length=256, layers=(1,), config="search", configs_dir=str(tmp_path),
                         bench=str(tmp_path / "no-bench.json")))
    head = HeadState(s)
    s.load().result(timeout=600)
    assert s.error == "" and s.ready
    s.select(1, 2)
    deadline = time.monotonic() + 600
    while (head.busy or head.view is None or (head.layer, head.head) != (1, 2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert head.error == "" and (head.layer, head.head) == (1, 2)
    for kind in KINDS:
        r = head.edit(kind)
        assert (r["entry"].pattern, r["entry"].params) == (kind, default_params(kind, 256))
        assert 0 < r["mass"] <= 1 and r["oracle"] >= r["mass"] - 1e-6 and r["tiles"] > 0
        assert s.config.entry(1, 2).pattern == kind and s.config.provenance["edits"][-1]["pattern"] == kind
        mates = [s.config.entry(1, h) for h in (0, 1)]  # head 2's KV group: heads 0-2
        if pattern_class(kind).kv_shared:  # the group moved with it, each mate re-scored on its own
            assert all(m.pattern == kind and m.recall["mean"] == pytest.approx(float(s.mass[1, m.head])) for m in mates)
        else:
            assert all(m.pattern != "vs_group" for m in mates)
    r = head.edit("ashape", {"sink": 4, "window": 16})
    assert r["entry"].params == {"sink": 4, "window": 16} and r["mass"] < 1
