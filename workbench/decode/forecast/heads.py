"""SparDA Forecast heads: predict layer l+1's InfLLM-V2 blocks from layer l's input, one layer early.

Per target layer t, a bias-free linear map W_t `[Hkv * D, hidden]` turns the input-normed hidden
state of source layer s(t) = max(t - 1, 0) into one query per GQA group (Hkv heads), RoPE at the
tokens' own positions (the model's rotary tables), scored with a dot product against target layer t's
compressed keys (32/16), max-pooled to 64-token blocks and selected like InfLLM-V2 (init and local
blocks forced, top-k of the rest). Target 0 has no earlier layer: its head reads layer 0's own input
(SparDA's F0_cur). The backbone stays frozen; only W is trained (`workbench.decode.forecast.train`).

Training target (`teacher_scores`): the target layer's real G query heads score *fine* compressed keys
(window 2, stride 1), softmax per head, summed over the group, max-pooled onto the 32/16 grid.
Loss (`partition_kl`): the teacher's top-k blocks, expanded to their compressed positions, are kept as
separate bins, every other supervised position is merged into one rest bucket, both sides are
renormalised, KL(teacher || student).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from workbench_kernels.gather_ref import dequantize_rows, quantize_rows

from workbench.core.model import ModelError, ModelShape
from workbench.patterns.infllm import (
    NEG,
    Budget,
    CompressedKeys,
    compress_keys,
    fine_to_coarse,
    forced_and_future,
    group_scores,
    pool_to_blocks,
    select_blocks,
    visible,
)

FORMAT = "workbench.decode.forecast.heads/2"  # "codes" int8 [L, Hkv * D, hidden] + "scales" fp16 [L, Hkv * D]
FP16_FORMATS = ("workbench.decode.forecast.heads/1", "workbench.forecast/1")  # earlier files: "weight" fp16


def rope_tables(model: nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary tables at `positions` `[T]` -> cos, sin `[T, D]` (float32)."""
    rotary = model.model.rotary_emb
    pos = positions.reshape(1, -1).to(rotary.inv_freq.device)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32, device=pos.device), pos)
    return cos[0].float(), sin[0].float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' Llama `apply_rotary_pos_emb` on x `[..., H, T, D]` with cos/sin `[..., T, D]`."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=-3)[0]


class ForecastHeads(nn.Module):
    """One forecast head per GQA group for every target layer.

    weight `[L, Hkv * D, hidden]`: row block t predicts layer t's blocks from the input-normed hidden
    state of layer `source(t)` = max(t - 1, 0). `meta` holds provenance (fingerprint, data, steps, losses).
    """

    def __init__(self, shape: ModelShape, weight: torch.Tensor | None = None, meta: dict[str, Any] | None = None):
        super().__init__()
        self.shape = shape
        size = (shape.n_layers, shape.n_kv_heads * shape.head_dim, shape.hidden_size)
        if weight is None:
            weight = torch.randn(size) * shape.hidden_size ** -0.5
        if tuple(weight.shape) != size:
            raise ModelError(f"forecast weight has shape {tuple(weight.shape)} but {shape.name} needs {size} "
                             "(layers, kv_heads * head_dim, hidden_size): train heads for this model")
        self.weight = nn.Parameter(weight.float())
        self.meta: dict[str, Any] = dict(meta or {})

    @staticmethod
    def source(target: int) -> int:
        """The layer whose input feeds the head that predicts `target`."""
        return max(target - 1, 0)

    @classmethod
    def from_queries(cls, model: nn.Module, shape: ModelShape) -> ForecastHeads:
        """Warm start: head t = the mean of target layer t's query projections over each GQA group."""
        rows = []
        for layer in model.model.layers:
            w = layer.self_attn.q_proj.weight.detach().float()  # [Hq * D, hidden]
            w = w.reshape(shape.n_kv_heads, shape.group, shape.head_dim, shape.hidden_size).mean(1)
            rows.append(w.reshape(-1, shape.hidden_size))
        return cls(shape, torch.stack(rows), meta={"init": "group mean of the target layer's q_proj"})

    def query(self, target: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Forecast queries for `target`: x `[..., T, hidden]` (input of layer source(target)), cos/sin
        `[..., T, D]` -> `[..., Hkv, T, D]` after RoPE."""
        self.shape.check_layer(target)
        f = x.float() @ self.weight[target].T  # [..., T, Hkv * D]
        f = f.unflatten(-1, (self.shape.n_kv_heads, self.shape.head_dim)).transpose(-3, -2)
        return apply_rope(f, cos.float(), sin.float())

    def query_all(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Every target at once: x `[L, T, hidden]` (x[t] = input of layer source(t)), cos/sin `[T, D]`
        -> `[L, Hkv, T, D]`."""
        f = torch.einsum("ltx,lfx->ltf", x.float(), self.weight)
        f = f.unflatten(-1, (self.shape.n_kv_heads, self.shape.head_dim)).transpose(1, 2)
        return apply_rope(f, cos.float(), sin.float())

    @torch.no_grad()
    def forecast_blocks(self, target: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        ck: CompressedKeys, budget: Budget = Budget()) -> torch.Tensor:
        """Decode step: blocks of `target` for the newest token (position ck.n - 1).

        x `[B, hidden]` (input-normed hidden state of layer source(target) at the newest token), cos/sin
        `[B, D]` or `[D]` at that position, ck = target layer's compressed keys (newest token appended)
        -> block ids `[B, Hkv, K]` (ascending, -1 padded).
        """
        b = x.shape[0]
        f = self.query(target, x[:, None, :], cos.reshape(-1, 1, cos.shape[-1]).expand(b, 1, -1),
                       sin.reshape(-1, 1, sin.shape[-1]).expand(b, 1, -1))  # [B, Hkv, 1, D]
        return select_blocks(f, ck, budget)

    def save(self, path: str | Path) -> Path:
        """safetensors, the weight as INT8 rows with fp16 scales (`gather_ref.quantize_rows`: half of fp16's bytes,
        and save -> load -> save is exact; the shipped SmolLM2 heads are 3.3 MB); metadata = format, model shape
        and provenance (atomic write)."""
        from safetensors.torch import save_file

        from workbench.core.io import atomic_path

        meta = {"format": FORMAT, "shape": json.dumps(self.shape.to_dict()), "meta": json.dumps(self.meta)}
        codes, scales = quantize_rows(self.weight.detach(), torch.int8, torch.float16)
        with atomic_path(path) as tmp:
            save_file({"codes": codes.contiguous(), "scales": scales.contiguous()}, str(tmp), metadata=meta)
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, shape: ModelShape, *, check_fingerprint: bool = True) -> ForecastHeads:
        """Load heads saved by `save`; refuses files made for another model shape (or other weights)."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"forecast heads {path} not found: train them with `workbench forecast train`")
        if path.is_dir():
            raise IsADirectoryError(f"forecast heads {path} is a folder: give the .safetensors file")
        try:
            with safe_open(str(path), "pt") as f:
                md = f.metadata() or {}
                tensors = ("weight",) if md.get("format") in FP16_FORMATS else ("codes", "scales")
                if md.get("format") not in (FORMAT, *FP16_FORMATS) or not set(tensors) <= set(f.keys()):
                    raise ModelError(f"{path} is not a forecast-heads file (format {md.get('format')!r}, "
                                     f"expected {FORMAT!r}): give a file written by `workbench forecast train`")
                weight = f.get_tensor("weight") if len(tensors) == 1 else dequantize_rows(
                    f.get_tensor("codes"), f.get_tensor("scales"), torch.float32)
        except SafetensorError as e:
            raise ModelError(f"{path} is not a safetensors file ({e}): give the .safetensors file written by "
                             "`workbench forecast train`") from None
        saved = ModelShape.from_dict(json.loads(md["shape"]))
        for field in ("n_layers", "n_kv_heads", "head_dim", "hidden_size"):
            if getattr(saved, field) != getattr(shape, field):
                raise ModelError(f"{path} was trained for {saved.name} with {field}={getattr(saved, field)}, "
                                 f"but the model has {field}={getattr(shape, field)}: train heads for this model")
        if check_fingerprint and saved.fingerprint != shape.fingerprint:
            raise ModelError(f"{path} was trained on weights {saved.fingerprint}, the model is {shape.fingerprint}: "
                             "train heads for these weights (or pass check_fingerprint=False)")
        return cls(shape, weight.float(), meta=json.loads(md.get("meta", "{}")))


# ----------------------------------------------------------------------------- teacher and loss

def teacher_scores(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, budget: Budget = Budget(), *,
                   fine: tuple[int, int] = (2, 1), scale: float | None = None) -> torch.Tensor:
    """SparDA's fine teacher on the student's grid.

    q `[Hq, R, D]` (target layer's query heads at rows `positions` `[R]`), k `[Hkv, N, D]` (its keys)
    -> `[Hkv, R, Nc]`: softmax per head over the fine compressed keys (window, stride = `fine`) each row
    sees, summed over the GQA group, max-pooled onto the `budget.window`/`budget.stride` grid.
    `fine=(budget.window, budget.stride)` gives the coarse teacher (the ablation).
    """
    hq, r, d = q.shape
    hkv, n, _ = k.shape
    fw, fs = fine
    nc = (n - budget.window) // budget.stride + 1
    fk = compress_keys(k, fw, fs)
    s = group_scores(q.reshape(hkv, hq // hkv, r, d), fk, positions, window=fw, stride=fs, scale=scale)
    if fine == (budget.window, budget.stride):
        return s
    coarse = fine_to_coarse(s, nc, fine_window=fw, fine_stride=fs, window=budget.window, stride=budget.stride)
    return coarse * visible(positions, nc, budget.window, budget.stride)  # the student sees whole windows only


def candidate_positions(positions: torch.Tensor, nc: int, budget: Budget) -> torch.Tensor:
    """Bool `[R, Nc]`: the supervised set. Compressed position j counts for row r when it is fully in the
    past and pools into at least one dynamic candidate block (not forced, not future)."""
    nb = math.ceil((int(positions.max()) + 1) / budget.block)
    forced, future = forced_and_future(positions // budget.block, nb, budget.init, budget.local)
    cand = (~forced & ~future).float()  # [R, nb]
    # j pools into block b iff their spans overlap: spread the candidate flags back onto the grid
    j = torch.arange(nc, device=positions.device)
    first = (j * budget.stride) // budget.block
    last = (j * budget.stride + budget.window - 1) // budget.block
    hit = cand.gather(1, first.clamp(max=nb - 1).expand(len(positions), -1)).bool() | \
        cand.gather(1, last.clamp(max=nb - 1).expand(len(positions), -1)).bool()
    ends = j * budget.stride + budget.window - 1
    return hit & (ends[None, :] <= positions[:, None])


def teacher_blocks(teacher: torch.Tensor, positions: torch.Tensor, supervised: torch.Tensor,
                   budget: Budget, n_blocks: int | None = None) -> torch.Tensor:
    """Bool `[Hkv, R, nb]`: the teacher's top-k dynamic blocks (block score = max of the supervised
    compressed scores overlapping the block); nb defaults to the blocks up to the last row."""
    nb = n_blocks or math.ceil((int(positions.max()) + 1) / budget.block)
    scores = pool_to_blocks(teacher.masked_fill(~supervised, NEG), nb, block=budget.block,
                            window=budget.window, stride=budget.stride)
    forced, future = forced_and_future(positions // budget.block, nb, budget.init, budget.local)
    scores = scores.masked_fill(forced | future, NEG)
    val, idx = scores.topk(min(budget.topk, nb), -1)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, val > NEG)


def teacher_keep(teacher: torch.Tensor, positions: torch.Tensor, supervised: torch.Tensor,
                 budget: Budget) -> torch.Tensor:
    """Bool `[Hkv, R, Nc]`: compressed positions of the teacher's top-k dynamic blocks (the separate bins)."""
    chosen = teacher_blocks(teacher, positions, supervised, budget)
    nc, nb = teacher.shape[-1], chosen.shape[-1]
    j = torch.arange(nc, device=teacher.device)
    first = ((j * budget.stride) // budget.block).clamp(max=nb - 1)
    last = ((j * budget.stride + budget.window - 1) // budget.block).clamp(max=nb - 1)
    shape = (*chosen.shape[:-1], nc)
    keep = chosen.gather(-1, first.expand(shape)) | chosen.gather(-1, last.expand(shape))
    return keep & supervised


def partition(dist: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Renormalise `dist` `[..., P]` and split it into the kept bins and one rest bucket -> `[..., P + 1]`:
    the first P entries are the kept bins (0 where not kept), the last is the rest bucket."""
    p = dist / dist.sum(-1, keepdim=True).clamp_min(1e-30)
    kept = p * keep
    return torch.cat([kept, (p - kept).sum(-1, keepdim=True)], -1)


def partition_kl(teacher: torch.Tensor, student: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the partition (kept bins + rest bucket), per row: `[..., P]` -> `[...]`.

    Both inputs are non-negative scores over the same supervised positions (zeros elsewhere).
    """
    p, q = partition(teacher, keep), partition(student, keep)
    return torch.where(p > 0, p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log()), p.new_zeros(())).sum(-1)


def partition_kl_logits(teacher: torch.Tensor, logits: torch.Tensor, keep: torch.Tensor,
                        supervised: torch.Tensor) -> torch.Tensor:
    """`partition_kl` with the student given as logits (student = softmax over the supervised set),
    computed in log space so gradients stay finite. teacher/logits/keep `[..., P]`, supervised `[..., P]`
    -> KL per row `[...]`; rows with no supervised position give 0."""
    p = partition(teacher * supervised, keep & supervised)
    logits = logits.float().masked_fill(~supervised, NEG)
    log_z = torch.logsumexp(logits, -1, keepdim=True)
    rest = supervised & ~keep
    log_rest = torch.logsumexp(logits.masked_fill(~rest, NEG), -1, keepdim=True)
    log_q = torch.cat([logits - log_z, log_rest - log_z], -1)
    terms = p * (p.clamp_min(1e-30).log() - log_q)
    return torch.where(p > 0, terms, terms.new_zeros(())).sum(-1)
