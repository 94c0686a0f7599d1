"""Sparse prefill of the whole embedded model: exactness with full budgets, refusal of a mismatched
config, the length threshold, the decode / cached-prefix fallback and the diagnostic layer mode.

On a machine without CUDA the Triton path runs under TRITON_INTERPRET=1 (set before triton is imported,
only there: on a GPU machine the same worker runs the real kernels) in fp32."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from prefill_configs import covering, make_config, tight

from workbench.config import ConfigError
from workbench.prefill.sparse import SparsePrefill, generate_greedy

N = 256


@pytest.fixture(scope="module")
def prompt(embedded):
    from workbench.core.corpus import make_sample

    _, tok, _ = embedded
    return make_sample("passkey", tok, N, seed=1, depth=0.4).input_ids


def logits(model, ids):
    with torch.no_grad():
        return model(ids[None], use_cache=False).logits[0].float()


def test_full_budgets_equal_dense(embedded, prompt):
    model, _, shape = embedded
    dense = logits(model, prompt)
    with SparsePrefill(model, shape, make_config(shape, covering(N)), min_length=0) as sp:
        sparse = logits(model, prompt)
    sparse_layers = [l for l in range(shape.n_layers) if any(covering(N)(l, h)[0] != "dense" for h in range(shape.n_heads))]
    assert sp.calls[("sparse", "prefill")] == len(sparse_layers) > 0
    assert (sparse - dense).abs().max().item() <= 1e-4


def test_small_budgets_change_the_output(embedded, prompt):
    model, _, shape = embedded
    dense = logits(model, prompt)
    with SparsePrefill(model, shape, make_config(shape, tight), min_length=0, compare=True) as sp:
        sparse = logits(model, prompt)
    assert (sparse - dense).abs().max().item() > 1e-2
    assert len(sp.cosine) == shape.n_layers and all(c.shape == (shape.n_heads,) for c in sp.cosine.values())
    assert min(float(c.min()) for c in sp.cosine.values()) < 0.999


def test_triton_path_matches_reference(embedded, prompt):
    """Mixed layers (VS, block, A-shape in one launch) on the Triton kernel equal the PyTorch reference."""
    model, _, shape = embedded
    cfg = make_config(shape, tight)
    with SparsePrefill(model, shape, cfg, min_length=0, layers=[0, 7]) as ref:
        want = logits(model, prompt)
    with SparsePrefill(model, shape, cfg, min_length=0, layers=[0, 7], backend="triton") as tri:
        got = logits(model, prompt)
    assert ref.calls[("sparse", "prefill")] == tri.calls[("sparse", "prefill")] == 2
    assert (got - want).abs().max().item() <= 2e-3


def test_mismatched_config_is_refused(embedded):
    model, _, shape = embedded
    other = dataclasses.replace(shape, n_layers=shape.n_layers + 2)
    with pytest.raises(ConfigError, match=r"model\.n_layers"):
        SparsePrefill(model, shape, make_config(other, covering(N)))
    wrong_heads = make_config(shape, covering(N))
    wrong_heads.model["n_kv_heads"] = shape.n_kv_heads * 3
    with pytest.raises(ConfigError, match=r"n_kv_heads.*KV heads"):
        SparsePrefill(model, shape, wrong_heads)


def test_length_threshold_and_diagnostic_layers(embedded, prompt):
    model, _, shape = embedded
    cfg = make_config(shape, tight)
    dense = logits(model, prompt)
    with SparsePrefill(model, shape, cfg, min_length=N + 1) as sp:
        below = logits(model, prompt)
    assert torch.equal(below, dense)
    assert sp.calls == {("dense", "short"): shape.n_layers}
    with SparsePrefill(model, shape, cfg, min_length=N, layers=[3]) as sp:
        one = logits(model, prompt)
    assert sp.calls == {("sparse", "prefill"): 1, ("dense", "layer off"): shape.n_layers - 1}
    assert not torch.equal(one, dense)


def test_decode_steps_and_cached_prefix_run_dense(embedded, prompt):
    """Generation under SparsePrefill: only the prefill is sparse; the decode steps equal a dense decode
    from the same (sparse-prefilled) cache, and the cache holds every prompt position."""
    model, _, shape = embedded
    cfg = make_config(shape, tight)
    with SparsePrefill(model, shape, cfg, min_length=0) as sp:
        tokens, first = generate_greedy(model, prompt, 3)
    assert sp.calls[("sparse", "prefill")] == shape.n_layers
    assert sp.calls[("dense", "decode")] == shape.n_layers * (len(tokens) - 1)
    with torch.no_grad(), SparsePrefill(model, shape, cfg, min_length=0) as sp:
        out = model(prompt[None, :-8], use_cache=True)
        assert out.past_key_values.get_seq_length() == N - 8
        model(prompt[None, -8:], past_key_values=out.past_key_values, use_cache=True)
    assert sp.calls[("dense", "cached prefix")] == shape.n_layers
    assert int(first.argmax()) == int(tokens[0])


def test_timing_breakdown_cpu(embedded, prompt):
    model, _, shape = embedded
    with SparsePrefill(model, shape, make_config(shape, tight), min_length=0, layers=[1], timing=True) as sp:
        logits(model, prompt)
        rows = sp.breakdown()
    assert [r["layer"] for r in rows] == list(range(shape.n_layers))
    assert rows[1]["mode"] == "sparse" and rows[0]["mode"] == "dense"
    for r in rows:
        assert r["proj_ms"] > 0 and r["sparse_ms"] > 0 and r["layer_ms"] >= r["proj_ms"] + r["sparse_ms"]


def test_row_masks_match_the_kernel_mask():
    """The CPU reference's row masks equal `tiles_to_mask` (what the Triton kernel computes): VS and
    block tiles through `tile_rows`, A-shape heads through `band_rows`."""
    from workbench_kernels.index_ref import ashape_to_tiles, block_sparse_to_tiles, merge_tiles, tiles_to_mask, vs_to_tiles

    from workbench.patterns import block_proxy
    from workbench.prefill.sparse import band_rows
    from workbench.prefill.tiles import tile_rows

    n, g = 300, torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    vs = vs_to_tiles(torch.tensor([[[3, 77, 150, -1]]]), torch.tensor([[[5, 90, 200]]]), n)
    bs = block_sparse_to_tiles(block_proxy(q, k, 2)[:, 1:2], n)
    tiles = merge_tiles([([0], vs), ([1], bs)], 2)
    sink, window = torch.tensor([4, 0, 100]), torch.tensor([40, n, 1])
    want = tiles_to_mask(tiles, n)
    want_band = tiles_to_mask(ashape_to_tiles(sink, window, n), n, sink, window)[0]
    for r0, r1 in ((0, 128), (128, 256), (256, 300)):
        for (keys, mask), full in ((tile_rows(tiles, r0, r1), want[..., r0:r1, :r1]),
                                   (band_rows(sink, window, r0, r1), want_band[:, r0:r1, :r1])):
            assert torch.equal(mask, full[..., keys])
            outside = torch.ones(r1, dtype=torch.bool)
            outside[keys] = False
            assert not full[..., outside].any()
