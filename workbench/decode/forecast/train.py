"""Train Forecast heads against the fine teacher with the partition KL (backbone frozen).

The teacher never changes during training, so each prompt is captured once and reduced to what the
loss needs at a random subset of query rows: the source layers' input-normed hidden states, the target
layers' compressed keys, the teacher's scores on the 32/16 grid, the supervised set and the kept bins.
One optimiser step = one prompt, all target layers at once (the loss is summed over layers).
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from workbench.core.capture import capture_attention
from workbench.core.model import ModelShape
from workbench.decode.forecast.heads import (
    ForecastHeads,
    candidate_positions,
    partition_kl_logits,
    rope_tables,
    teacher_keep,
    teacher_scores,
)
from workbench.patterns.infllm import Budget, compress_keys


@dataclass
class Prompt:
    """One prompt reduced to its training rows (R rows, L target layers, Nc compressed positions).

    positions `[R]`; hidden `[L, R, hidden]` (input of each *source* layer: hidden[t] feeds target t);
    cos/sin `[R, D]`; ck `[L, Hkv, Nc, D]`; teacher `[L, Hkv, R, Nc]`; keep `[L, Hkv, R, Nc]` (bool);
    supervised `[R, Nc]` (bool).
    """

    positions: torch.Tensor
    hidden: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    ck: torch.Tensor
    teacher: torch.Tensor
    keep: torch.Tensor
    supervised: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)


def training_rows(n: int, count: int, budget: Budget, seed: int) -> torch.Tensor:
    """`count` distinct query rows, sorted, drawn from the rows that have more past blocks than the
    budget (earlier rows select everything and teach nothing)."""
    first = min(n - 1, budget.total * budget.block)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n - first, generator=g)[:count] + first
    return pick.sort().values


@torch.no_grad()
def prepare_prompt(model: torch.nn.Module, shape: ModelShape, input_ids: torch.Tensor, budget: Budget, *,
                   rows: int = 384, fine: tuple[int, int] = (2, 1), seed: int = 0,
                   meta: dict[str, Any] | None = None) -> Prompt:
    """Capture one prompt (all layers, hidden states) and compute the teacher at `rows` random rows."""
    cap = capture_attention(model, shape, input_ids, hidden=True, dtype=torch.float32, progress=False)
    n = cap.n
    pos = training_rows(n, rows, budget, seed)
    src = [ForecastHeads.source(t) for t in range(shape.n_layers)]
    ck = compress_keys(cap.k, budget.window, budget.stride)  # [L, Hkv, Nc, D]
    nc = ck.shape[2]
    supervised = candidate_positions(pos, nc, budget)
    teacher, keep = [], []
    for t in range(shape.n_layers):
        s = teacher_scores(cap.q[t][:, pos], cap.k[t], pos, budget, fine=fine, scale=cap.scale)
        teacher.append(s)
        keep.append(teacher_keep(s, pos, supervised, budget))
    cos, sin = rope_tables(model, pos)
    return Prompt(positions=pos, hidden=cap.hidden[src][:, pos].clone(), cos=cos, sin=sin, ck=ck,
                  teacher=torch.stack(teacher), keep=torch.stack(keep), supervised=supervised,
                  meta={"n": n, "rows": len(pos), "fine_teacher": list(fine), **(meta or {})})


def prompt_kl(heads: ForecastHeads, p: Prompt, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Partition KL per target layer, mean over KV heads and rows -> `[L]` (differentiable in heads)."""
    r = slice(None) if rows is None else rows
    f = heads.query_all(p.hidden[:, r], p.cos[r], p.sin[r])  # [L, Hkv, R, D]
    logits = torch.einsum("lhrd,lhcd->lhrc", f, p.ck) * heads.shape.head_dim ** -0.5
    sup = p.supervised[r][None, None]
    kl = partition_kl_logits(p.teacher[:, :, r], logits, p.keep[:, :, r], sup)  # [L, Hkv, R]
    return kl.mean((1, 2))


@torch.no_grad()
def held_out_kl(heads: ForecastHeads, prompts: Sequence[Prompt]) -> torch.Tensor:
    """Mean partition KL per target layer over held-out prompts -> `[L]`."""
    return torch.stack([prompt_kl(heads, p) for p in prompts]).mean(0)


@dataclass
class TrainConfig:
    """AdamW as in SparDA (constant lr, wd 0.01, betas 0.9/0.95, eps 1e-6, grad-norm clip 0.5); lr and
    steps scaled to the small model; `batch_rows` query rows of one prompt per step."""

    steps: int = 300
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-6
    clip: float = 0.5
    batch_rows: int = 192
    seed: int = 0
    eval_every: int = 100


def train(heads: ForecastHeads, train_set: Sequence[Prompt], held_out: Sequence[Prompt],
          cfg: TrainConfig = TrainConfig(), progress: bool = True) -> dict[str, Any]:
    """Train `heads` in place. Returns the history: loss per step (mean over layers), held-out KL per
    layer before and after, and the wall time."""
    if not train_set:
        raise ValueError("no training prompts: give at least one sample")
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay)
    before = held_out_kl(heads, held_out) if held_out else None
    losses, evals = [], []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="forecast train", unit="step", disable=not progress)
    for step in bar:
        p = train_set[int(torch.randint(len(train_set), (1,), generator=g))]
        rows = torch.randperm(len(p.positions), generator=g)[:cfg.batch_rows]
        loss = prompt_kl(heads, p, rows).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), cfg.clip)
        opt.step()
        losses.append(loss.item() / heads.shape.n_layers)
        bar.set_postfix(kl=f"{losses[-1]:.4f}")
        if held_out and cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            evals.append({"step": step + 1, "held_out_kl": held_out_kl(heads, held_out).mean().item()})
    bar.close()
    after = held_out_kl(heads, held_out) if held_out else None
    return {
        "train_seconds": round(time.perf_counter() - t0, 1),
        "loss_per_step": [round(x, 5) for x in losses],
        "held_out_curve": evals,
        "held_out_kl_before": None if before is None else [round(x, 5) for x in before.tolist()],
        "held_out_kl_after": None if after is None else [round(x, 5) for x in after.tolist()],
    }


def make_prompts(model: torch.nn.Module, tok: Any, shape: ModelShape, specs: Sequence[tuple[str, int, int]],
                 budget: Budget, *, rows: int, fine: tuple[int, int], progress: bool = True) -> list[Prompt]:
    """Build training prompts from `(task, length, seed)` specs with `workbench.core.corpus.make_sample`."""
    from workbench.core.corpus import make_sample

    out = []
    for task, length, seed in tqdm(specs, desc="teacher", unit="prompt", disable=not progress):
        s = make_sample(task, tok, length, seed=seed, max_length=shape.max_positions)
        out.append(prepare_prompt(model, shape, s.input_ids, budget, rows=rows, fine=fine, seed=seed,
                                  meta=s.describe()))
    return out


def lengths_ok(n: int, budget: Budget) -> None:
    """Refuse prompts too short to have dynamic blocks under the budget."""
    need = (budget.total + 1) * budget.block
    if n < need:
        raise ValueError(f"length {n} is too short for the budget (init {budget.init} + local {budget.local} + "
                         f"topk {budget.topk} blocks of {budget.block}): use --length >= {need}")
    if math.ceil(n / budget.block) <= budget.total:
        raise ValueError("every block would be selected: lower --topk or use a longer --length")
