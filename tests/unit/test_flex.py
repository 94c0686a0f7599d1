"""FlexAttention export of head configs, on the CPU (eager flex_attention, n <= 512): the physical masks
give SparsePrefill's reference output, the logical masks the patterns' own row masks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workbench.config import ConfigError, HeadConfig, HeadEntry
from workbench.core.model import ModelShape
from workbench.prefill.flex import block_mask, flex, load_masks, save_masks, static_layers
from workbench.prefill.sparse import SparsePrefill

SHAPE = ModelShape(name="tiny", architecture="llama", n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                   hidden_size=64, rope_type="default", rope_theta=10000.0, max_positions=2048, fingerprint="f")
LAYERS = [  # layer 0 mixes every pattern, 1 is static (with a Tri-shape head), 2 is all online
    [("vs", {"vertical": 40, "slash": 70}), ("ashape", {"sink": 8, "window": 96}), ("block", {"topk": 2}), ("dense", {})],
    [("ashape", {"sink": 4, "window": 50}), ("dense", {}), ("trishape", {"sink": 0, "window": 130, "last": 40}),
     ("dense", {})],
    [("block", {"topk": 1}), ("vs", {"vertical": 8, "slash": 20}), ("vs", {"vertical": 100, "slash": 5}), ("block", {"topk": 3})],
]
CONFIG = HeadConfig(model=SHAPE.to_dict(), heads=[HeadEntry(l, h, p, dict(params)) for l, layer in enumerate(LAYERS)
                                                  for h, (p, params) in enumerate(layer)])
CONFIG.proxy.update(sink=4, local=8)  # small forced sets so that the budgets above select something


def qkv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g),
            torch.randn(1, 2, n, 16, generator=g))


@pytest.mark.parametrize("n", [64, 300, 512])
def test_sparse_prefill_flex_backend_equals_the_reference(n):
    q, k, v = qkv(n)
    out = {}
    for backend in ("torch", "flex"):
        sp = SparsePrefill(torch.nn.Module(), SHAPE, CONFIG, min_length=0, backend=backend)
        for layer in range(3):
            out[backend, layer] = sp.attention(SimpleNamespace(layer_idx=layer, scaling=0.25), q, k, v, None)[0]
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    for layer in range(3):
        torch.testing.assert_close(out["flex", layer], out["torch", layer], atol=2e-6, rtol=1e-5)
        if n > 128:  # the masks are sparse: far from dense attention
            assert (out["flex", layer] - dense.transpose(1, 2)).abs().max() > 0.05


@pytest.mark.parametrize("physical", [False, True])
def test_block_mask_matches_the_patterns_masks(physical):
    n = 320
    q, k, v = qkv(n, seed=1)
    for layer in range(3):
        bm, mask_mod = block_mask(CONFIG, layer, n, q=q[0], k=k[0], scale=0.25, physical=physical)
        index = CONFIG.layer_index(layer, q[0], k[0], 0.25)
        grid = torch.arange(n)
        got = torch.stack([mask_mod(0, torch.tensor(h), grid[:, None], grid[None, :]) for h in range(4)])
        if physical:
            from workbench_kernels.index_ref import tiles_to_mask

            band = index.token_band()
            want = tiles_to_mask(index.to_tiles(n), n, *(band if band is not None else (None, None)))[0]
            assert (want >= index.row_mask(0, n, n)).all()
        else:
            want = index.row_mask(0, n, n)
        assert torch.equal(got, want)
        o = flex(q, k, v, bm, 0.25)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                               attn_mask=want[None], scale=0.25)
        torch.testing.assert_close(o, ref, atol=2e-6, rtol=1e-5)


def test_online_layers_need_the_prompt_and_static_layers_export(tmp_path):
    assert static_layers(CONFIG) == [1]
    with pytest.raises(ConfigError, match=r"layer 0 heads \[0, 2\] are indexed from the prompt.*q and k"):
        block_mask(CONFIG, 0, 128)
    bm, _ = block_mask(CONFIG, 1, 128)  # static: from the config alone
    saved = save_masks(CONFIG, 128, tmp_path / "m.pt")
    assert sorted(saved["online"]) == [0, 2] and saved["online"][2] == [0, 1, 2, 3]
    masks = load_masks(tmp_path / "m.pt")
    assert list(masks) == [1]
    q, k, v = qkv(128, seed=2)
    torch.testing.assert_close(flex(q, k, v, masks[1], 0.25), flex(q, k, v, bm, 0.25))


def test_cli_exports_flex_masks(tmp_path, capsys):
    from workbench.cli import main

    path = CONFIG.save(tmp_path / "c.json")
    out = tmp_path / "m.pt"
    assert main(["export", str(path), "--format", "flex", "--length", "256", "--out", str(out)]) == 0
    assert "1 static layers at n=256; 2 layers with" in capsys.readouterr().out
    assert list(load_masks(out)) == [1]
    assert main(["export", str(path), "--format", "flex"]) == 2
    assert "give --length N" in capsys.readouterr().err
