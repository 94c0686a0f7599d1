"""One rank of a real tensor-parallel run of the embedded model (run by tests/model/test_distributed.py under
`torchrun --nproc_per_node 3`): shard attention heads over the ranks, capture the local heads' q on the
config's probe tokens, check the head mapping of the right view and of three wrong ones, and compare the
sparse prefill of the sharded model (with its rank view) to the whole model's (with the whole config).

Usage: torchrun --standalone --nproc_per_node 3 tests/model/distributed_tp_worker.py CONFIG OUT_DIR
Writes OUT_DIR/rank<r>.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from workbench.config import ConfigError, HeadConfig, HeadEntry, global_head
from workbench.core.capture import capture_attention
from workbench.core.io import write_json
from workbench.core.model import load_model
from workbench.prefill.sparse import SparsePrefill
from workbench.search import distributed


def remapped_view(cfg: HeadConfig, rank: int, tp: int, to_global) -> HeadConfig:
    """A rank view whose metadata is right but whose local head h reads global head `to_global(h)`."""
    right = cfg.for_rank(rank, tp)
    heads = [HeadEntry.from_dict({**cfg.entry(e.layer, to_global(e.head)).to_dict(), "head": e.head})
             for e in right.heads]
    return HeadConfig(model=right.model, heads=heads, provenance=right.provenance, proxy=right.proxy)


def error_of(fn) -> str | None:
    try:
        fn()
    except ConfigError as e:
        return str(e)
    return None


@torch.no_grad()
def main(config_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    d = distributed.init()
    rank, tp = d.rank, d.world_size
    model, _, shape = load_model()
    cfg = HeadConfig.load(config_path, shape)
    ids = torch.tensor(cfg.provenance["head_probe"]["input_ids"])
    with SparsePrefill(model, shape, cfg, min_length=0, backend="torch"):
        whole = model(ids[None], use_cache=False).logits

    distributed.shard_attention(model, rank, tp)
    local = distributed.local_shape(shape, tp)
    view = cfg.for_rank(rank, tp)
    worst = distributed.check_rank(model, local, view, rank, tp)
    cap = capture_attention(model, local, ids, progress=False)
    q = {layer: cap.layer_qkv(layer)[0] for layer in cap.layers}
    with SparsePrefill(model, local, view, min_length=0, backend="torch"):
        sharded = model(ids[None], use_cache=False).logits

    check = lambda v: distributed.check_local_heads(v, q, rank, tp)  # noqa: E731
    wrong = {
        "other_rank_view": lambda: check(cfg.for_rank((rank + 1) % tp, tp)),
        "full_config": lambda: check(cfg),
        "strided": lambda: check(remapped_view(cfg, rank, tp, lambda h: h * tp + rank)),  # local h -> global h*T + r
        "no_offset": lambda: check(remapped_view(cfg, rank, tp, lambda h: h)),  # local index used as global
    }
    write_json(Path(out_dir) / f"rank{rank}.json", {
        "rank": rank, "tp": tp, "heads": [global_head(rank, h, tp, shape.n_heads) for h in range(local.n_heads)],
        "worst_deviation": worst, "logits_max_abs_diff": float((sharded - whole).abs().max()),
        "errors": {name: error_of(fn) for name, fn in wrong.items()}})
    distributed.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
