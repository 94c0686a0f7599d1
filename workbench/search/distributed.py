"""Calibration over many processes with torch.distributed (launched by torchrun), and tensor-parallel
head checks.

Search: every rank builds the same calibration samples and candidates, captures each sample with only
the layers of its shard and scores its (sample, layer) slices (`search.collect_evidence(shard=...)`);
the additive evidence tensors `[S, L, H, C]` are summed over ranks (a slice is non-zero on exactly one
rank, so the float64 sum is exact). Rank 0 makes the same deterministic choice as one process would, so
the HeadConfig is the single-process one; only provenance (date, hardware, ranks) differs. Backend:
gloo on the CPU; on GPUs NCCL for CUDA tensors (one GPU per rank, `LOCAL_RANK`) with gloo for the
small CPU evidence tensors. Every rank holds the whole model: the split saves time and capture memory
(a rank keeps q/k/v of its layers only), not weight memory.

Tensor parallelism: rank r of a TP group of size T holds query heads r * H_local .. r * H_local +
H_local - 1 (H_local = H / T) and reads their entries through `HeadConfig.for_rank(r, T)`. A wrong
mapping raises nothing by itself, it silently runs another head's pattern; `check_local_heads` catches it
by comparing each local head's captured q against the q fingerprint the search recorded for the global
head the view claims it is (`add_fingerprints`), after checking the view's rank metadata; `check_rank`
captures the probe on a rank's shard and runs that check.
`shard_attention` turns a loaded model into one real TP rank (heads split, all-reduce after o_proj).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workbench.config import ConfigError, HeadConfig, global_head, rank_kv_heads, tp_split
from workbench.core.model import ModelShape
from workbench.search.search import TARGET, Candidate, Evidence, build_config, choose, collect_evidence, default_candidates

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PROBE_TOKENS = 128  # tokens of calibration sample 0 whose q fingerprints each head
BANDS = 4  # fingerprint: RMS of q in this many RoPE frequency bands per head
FINGERPRINT_RTOL = 0.05  # bf16 vs fp32 and split matmuls stay far inside this; distinct heads do not


@dataclass(frozen=True)
class Dist:
    """This process's place in the job: rank in 0..world_size-1, its device, the backend."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """True when this process was started by torchrun (its environment variables are set)."""
    return all(name in os.environ for name in ENV)


def init(backend: str | None = None) -> Dist:
    """Join the torchrun job: gloo on the CPU; with GPUs, "cpu:gloo,cuda:nccl" and one GPU per rank
    (cuda:LOCAL_RANK), so CUDA tensors go through NCCL and the CPU evidence through gloo."""
    missing = [name for name in ENV if name not in os.environ]
    if missing:
        raise ValueError(f"distributed run without {', '.join(missing)} in the environment: launch with "
                         "`torchrun --nproc_per_node N -m workbench search ...`")
    rank, world, local = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local} has no GPU ({torch.cuda.device_count()} visible): use "
                             "--nproc_per_node <= the number of GPUs")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                **({"device_id": device} if "nccl" in backend else {}))
    return Dist(rank, world, local, backend, device)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _layers_of(sample: int, n_layers: int, rank: int, world_size: int) -> list[int]:
    """The layers of `sample` this rank scores under `search.collect_evidence(shard=(rank, world_size))`:
    capturing only those keeps 1/world of the q/k/v in memory."""
    return [l for l in range(n_layers) if (sample * n_layers + l) % world_size == rank]


def score_shard(model: torch.nn.Module, shape: ModelShape, samples: Sequence[Any], candidates: Sequence[Candidate],
                d: Dist, proxy: dict[str, Any] | None = None, progress: bool = True) -> Evidence:
    """This rank's part of the evidence: `collect_evidence` over its (sample, layer) shard, each sample
    streamed layer by layer as `search_heads` does (`stream_capture`: one layer's q/k/v in memory, the
    forward in query chunks), keeping only the layers this rank scores."""
    from workbench.core.stream import stream_capture

    if shape.n_layers < d.world_size:
        raise ValueError(f"{d.world_size} ranks for {shape.n_layers} layers: use --nproc_per_node <= {shape.n_layers}")
    lengths = [int(s.input_ids.numel()) for s in samples]
    captures = (stream_capture(model, shape, s.input_ids, progress=False,
                               layers=_layers_of(i, shape.n_layers, d.rank, d.world_size))
                for i, s in enumerate(samples))
    return collect_evidence(captures, [s.describe() for s in samples], lengths, candidates, shape.n_layers,
                            shape.n_heads, proxy, progress, shard=(d.rank, d.world_size),
                            group=shape.n_heads // shape.n_kv_heads)


def merge_evidence(ev: Evidence) -> Evidence:
    """Sum every rank's evidence (in place, on every rank) and check each slice was scored exactly once."""
    ev.all_reduce()
    if bool((ev.done != 1).any()):
        bad = (ev.done != 1).nonzero().tolist()[:3]
        raise RuntimeError(f"(sample, layer) {bad} were scored by {int(ev.done[tuple(bad[0])])} ranks instead of one: "
                           "every rank must run the same search with the same world size")
    return ev


def _agree(d: Dist, what: dict[str, Any]) -> None:
    """Raise on every rank if the ranks do not run the same job (model, samples, candidates, settings)."""
    views: list[Any] = [None] * d.world_size
    dist.all_gather_object(views, what)
    for r, other in enumerate(views):
        diff = sorted(k for k in what if other.get(k) != views[0].get(k))
        if diff:
            raise ValueError(f"rank {r} differs from rank 0 in {diff}: start every rank with the same model, "
                             "calibration tasks, lengths, seed and candidates")


def search_heads_distributed(model: torch.nn.Module, shape: ModelShape, samples: Sequence[Any], d: Dist, *,
                             candidates: Sequence[Candidate] | None = None, target: float = TARGET,
                             proxy: dict[str, Any] | None = None, progress: bool = True,
                             latency: dict[str, dict[str, float]] | None = None,
                             provenance: dict[str, Any] | None = None,
                             tail_target: float | None = None) -> tuple[HeadConfig | None, Evidence]:
    """`search.search_heads` over all ranks of `d`. Every rank must call it with the same arguments.

    Returns (HeadConfig, full Evidence) on rank 0 and (None, this rank's partial Evidence) elsewhere.
    The config's provenance gains "distributed": backend, world size and per-rank host, device, items,
    seconds."""
    if not samples:
        raise ValueError("no calibration samples: give at least one (e.g. --tasks passkey,code,vartrack)")
    t0 = time.perf_counter()
    lengths = [int(s.input_ids.numel()) for s in samples]
    candidates = list(candidates or default_candidates(max(lengths)))
    _agree(d, {"model": shape.fingerprint, "samples": [s.describe() for s in samples],
               "candidates": [c.label() for c in candidates], "proxy": proxy, "target": target, "tail_target": tail_target,
               "latency": latency})
    ev = merge_evidence(score_shard(model, shape, samples, candidates, d, proxy, progress))
    items = sum(len(_layers_of(s, shape.n_layers, d.rank, d.world_size)) for s in range(len(samples)))
    me = {"rank": d.rank, "host": platform.node(), "device": _device_name(d.device), "items": items,
          "seconds": round(time.perf_counter() - t0, 2)}
    ranks: list[Any] = [None] * d.world_size
    dist.all_gather_object(ranks, me)
    if not d.is_main:
        return None, ev
    prov = {**(provenance or {}),
            "distributed": {"backend": d.backend, "world_size": d.world_size, "launcher": "torchrun",
                            "split": "(sample * layers + layer) % world_size == rank", "ranks": ranks}}
    cfg = build_config(ev, choose(ev, target, latency, tail_target), shape.to_dict(), target=target,
                       tail_target=tail_target, proxy=proxy, provenance=prov)
    return cfg, ev


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---- tensor parallelism: fingerprints, rank views, a real TP shard ------------------------------------

def q_fingerprint(q: torch.Tensor) -> torch.Tensor:
    """`[H, BANDS]` float64: per head, the RMS of q `[H, N, D]` over tokens within each RoPE frequency
    band (dims i and i + D/2 rotate together, so the statistic does not depend on positions' rotation)."""
    h, n, d = q.shape
    pairs = q.double().reshape(h, n, 2, d // 2).pow(2).sum(2)  # [H, N, D/2]: squared norm of each rotating pair
    return pairs.reshape(h, n, BANDS, -1).mean((1, 3)).div(2).sqrt()


def add_fingerprints(config: HeadConfig, model: torch.nn.Module, shape: ModelShape, input_ids: torch.Tensor) -> None:
    """Record, per (layer, head) entry, `evidence["q_fingerprint"]` (`q_fingerprint` on the first
    `PROBE_TOKENS` tokens of `input_ids`), and the probe tokens in `provenance["head_probe"]`."""
    from workbench.core.capture import capture_attention

    ids = input_ids.reshape(-1)[:PROBE_TOKENS]
    cap = capture_attention(model, shape, ids, progress=False)
    for layer in range(shape.n_layers):
        fp = q_fingerprint(cap.layer_qkv(layer)[0])
        for h, e in enumerate(config.layer(layer)):
            e.evidence = {**(e.evidence or {}), "q_fingerprint": [float(f"{x:.5g}") for x in fp[h].tolist()]}
    config.provenance["head_probe"] = {
        "input_ids": ids.tolist(),
        "statistic": f"per head: RMS of post-RoPE q in {BANDS} RoPE frequency bands over these tokens",
        "use": "workbench.search.distributed.check_local_heads compares a tensor-parallel rank's local heads to it"}


def local_shape(shape: ModelShape, tp_size: int) -> ModelShape:
    """The shape one tensor-parallel rank's attention sees (H / T query heads, H_kv / T KV heads)."""
    h_local, kv_local = tp_split(shape.n_heads, shape.n_kv_heads, tp_size)
    return dataclasses.replace(shape, n_heads=h_local, n_kv_heads=kv_local)


def check_rank_view(view: HeadConfig, rank: int, tp_size: int, full_heads: int | None = None) -> None:
    """Raise ConfigError unless `view` is the `for_rank(rank, tp_size)` view (rank metadata, head count)."""
    tp = view.provenance.get("tensor_parallel")
    if not tp:
        raise ConfigError("head config has no provenance.tensor_parallel: a tensor-parallel rank must load "
                          "config.for_rank(rank, tp_size) (or `workbench export --format workbench --tp T --rank r`), "
                          "not the full config")
    if (tp.get("rank"), tp.get("size")) != (rank, tp_size):
        raise ConfigError(f"head config is the view of rank {tp.get('rank')} of {tp.get('size')}, but this process is "
                          f"rank {rank} of {tp_size}: load the view made for rank {rank}")
    h_local = view.model["n_heads"]
    if full_heads is not None and h_local * tp_size != full_heads:
        raise ConfigError(f"head config view has {h_local} heads per rank, but {full_heads} heads over {tp_size} "
                          f"ranks need {full_heads // tp_size}: make the view with tp_size={tp_size}")
    if tp.get("head_offset") != rank * h_local:
        raise ConfigError(f"provenance.tensor_parallel.head_offset is {tp.get('head_offset')}, but rank {rank} "
                          f"holds global heads from {rank * h_local}: make the view with config.for_rank")


def check_local_heads(view: HeadConfig, q_by_layer: dict[int, torch.Tensor], rank: int, tp_size: int,
                      rtol: float = FINGERPRINT_RTOL) -> float:
    """Check that the config entries a TP rank reads belong to the heads it holds.

    view: the rank's config (`for_rank`), whose entries carry `q_fingerprint` (`add_fingerprints`);
    q_by_layer: layer -> this rank's captured q `[H_local, N, D]` on the probe tokens
    (`provenance.head_probe.input_ids`). Raises ConfigError naming the first layer and head whose q
    does not match its entry; returns the largest relative deviation seen."""
    check_rank_view(view, rank, tp_size)
    worst = 0.0
    for layer, q in sorted(q_by_layer.items()):
        entries = view.layer(layer)
        if q.shape[0] != len(entries):
            raise ConfigError(f"layer {layer}: this rank holds {q.shape[0]} heads but its view lists {len(entries)}: "
                              f"make the view with tp_size={tp_size}")
        have = q_fingerprint(q.float())
        for h, e in enumerate(entries):
            recorded = (e.evidence or {}).get("q_fingerprint")
            if recorded is None:
                raise ConfigError(f"layer {layer} head {e.head} has no evidence.q_fingerprint: re-run `workbench search` "
                                  "(it records one per head) or skip the head-mapping check")
            want = torch.tensor(recorded, dtype=torch.float64)
            dev = float(((have[h] - want).abs() / want.abs().clamp(min=1e-6)).max())
            worst = max(worst, dev)
            if dev > rtol:
                g = global_head(rank, h, tp_size, view.model["n_heads"] * tp_size)
                raise ConfigError(
                    f"wrong tensor-parallel head mapping: rank {rank} local head {h} in layer {layer} should be global "
                    f"head {g} (= rank * {view.model['n_heads']} + local), but its q fingerprint "
                    f"{[round(x, 4) for x in have[h].tolist()]} differs from that entry's {recorded} by {dev:.1%}: "
                    "build the rank's view with config.for_rank(rank, tp_size) and shard heads in the same order")
    return worst


@torch.no_grad()
def check_rank(model: torch.nn.Module, shape: ModelShape, view: HeadConfig, rank: int, tp_size: int,
               rtol: float = FINGERPRINT_RTOL) -> float:
    """On a tensor-parallel rank before serving: capture this rank's q on the view's probe tokens
    (`provenance.head_probe`) with `model` (this rank's shard; `shape` = `local_shape(full, tp_size)`)
    and `check_local_heads`. Every rank of the TP group must call it (the shard's forward communicates)."""
    from workbench.core.capture import capture_attention

    probe = view.provenance.get("head_probe")
    if not probe:
        raise ConfigError("head config has no provenance.head_probe: re-run `workbench search` (it records the probe "
                          "tokens and per-head q fingerprints) to check tensor-parallel head mapping")
    ids = torch.tensor(probe["input_ids"])
    cap = capture_attention(model, shape, ids, progress=False)
    return check_local_heads(view, {layer: cap.layer_qkv(layer)[0] for layer in cap.layers}, rank, tp_size, rtol)


def shard_attention(model: torch.nn.Module, rank: int, tp_size: int) -> torch.nn.Module:
    """Make `model` (loaded whole, Llama-style attention) one rank of a Megatron-style tensor-parallel
    split of its attention, in place: rank r keeps query heads r*H_local.. and their KV heads (rows of
    q/k/v_proj, columns of o_proj), and the attention output is all-reduced after o_proj (MLPs stay
    replicated). Needs an initialised process group of `tp_size` ranks."""
    cfg = model.config
    h_local, _ = tp_split(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size)
    for layer in model.model.layers:
        attn = layer.self_attn
        d = attn.head_dim
        q_rows = slice(rank * h_local * d, (rank + 1) * h_local * d)
        kv = rank_kv_heads(rank, cfg.num_key_value_heads, tp_size)  # replicated when tp_size > KV heads
        kv_rows = slice(kv.start * d, kv.stop * d)
        for proj, rows in ((attn.q_proj, q_rows), (attn.k_proj, kv_rows), (attn.v_proj, kv_rows)):
            proj.weight = torch.nn.Parameter(proj.weight.data[rows].clone(), requires_grad=False)
            if proj.bias is not None:
                proj.bias = torch.nn.Parameter(proj.bias.data[rows].clone(), requires_grad=False)
        o = attn.o_proj
        o.weight = torch.nn.Parameter(o.weight.data[:, q_rows].clone(), requires_grad=False)
        if o.bias is not None:  # added once, after the sum
            o.bias = torch.nn.Parameter(o.bias.data / tp_size, requires_grad=False)
        o.register_forward_hook(lambda module, args, out: dist.all_reduce(out) or out)
    return model
