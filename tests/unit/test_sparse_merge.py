"""The Triton launch of a layer whose heads are only A-shape and dense gives every head its own band: the
regression behind a 25x quality gap on the GPU (the single-group shortcut handed head h the tiles of the h-th banded
head, e.g. a dense head an A-shape head's window)."""
from __future__ import annotations

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
    sp = SparsePrefill(None, shape, config, min_length=0, backend="triton")
    tiles, sink, window = sp.layer_index(0, torch.zeros(1, 4, N, 16), torch.zeros(1, 2, N, 16), 0.25, "triton")
    got = tiles_to_mask(tiles, N, sink, window)[0]
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    sink, window = torch.tensor([0, 4, 0, 0]).view(-1, 1, 1), torch.tensor([N, 16, N, 64]).view(-1, 1, 1)
    want = (j <= i) & ((i - j < window) | (j < sink))
    assert torch.equal(got, want)
