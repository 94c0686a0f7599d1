"""Forecast heads: partition KL, fine teacher, supervised set, checkpoints, training, report."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from workbench.core.model import ModelError
from workbench.decode.forecast.heads import (
    ForecastHeads,
    candidate_positions,
    partition,
    partition_kl,
    partition_kl_logits,
    rope_tables,
    teacher_keep,
    teacher_scores,
)
from workbench.patterns.infllm import Budget, compress_keys, group_scores

SMALL = Budget(init=1, local=1, topk=2)  # 4 of 8 blocks at 512 tokens


def test_partition_kl_seed_example():
    teacher = torch.tensor([0.40, 0.30, 0.20, 0.10])
    student = torch.tensor([0.35, 0.25, 0.15, 0.25])
    keep = torch.tensor([True, True, False, False])  # the teacher's top-2
    torch.testing.assert_close(partition(teacher, keep), torch.tensor([0.40, 0.30, 0, 0, 0.30]))
    torch.testing.assert_close(partition(student, keep), torch.tensor([0.35, 0.25, 0, 0, 0.40]))
    expected = 0.4 * math.log(0.4 / 0.35) + 0.3 * math.log(0.3 / 0.25) + 0.3 * math.log(0.3 / 0.4)
    assert partition_kl(teacher, student, keep).item() == pytest.approx(expected, rel=1e-5)
    # keeping only the top-2 and renormalising would hide the student's excess mass outside them
    assert partition_kl(teacher[:2], student[:2], keep[:2]).item() != pytest.approx(expected, rel=1e-2)


def test_partition_kl_from_logits_matches_probabilities_and_renormalises():
    torch.manual_seed(0)
    teacher = torch.rand(4, 20) * 3  # a sum of G softmaxes: not normalised
    logits = torch.randn(4, 20)
    sup = torch.rand(4, 20) > 0.3
    keep = (torch.rand(4, 20) > 0.6) & sup
    student = torch.softmax(logits.masked_fill(~sup, float("-inf")), -1)
    torch.testing.assert_close(partition_kl_logits(teacher, logits, keep, sup),
                               partition_kl(teacher * sup, student, keep))
    assert (partition_kl_logits(teacher, logits, keep, sup) >= -1e-6).all()
    same = partition_kl_logits(teacher, (teacher * sup).clamp_min(1e-30).log(), keep, sup)
    torch.testing.assert_close(same, torch.zeros(4), atol=1e-5, rtol=0)


def test_fine_teacher_equals_brute_force():
    torch.manual_seed(1)
    n, d = 160, 8
    q, k = torch.randn(4, 5, d), torch.randn(2, n, d)  # 4 query heads, 2 KV heads (G = 2)
    pos = torch.tensor([40, 63, 100, 130, 159])
    got = teacher_scores(q, k, pos, Budget())
    nc = (n - 32) // 16 + 1
    for h in range(2):
        for r, p in enumerate(pos.tolist()):
            fine_keys = [(k[h, f] + k[h, f + 1]) / 2 for f in range(n - 1) if f + 1 <= p]
            fine = sum(torch.softmax(torch.stack([q[2 * h + g, r] @ fk for fk in fine_keys]) / math.sqrt(d), -1)
                       for g in range(2))
            for j in range(nc):
                inside = [fine[f] for f in range(len(fine_keys)) if 16 * j <= f and f + 2 <= 16 * j + 32]
                want = max(inside) if 16 * j + 31 <= p else 0.0  # only fully-past windows are scored
                assert got[h, r, j].item() == pytest.approx(float(want), abs=1e-6)


def test_coarse_teacher_is_the_same_layer_grid():
    torch.manual_seed(2)
    q, k, pos = torch.randn(6, 4, 8), torch.randn(3, 200, 8), torch.tensor([50, 90, 150, 199])
    coarse = teacher_scores(q, k, pos, Budget(), fine=(32, 16))
    torch.testing.assert_close(coarse, group_scores(q.reshape(3, 2, 4, 8), compress_keys(k), pos))


def test_supervised_set_excludes_future_forced_and_unseen_positions():
    pos = torch.tensor([200, 511])
    sup = candidate_positions(pos, (512 - 32) // 16 + 1, SMALL)
    for r, p in enumerate(pos.tolist()):
        m = p // 64
        cand = {b for b in range(m + 1) if b >= SMALL.init and b <= m - SMALL.local}
        for j in range(sup.shape[1]):
            blocks = {b for b in range(8) if 16 * j < 64 * (b + 1) and 16 * j + 32 > 64 * b}
            assert sup[r, j].item() == (16 * j + 31 <= p and bool(blocks & cand))


def test_teacher_keep_marks_positions_of_the_top_blocks_only():
    torch.manual_seed(3)
    pos = torch.tensor([511])
    nc = 31
    sup = candidate_positions(pos, nc, SMALL)
    teacher = torch.rand(1, 1, nc)
    teacher[0, 0, 4 * 3] = 10.0  # block 3
    teacher[0, 0, 4 * 5 + 1] = 9.0  # block 5
    keep = teacher_keep(teacher, pos, sup, SMALL)[0, 0]
    blocks = {b for j in keep.nonzero().flatten().tolist()
              for b in range(8) if 16 * j < 64 * (b + 1) and 16 * j + 32 > 64 * b}
    assert blocks >= {3, 5} and keep.sum() >= 8
    assert not (keep & ~sup[0]).any()


def test_forecast_blocks_decode_form_is_causal_and_matches_the_row_form():
    from workbench.core.model import ModelShape
    from workbench.patterns.infllm import CompressedKeys, select_rows

    shape = ModelShape("tiny", "llama", 3, 4, 2, 8, 16, "default", 1e4, 4096, "f" * 16)
    torch.manual_seed(6)
    heads = ForecastHeads(shape)
    n, b = 900, 2
    k = torch.randn(b, 2, n, 8)
    ck = CompressedKeys.from_keys(k)
    x = torch.randn(b, 16)
    angle = torch.rand(8)
    cos, sin = angle.cos(), angle.sin()
    ids = heads.forecast_blocks(2, x, cos, sin, ck, Budget())
    assert ids.shape == (b, 2, Budget().total)
    assert ids.max() <= (n - 1) // 64 and ((ids >= 0).sum(-1) == Budget().total).all()
    for i in range(b):
        f = heads.query(2, x[i, None], cos[None], sin[None])  # [Hkv, 1, D]
        rows = select_rows(f[:, None], compress_keys(k[i]), torch.tensor([n - 1]), math.ceil(n / 64), Budget())
        assert torch.equal(ids[i], rows[:, 0])


@pytest.mark.model
def test_forecast_query_uses_the_models_rope(embedded, capture_256):
    model, _, shape = embedded
    heads = ForecastHeads.from_queries(model, shape)
    cos, sin = rope_tables(model, torch.arange(capture_256.n))
    for t in (0, 7):  # from_queries' head t applied to layer t's own input = the group mean of its queries
        f = heads.query(t, capture_256.hidden[t], cos, sin)
        want = capture_256.q[t].reshape(shape.n_kv_heads, shape.group, capture_256.n, -1).mean(1)
        torch.testing.assert_close(f, want, atol=1e-4, rtol=1e-4)


def test_checkpoint_round_trip_and_validation(embedded, tmp_path):
    _, _, shape = embedded
    torch.manual_seed(4)
    heads = ForecastHeads(shape, meta={"steps": 3, "loss": [0.5, 0.25]})
    path = heads.save(tmp_path / "h.safetensors")
    back = ForecastHeads.load(path, shape)
    w = heads.weight.detach()
    err = (back.weight - w).abs().amax(-1) / w.abs().amax(-1)
    assert 0 < err.max() <= 0.5 / 127 + 1e-3  # INT8 rows: at most half a step of each row's scale
    assert back.meta == heads.meta
    assert torch.equal(ForecastHeads.load(back.save(tmp_path / "again.safetensors"), shape).weight, back.weight)
    assert path.stat().st_size < w.numel() * 1.1  # about a byte per weight
    from safetensors.torch import save_file
    old = tmp_path / "fp16.safetensors"  # files of the earlier format (fp16 weight) still load
    save_file({"weight": w.half().contiguous()}, str(old), metadata={"format": "workbench.decode.forecast.heads/1",
                                                                    "shape": json.dumps(shape.to_dict())})
    assert torch.equal(ForecastHeads.load(old, shape).weight, w.half().float())
    with pytest.raises(ModelError, match="n_layers"):
        ForecastHeads.load(path, replace(shape, n_layers=12))
    with pytest.raises(ModelError, match="head_dim"):
        ForecastHeads.load(path, replace(shape, head_dim=32, n_heads=18))
    with pytest.raises(ModelError, match="weights"):
        ForecastHeads.load(path, replace(shape, fingerprint="0" * 16))
    assert ForecastHeads.load(path, replace(shape, fingerprint="0" * 16), check_fingerprint=False) is not None
    with pytest.raises(ModelError, match="shape"):
        ForecastHeads(shape, torch.zeros(3, 4, 5))
    with pytest.raises(FileNotFoundError, match="forecast train"):
        ForecastHeads.load(tmp_path / "missing.safetensors", shape)
    other = tmp_path / "other.safetensors"
    save_file({"weight": torch.zeros(2)}, str(other))
    with pytest.raises(ModelError, match="not a forecast-heads file"):
        ForecastHeads.load(other, shape)


@pytest.fixture(scope="module")
def small_prompts(embedded):
    from workbench.decode.forecast.train import make_prompts

    model, tok, shape = embedded
    specs = [("code", 512, 1), ("passkey", 512, 2), ("multikey", 512, 3)]
    return make_prompts(model, tok, shape, specs, SMALL, rows=64, fine=(2, 1), progress=False)


@pytest.mark.model
def test_training_lowers_held_out_kl(embedded, small_prompts):
    from workbench.decode.forecast.train import TrainConfig, train

    _, _, shape = embedded
    torch.manual_seed(5)
    heads = ForecastHeads(shape)  # random start
    hist = train(heads, small_prompts[:2], small_prompts[2:], TrainConfig(steps=25, lr=5e-3, batch_rows=64),
                 progress=False)
    before, after = torch.tensor(hist["held_out_kl_before"]), torch.tensor(hist["held_out_kl_after"])
    assert after.mean() < 0.8 * before.mean()
    assert (after < before).float().mean() > 0.8  # most target layers improve, not just the average
    assert len(hist["loss_per_step"]) == 25


@pytest.mark.model
def test_cli_train_and_report(tmp_path):
    """Both verbs end to end at 512 tokens; the report's numbers must order sensibly."""
    import json

    from workbench.cli import main

    ckpt = tmp_path / "heads.safetensors"
    assert main(["forecast", "train", "--tasks", "code", "--lengths", "512", "--held-out", "0", "--rows", "32",
                 "--steps", "3", "--local", "1", "--topk", "2", "--out", str(ckpt)]) == 0
    out = tmp_path / "rep"
    assert main(["forecast", "report", "--heads", str(ckpt), "--tasks", "passkey", "--length", "512",
                 "--rows", "32", "--steps", "4", "--local", "1", "--topk", "2", "--shallow", "3", "--calib", "1",
                 "--out", str(out / "forecast.json")]) == 0
    rep = json.loads((out / "forecast.json").read_text())
    assert rep["heads"]["steps"] == 3 and "<table>" in (out / "forecast.html").read_text()
    L = rep["model"]["n_layers"]
    assert len(rep["layers"]) == L
    for row in rep["layers"]:
        rec = {k: v for k, v in row["recall"].items() if v is not None}
        assert all(0.0 <= v <= 1.0 for v in rec.values())
        assert all(rec["oracle"] >= v - 1e-6 for v in rec.values())  # the exact top-k holds the most mass
        assert row["iou_teacher"]["teacher"] == 1.0
        assert (row["recall"]["proxy"] is None) == (row["target"] == 0)
    picked = rep["reuse"]["picked_layer"]
    assert picked in range(0, 3)
    assert [r["target"] for r in rep["layers"] if r["recall"]["reuse"] is not None] == list(range(picked + 1, L))
    m = torch.tensor(rep["iou_matrix"])
    assert torch.allclose(m.diagonal(), torch.ones(L)) and torch.allclose(m, m.T, atol=1e-3)
    for c in rep["churn"].values():
        assert 0.0 <= c["churn_ema"] <= 1.0 and 0.0 <= c["churn"] <= 1.0
    assert main(["forecast", "train", "--lengths", "300", "--out", str(ckpt)]) == 2  # too short: clear error
