"""InfLLM-V2 block selection: the backbone selector that SparDA's Forecast heads imitate one layer early.

For a query at token position i, the selected key blocks are init blocks U local blocks U top-k:

1. Compressed keys: the mean of `window` (32) consecutive keys every `stride` (16) tokens; compressed
   key j covers tokens [j*stride, j*stride + window) and a query at i sees it once j*stride + window - 1 <= i.
2. Group scores: each of the G query heads of a GQA group takes a softmax over the compressed keys it
   sees (scale 1/sqrt(D)); the G distributions are summed -> one score per KV head.
3. Block scores: `block`-token (64) block b takes the max of the compressed scores whose windows overlap
   it (kernel 5, stride 4, padding 1 over the stride-16 grid).
4. The init blocks and the `local` blocks ending at the query's own block are forced; the other past
   blocks compete for `topk` places; future blocks are never selected.

Output layout (shared with `BlockSparse.block_index`): block ids, Long, ascending, padded with -1 at
the end, `[H, M, K]` for prefill (M query blocks) or `[B, H, K]` for decode; H is the KV-head count,
K = init + local + topk.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workbench.patterns.block_sparse import BlockSparse

NEG = float("-inf")


@dataclass(frozen=True)
class Budget:
    """Block budget of one selection, in blocks of `block` tokens; compression `window`/`stride` in tokens.

    The paper uses init 1, local 32, topk 64 at 128K tokens (MiniCPM4.1); the defaults here are scaled
    to 2K-4K-token prompts: init 1, local 2, topk 8 (11 of 32-64 blocks).
    """

    init: int = 1
    local: int = 2
    topk: int = 8
    block: int = 64
    window: int = 32
    stride: int = 16

    def __post_init__(self) -> None:
        for name in ("init", "local", "topk"):
            if getattr(self, name) < 0:
                raise ValueError(f"budget {name}={getattr(self, name)} is negative: give a count >= 0")
        for name in ("block", "window", "stride"):
            if getattr(self, name) <= 0:
                raise ValueError(f"budget {name}={getattr(self, name)} must be positive")
        if self.window > self.block:
            raise ValueError(f"budget window ({self.window}) is longer than a block ({self.block}): use window <= block")
        if self.block % self.stride or self.window % self.stride:
            raise ValueError(f"budget: block ({self.block}) and window ({self.window}) must be multiples of "
                             f"stride ({self.stride}) so that compressed keys tile blocks evenly")

    @property
    def total(self) -> int:
        """K: the number of block slots per query (forced + dynamic)."""
        return self.init + self.local + self.topk

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def fitted(cls, max_tokens: int, **sizes: int) -> Budget:
        """The budget `sizes` (defaults above) cut to what sequences of `max_tokens` tokens hold: top-k,
        then local, lowered until init + local + topk <= ceil(max_tokens / block). A 600-token prompt
        decoding 16 tokens has 10 blocks, so the default 1 + 2 + 8 becomes 1 + 2 + 7."""
        b = cls(**sizes)
        n_blocks = -(-max_tokens // b.block)
        topk = max(0, min(b.topk, n_blocks - b.init - b.local))
        local = max(0, min(b.local, n_blocks - b.init - topk))
        return replace(b, local=local, topk=topk)


def n_compressed(n: int, window: int = 32, stride: int = 16) -> int:
    """Number of complete compression windows over n tokens."""
    return max(0, (n - window) // stride + 1)


def compress_keys(k: torch.Tensor, window: int = 32, stride: int = 16) -> torch.Tensor:
    """Mean of each window of keys: k `[..., N, D]` -> `[..., Nc, D]`, Nc = (N - window) // stride + 1."""
    nc = n_compressed(k.shape[-2], window, stride)
    if nc == 0:
        return k.new_zeros(*k.shape[:-2], 0, k.shape[-1])
    return k.unfold(-2, window, stride)[..., :nc, :, :].mean(-1)


def visible(positions: torch.Tensor, nc: int, window: int = 32, stride: int = 16) -> torch.Tensor:
    """Bool `[Nq, Nc]`: compressed key j is fully in the past of the query at `positions[r]`."""
    ends = torch.arange(nc, device=positions.device) * stride + window - 1
    return ends[None, :] <= positions[:, None]


def group_scores(q: torch.Tensor, ck: torch.Tensor, positions: torch.Tensor, *, window: int = 32,
                 stride: int = 16, scale: float | None = None) -> torch.Tensor:
    """Per-head softmax over the visible compressed keys, summed over each GQA group.

    q `[..., H, G, Nq, D]` (G query heads per KV head), ck `[..., H, Nc, D]`, positions `[Nq]` (token
    index of each query) -> `[..., H, Nq, Nc]`; rows that see no compressed key are all zero.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.einsum("...gqd,...cd->...gqc", q.float(), ck.float()) * scale
    seen = visible(positions, ck.shape[-2], window, stride)
    logits = logits.masked_fill(~seen, NEG)
    probs = torch.softmax(logits, -1).nan_to_num(0.0)  # an all-masked row gives NaN -> 0
    return probs.sum(-3)


def pool_to_blocks(scores: torch.Tensor, n_blocks: int, *, block: int = 64, window: int = 32,
                   stride: int = 16) -> torch.Tensor:
    """Max over the compressed scores whose windows overlap each block: `[..., Nc]` -> `[..., n_blocks]`.

    Block b spans tokens [b*block, (b+1)*block); compressed key j spans [j*stride, j*stride + window);
    they overlap for j in [b*block/stride - window/stride + 1, (b+1)*block/stride - 1], i.e. a max-pool of
    kernel (block + window)/stride - 1, stride block/stride, padding window/stride - 1 (5, 4, 1 for
    64/32/16). Blocks with no compressed key get -inf.
    """
    step, pad = block // stride, window // stride - 1
    kernel = (block + window) // stride - 1
    nc = scores.shape[-1]
    right = max(0, step * (n_blocks - 1) + kernel - pad - nc)
    padded = torch.cat([scores.new_full((*scores.shape[:-1], pad), NEG), scores,
                        scores.new_full((*scores.shape[:-1], right), NEG)], -1)
    return padded.unfold(-1, kernel, step)[..., :n_blocks, :].amax(-1)


def fine_to_coarse(fine: torch.Tensor, nc: int, *, fine_window: int = 2, fine_stride: int = 1,
                   window: int = 32, stride: int = 16) -> torch.Tensor:
    """Max of the fine-grid scores whose windows lie inside each coarse window: `[..., Nf]` -> `[..., nc]`.

    Fine position f spans [f*fine_stride, f*fine_stride + fine_window); coarse j spans
    [j*stride, j*stride + window). This is how SparDA's fine teacher (2/1) is aligned to the 32/16 grid.
    """
    if stride % fine_stride or (window - fine_window) % fine_stride or fine_window > window:
        raise ValueError(f"fine grid {fine_window}/{fine_stride} does not nest in the coarse grid {window}/{stride}")
    kernel = (window - fine_window) // fine_stride + 1
    step = stride // fine_stride
    if nc == 0:
        return fine.new_zeros(*fine.shape[:-1], 0)
    return fine.unfold(-1, kernel, step)[..., :nc, :].amax(-1)


def forced_and_future(query_block: torch.Tensor, n_blocks: int, init: int, local: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool `[Nq, n_blocks]` masks: forced (init blocks and the `local` blocks ending at the query's block,
    both limited to the past) and future (blocks after the query's block)."""
    b = torch.arange(n_blocks, device=query_block.device)[None, :]
    m = query_block[:, None]
    future = b > m
    forced = ((b < init) | ((b > m - local) & (b <= m))) & ~future
    return forced, future


def topk_blocks(block_scores: torch.Tensor, query_block: torch.Tensor, budget: Budget) -> torch.Tensor:
    """Forced blocks + the `topk` best other past blocks: scores `[..., Nq, nb]` -> ids `[..., Nq, K]`.

    Ids ascending, -1 padded; future blocks and blocks scored -inf are never returned.
    """
    nb = block_scores.shape[-1]
    forced, future = forced_and_future(query_block, nb, budget.init, budget.local)
    s = block_scores.float().masked_fill(future, NEG).masked_fill(forced, float("inf"))
    k = min(budget.total, nb)
    val, idx = s.topk(k, -1)
    idx = idx.masked_fill(val == NEG, nb)  # sort invalid slots last, then mark them -1
    idx = idx.sort(-1).values
    idx = idx.masked_fill(idx == nb, -1)
    if k < budget.total:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], budget.total - k), -1)], -1)
    return idx


def row_block_scores(q: torch.Tensor, ck: torch.Tensor, positions: torch.Tensor, n_blocks: int,
                     budget: Budget, scale: float | None = None) -> torch.Tensor:
    """Block scores of single query rows: q `[H, G, R, D]`, ck `[H, Nc, D]`, positions `[R]` -> `[H, R, nb]`."""
    s = group_scores(q, ck, positions, window=budget.window, stride=budget.stride, scale=scale)
    return pool_to_blocks(s, n_blocks, block=budget.block, window=budget.window, stride=budget.stride)


def select_rows(q: torch.Tensor, ck: torch.Tensor, positions: torch.Tensor, n_blocks: int,
                budget: Budget = Budget(), scale: float | None = None) -> torch.Tensor:
    """Per-row selection (what decode does at each step): q `[H, G, R, D]` -> ids `[H, R, K]`."""
    s = row_block_scores(q, ck, positions, n_blocks, budget, scale)
    return topk_blocks(s, positions // budget.block, budget)


def select_prefill(q: torch.Tensor, k: torch.Tensor, budget: Budget = Budget(), *, scale: float | None = None,
                   chunk: int = 1024) -> torch.Tensor:
    """Prefill form, one selection per query block: q `[Hq, N, D]`, k `[Hkv, N, D]` -> ids `[Hkv, M, K]`.

    A query block's compressed scores are the sum of its rows' group scores (each row sees only the
    compressed keys fully in its past), then pooled to blocks and selected. Rows are processed `chunk`
    at a time (a multiple of the block size) to bound memory at `[Hkv, G, chunk, Nc]`.
    """
    hq, n, d = q.shape
    hkv = k.shape[0]
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of k's {hkv} KV heads")
    ck = compress_keys(k, budget.window, budget.stride)
    m = math.ceil(n / budget.block)
    qg = q.reshape(hkv, hq // hkv, n, d)
    sums = []
    chunk = max(budget.block, chunk // budget.block * budget.block)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        pos = torch.arange(r0, r1, device=q.device)
        s = group_scores(qg[:, :, r0:r1], ck, pos, window=budget.window, stride=budget.stride, scale=scale)
        pad = (-(r1 - r0)) % budget.block
        s = torch.cat([s, s.new_zeros(hkv, pad, s.shape[-1])], 1)
        sums.append(s.reshape(hkv, -1, budget.block, s.shape[-1]).sum(2))
    per_block = torch.cat(sums, 1)  # [Hkv, M, Nc]
    scores = pool_to_blocks(per_block, m, block=budget.block, window=budget.window, stride=budget.stride)
    return topk_blocks(scores, torch.arange(m, device=q.device), budget)


def infllm_blocks(q: torch.Tensor, k: torch.Tensor, budget: Budget = Budget(), *,
                  scale: float | None = None) -> BlockSparse:
    """The prefill selection as a `BlockSparse` index over the *query* heads (each query head reads its KV
    group's blocks), so that `workbench.analysis.stats` and the kernels can use it: q `[Hq, N, D]`, k `[Hkv, N, D]`."""
    from workbench.patterns.block_sparse import BlockSparse

    ids = select_prefill(q, k, budget, scale=scale)
    return BlockSparse(ids.repeat_interleave(q.shape[0] // k.shape[0], 0), block=budget.block)


class CompressedKeys:
    """Compressed keys of one layer that grow token by token (decode); batch-first.

    keys `[B, H, Nc, D]` (float32), `n` = tokens appended so far. Keeps the last `window` raw keys so that
    each new complete window is averaged exactly as `compress_keys` would.
    """

    def __init__(self, batch: int, heads: int, head_dim: int, *, window: int = 32, stride: int = 16,
                 device: torch.device | str = "cpu") -> None:
        self.window, self.stride, self.n = window, stride, 0
        self.keys = torch.zeros(batch, heads, 0, head_dim, device=device)
        self._tail = torch.zeros(batch, heads, 0, head_dim, device=device)

    @classmethod
    def from_keys(cls, k: torch.Tensor, *, window: int = 32, stride: int = 16) -> CompressedKeys:
        """Start from a prefilled cache: k `[B, H, N, D]`."""
        ck = cls(k.shape[0], k.shape[1], k.shape[3], window=window, stride=stride, device=k.device)
        ck.append(k)
        return ck

    def append(self, k: torch.Tensor) -> CompressedKeys:
        """Add new keys `[B, H, T, D]` (positions n .. n+T-1) and compress every window they complete."""
        start = self.n - self._tail.shape[2]  # token position of tail[0]
        raw = torch.cat([self._tail, k.float()], 2)
        self.n += k.shape[2]
        done = self.keys.shape[2]
        new = n_compressed(self.n, self.window, self.stride) - done
        if new > 0:
            first = done * self.stride - start
            span = raw[:, :, first:first + (new - 1) * self.stride + self.window]
            self.keys = torch.cat([self.keys, compress_keys(span, self.window, self.stride)], 2)
        keep_from = max(0, (done + max(new, 0)) * self.stride - start)  # the next window starts there
        self._tail = raw[:, :, keep_from:]
        return self


def select_blocks(q_group: torch.Tensor, ck: CompressedKeys, budget: Budget = Budget(),
                  scale: float | None = None) -> torch.Tensor:
    """Decode form for the newest token (position ck.n - 1, already appended to `ck`).

    q_group `[B, H, G, D]` (the G query heads of each KV head; G = 1 for a Forecast head) -> ids `[B, H, K]`.
    """
    b, h, g, d = q_group.shape
    if ck.keys.shape[:2] != (b, h) or ck.keys.shape[-1] != d:
        raise ValueError(f"q_group {tuple(q_group.shape)} does not match compressed keys "
                         f"{tuple(ck.keys.shape)}: batch, heads and head_dim must agree")
    pos = torch.tensor([ck.n - 1], device=q_group.device)
    nb = math.ceil(ck.n / budget.block)
    s = row_block_scores(q_group[:, :, :, None, :], ck.keys, pos, nb, budget, scale)  # [B, H, 1, nb]
    return topk_blocks(s, pos // budget.block, budget)[:, :, 0]
