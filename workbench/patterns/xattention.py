"""XAttention: block-sparse prefill chosen per prompt by antidiagonal scoring and a cumulative threshold.

1. Antidiagonal scores at stride S: query group a = rows aS .. aS+S-1, key group c = keys cS .. cS+S-1;
   their score is the sum of the S logits on the group's antidiagonal, sum_s q_{aS+s} . k_{cS+S-1-s}
   (one [n/S, n/S] product of the stride-reshaped q and the group-reversed k: O(n^2 d / S)).
2. Softmax over the causal key groups c <= a of each query group (logits scaled by scale / S: the mean
   of the antidiagonal), summed into 64x64 blocks ((64/S)^2 groups each) and normalised per query block.
3. Per query block, key blocks by descending score until their cumulative share reaches `tau`; the
   diagonal block and the first (sink) block are always kept. tau >= 1 keeps every causal block.

The head config records tau and S, not a block budget. q `[..., Hq, N, D]`, k `[..., Hkv, N, D]`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from workbench_kernels.index_ref import VSTiles, selected_block_tiles
from workbench_kernels.tiling import ints_on

from workbench.patterns.base import (
    BLOCK,
    PatternBase,
    Reductions,
    Scores,
    Sweep,
    generic_evidence,
    register_pattern,
)
from workbench.patterns.block_sparse import BlockSparse
from workbench.patterns.proxy import _grouped_scores
from workbench.patterns.tile_select import cumulative_keep, positions

STRIDES = (4, 8, 16, 32, 64)


SCORE_BYTES = 1 << 30  # fp32 antidiagonal scores one pass of `antidiagonal_block_scores` holds (about 1 GiB)


@contextlib.contextmanager
def _tf32_where_exact(dtype: torch.dtype):
    """TF32 matmuls while q / k came in bf16 / fp16: their values are exact in TF32's 10-bit mantissa and the
    products accumulate in fp32, so the scores keep fp32's accuracy at the tensor cores' rate (else unchanged)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = old or dtype in (torch.bfloat16, torch.float16)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@torch.no_grad()
def antidiagonal_block_scores(q: torch.Tensor, k: torch.Tensor, scale: float, stride: int = 8,
                              block: int = BLOCK, chunk: int | None = None) -> torch.Tensor:
    """Float `[..., Hq, M, M]`: each query block's estimated attention share per key block (rows sum
    to 1 over the causal blocks, 0 above the diagonal). M = ceil(N / block). The query groups go in passes of
    `chunk` (a multiple of block / stride; None: as many as keep a pass's scores near `SCORE_BYTES`), each against
    the key groups up to its last one only, so no pass holds more than chunk x N / stride scores per head.
    H200, Llama 32/8/128 at 64K: the one-pass fp32 form took 197 ms a layer (dense SDPA 69 ms)."""
    if stride not in STRIDES or block % stride:
        raise ValueError(f"stride={stride} must be one of {STRIDES} and divide the block ({block})")
    n, d = q.shape[-2], q.shape[-1]
    m = -(-n // block)
    pad = m * block - n
    g = m * block // stride  # query / key groups
    per = block // stride  # groups per block
    if chunk is None:
        heads = max(1, q.numel() // max(n * d, 1))
        chunk = max(per, SCORE_BYTES // (4 * heads * g) // per * per)
    if chunk < 1 or chunk % per:
        raise ValueError(f"chunk={chunk} must be a positive multiple of block / stride = {per} query groups")
    qs = torch.nn.functional.pad(q.float(), (0, 0, 0, pad)).reshape(*q.shape[:-2], g, stride * d)
    kr = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).reshape(*k.shape[:-2], g, stride, d)
    ks = kr.flip(-2).reshape(*k.shape[:-2], g, stride * d)
    a = torch.arange(g, device=q.device)
    blocks = torch.zeros(*q.shape[:-2], m, m, device=q.device)
    with _tf32_where_exact(q.dtype):
        for r0 in range(0, g, chunk):
            r1 = min(g, r0 + chunk)  # query groups [r0, r1) against key groups [0, r1): blocks [r0, r1) / per
            s = _grouped_scores(qs[..., r0:r1, :], ks[..., :r1, :]) * (scale / stride)
            rows, cols = a[r0:r1, None], a[None, :r1]
            live = (cols <= rows) & (cols * stride < n)  # causal groups holding real keys
            p = torch.softmax(s.masked_fill(~live, float("-inf")), -1)
            p = p * (rows * stride < n).to(p.dtype)  # padded query groups count for nothing
            blocks[..., r0 // per:r1 // per, :r1 // per] = p.reshape(*p.shape[:-2], (r1 - r0) // per, per,
                                                                     r1 // per, per).sum((-3, -1))
    return blocks / blocks.sum(-1, keepdim=True).clamp(min=1e-30)


def threshold_blocks(score: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """Bool `[..., H, M, M]`: per query block the key blocks by cumulative share `tau` (float or one
    per head), plus the diagonal and block 0; causal blocks only."""
    m = score.shape[-1]
    tau = torch.as_tensor(tau, dtype=score.dtype, device=score.device)
    tau = tau.reshape(-1, 1, 1) if tau.dim() == 1 else tau
    keep = cumulative_keep(score, tau, min_keep=0)
    eye = torch.eye(m, dtype=torch.bool, device=score.device)
    first = torch.zeros(m, m, dtype=torch.bool, device=score.device)
    first[:, 0] = True
    causal = torch.ones(m, m, dtype=torch.bool, device=score.device).tril()
    return (keep | eye | first | (tau >= 1)) & causal


@torch.no_grad()
def xattention_index(q: torch.Tensor, k: torch.Tensor, scale: float, tau: float | torch.Tensor = 0.9,
                     stride: int = 8, block: int = BLOCK, triton: bool = False) -> torch.Tensor:
    """Block table Int `[..., Hq, M, M]` (key-block ids ascending, -1 padded) of XAttention at `tau`; `triton`
    (q `[Hq, N, D]`): the scores from the Triton kernel (`antidiagonal.antidiagonal_scores`, no `[N / S, N / S]`
    matrix in memory) instead of `antidiagonal_block_scores`."""
    if triton and q.dim() == 3 and (q.shape[-1] * stride) % 16 == 0 and block == BLOCK:
        from workbench_kernels.antidiagonal import antidiagonal_scores

        score = antidiagonal_scores(q, k, scale, stride, block)
    else:
        score = antidiagonal_block_scores(q, k, scale, stride, block)
    return positions(threshold_blocks(score, tau)).int()


@register_pattern
class XAttention(BlockSparse):
    """A block table chosen by XAttention. Config params: `tau_milli` (tau in thousandths: 900 = 0.9)
    and `stride` (S in tokens)."""

    kind = "xattention"
    title = "XAttention"
    params = ("tau_milli", "stride")
    order = 80
    bench_kernel = None
    minference_name = None
    minference_attn_type = "xattention"
    default_search = False
    sweep = Sweep("xattention", "tau", (0.8, 0.9, 0.95), lambda v: {"tau_milli": round(v * 1000), "stride": 8},
                  adaptive=True)

    at_budget = PatternBase.__dict__["at_budget"]  # a threshold, not a key budget (not BlockSparse's top-k)

    @classmethod
    def defaults(cls, n: int) -> dict[str, int]:
        return {"tau_milli": 900, "stride": 8}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """tau 0.9 / 0.95 at stride 8 (thresholds, not budgets: the same at every length)."""
        return [{"tau_milli": tau, "stride": 8} for tau in (900, 950)]

    @classmethod
    def evidence(cls, params: Sequence[dict[str, int]], sums: Reductions) -> Scores:
        """Adaptive (its table depends on the prompt and a threshold): one exact pass per candidate."""
        return generic_evidence(cls, params, sums)

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        """Its table is ascending, causal, duplicate-free and holds the diagonal (`threshold_blocks`), so its tiles
        are `selected_block_tiles`' two elementwise ops (no sort, no host sync)."""
        if self.block != BLOCK:
            raise ValueError(f"the kernels tile {BLOCK}-token blocks: this index has block={self.block}, "
                             f"build it with block={BLOCK} to run it")
        return selected_block_tiles(self.block_index.expand(batch, -1, -1, -1))

    layer_tiles = PatternBase.__dict__["layer_tiles"]  # its own index per prompt (`for_heads`), not BlockSparse's
    # pooled top-k

    @classmethod
    def for_heads(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                  block: int, triton: bool = False) -> XAttention:
        """One scoring pass per distinct stride over all the heads; each head keeps its own stride's table."""
        tau = ints_on([p["tau_milli"] for p in params], q.device).double() / 1000  # (a cached copy: no sync)
        strides = [p["stride"] for p in params]
        table = None
        for stride in sorted(set(strides)):
            t = xattention_index(q, k, scale, tau, stride, block, triton)
            if table is None:
                table = t
                continue
            mine = ints_on([s == stride for s in strides], q.device).bool()[:, None, None]
            table = torch.where(mine, t, table)
        return cls(table, block)


def xattention(q: torch.Tensor, k: torch.Tensor, scale: float, tau: float | torch.Tensor = 0.9,
               stride: int = 8) -> XAttention:
    """XAttention's index of one layer: q `[Hq, N, D]`, k `[Hkv, N, D]`; tau float or `[Hq]`."""
    return XAttention(xattention_index(q, k, scale, tau, stride))
