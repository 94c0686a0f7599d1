"""Pattern indexes: masks, logical edges, physical tiles, normalisation rules, online proxies."""
from __future__ import annotations

import pytest
import torch

from workbench.analysis.metrics import sparse_attention
from workbench.patterns import AShape, BlockSparse, Dense, Stack, VerticalSlash, block_proxy, causal_tiles, vs_proxy
from workbench.patterns.tile_select import tile_count

B = 64


def mask_tiles(mask: torch.Tensor) -> torch.Tensor:
    """Brute force: 64x64 tiles of a mask `[H, n, n]` holding at least one True."""
    h, n, _ = mask.shape
    m = -(-n // B)
    p = torch.nn.functional.pad(mask, (0, m * B - n, 0, m * B - n))
    return p.reshape(h, m, B, m, B).any(4).any(2).sum((1, 2))


def vs_tiles_loop(cols: list[int], offs: list[int], n: int) -> int:
    """Brute force of the VS tiling rule, one row block at a time, in plain Python."""
    offs = sorted({d for d in offs if 0 <= d < n} | {0})
    cols = sorted({c for c in cols if 0 <= c < n})
    total = 0
    for m in range(-(-n // B)):
        ranges = sorted((max(m * B - d, 0), (m + 1) * B - d) for d in offs if (m + 1) * B - d > 0)
        merged: list[list[int]] = []
        for lo, hi in ranges:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        pieces: list[tuple[int, int]] = []
        for lo, hi in reversed(merged):  # 64-wide pieces from the top key down, each at the highest key not covered
            top = hi if not pieces else min(hi, pieces[-1][0])
            while top > lo:
                pieces.append((top - B, top))
                top -= B
        left = [c for c in cols if c < m * B and not any(a <= c < b for a, b in pieces)]
        total += len(pieces) + -(-len(left) // B)
    return total


def random_vs(h: int, n: int, gen: torch.Generator) -> VerticalSlash:
    cols = torch.randint(-1, n + 3, (h, int(torch.randint(1, 12, (1,), generator=gen))), generator=gen)
    offs = torch.randint(-1, n, (h, int(torch.randint(1, 9, (1,), generator=gen))), generator=gen)
    if torch.rand(1, generator=gen) < 0.5:  # clustered offsets merge into long ranges
        offs = torch.cat([offs, torch.randint(0, 90, (h, 20), generator=gen)], 1)
    return VerticalSlash(cols, offs)


def test_worked_example():
    """Seed example: n=8, d=2, C={1}, D={0,2}: N(6)={1,4,6}, weights (0.422, 0.155, 0.422), o=(1.266, 0.732)."""
    vs = VerticalSlash(torch.tensor([[1]]), torch.tensor([[0, 2]]))
    mask = vs.to_mask(8)[0]
    assert mask[6].nonzero().flatten().tolist() == [1, 4, 6]
    assert mask[1].nonzero().flatten().tolist() == [1]  # 1 - 2 < 0 is dropped; column 1 and offset 0 coincide
    q = torch.zeros(1, 8, 2)
    k = torch.zeros(1, 8, 2)
    v = torch.zeros(1, 8, 2)
    q[0, 6] = torch.tensor([1.0, 1.0])
    k[0, 1], k[0, 4], k[0, 6] = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])
    v[0, 1], v[0, 4], v[0, 6] = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), torch.tensor([2.0, 1.0])
    weights = torch.softmax((q[0, 6] @ k[0].T).masked_fill(~mask[6], float("-inf")), -1)
    assert weights[[1, 4, 6]].tolist() == pytest.approx([0.422, 0.155, 0.422], abs=1e-3)
    out = sparse_attention(q, k, v, 1.0, vs)
    # the seed rounds the weights first (0.422 + 2 * 0.422 = 1.266); unrounded it is (1.2670, 0.7330)
    assert out[0, 6].tolist() == pytest.approx([1.266, 0.732], abs=2e-3)
    assert vs.edges(8).item() == mask.sum().item()


def test_edges_and_tiles_match_brute_force():
    gen = torch.Generator().manual_seed(1)
    for n in (1, 37, 64, 130, 257):
        h = 3
        sink = torch.randint(0, 80, (h,), generator=gen)
        window = torch.randint(1, 150, (h,), generator=gen)
        m = -(-n // B)
        table = torch.randint(-1, m + 2, (h, m, 3), generator=gen).int()
        vs = random_vs(h, n, gen)
        patterns = [AShape(sink, window), BlockSparse(table), Dense(h), vs]
        for p in patterns:
            mask = p.to_mask(n)
            assert torch.equal(p.edges(n), mask.sum((1, 2))), p
            assert torch.equal(torch.cat([p.row_mask(r, min(n, r + 50), n) for r in range(0, n, 50)], 1), mask)
            assert not torch.triu(mask, 1).any(), "a pattern kept a future key"
        for p in patterns[:3]:
            assert torch.equal(p.tiles(n), mask_tiles(p.to_mask(n))), p
        expect = [vs_tiles_loop(vs.columns[i].tolist(), vs.offsets[i].tolist(), n) for i in range(h)]
        assert vs.tiles(n).tolist() == expect
        stack = Stack(patterns)
        assert stack.n_heads == 4 * h and torch.equal(stack.to_mask(n), torch.cat([p.to_mask(n) for p in patterns]))
        assert causal_tiles(n) == Dense(1).tiles(n).item()


def test_vs_normalisation():
    """Duplicates count once, -1 and out-of-range positions are ignored, offset 0 is always present."""
    n = 100
    a = VerticalSlash(torch.tensor([[5, 5, -1, 200, 40]]), torch.tensor([[3, 3, -1, -7]]))
    b = VerticalSlash(torch.tensor([[5, 40]]), torch.tensor([[0, 3]]))
    assert torch.equal(a.to_mask(n), b.to_mask(n))
    assert torch.equal(a.edges(n), b.edges(n)) and torch.equal(a.tiles(n), b.tiles(n))
    assert a.to_mask(n)[0].diagonal().all()


def test_pattern_errors_name_the_field():
    with pytest.raises(ValueError, match="window"):
        AShape(4, 0)
    with pytest.raises(ValueError, match="sink"):
        AShape(-1, 8)
    with pytest.raises(ValueError, match=r"columns \[H, Kv\]"):
        VerticalSlash(torch.zeros(3, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="n=100 needs 2"):
        BlockSparse(torch.zeros(1, 3, 1, dtype=torch.int32)).tiles(100)
    with pytest.raises(ValueError, match="row_mask"):
        Dense(1).to_mask(100_000)
    with pytest.raises(ValueError, match="aggregate"):
        vs_proxy(torch.randn(2, 8, 4), torch.randn(1, 8, 4), 1.0, 2, 2, aggregate="mean")


def explicit_vs_scores(q, k, scale, r):
    """Per-head loop: column sums and offset sums of softmax over the last r rows."""
    hq, n, _ = q.shape
    g = hq // k.shape[0]
    cols, diags = [], []
    for h in range(hq):
        s = (q[h, n - r:] @ k[h // g].T) * scale
        i = torch.arange(n - r, n)[:, None]
        j = torch.arange(n)[None, :]
        p = torch.softmax(s.masked_fill(j > i, float("-inf")), -1)
        d = torch.zeros(n)
        for a in range(r):
            for jj in range(n - r + a + 1):
                d[n - r + a - jj] += p[a, jj]
        cols.append(p.sum(0))
        diags.append(d)
    return torch.stack(cols), torch.stack(diags)


def test_vs_proxy_matches_per_head_reference():
    torch.manual_seed(0)
    q, k = torch.randn(6, 90, 8) * 2, torch.randn(2, 90, 8)
    col, diag = explicit_vs_scores(q, k, 0.5, 16)
    columns, offsets = vs_proxy(q, k, 0.5, 10, 12, last_rows=16, sink=3, local=4)
    for h in range(6):
        c = columns[h].tolist()
        assert c[:3] == [0, 1, 2] and c == sorted(c)
        free = col[h].clone()
        free[:3] = -1
        assert set(c[3:]) == set(free.topk(7).indices.tolist())
        o = offsets[h].tolist()
        assert o[:4] == [0, 1, 2, 3]
        free = diag[h].clone()
        free[:4] = -1
        assert set(o[4:]) == set(free.topk(8).indices.tolist())
    # batched input gives the same index; per-head budgets keep exactly that many entries
    bc, bo = vs_proxy(q[None], k[None], 0.5, 10, 12, last_rows=16, sink=3, local=4)
    assert torch.equal(bc[0], columns) and torch.equal(bo[0], offsets)
    budget = torch.tensor([1, 2, 3, 4, 5, 200])
    c2, o2 = vs_proxy(q, k, 0.5, budget, budget, last_rows=16, sink=3, local=4)
    assert c2.shape == (6, 200)
    assert (c2 >= 0).sum(1).tolist() == [1, 2, 3, 4, 5, 90]
    assert (o2 >= 0).sum(1).tolist() == [1, 2, 3, 4, 5, 90]
    assert (o2[:, 0] == 0).all()


@pytest.mark.parametrize("aggregate", ["sum", "max", "logits"])
@pytest.mark.parametrize("diag_norm", ["sum", "mean", "prior"])
def test_vs_proxy_variants_are_valid_indexes(aggregate, diag_norm):
    torch.manual_seed(1)
    q, k = torch.randn(4, 150, 8), torch.randn(2, 150, 8)
    c, o = vs_proxy(q, k, 0.3, 20, 30, aggregate=aggregate, diag_norm=diag_norm, sink=5, local=6)
    for t, size in ((c, 20), (o, 30)):
        assert t.shape == (4, size)
        assert all(len(set(row.tolist())) == size and row.tolist() == sorted(row.tolist()) for row in t)
    assert (c[:, :5] == torch.arange(5)).all() and (o[:, :6] == torch.arange(6)).all()


def test_vs_proxy_aggregates_differ_where_they_should():
    """A key hit hard by one row wins under max; a key hit moderately by every row wins under sum."""
    n, r = 128, 8
    q = torch.zeros(1, n, 4)
    k = torch.zeros(1, n, 4)
    q[0, n - r:, 0] = 1.0
    q[0, n - 1, 1] = 1.0
    k[0, 50, 0] = 5.0  # moderately preferred by all last rows
    k[0, 70, 1] = 9.0  # strongly preferred by the last row only
    top_sum, _ = vs_proxy(q, k, 1.0, 1, 1, last_rows=r, sink=0, local=1)
    top_max, _ = vs_proxy(q, k, 1.0, 1, 1, last_rows=r, sink=0, local=1, aggregate="max")
    assert top_sum.item() == 50 and top_max.item() == 70


def test_block_proxy():
    torch.manual_seed(2)
    n = 300
    q, k = torch.randn(6, n, 8), torch.randn(2, n, 8)
    table = block_proxy(q, k, 3)
    m = -(-n // B)
    assert table.shape == (6, m, 3) and table.dtype == torch.int32
    for h in range(6):
        qp = torch.stack([q[h, i * B:(i + 1) * B].mean(0) for i in range(m)])
        kp = torch.stack([k[h // 3, i * B:(i + 1) * B].mean(0) for i in range(m)])
        score = qp @ kp.T
        for row in range(m):
            got = [b for b in table[h, row].tolist() if b >= 0]
            assert got == sorted(got) and row in got and max(got) <= row, "future block or no diagonal"
            assert len(got) == min(3, row + 1)
            others = score[row, :row].topk(min(2, row)).indices.tolist() if row else []
            assert set(got) == {row, *others}
    per_head = block_proxy(q, k, torch.tensor([1, 2, 3, 1, 2, 3]))
    assert ((per_head >= 0).sum(-1)[:, -1]).tolist() == [1, 2, 3, 1, 2, 3]


def test_tile_counts_agree_with_the_kernel_tiling():
    """A-shape and block-sparse tile counts equal what the kernels' tile conversion emits."""
    from workbench_kernels.index_ref import ashape_to_tiles, block_sparse_to_tiles

    gen = torch.Generator().manual_seed(3)
    for n in (100, 1000, 4096):
        for g, w in ((64, 64), (0, 64), (30, 100), (100, 500), (64, 1024)):
            t = ashape_to_tiles([g], [w], n)
            kernel = int(t.block_count.long().sum() + (-(-t.column_count.long() // B)).sum())
            assert AShape(g, w).tiles(n).item() == kernel
        m = -(-n // B)
        table = torch.randint(-1, m, (2, m, 4), generator=gen).int()
        t = block_sparse_to_tiles(table[None], n)
        assert BlockSparse(table).tiles(n).tolist() == t.block_count.long().sum(-1)[0].tolist()


# ----------------------------------------------------------------------------- the Pattern protocol

def protocol_cases(n: int, gen: torch.Generator) -> list:
    """One instance of every registered pattern (several heads each) and a Stack of them."""
    m = -(-n // B)
    cases = [AShape(torch.tensor([0, 3, 70]), torch.tensor([1, 40, 100])),
             random_vs(2, n, gen),
             BlockSparse(torch.randint(-1, m + 2, (3, m, 3), generator=gen).int()),
             Dense(2)]
    from workbench.patterns.dilated import Dilated, Strided  # the newer kinds (tests/unit/test_methods.py)
    from workbench.patterns.flexprefill import flexprefill
    from workbench.patterns.trishape import TriShape
    from workbench.patterns.xattention import xattention

    q, k = torch.randn(2, n, 8, generator=gen), torch.randn(1, n, 8, generator=gen)
    cases += [TriShape(torch.tensor([4, 0]), torch.tensor([16, 1]), torch.tensor([20, 0])),
              Dilated(torch.tensor([5, 40]), torch.tensor([3, 2])), Strided(torch.tensor([8, 1]), torch.tensor([5, 64])),
              xattention(q, k, 0.3, 0.7), flexprefill(q, k, 0.3, 0.5, torch.tensor([0.0, 1.0]), min_budget=16)]
    return cases + [Stack(cases)]


def kernel_mask(p, n: int) -> torch.Tensor:
    """What the kernel computes for a pattern: its tiles plus its token band, `[H, n, n]`."""
    from workbench_kernels.index_ref import tiles_to_mask

    band = p.token_band()
    return tiles_to_mask(p.to_tiles(n), n, *(band or (None, None)))[0]


def inside_polygons(polys: list, n: int) -> torch.Tensor:
    """Bool `[n, n]` (row i, column j): lattice point (x = j, y = i) inside any polygon (crossing parity)."""
    x = torch.arange(n, dtype=torch.float64)[None, :]
    y = torch.arange(n, dtype=torch.float64)[:, None]
    out = torch.zeros(n, n, dtype=torch.bool)
    for poly in polys:
        odd = torch.zeros(n, n, dtype=torch.bool)
        for (x0, y0), (x1, y1) in zip(poly, poly[1:] + poly[:1]):
            if y0 != y1:
                odd ^= ((y0 > y) != (y1 > y)) & (x < x0 + (y - y0) * (x1 - x0) / (y1 - y0))
        out |= odd
    return out


def test_registry_maps_config_kinds_to_classes_and_back():
    from workbench.patterns import PATTERNS, PatternBase, default_params, pattern_class, register_pattern

    assert {k: c.__name__ for k, c in PATTERNS.items()} == {
        "ashape": "AShape", "vs": "VerticalSlash", "vs_group": "GroupVerticalSlash", "block": "BlockSparse",
        "dense": "Dense", "trishape": "TriShape",
        "dilated": "Dilated", "strided": "Strided", "xattention": "XAttention", "flexprefill": "FlexPrefill"}
    assert list(PATTERNS) == sorted(PATTERNS, key=lambda kind: PATTERNS[kind].order)
    for kind, cls in PATTERNS.items():
        assert pattern_class(kind) is cls and cls.kind == kind and default_params(kind, 1024) == cls.defaults(1024)
    with pytest.raises(ValueError, match="unknown pattern 'tri'.*register_pattern"):
        pattern_class("tri")
    own = {"title": "test", "params": (), "order": 1000, "defaults": classmethod(lambda cls, n: {})}
    with pytest.raises(ValueError, match="already VerticalSlash"):
        register_pattern(type("Other", (PatternBase,), {"kind": "vs", **own}))
    with pytest.raises(ValueError, match="`kind`"):
        register_pattern(type("Nameless", (PatternBase,), {}))
    with pytest.raises(ValueError, match=r"must set \['title', 'order'\]"):
        register_pattern(type("Bare", (PatternBase,), {"kind": "bare", "params": ()}))
    with pytest.raises(ValueError, match=r"sets no sizes: define `at_budget\(budget, n\)`"):
        register_pattern(type("Sizeless", (PatternBase,), {"kind": "sizeless", **own, "defaults": PatternBase.defaults}))
    with pytest.raises(ValueError, match="inherit `bench_kernel` from BlockSparse"):
        register_pattern(type("Child", (BlockSparse,), {"kind": "child", **own}))
    rest = {name: PatternBase.__dict__[name] for name in ("bench_kernel", "minference_name", "minference_attn_type",
                                                         "default_search", "at_budget", "grid", "evidence", "sweep")}
    with pytest.raises(ValueError, match="inherit `layer_attention` from AShape"):  # A-shape's own kernel
        register_pattern(type("Banded", (AShape,), {"kind": "banded", **own, **rest}))
    with pytest.raises(ValueError, match="order = 10 is already AShape's"):
        register_pattern(type("Twin", (PatternBase,), {"kind": "twin", **own, "order": 10}))
    assert PATTERNS["vs"] is VerticalSlash and "child" not in PATTERNS and "twin" not in PATTERNS


@pytest.mark.parametrize("n", [1000, 8192, 131072])
def test_at_budget_is_each_kinds_one_knob(n):
    """A kind with a key budget gives exactly its params at any budget, its defaults are its sizes at n / 16 keys,
    and more keys never shrink the mask of a prompt-free kind; kinds without one (dense, the thresholds, not
    XAttention's inherited top-k) say None, and a candidate at a budget then takes their defaults."""
    from workbench.patterns import PATTERNS, PromptFree
    from workbench.patterns.base import default_budget
    from workbench.search.search import Candidate

    budgeted = {kind for kind, cls in PATTERNS.items() if cls.at_budget(64, n) is not None}
    assert budgeted == {"ashape", "vs", "vs_group", "block", "trishape", "dilated", "strided"}
    for kind, cls in PATTERNS.items():
        if kind not in budgeted:
            assert Candidate.at_budget(kind, 256, n).params == cls.defaults(n)
            continue
        assert cls.defaults(n) == cls.at_budget(default_budget(n), n)
        for b in (64, 256, n // 4):
            assert set(cls.at_budget(b, n)) == set(cls.params) and Candidate.at_budget(kind, b, n).params == cls.at_budget(b, n)
        if issubclass(cls, PromptFree) and n <= 8192:
            m = 512
            small, large = (cls.for_heads([cls.at_budget(b, m)], None, None, 0.0, {}, 64).to_mask(m) for b in (64, 128))
            assert (small <= large).all() and large.sum() > small.sum(), kind


def test_mask_algebra_is_every_consumers_mask():
    """A-shape as its definition (N(i) = sinks up to i plus the window ending at i), the pattern's mask,
    the kernel reference's physical mask and the CPU prefill's band: one set, from `workbench_kernels.masks`;
    block tiles through `masks.tile`."""
    from workbench_kernels import masks
    from workbench_kernels.index_ref import ashape_to_tiles, tiles_to_mask

    from workbench.prefill.tiles import band_mask

    n, sink, window = 150, torch.tensor([0, 3, 20, 70]), torch.tensor([1, 10, 200, 64])
    want = torch.zeros(4, n, n, dtype=torch.bool)
    for h in range(4):
        for i in range(n):
            want[h, i, :min(int(sink[h]), i + 1)] = True
            want[h, i, max(0, i - int(window[h]) + 1):i + 1] = True
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(masks.ashape(i, j, sink.view(-1, 1, 1), window.view(-1, 1, 1)), want)
    assert torch.equal(AShape(sink, window).to_mask(n), want)
    assert torch.equal(tiles_to_mask(ashape_to_tiles(sink, window, n), n, sink, window)[0], want)
    assert torch.equal(band_mask(sink, window, torch.arange(n), 0, n) & masks.causal(i, j), want)
    table = BlockSparse(torch.tensor([[[0], [0], [-1]]]))
    assert torch.equal(masks.tile(table.block_set(n), i, j) & masks.causal(i, j), table.to_mask(n))


@pytest.mark.parametrize("n", [1, 37, 64, 130, 200])
def test_protocol_parts_agree(n):
    """row_mask, kernel tiles, FlexAttention mask_mod, overlay shapes, edges and tiles: one geometry."""
    gen = torch.Generator().manual_seed(n)
    q_idx, kv_idx = torch.arange(n)[None, :, None], torch.arange(n)[None, None, :]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for p in protocol_cases(n, gen):
        mask = p.row_mask(0, n, n)
        physical = kernel_mask(p, n)
        assert bool((physical >= mask).all()), f"{p}: the kernel tiles miss kept pairs"
        if getattr(p, "kind", None) in ("ashape", "trishape", "block", "dense", "xattention"):  # VS-like slashes widen
            assert torch.equal(physical, mask), p
        t = p.to_tiles(n)
        assert torch.equal(p.tiles(n), tile_count(t)[0]), p  # pieces, column strips and dense rows' blocks
        assert torch.equal(p.edges(n), mask.sum((1, 2))), p
        mod = p.mask_mod(n)
        grid = mod(0, torch.arange(p.n_heads)[:, None, None], q_idx, kv_idx)
        assert torch.equal(grid.expand_as(mask), mask), p
        for head in range(p.n_heads):
            polys = [poly for part in p.shapes(head, n).values() for poly in part]
            assert torch.equal(inside_polygons(polys, n) & causal, mask[head]), (p, head)


def test_stack_mixes_kernel_tiles_and_bands():
    """The stack's tiles and band are its parts' (heads without a band get none), so a mixed layer is one launch."""
    n = 150
    parts = [VerticalSlash(torch.tensor([[3, 5, 120]]), torch.tensor([[1, 64, -1]])), AShape(4, 37),
             BlockSparse(torch.tensor([[[0], [0], [1]]])), Dense(1)]
    stack = Stack(parts)
    sink, window = stack.token_band()
    assert sink.tolist()[1] == 4 and window.tolist()[1] == 37 and min(window[[0, 2, 3]].tolist()) >= n
    assert torch.equal(kernel_mask(stack, n), torch.cat([kernel_mask(p, n) for p in parts]))
    assert Stack([Dense(2), parts[0]]).token_band() is None
    with pytest.raises(ValueError, match="out of range"):
        stack.shapes(4, n)


def test_cost_is_tiles_times_rate_plus_index():
    rates = {"vs": {"per_tile_ms": 0.5, "index_ms": 2.0}, "dense": {"per_tile_ms": 0.25, "index_ms": 0.0}}
    n = 300
    vs = VerticalSlash(torch.tensor([[0, 7]]), torch.tensor([[0, 9]]))
    assert vs.cost(n, rates).tolist() == [vs.tiles(n).item() * 0.5 + 2.0]
    assert Stack([vs, Dense(1)]).cost(n, rates).tolist() == [vs.tiles(n).item() * 0.5 + 2.0, causal_tiles(n) * 0.25]
    with pytest.raises(ValueError, match="no rate for pattern 'ashape'"):
        AShape(1, 4).cost(n, rates)


def test_mask_mod_builds_a_flex_block_mask():
    """The mask_mod runs under FlexAttention's vmap: the block mask it gives equals the row mask."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    n = 192
    p = Stack([VerticalSlash(torch.tensor([[2, 100]]), torch.tensor([[0, 70]])), AShape(3, 20),
               BlockSparse(torch.tensor([[[0], [0], [1]]])), Dense(1)])
    bm = flex.create_block_mask(p.mask_mod(n), 1, p.n_heads, n, n, device="cpu", BLOCK_SIZE=64)
    dense = bm.to_dense()[0].repeat_interleave(64, 1).repeat_interleave(64, 2)[:, :n, :n].bool()
    mask = p.row_mask(0, n, n)
    assert bool((dense >= mask).all())  # every block holding a kept pair is visited
    assert torch.equal(dense.reshape(4, 3, 64, 3, 64).any(4).any(2), mask.reshape(4, 3, 64, 3, 64).any(4).any(2))



def test_causal_rows_follow_the_device_not_an_earlier_call():
    """The cached causal rows are keyed by the device they are asked on: a CPU call first, then the same rows
    inside `with torch.device(...)` (as `layer_scores` runs on a GPU capture) give that device's tensor
    (a GPU lane run mixed a cached CPU mask into CUDA sums)."""
    from workbench.patterns.base import causal_rows

    assert causal_rows(0, 8, 8).device.type == "cpu"
    with torch.device("meta"):
        assert causal_rows(0, 8, 8).device.type == "meta"
    assert causal_rows(0, 8, 8, "meta").device.type == "meta"
    assert causal_rows(0, 8, 8).device.type == "cpu"
