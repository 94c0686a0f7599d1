"""The Triton launch of a layer whose heads are only A-shape and dense gives every head its own band: the
regression behind a 25x quality gap on the GPU (the single-group shortcut handed head h the tiles of the h-th banded
head, e.g. a dense head an A-shape head's window). A layer of several kinds as one launch per kind equals the one
launch over its merged tiles."""
from __future__ import annotations

import pytest
import torch
from workbench_kernels.index_ref import tiles_to_mask

from workbench.config import HeadConfig, HeadEntry
from workbench.core.model import ModelShape
from workbench.prefill.sparse import SparsePrefill

N = 256


def test_banded_only_layer_keeps_each_heads_band():
    shape = ModelShape("toy", "llama", 1, 4, 2, 16, 64, "default", 10000.0, 4096, "toy")
    entries = [("dense", {}), ("ashape", {"sink": 4, "window": 16}), ("dense", {}), ("ashape", {"sink": 0, "window": 64})]
    config = HeadConfig(model=shape.to_dict(), heads=[HeadEntry(0, h, p, a) for h, (p, a) in enumerate(entries)])
    sp = SparsePrefill(None, shape, config, min_length=0, backend="triton", per_kind=False)
    tiles, sink, window = sp.layer_index(0, torch.zeros(1, 4, N, 16), torch.zeros(1, 2, N, 16), 0.25, "triton")
    got = tiles_to_mask(tiles, N, sink, window)[0]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    sink, window = torch.tensor([0, 4, 0, 0]).view(-1, 1, 1), torch.tensor([N, 16, N, 64]).view(-1, 1, 1)
    want = (j <= i) & ((i - j < window) | (j < sink))
    assert torch.equal(got, want)


def test_one_launch_per_kind_equals_the_merged_launch():
    """Layer 0: kinds interleaved across KV groups (per-head VS, block, A-shape, dense: K/V gathered per query head)
    and one whole group of vs_group, whose tiles stay per KV head. Layer 1: per-head kinds that hold whole groups (K/V
    gathered per group). Each kind's output written back in place."""
    shape = ModelShape("toy", "llama", 2, 9, 3, 16, 64, "default", 10000.0, 4096, "toy")
    vs, block, ashape = ("vs", {"vertical": 8, "slash": 16}), ("block", {"topk": 1}), ("ashape", {"sink": 4, "window": 32})
    layers = [[vs, block, ashape, ("dense", {}), ("vs", {"vertical": 4, "slash": 8}), ("ashape", {"sink": 0, "window": 64}),
               *[("vs_group", {"vertical": 8, "slash": 16})] * 3],
              [block, block, block, vs, ashape, vs, ashape, ashape, ashape]]
    config = HeadConfig(model=shape.to_dict(), heads=[HeadEntry(l, h, p, a) for l, entries in enumerate(layers)
                                                      for h, (p, a) in enumerate(entries)])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, N, 16, generator=gen) for h in (9, 3, 3))
    for layer in range(2):
        outs = {}
        for per_kind in (True, False):
            sp = SparsePrefill(None, shape, config, min_length=0, backend="triton", per_kind=per_kind, graph_index=False)
            index = sp.layer_index(layer, q, k, 0.25, "triton")
            assert isinstance(index, dict) == per_kind
            outs[per_kind] = sp.layer_kernel(layer, index, q, k, v, 0.25, "triton")
        ref = SparsePrefill(None, shape, config, min_length=0, backend="torch")
        want = ref.layer_kernel(layer, ref.layer_index(layer, q, k, 0.25, "torch"), q, k, v, 0.25, "torch")
        assert torch.allclose(outs[True], outs[False], atol=1e-5), layer
        assert torch.allclose(outs[True], want, atol=1e-5), layer


def test_layers_of_several_kinds_merge_where_the_gluon_kernel_takes_no_kind():
    """`per_kind=None` runs one launch per kind only where a kind carries a band and `gluon_takes_kinds` holds (sm_90,
    head_dim 128 or 256, 16-bit): on the CPU the merged launch; True / False force either; a layer of one kind never splits."""
    shape = ModelShape("toy", "llama", 3, 4, 2, 128, 512, "default", 10000.0, 4096, "toy")
    entries = [[("vs", {"vertical": 8, "slash": 16}), ("ashape", {"sink": 4, "window": 32})] * 2,
               [("vs", {"vertical": 8, "slash": 16}), ("block", {"topk": 1})] * 2, [("block", {"topk": 2})] * 4]
    config = HeadConfig(model=shape.to_dict(), heads=[HeadEntry(l, h, p, a) for l, layer in enumerate(entries)
                                                      for h, (p, a) in enumerate(layer)])
    q, k = torch.zeros(1, 4, 64, 128), torch.zeros(1, 2, 64, 128)
    rules = {per_kind: SparsePrefill(None, shape, config, min_length=0, per_kind=per_kind) for per_kind in (None, True, False)}
    groups = [rules[None].group_tiles(layer, q, k, 0.25, triton=False) for layer in range(3)]
    assert [band is not None for _, _, band in groups[0].values()] == [False, True]
    assert [[sp.launch_per_kind(g, q, "triton") for g in groups] for sp in rules.values()] == [
        [False, False, False], [True, True, False], [False, False, False]]
    assert not rules[True].launch_per_kind(groups[0], q, "torch")
    with pytest.raises(ValueError, match="per_kind='yes' must be True"):
        SparsePrefill(None, shape, config, per_kind="yes")
