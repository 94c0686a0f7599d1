"""InfLLM-V2 block selection: compression, pooling, forcing, causality, decode vs row form."""
from __future__ import annotations

import math

import pytest
import torch

from workbench.patterns.infllm import (
    Budget,
    CompressedKeys,
    compress_keys,
    fine_to_coarse,
    group_scores,
    pool_to_blocks,
    select_blocks,
    select_prefill,
    select_rows,
    topk_blocks,
)


def test_compress_keys_is_window_mean():
    k = torch.randn(2, 100, 4)
    ck = compress_keys(k, 32, 16)
    assert ck.shape == (2, (100 - 32) // 16 + 1, 4)
    for j in range(ck.shape[1]):
        torch.testing.assert_close(ck[:, j], k[:, 16 * j:16 * j + 32].mean(1))


def test_compressed_keys_grow_token_by_token_like_a_full_compression():
    torch.manual_seed(0)
    k = torch.randn(2, 3, 333, 8)
    ck = CompressedKeys(2, 3, 8)
    for size in (1, 1, 30, 2, 17, 64, 100, 118):
        ck.append(k[:, :, ck.n:ck.n + size])
    assert ck.n == 333
    torch.testing.assert_close(ck.keys, compress_keys(k))
    torch.testing.assert_close(CompressedKeys.from_keys(k).keys, compress_keys(k))


def _brute_pool(scores, n_blocks, block, window, stride):
    out = torch.full((*scores.shape[:-1], n_blocks), float("-inf"))
    for b in range(n_blocks):
        for j in range(scores.shape[-1]):
            if j * stride < (b + 1) * block and j * stride + window > b * block:  # spans overlap
                out[..., b] = torch.maximum(out[..., b], scores[..., j])
    return out


@pytest.mark.parametrize("nc,n_blocks", [(17, 5), (3, 1), (30, 8), (1, 3)])
def test_block_pooling_matches_brute_force_and_maxpool_5_4_1(nc, n_blocks):
    s = torch.randn(3, nc)
    got = pool_to_blocks(s, n_blocks)
    torch.testing.assert_close(got, _brute_pool(s, n_blocks, 64, 32, 16))
    if nc >= 3:  # max_pool1d needs at least one full window
        mp = torch.nn.functional.max_pool1d(s[None], kernel_size=5, stride=4, padding=1)[0]
        m = min(mp.shape[-1], n_blocks)
        torch.testing.assert_close(got[:, :m], mp[:, :m])


def test_fine_to_coarse_matches_brute_force():
    fine = torch.randn(2, 5, 199)  # fine grid 2/1 over 200 tokens
    nc = (200 - 32) // 16 + 1
    got = fine_to_coarse(fine, nc)
    for j in range(nc):
        inside = [f for f in range(199) if f >= 16 * j and f + 2 <= 16 * j + 32]
        torch.testing.assert_close(got[..., j], fine[..., inside].amax(-1))


def test_group_scores_sum_softmaxes_over_the_group_and_respect_causality():
    torch.manual_seed(1)
    q, ck = torch.randn(2, 3, 6, 8), torch.randn(2, 10, 8)
    pos = torch.tensor([0, 31, 47, 48, 100, 300])
    s = group_scores(q, ck, pos)
    seen = torch.tensor([sum(1 for j in range(10) if 16 * j + 31 <= p) for p in pos.tolist()])
    assert torch.equal((s[0] > 0).sum(-1), seen)  # only fully-past windows get mass
    torch.testing.assert_close(s.sum(-1), torch.where(seen > 0, 3.0, 0.0).expand(2, -1))
    h, r = 1, 4
    ref = sum(torch.softmax(q[h, g, r] @ ck[h, :seen[r]].T / math.sqrt(8), -1) for g in range(3))
    torch.testing.assert_close(s[h, r, :seen[r]], ref)


def _check_ids(ids, query_block, budget):
    """Ascending, -1 only at the end, no duplicates, no future block, forced blocks present."""
    k = budget.total
    assert ids.shape[-1] == k
    for row, m in zip(ids.reshape(-1, k).tolist(), query_block):
        valid = [b for b in row if b >= 0]
        assert row == valid + [-1] * (k - len(valid))
        assert valid == sorted(set(valid))
        assert all(b <= m for b in valid), f"future block in {row} for query block {m}"
        forced = set(range(min(budget.init, m + 1))) | set(range(max(0, m - budget.local + 1), m + 1))
        assert forced <= set(valid)
        assert len(valid) == min(k, m + 1)


def test_prefill_selection_never_picks_future_blocks():
    torch.manual_seed(2)
    n, budget = 700, Budget(init=1, local=2, topk=3)
    q, k = torch.randn(6, n, 16), torch.randn(2, n, 16)
    ids = select_prefill(q, k, budget, chunk=128)
    m = math.ceil(n / 64)
    assert ids.shape == (2, m, budget.total)
    _check_ids(ids, [b for _ in range(2) for b in range(m)], budget)


def test_infllm_blocks_is_a_causal_block_sparse_index_over_query_heads():
    from workbench.patterns import BlockSparse
    from workbench.patterns.infllm import infllm_blocks

    torch.manual_seed(5)
    n = 400
    q, k = torch.randn(6, n, 16), torch.randn(2, n, 16)
    index = infllm_blocks(q, k, Budget(init=1, local=1, topk=1))
    assert isinstance(index, BlockSparse) and index.n_heads == 6
    mask = index.to_mask(n)
    assert not mask.triu(1).any()  # causal
    assert mask[:, torch.arange(n), torch.arange(n)].all()  # the diagonal is always read
    assert torch.equal(mask[0], mask[2]) and torch.equal(mask[3], mask[5])  # one selection per GQA group
    assert mask[:, 64:, :64].all(-1).all()  # the init block is forced for every later row


def test_prefill_selection_finds_a_planted_block():
    torch.manual_seed(3)
    n, d = 1024, 16
    k = torch.randn(1, n, d) * 0.1
    q = torch.randn(2, n, d) * 0.1
    k[0, 320:384] += 3 * torch.ones(d)  # block 5 matches every query
    q[:, 768:] += torch.ones(d)
    ids = select_prefill(q, k, Budget(init=1, local=1, topk=1))
    assert ids[0, 12:].tolist() == [[0, 5, m] for m in range(12, 16)]


def test_decode_selection_equals_row_selection_and_stays_causal():
    torch.manual_seed(4)
    n, budget = 999, Budget()
    q, k = torch.randn(2, 3, 3, 16), torch.randn(2, 3, n, 16)  # [B, Hkv, G, D], [B, Hkv, N, D]
    ck = CompressedKeys.from_keys(k)
    ids = select_blocks(q, ck, budget)
    assert ids.shape == (2, 3, budget.total)
    for b in range(2):
        rows = select_rows(q[b, :, :, None], compress_keys(k[b]), torch.tensor([n - 1]), math.ceil(n / 64), budget)
        assert torch.equal(ids[b], rows[:, 0])
    _check_ids(ids, [(n - 1) // 64] * 6, budget)


def test_topk_marks_unscorable_blocks_minus_one():
    scores = torch.tensor([[[0.1, float("-inf"), 0.5, 0.2, 9.0]]])  # block 4 is in the future of block 3
    ids = topk_blocks(scores, torch.tensor([3]), Budget(init=1, local=1, topk=3))
    assert ids.tolist() == [[[0, 2, 3, -1, -1]]]


@pytest.mark.parametrize("kw,field", [({"topk": -1}, "topk"), ({"block": 0}, "block"),
                                      ({"window": 128}, "window"), ({"stride": 24}, "stride")])
def test_budget_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        Budget(**kw)


def test_decode_rejects_mismatched_compressed_keys():
    ck = CompressedKeys.from_keys(torch.randn(1, 2, 100, 8))
    with pytest.raises(ValueError, match="heads"):
        select_blocks(torch.randn(1, 3, 1, 8), ck)


@pytest.mark.parametrize("tokens, expected", [(8192, (1, 2, 8)), (704, (1, 2, 8)), (616, (1, 2, 7)), (130, (1, 2, 0)),
                                              (64, (1, 0, 0))])
def test_fitted_budget_cuts_topk_then_local_to_the_blocks_a_sequence_has(tokens, expected):
    b = Budget.fitted(tokens)
    assert (b.init, b.local, b.topk) == expected
    assert b.total <= math.ceil(tokens / b.block)
    assert Budget.fitted(2048, topk=100, block=32).topk == 64 - 3  # other sizes are cut the same way
