"""FlexPrefill: per head and prompt, a query-aware block pattern or Vertical-Slash, by cumulative share.

From the last `block` query rows (the question):
1. True block distribution: their exact attention (softmax, causal) summed over the rows and pooled into
   64-token key blocks. Estimated one: softmax of the mean query of those rows against the mean-pooled
   key blocks. d = sqrt(Jensen-Shannon divergence) of the two (natural log, in [0, sqrt(ln 2)]).
2. d < `tau` (the pooled estimate is trustworthy): query-aware blocks. Each query block scores the key
   blocks by softmax of pooled q . pooled k (causal) and keeps blocks by descending score until their
   cumulative share reaches `gamma` (at least `min_budget` tokens' worth of blocks; diagonal always).
3. Otherwise Vertical-Slash from the same exact last-row attention: columns by their summed probability,
   slash offsets by their diagonal sums, each kept until the cumulative share reaches `gamma` (at least
   `min_budget` columns and offsets; offset 0 always).
gamma >= 1 keeps everything: dense. The head config records gamma, tau and min_budget, not budgets.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from workbench_kernels.index_ref import VSTiles, selected_block_tiles, vs_to_tiles
from workbench_kernels.tiling import ints_on

from workbench.patterns.base import (
    BLOCK,
    MaskMod,
    PatternBase,
    Shapes,
    Sweep,
    check_head,
    check_rows,
    default_budget,
    register_pattern,
)
from workbench.patterns.block_sparse import BlockSparse
from workbench.patterns.proxy import _grouped_scores
from workbench.patterns.tile_select import (
    cumulative_keep,
    positions,
    repeat_batch,
    select_tiles,
    tile_count,
)
from workbench.patterns.vertical_slash import VerticalSlash


@register_pattern
class FlexPrefill(PatternBase):
    """Per head either the VS index or the block table: `use_vs` Bool `[H]`, `vs` over all H heads
    (used where use_vs), `blocks` over all H heads (used elsewhere). Config params: `gamma_milli`,
    `tau_milli` (thousandths) and `min_budget` (tokens)."""

    kind = "flexprefill"
    title = "FlexPrefill"
    params = ("gamma_milli", "tau_milli", "min_budget")
    order = 90
    bench_kernel = None
    minference_attn_type = "flexprefill"
    sweep = Sweep("flexprefill", "gamma", (0.8, 0.9, 0.95),
                  lambda v: {"gamma_milli": round(v * 1000), "tau_milli": 100, "min_budget": 256}, adaptive=True)

    @classmethod
    def defaults(cls, n: int) -> dict[str, int]:
        return {"gamma_milli": 900, "tau_milli": 100, "min_budget": default_budget(n)}

    @classmethod
    def grid(cls, n: int) -> list[dict[str, int]]:
        """gamma 0.9 / 0.95, tau 0.1, at least 256 tokens (thresholds: the same at every length)."""
        return [{"gamma_milli": gamma, "tau_milli": 100, "min_budget": 256} for gamma in (900, 950)]

    def __init__(self, use_vs: torch.Tensor, vs: VerticalSlash, blocks: BlockSparse, triton: bool = False):
        if not (use_vs.numel() == vs.n_heads == blocks.n_heads):
            raise ValueError(f"FlexPrefill wants use_vs, vs and blocks for the same heads, got "
                             f"{use_vs.numel()}, {vs.n_heads}, {blocks.n_heads}")
        self.use_vs, self.vs, self.blocks = use_vs.bool().to(vs.columns.device), vs, blocks
        self.triton = triton  # `to_tiles` through the Triton VS builder
        self.n_heads = vs.n_heads

    def row_mask(self, r0: int, r1: int, n: int) -> torch.Tensor:
        check_rows(r0, r1, n)
        return torch.where(self.use_vs[:, None, None], self.vs.row_mask(r0, r1, n), self.blocks.row_mask(r0, r1, n))

    def edges(self, n: int) -> torch.Tensor:
        return torch.where(self.use_vs, self.vs.edges(n), self.blocks.edges(n))

    def to_tiles(self, n: int, batch: int = 1) -> VSTiles:
        """The VS heads' tiles where `use_vs`, else the block heads'. Its block table is ascending, causal,
        duplicate-free and holds the diagonal, so those are `selected_block_tiles`' (no sort, no sync); the VS
        lists (N wide, -1 padded) are cut to the widest head's count (one host sync) and, with `self.triton`, expanded
        by the Triton builder (`index_build.vs_tiles`) instead of the PyTorch reference (H200, Llama 32/8/128 at
        64K: 214 ms a layer with the reference against dense SDPA's 67; scripts/host_overhead.py --layers)."""
        cols, offs = (x[None].sort(-1, descending=True).values for x in (self.vs.columns, self.vs.offsets))  # -1 last
        kv, ks = (max(int(x), 1) for x in torch.stack([(cols >= 0).sum(-1).max(), (offs >= 0).sum(-1).max()]).tolist())
        cols, offs = cols[..., :kv], offs[..., :ks]
        if self.triton:
            from workbench_kernels.index_build import vs_tiles

            vs = vs_tiles(cols, offs, n, BLOCK)
        else:
            vs = vs_to_tiles(cols, offs, n, BLOCK)
        blocks = selected_block_tiles(self.blocks.block_index[None])
        return repeat_batch(select_tiles(blocks, vs, self.use_vs.to(vs.block_count.device)[None, :, None]), batch)

    def mask_mod(self, n: int, device: torch.device | str | None = None) -> MaskMod:
        vs, blocks, use_vs = self.vs.mask_mod(n, device), self.blocks.mask_mod(n, device), self.use_vs.to(device)
        return lambda b, h, q_idx, kv_idx: torch.where(use_vs[h], vs(b, h, q_idx, kv_idx), blocks(b, h, q_idx, kv_idx))

    def shapes(self, head: int, n: int) -> Shapes:
        check_head(self, head)
        return (self.vs if bool(self.use_vs[head]) else self.blocks).shapes(head, n)

    def head(self, h: int) -> FlexPrefill:
        """The one-head pattern of head h."""
        return FlexPrefill(self.use_vs[h:h + 1], VerticalSlash(self.vs.columns[h:h + 1], self.vs.offsets[h:h + 1]),
                           BlockSparse(self.blocks.block_index[h:h + 1], self.blocks.block))

    @classmethod
    def for_heads(cls, params, q: torch.Tensor, k: torch.Tensor, scale: float, proxy: dict[str, Any],
                  block: int, triton: bool = False) -> FlexPrefill:
        """One pass per distinct `min_budget` over all the heads (static widths: N columns and offsets,
        M blocks); each head keeps its own budget's choice."""
        gamma, tau = (ints_on([p[key] for p in params], q.device).float() / 1000  # cached copies: no sync
                      for key in ("gamma_milli", "tau_milli"))
        budgets = [p["min_budget"] for p in params]
        out = None
        for budget in sorted(set(budgets)):
            f = flexprefill(q, k, scale, gamma, tau, budget, block, triton)
            if out is None:
                out = f
                continue
            mine = ints_on([b == budget for b in budgets], q.device).bool()
            pick = lambda a, b: torch.where(mine.view(-1, *[1] * (a.dim() - 1)), a, b)  # noqa: E731
            out = FlexPrefill(pick(f.use_vs, out.use_vs),
                              VerticalSlash(pick(f.vs.columns, out.vs.columns), pick(f.vs.offsets, out.vs.offsets)),
                              BlockSparse(pick(f.blocks.block_index, out.blocks.block_index), block), triton)
        return out

    def tiles(self, n: int) -> torch.Tensor:
        return tile_count(self.to_tiles(n))[0]

    def __repr__(self) -> str:
        return f"FlexPrefill(vs heads {self.use_vs.nonzero().flatten().tolist()} of {self.n_heads})"


def _pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over `block`-token groups (the last group may be short): `[..., N, D]` -> `[..., M, D]`."""
    n = x.shape[-2]
    m = -(-n // block)
    size = torch.clamp(n - torch.arange(m, device=x.device) * block, max=block).to(torch.float32)
    x = torch.nn.functional.pad(x.float(), (0, 0, 0, m * block - n))
    return x.reshape(*x.shape[:-2], m, block, x.shape[-1]).sum(-2) / size[:, None]


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sqrt of the Jensen-Shannon divergence (natural log) of distributions on the last dim."""
    mid = (p + q) / 2
    kl = lambda a: torch.where(a > 0, a * (a.clamp(min=1e-30).log() - mid.clamp(min=1e-30).log()), 0).sum(-1)  # noqa: E731
    return ((kl(p) + kl(q)) / 2).clamp(min=0).sqrt()


@torch.no_grad()
def flexprefill_scores(q: torch.Tensor, k: torch.Tensor, scale: float, block: int = BLOCK,
                       triton: bool = False) -> dict[str, torch.Tensor]:
    """What FlexPrefill decides from, q `[Hq, N, D]`, k `[Hkv, N, D]`: {"distance" `[Hq]`,
    "block_score" `[Hq, M, M]` (pooled softmax, rows sum to 1), "column" `[Hq, N]`, "diagonal" `[Hq, N]`}
    (the last rows' attention summed per key and per offset i - j; `triton` and block 64: those two from the
    VS index's Triton passes, `index_build.vs_scores`, with no `[Hq, 64, N]` probabilities in memory)."""
    hq, n, _ = q.shape
    r = min(block, n)
    if triton and block == 64:
        from workbench_kernels.index_build import vs_scores

        column, diagonal = (x[0] for x in vs_scores(q[None], k[None], scale))
    else:
        i = torch.arange(n - r, n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        p = torch.softmax((_grouped_scores(q[:, n - r:].float(), k.float()) * scale).masked_fill(j > i, float("-inf")), -1)
        column = p.sum(1)  # [Hq, N]
        d = torch.where(j <= i, i - j, n).expand(hq, -1, -1).reshape(hq, -1)
        diagonal = torch.zeros(hq, n + 1, device=q.device).scatter_add_(1, d, p.reshape(hq, -1))[:, :n]
    m = -(-n // block)
    true = torch.nn.functional.pad(column, (0, m * block - n)).reshape(hq, m, block).sum(-1) / r
    qp, kp = _pool(q, block), _pool(k, block)  # [Hq, M, D], [Hkv, M, D]
    est = torch.softmax(_grouped_scores(q[:, n - r:].float().mean(1, keepdim=True), kp)[:, 0] * scale, -1)
    causal = torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
    block_score = torch.softmax((_grouped_scores(qp, kp) * scale).masked_fill(~causal, float("-inf")), -1)
    return {"distance": js_distance(true, est), "block_score": block_score, "column": column, "diagonal": diagonal}


@torch.no_grad()
def flexprefill(q: torch.Tensor, k: torch.Tensor, scale: float, gamma: float | torch.Tensor = 0.9,
                tau: float | torch.Tensor = 0.1, min_budget: int = 256, block: int = BLOCK,
                triton: bool = False) -> FlexPrefill:
    """FlexPrefill's index of one layer (q `[Hq, N, D]`, k `[Hkv, N, D]`). gamma, tau: float or `[Hq]`;
    min_budget: tokens (columns and offsets for VS heads, min_budget // block blocks for block heads); `triton`:
    the column / diagonal sums from the Triton passes (`flexprefill_scores`), and its VS tiles from the Triton
    builder."""
    hq, n, _ = q.shape
    if min_budget < 0:
        raise ValueError(f"min_budget={min_budget} must be >= 0 tokens")
    sc = flexprefill_scores(q, k, scale, block, triton)
    gamma = torch.as_tensor(gamma, dtype=torch.float32, device=q.device).reshape(-1)
    g1 = gamma[:, None]
    tau = torch.as_tensor(tau, dtype=torch.float32, device=q.device).reshape(-1)
    use_vs = sc["distance"] >= tau.to(q.device).expand(hq)
    cols = positions(cumulative_keep(sc["column"], g1, min(min_budget, n)))
    offs = positions(cumulative_keep(sc["diagonal"], g1, min(min_budget, n)))
    m = sc["block_score"].shape[-1]
    keep = cumulative_keep(sc["block_score"], g1[:, :, None], max(1, math.ceil(min_budget / block)))
    keep |= torch.eye(m, dtype=torch.bool, device=q.device)
    keep &= torch.ones(m, m, dtype=torch.bool, device=q.device).tril()
    return FlexPrefill(use_vs, VerticalSlash(cols, offs), BlockSparse(positions(keep).int()), triton)
