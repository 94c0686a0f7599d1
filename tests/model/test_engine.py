"""Offloaded decode engine on the CPU: block map, compressed keys, selection, capacity refusals, and
losslessness on the embedded model (offload modes give exactly sparse-resident's tokens); Gemma-3's adapter;
the Triton path (TRITON_INTERPRET=1 on the CPU) against the PyTorch reference path."""
from __future__ import annotations

import os

import pytest
import torch
from workbench_kernels.gather_ref import gather_blocks_ref

from workbench.decode.engine import BlockCache, BlockStore, DecodeEngine, EngineConfig, StoreCapacityError, StoreSpec
from workbench.decode.engine.reuse import ImposedReuse, ReuseMeter
from workbench.decode.engine.select import CompressedKeyBuffer, select_decode
from workbench.patterns.infllm import Budget, CompressedKeys, compress_keys, select_blocks

GiB = 1024 ** 3


# tests/conftest.py turns the interpreter on where there is no GPU; a run that exported TRITON_INTERPRET=0 skips these
NEEDS_TRITON = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="Triton on the CPU needs TRITON_INTERPRET=1 before triton is imported")


def test_block_cache_keeps_selected_blocks_and_copies_only_misses():
    g = torch.Generator().manual_seed(0)
    B, H, NB, K, C, E = 2, 3, 40, 6, 8, 4
    host = torch.randn(B * H * NB, E, generator=g)
    cache = BlockCache(B, H, C, NB, 1, torch.float32, "cpu")
    kpool = cache.k.view(B * H * C, -1)[:, :E]
    previous = None
    for _ in range(12):
        sel = torch.stack([torch.randperm(NB, generator=g)[:K].sort().values for _ in range(B * H)]).view(B, H, K)
        sel[0, 0, -2:] = -1  # padded entries
        before = cache.slot_of.clone()
        hits0, misses0 = int(cache.hits), int(cache.misses)
        plan = cache.plan(sel)
        n = int((plan.dst >= 0).sum())  # entries to copy (dst -1: a hit or padding)
        valid = sel >= 0
        was_cached = before.gather(2, sel.clamp(min=0)) >= 0
        assert n == int((valid & ~was_cached).sum()) == int(cache.misses) - misses0
        assert int(cache.hits) - hits0 == int((valid & was_cached).sum())
        # hits keep their slot
        assert torch.equal(plan.slots[valid & was_cached] % C, before.gather(2, sel.clamp(min=0))[valid & was_cached])
        # distinct slots per (sequence, head), inside its own row
        for b in range(B):
            for h in range(H):
                s = plan.slots[b, h][valid[b, h]]
                assert s.unique().numel() == s.numel() and ((s // C) == b * H + h).all()
        dst = torch.zeros(B * H * C, E)
        dst[:] = kpool
        gather_blocks_ref(host, host, dst, dst.clone(), plan.src, plan.dst, plan.count)
        kpool = dst
        want = host[(sel.clamp(min=0) + torch.arange(B * H).view(B, H, 1) * NB)[valid]]
        assert torch.equal(kpool[plan.slots[valid]], want)  # every selected block is in its slot
        previous = sel
    assert previous is not None and int(cache.hits) > 0


def test_compressed_key_buffer_matches_compress_keys_with_different_lengths():
    g = torch.Generator().manual_seed(1)
    budget = Budget()
    k = torch.randn(2, 3, 300, 8, generator=g)
    buf = CompressedKeyBuffer(2, 3, 8, 400, budget, "cpu")
    start = [100, 37]
    for b in range(2):
        buf.fill(b, k[b, :, :start[b]])
    pos = torch.tensor(start)
    for _ in range(150):
        buf.append(k[torch.arange(2), :, pos], pos)
        pos = pos + 1
    for b in range(2):
        want = compress_keys(k[b, :, :int(pos[b])])
        torch.testing.assert_close(buf.keys[b, :, :want.shape[1]], want, rtol=1e-5, atol=1e-6)


def test_select_decode_equals_infllm_select_blocks():
    g = torch.Generator().manual_seed(2)
    budget = Budget(init=1, local=2, topk=3)
    n, H, G, D = 700, 2, 3, 16
    k = torch.randn(1, H, n, D, generator=g)
    q = torch.randn(1, H, G, D, generator=g)
    ck = CompressedKeys.from_keys(k)
    buf = CompressedKeyBuffer(1, H, D, 1024, budget, "cpu")
    buf.fill(0, k[0])
    pos = torch.tensor([n - 1])
    got = select_decode(q, buf, pos, pos, 16, budget)
    assert torch.equal(got, select_blocks(q, ck, budget))


def test_store_refuses_before_allocating():
    huge = StoreSpec(layers=32, batch=64, kv_heads=8, n_blocks=2048, head_dim=128, dtype=torch.bfloat16)  # 2 TiB
    with pytest.raises(StoreCapacityError, match=r"reduce the batch \(--batch\) or the prompt length \(--length\)"):
        BlockStore(huge)
    small = StoreSpec(layers=2, batch=1, kv_heads=1, n_blocks=4, head_dim=8, dtype=torch.float32)
    with pytest.raises(StoreCapacityError, match="GiB of pinned host memory"):
        BlockStore(small, limit_bytes=small.nbytes - 1)
    store = BlockStore(small, limit_bytes=small.nbytes)
    assert store.view(1, 1, 4)[0].shape == (1, 1, 4, 64, 8)
    with pytest.raises(StoreCapacityError, match="does not fit"):
        store.view(0, 2, 4)


def test_imposed_reuse_gives_the_requested_rate():
    budget = Budget(init=1, local=2, topk=20)
    nb = 200
    hook, meter = ImposedReuse(budget, 0.75, nb), ReuseMeter(budget, nb)
    pos = torch.tensor([150 * 64, 120 * 64 + 5])
    for _ in range(20):
        sel = hook(3, torch.zeros(2, 4, budget.total, dtype=torch.long), pos)
        assert ((sel >= 0).sum(-1) == budget.total).all() and (sel.diff(dim=-1) > 0).all()  # ascending, no repeats
        assert (sel.amax(-1) == (pos // 64).view(2, 1)).all()  # the current block, nothing past it
        meter(3, sel, pos)
        pos = pos + 1
    assert abs(meter.rate - 0.75) < 0.03


# ----------------------------------------------------------------------------- the embedded model

BUDGET = Budget(init=1, local=2, topk=5)
STEPS = 64


@pytest.fixture(scope="module")
def prompts(embedded, one_thread):
    from workbench.core.corpus import make_sample
    from workbench.decode.engine.llama import LlamaLayers

    model, tok, _ = embedded
    ids = [make_sample("passkey", tok, 1100, seed=0).input_ids, make_sample("vartrack", tok, 900, seed=1).input_ids]
    lm = LlamaLayers(model)
    return ids, [lm.prefill(p) for p in ids]


def _decode(model, prompts, mode, selector="same-layer", **kw):
    ids, done = prompts
    cap = max(p.numel() for p in ids) + STEPS
    eng = DecodeEngine(model, EngineConfig(mode=mode, budget=BUDGET, selector=selector, **kw), batch=2, max_tokens=cap)
    first = eng.prefill(ids, STEPS, prefilled=done)
    tokens, _, stats = eng.run(first, STEPS, progress=False)
    return tokens, stats


@pytest.mark.model
def test_offload_modes_are_lossless(embedded, prompts):
    model = embedded[0]
    resident, _ = _decode(model, prompts, "sparse-resident", "same-layer")
    sync, st = _decode(model, prompts, "sparse-offload-sync")
    assert torch.equal(sync, resident)
    assert 0 < st.hit_rate < 1 and st.bytes_moved_per_step > 0 and st.host_kv_bytes > 0
    resident_f, _ = _decode(model, prompts, "sparse-resident", "forecast")
    forecast, stf = _decode(model, prompts, "sparse-offload-forecast")
    no_prefetch, _ = _decode(model, prompts, "forecast-without-prefetch")
    assert torch.equal(forecast, resident_f) and torch.equal(no_prefetch, resident_f)
    assert 0 < stf.hit_rate < 1
    assert not torch.equal(resident_f, resident) or not torch.equal(sync, _decode(model, prompts, "dense-resident")[0])


@pytest.mark.model
def test_engine_refuses_context_beyond_capacity(embedded, prompts):
    ids, done = prompts
    eng = DecodeEngine(embedded[0], EngineConfig(mode="sparse-offload-sync", budget=BUDGET), batch=2, max_tokens=1100)
    before = [t.clone() for t in eng.store.k]
    with pytest.raises(StoreCapacityError, match="exceeds the engine's capacity"):
        eng.prefill(ids, STEPS, prefilled=done)
    # the store is torch.empty (may hold NaN garbage): compare bits, not values
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, eng.store.k))
    assert int(eng.positions.max()) == 0
    with pytest.raises(StoreCapacityError, match="model's 8192 positions"):
        DecodeEngine(embedded[0], EngineConfig(mode="sparse-offload-sync"), batch=1, max_tokens=9000)
    with pytest.raises(StoreCapacityError, match="pinned host memory"):
        DecodeEngine(embedded[0], EngineConfig(mode="sparse-offload-sync"), batch=64, max_tokens=8192,
                     host_limit_bytes=GiB)


@pytest.mark.model
def test_decode_cli_prints_summary_and_writes_json(embedded, one_thread, tmp_path, capsys):
    import json

    from workbench.cli import main

    out = tmp_path / "decode.json"
    assert main(["decode", "--mode", "sparse-offload-sync", "--batch", "2", "--length", "300", "--steps", "4",
                 "--budget", "1,1,2", "--store-dtype", "int8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tok/s" in text and "sparse-offload-sync" in text and "int8" in text
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert run["steps"] == 4 and run["bytes_moved_per_step"] > 0 and run["hit_rate"] is not None
    assert result["store_dtype"] == run["store_dtype"] == "int8"
    assert main(["decode", "--budget", "1,2"]) == 2
    assert "--budget" in capsys.readouterr().err


def test_decode_cli_all_modes_goes_through_compare_modes(embedded, one_thread, tmp_path, capsys):
    import json

    from workbench.cli import main
    from workbench.decode.compare import ALL_MODES

    out = tmp_path / "all.json"
    assert main(["decode", "--mode", "all", "--length", "200", "--steps", "3", "--budget", "1,1,1", "--quality",
                 "--measure-reuse", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sparse-offload-forecast == sparse-resident/forecast: yes" in text and "top-1 agreement" in text
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["runs"]] == list(ALL_MODES)
    assert all(r["steps"] == 3 and len(r["greedy_tokens"]) == 4 for r in result["runs"])
    assert {r["mode"]: r["selector"] for r in result["runs"]}["sparse-resident/forecast"] == "forecast"
    assert all(v for v in result["lossless"].values()) and len(result["lossless"]) == 3
    assert all((r["dynamic_reuse"] is None) == (r["mode"] == "dense-resident") for r in result["runs"])
    q = result["quality_vs_dense"]
    assert set(q) == {"same-layer", "forecast"} and all(0 <= v["top1_agreement_teacher_forced"] <= 1 for v in q.values())
    assert all(v["free_running_tokens_equal_to_dense"] is not None and v["kl_dense_to_sparse_mean"] >= -1e-6
               for v in q.values())


@pytest.mark.parametrize("argv,flag", [(["--mode", "fast"], "--mode"),
                                       (["--mode", "sparse-offload-sync", "--selector", "forecast"], "--selector"),
                                       (["--mode", "all", "--selector", "quest"], "--selector"),
                                       (["--steps", "0"], "--steps"),
                                       (["--measure-reuse", "--graph"], "--measure-reuse")])
def test_decode_cli_bad_flags_are_named(argv, flag, capsys):
    from workbench.cli import main

    assert main(["decode", *argv]) == 2
    assert flag in capsys.readouterr().err


# ----------------------------------------------------------------------------- lifecycle and hooks

def _tiny_llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).to(device).eval()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("store", ["model", "int8", "int8k-int4v"])
def test_fill_synthetic_gives_a_layer_the_same_kv_resident_or_in_the_host_store(store, device):
    """The benchmarks' lossless check compares modes on synthetic KV: an offloaded layer's host rows must hold
    the resident engine's numbers (through the store's codes when quantised), and the compressed keys too. (One
    generator over all draws held on the CPU, where draws are one stream, and not on CUDA, where each call's draws
    start at an offset that depends on the earlier calls' sizes: the H200 check read false for every store.)"""
    from workbench_kernels.gather_ref import dequantize_rows

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _tiny_llama(device)
    budget = Budget(init=1, local=1, topk=2)
    engines = {mode: DecodeEngine(model, EngineConfig(mode=mode, budget=budget, store_dtype=store), batch=2,
                                  max_tokens=700) for mode in ("sparse-resident", "sparse-offload-sync")}
    for eng in engines.values():
        eng.fill_synthetic([640, 512], seed=3)
    res, off = engines["sparse-resident"], engines["sparse-offload-sync"]
    assert set(off.slot) == {1, 2}
    for layer in off.slot:
        pool = res.kv[layer].view(2, 2, 2, -1, 64, 32)
        for part, host in enumerate(off.host[layer]):
            rows = host if off.quant is None else dequantize_rows(host, off.host_scales[layer][part], torch.float32)
            assert torch.equal(rows.to(pool.device, pool.dtype), pool[part])
    assert torch.equal(res.kv[0], off.kv[0])
    for layer in res.ck:
        assert torch.equal(res.ck[layer].keys, off.ck[layer].keys) and torch.equal(res.ck[layer].tail, off.ck[layer].tail)
    assert not torch.equal(res.kv[1][0], res.kv[2][0])  # layers draw their own numbers
    for eng in engines.values():
        eng.close()


def test_engine_close_with_and_gc_release_the_store():
    import gc
    import weakref

    model = _tiny_llama("cpu")
    cfg = EngineConfig(mode="sparse-offload-sync", budget=Budget(init=1, local=1, topk=2))
    eng = DecodeEngine(model, cfg, batch=1, max_tokens=512)
    store = eng.store
    eng.close()
    assert eng.closed and store.closed and store.k == [] and not eng.host
    eng.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        eng.step(torch.zeros(1, dtype=torch.long))
    with DecodeEngine(model, cfg, batch=1, max_tokens=512) as eng2:
        store2 = eng2.store
    assert store2.closed
    eng3 = DecodeEngine(model, cfg, batch=1, max_tokens=512)
    store3 = weakref.ref(eng3.store)
    del eng3
    gc.collect()
    assert store3() is None or store3().closed
    shared = BlockStore(StoreSpec(2, 1, 2, 8, 32, torch.float32))
    with DecodeEngine(model, cfg, batch=1, max_tokens=512, store=shared):
        pass
    assert not shared.closed  # a store the caller gave is the caller's to close
    shared.close()


def test_hooks_see_every_layer_and_copy():
    from workbench.decode.engine.hooks import StepHooks

    class Count(StepHooks):
        def __init__(self):
            self.seen = []

        def layer_start(self, layer):
            self.seen.append(("layer", layer))

        def copy_start(self, layer):
            self.seen.append(("copy", layer))

        def wait_start(self, layer):
            self.seen.append(("wait", layer))

    model = _tiny_llama("cpu")
    eng = DecodeEngine(model, EngineConfig(mode="sparse-offload-forecast", budget=Budget(init=1, local=1, topk=2)),
                       batch=1, max_tokens=512)
    eng.prefill([torch.arange(300) % 256], 4)
    hook = Count()
    eng.hooks.append(hook)
    eng.step(torch.zeros(1, dtype=torch.long))
    assert [x for x in hook.seen if x[0] == "layer"] == [("layer", i) for i in range(3)]
    assert {x[1] for x in hook.seen if x[0] == "copy"} == {1, 2} and {x[1] for x in hook.seen if x[0] == "wait"} == {1, 2}
    eng.close()


@pytest.mark.gpu
def test_five_engines_in_a_row_on_the_gpu():
    """Pinned memory must be unregistered when an engine goes away (cudaHostRegister error 712 otherwise)."""
    import gc

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _tiny_llama("cuda").to(torch.bfloat16)
    cfg = EngineConfig(mode="sparse-offload-forecast", budget=Budget(init=1, local=1, topk=2))
    for i in range(5):
        eng = DecodeEngine(model, cfg, batch=2, max_tokens=1024)
        eng.prefill([torch.arange(400) % 256, torch.arange(300) % 256], 8)
        eng.run(torch.zeros(2, dtype=torch.long, device="cuda"), 8, progress=False)
        if i % 2:
            eng.close()
        del eng
        gc.collect()


@pytest.mark.gpu
def test_offload_modes_lossless_on_the_gpu_triton_and_graphs():
    """Every store dtype, eager and CUDA graphs, on the fused Triton path; and that path against the module path
    with the reference kernels (bf16: the same tokens but at near-ties)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _tiny_llama("cuda").to(torch.bfloat16)
    budget = Budget(init=1, local=1, topk=3)
    prompts = [torch.arange(900) % 251, torch.arange(700) % 241]

    def decode(mode, selector, graph, store="model", kernels="auto"):
        cfg = EngineConfig(mode=mode, budget=budget, selector=selector, store_dtype=store, kernels=kernels)
        with DecodeEngine(model, cfg, batch=2, max_tokens=1024) as e:
            assert e.fused == (kernels == "auto")
            first = e.prefill(prompts, 24)
            return e.run(first, 24, graph=graph, progress=False)[0].cpu()

    for store in ("model", "fp8", "int8", "int4", "int8k-int4v"):
        for graph in (False, True):
            res = decode("sparse-resident", "same-layer", graph, store)
            assert torch.equal(decode("sparse-offload-sync", "same-layer", graph, store), res), (store, graph)
            fc = decode("sparse-resident", "forecast", graph, store)
            assert torch.equal(decode("sparse-offload-forecast", "forecast", graph, store), fc), (store, graph)
            assert torch.equal(decode("forecast-without-prefetch", "forecast", graph, store), fc), (store, graph)
    fused = decode("dense-resident", "same-layer", False)
    modules = decode("dense-resident", "same-layer", False, kernels="torch")
    assert (fused == modules).float().mean() > 0.8


@pytest.mark.model
def test_compare_modes_reports_every_mode_and_offload_is_lossless(embedded):
    from workbench.core.corpus import make_sample
    from workbench.decode.compare import ALL_MODES, compare_modes

    model, tok, _ = embedded
    prompt = make_sample("passkey", tok, 256, seed=0).input_ids
    seen = []
    out = compare_modes(model, prompt, modes=ALL_MODES, new_tokens=3, budget=Budget(init=1, local=1, topk=1),
                        progress=lambda what, done, total: seen.append((done, total)))
    assert list(out.runs) == list(ALL_MODES) and out.device.startswith("cpu reference path")
    assert seen[-1] == (len(ALL_MODES) * 2 + 1, len(ALL_MODES) * 2 + 1)  # 2 decode steps per mode, 1 prefill
    assert out.lossless == {"sparse-offload-sync": True, "sparse-offload-forecast": True,
                            "forecast-without-prefetch": True}
    for row in out.rows():
        assert row["tokens_per_s"] > 0 and len(row["greedy_tokens"]) == 3
        offload = row["reference"] is not None
        assert (row["bytes_moved_per_step"] > 0) == offload and (row["hit_rate"] is not None) == offload
    spans = out.runs["sparse-offload-forecast"].timeline
    assert {s["stream"] for s in spans} == {"compute", "copy"} and all(s["end"] >= s["start"] for s in spans)
    short = compare_modes(model, prompt, modes=["sparse-resident"], new_tokens=3, progress=False)  # no budget:
    # the default 1 + 2 + 8 blocks cut to the 5 blocks of 256 + 3 (+ 2 traced / spare) tokens
    assert (short.budget.init, short.budget.local, short.budget.topk) == (1, 2, 2)
    with pytest.raises(ValueError, match="only sparse-resident takes a selector"):
        compare_modes(model, prompt, modes=["sparse-offload-sync/forecast"], progress=False)
    with pytest.raises(ValueError, match="unknown"):
        compare_modes(model, prompt, modes=["fast"], progress=False)


def _bench_args(*argv: str):
    import argparse

    from workbench_benchmarks import decode as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return bench, p.parse_args(list(argv))


@pytest.mark.model
def test_decode_benchmark_embedded_part_runs_on_the_cpu(one_thread, tmp_path):
    import json

    out = tmp_path / "embedded.json"
    bench, args = _bench_args("--part", "embedded", "--device", "cpu", "--prompt", "128", "--new-tokens", "3",
                              "--budget", "1,1,1", "--store-dtypes", "model,int8", "--retrieval", "1", "--out", str(out))
    assert bench.run(args) == 0
    r = json.loads(out.read_text())
    assert r["summary"]["lossless"] == {"sparse-offload-sync": True, "sparse-offload-forecast": True,
                                        "forecast-without-prefetch": True, "sparse-offload-sync@int8": True,
                                        "sparse-offload-forecast@int8": True}
    hf = r["hf_generate"]["static_cache_eager"]
    assert hf["tokens_per_s"] > 0 and len(hf["greedy_tokens"]) == 3
    dense = next(x for x in r["engine"]["runs"] if x["mode"] == "dense-resident")
    assert hf["same_tokens_as_dense_resident"] == 1.0 and dense["greedy_tokens"] == hf["greedy_tokens"]
    assert r["divergence_from_hf"]["model_dtype"]["tokens_equal"]  # fp32 on the CPU: plain greedy, same tokens
    assert set(r["summary"]["quality_vs_dense"]) == {"same-layer", "forecast", "dense@int8", "same-layer@int8",
                                                     "forecast@int8"}
    assert set(r["retrieval"]["found"]) == {"dense-resident", "sparse-offload-forecast@model",
                                            "sparse-offload-forecast@int8"}


def test_decode_benchmark_modes_part_runs_on_the_cpu(one_thread, tmp_path):
    """The modes part's orchestration (a store per dtype, the lossless check, every job, the summary) on the tiny
    shape (an INT4 store: its fill and its traffic); its numbers only mean something on the GPU."""
    import json

    out = tmp_path / "modes.json"
    bench, args = _bench_args("--part", "modes", "--device", "cpu", "--tiny", "--layers", "3", "--reuse", "0.75",
                              "--plan", "4096:2", "--quick", "--store-dtypes", "model,int4", "--steps", "2",
                              "--warmup", "1", "--check", "--host-gib", "1", "--sweep-ctas", "8", "--variants", "4:0,1:4",
                              "--out", str(out))
    assert bench.run(args) == 0
    r = json.loads(out.read_text())
    assert all(all(v.values()) for check in r["lossless_gpu"].values() for v in (check["eager"],))
    runs = [x for x in r["runs"] if "tokens_per_s" in x]
    # resident (no hook, hook), dense; offload x 2 stores; sync and forecast at 8 CTAs x 2 stores; the second variant:
    # resident with the hook once, offload x 2 stores
    assert len(runs) == len(r["runs"]) == 3 + 3 + 3 + 2 * 2 + 1 + 3 + 3
    second = [x for x in runs if (x["gather_warps"], x["splits"]) == (1, 4)]
    assert len(second) == 7 and not any(x["ctas_main"] for x in second)
    runs = [x for x in runs if x not in second]
    offload = {(x["store_dtype"], x["ctas"], x["ctas_main"]) for x in runs if x["mode"] == "sparse-offload-forecast"}
    assert offload == {("model", 32, True), ("int4", 64, True), ("model", 8, False), ("int4", 8, False)}  # gather_ctas
    assert len(r["summary"]["ratios"]) == 2  # the main CTA count's forecast runs only
    ratios = {x["store_dtype"]: x for x in r["summary"]["ratios"]}
    assert set(ratios) == {"model", "int4"} and ratios["int4"]["mb_moved_per_step"] < ratios["model"]["mb_moved_per_step"] / 4
    assert all(x["forecast_over_sparse_resident_same_hook"] for x in ratios.values())


def test_decode_benchmark_capacity_part_runs_on_the_cpu(tmp_path):
    import json

    out = tmp_path / "capacity.json"
    bench, args = _bench_args("--part", "capacity", "--device", "cpu", "--tiny", "--capacity-layers", "2",
                              "--context", "1024", "--host-gib", "0.05", "--steps", "2", "--out", str(out))
    assert bench.run(args) == 0
    r = json.loads(out.read_text())
    dense = r["runs"]["dense-resident"]
    assert dense["largest_batch"] == dense["batch_bound_by_device"] >= 1 and dense["eager_tokens_per_s"] > 0
    assert "reduce the batch" in dense["next_batch_refused"]  # one more sequence is refused before allocating
    assert r["summary"]["offload_largest_batch"] >= 1 and r["summary"]["host_gib_per_seq_at_128k"] > 0


@pytest.mark.gpu
@pytest.mark.model
def test_compare_modes_on_the_gpu_graphs_lossless_with_the_embedded_model():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from workbench.core.corpus import make_sample
    from workbench.core.model import load_model
    from workbench.decode.compare import ALL_MODES, compare_modes

    model, tok, _ = load_model(device="cuda", dtype=torch.bfloat16)
    prompt = make_sample("passkey", tok, 2048, seed=0).input_ids.cuda()
    out = compare_modes(model, prompt, modes=ALL_MODES, new_tokens=16, progress=False)
    assert out.device.startswith("cuda:") and all(r.cuda_graph and not r.note for r in out.runs.values())
    assert out.lossless == {"sparse-offload-sync": True, "sparse-offload-forecast": True,
                            "forecast-without-prefetch": True}
    fc = out.runs["sparse-offload-forecast"]
    assert fc.hidden_fraction is not None and fc.copy_gbps is not None
    assert {s["stream"] for s in fc.timeline} == {"compute", "copy"}


def test_compare_modes_store_dtypes_are_lossless_move_fewer_bytes_and_report_their_cost():
    from workbench.decode.compare import compare_modes, reference_of

    model = _tiny_llama("cpu")
    prompt = torch.arange(400) % 251
    specs = ["dense-resident", "sparse-resident", "sparse-offload-sync", "sparse-resident@fp8", "sparse-offload-sync@fp8",
             "sparse-resident/forecast@int8", "sparse-offload-forecast@int8"]
    out = compare_modes(model, prompt, modes=specs, new_tokens=4, budget=Budget(init=1, local=1, topk=2), quality=True,
                        trace=False, progress=False)
    assert reference_of("sparse-offload-forecast@int8") == "sparse-resident/forecast@int8"
    assert out.lossless == {"sparse-offload-sync": True, "sparse-offload-sync@fp8": True,
                            "sparse-offload-forecast@int8": True}
    rows = {r["mode"]: r for r in out.rows()}
    assert rows["sparse-offload-sync@fp8"]["store_dtype"] == "fp8" and rows["sparse-resident"]["store_dtype"] == "model"
    # fp32 model: 4-byte values -> 1-byte codes plus a 4-byte scale per 32-element row (head_dim 32)
    ratio = rows["sparse-offload-sync@fp8"]["bytes_moved_per_step"] / rows["sparse-offload-sync"]["bytes_moved_per_step"]
    assert ratio == pytest.approx((32 + 4) / (4 * 32))
    q = out.quality
    assert set(q) == {"same-layer", "forecast", "dense@fp8", "same-layer@fp8", "forecast@fp8", "dense@int8",
                      "same-layer@int8", "forecast@int8"}
    assert all(v["kl_dense_to_sparse_mean"] > -1e-6 and 0 <= v["top1_agreement_teacher_forced"] <= 1 for v in q.values())
    assert q["dense@fp8"]["kl_dense_to_sparse_mean"] != 0  # the store's rounding reaches the logits
    assert q["same-layer@fp8"]["free_running_tokens_equal_to_dense"] is not None
    with pytest.raises(ValueError, match="store dtype 'fp16' is unknown"):
        compare_modes(model, prompt, modes=["sparse-resident@fp16"], progress=False)


def test_with_store_keeps_dense_exact_and_suffixes_every_other_mode():
    from workbench.decode.compare import DEFAULT_MODES, reference_of, with_store

    for store in ("int8", "int4", "int8k-int4v"):
        specs = with_store(DEFAULT_MODES, store)
        assert specs[0] == "dense-resident" and all(s.endswith(f"@{store}") for s in specs[1:])
        assert all(reference_of(s) in specs for s in specs if reference_of(s))  # every offload mode's reference runs too
    assert with_store(["sparse-resident@fp8", "sparse-offload-sync"], "model") == ["sparse-resident@fp8",
                                                                                  "sparse-offload-sync"]
    with pytest.raises(ValueError, match="store 'fp4' is unknown: choose one of model, fp8, int8, int4, int8k-int4v"):
        with_store(DEFAULT_MODES, "fp4")


# bytes of a K row + a V row at head_dim 32: INT4 16 code bytes + one float16 scale; INT8 32 codes + a float32 scale
@pytest.mark.parametrize(("store", "row_bytes"), [("int4", (16 + 2) * 2), ("int8k-int4v", (32 + 4) + (16 + 2))])
@NEEDS_TRITON
def test_int4_stores_are_lossless_on_the_reference_and_triton_paths_and_move_fewer_bytes(store, row_bytes):
    """store_dtype "int4" and "int8k-int4v" end to end on the CPU: each offload mode gives its @store resident
    reference's tokens on the reference path and on the fused Triton path (interpreter: UVA gather, rope_split's
    append), the two paths agree, a block moves 64 x (D / 2 code bytes + D / 32 float16 scales) per INT4 part and
    64 x (D codes + a float32 scale) per INT8 part, and the rounding reaches the logits (dense-resident@store is not
    dense-resident)."""
    model = _tiny_llama("cpu")  # fp32, head_dim 32: one group per row
    prompts = [torch.arange(400) % 251, torch.arange(300) % 241]
    runs = [("sparse-resident", "same-layer", store), ("sparse-offload-sync", "same-layer", store),
            ("sparse-resident", "forecast", store), ("sparse-offload-forecast", "forecast", store),
            ("dense-resident", "same-layer", store)]
    out, engines = {}, {}
    for kernels in ("torch", "triton"):
        for mode, selector, kind in runs + [("dense-resident", "same-layer", "model")] * (kernels == "torch"):
            cfg = EngineConfig(mode=mode, budget=Budget(init=1, local=1, topk=2), selector=selector, store_dtype=kind,
                               kernels=kernels)
            with DecodeEngine(model, cfg, batch=2, max_tokens=512) as eng:
                assert eng.fused == (kernels == "triton")
                first = eng.prefill(prompts, 6)
                out[(kernels, mode, selector, kind)] = eng.run(first, 6, keep_logits=True, progress=False)
                engines[(kernels, mode, kind)] = (eng.block_bytes, eng.host_kv_bytes)
    for k in ("torch", "triton"):
        for offload, selector in (("sparse-offload-sync", "same-layer"), ("sparse-offload-forecast", "forecast")):
            got, want = out[(k, offload, selector, store)], out[(k, "sparse-resident", selector, store)]
            assert torch.equal(got[0], want[0]), (k, offload)
            assert got[2].hit_rate is not None and got[2].hit_rate < 1  # blocks were gathered from the store
            assert got[2].store_dtype == store and got[2].bytes_moved_per_step * 6 % (64 * row_bytes) == 0
    for (kernels, *run), (tokens, logits, _) in out.items():
        if kernels == "torch" and ("triton", *run) in out:
            tri = out[("triton", *run)]
            assert torch.equal(tri[0], tokens), run
            close = ((tri[1] - logits).abs().amax(-1) < 1e-4).float()  # [B, steps]
            # the fused selection sums scores in another order: one near-tie block flips at a step of sequence 0
            # (with the model-dtype store too); a wrong gather or append would move every later step
            assert close.mean() > (0.99 if run[0] == "dense-resident" else 0.8), (run, close)
    block_bytes, host_bytes = engines[("torch", "sparse-offload-sync", store)]
    assert block_bytes == 64 * row_bytes  # fp32 model: 2 * 64 * 128 bytes in its own dtype
    assert host_bytes == 2 * 2 * 2 * 8 * 64 * row_bytes  # 2 offloaded layers, batch 2, 2 heads, 8 blocks
    dense4, dense = (out[("torch", "dense-resident", "same-layer", kind)][1] for kind in (store, "model"))
    assert (dense4 - dense).abs().max() > 1e-3


def test_int4_store_refuses_a_head_dim_it_cannot_group_before_allocating():
    from transformers import LlamaConfig, LlamaForCausalLM
    from workbench_kernels.gather_ref import INT4

    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, vocab_size=128)).eval()
    for mode in ("sparse-offload-sync", "sparse-resident"):
        with pytest.raises(ValueError, match=r"store_dtype 'int4' needs head_dim .* got head_dim=16: use store_dtype 'fp8'"):
            DecodeEngine(model, EngineConfig(mode=mode, budget=Budget(init=1, local=1, topk=2), store_dtype="int4"),
                         batch=1, max_tokens=512)
    spec = StoreSpec(layers=2, batch=1, kv_heads=2, n_blocks=4, head_dim=128, dtype=torch.bfloat16, quant=INT4)
    assert spec.nbytes == 2 * 2 * (2 * 4 * 64) * (64 + 4 * 2)  # K + V, layers, rows, (code bytes + fp16 scales)
    with BlockStore(spec, pinned=False) as store:
        assert store.view(1, 1, 4)[0].shape == (1, 2, 4, 64, 64) and store.view(1, 1, 4)[0].dtype == torch.uint8
        assert store.scales(1, 1, 4)[0].shape == (1, 2, 4, 64, 4) and store.scales(1, 1, 4)[0].dtype == torch.float16


def test_a_budget_beyond_the_sequence_blocks_is_refused_naming_topk():
    """A top-k of 100000 used to size every block buffer by 100003 blocks per head (gigabytes per layer): the
    decode looked hung. It is refused before anything is prefilled or allocated, with the largest useful top-k."""
    from workbench.decode.compare import compare_modes

    model = _tiny_llama("cpu")
    prompt = torch.arange(200) % 256
    with pytest.raises(ValueError, match=r"topk=100000 .* topk can be at most 1 \(init \+ local \+ topk <= 4\)"):
        compare_modes(model, prompt, new_tokens=4, budget=Budget(init=1, local=2, topk=100000), progress=False)
    with pytest.raises(ValueError, match="topk can be at most 5"):
        DecodeEngine(model, EngineConfig(mode="sparse-offload-sync", budget=Budget(init=1, local=2, topk=6)),
                     batch=1, max_tokens=512)
    with pytest.raises(ValueError, match="lower budget local"):
        DecodeEngine(model, EngineConfig(mode="sparse-resident", budget=Budget(init=1, local=9, topk=0)),
                     batch=1, max_tokens=512)
    out = compare_modes(model, prompt, modes=["dense-resident", "sparse-resident"], new_tokens=2,
                        budget=Budget(init=1, local=2, topk=1), progress=False, trace=False)
    assert out.runs["sparse-resident"].tokens.shape == (1, 2)


# ----------------------------------------------------------------------------- Gemma-3: sliding layers, QK-norm

def _tiny_gemma():
    """Random-weight Gemma-3 text model: head_dim 256, one KV head, sliding layers of a 40-token window (not a
    multiple of the 64-token block) beside full layers, local / global RoPE theta 1e4 / 1e6."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=40,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=2048, query_pre_attn_scalar=256)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # zero-initialised norm weights would hide the (1 + w) convention
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    return model


def test_gemma_engine_greedy_tokens_equal_hf_generate_fp32():
    from workbench.decode.engine.adapters import decoder_layers
    from workbench.decode.engine.gemma import GemmaLayers

    model = _tiny_gemma()
    lm = decoder_layers(model)
    assert isinstance(lm, GemmaLayers) and lm.windows == (40, None, 40, None) and lm.scale == 256 ** -0.5
    rope = lm.rope(torch.tensor([[5]]))
    assert not torch.allclose(*(rope[t][0] for t in ("sliding_attention", "full_attention")))  # 1e4 vs 1e6
    prompt = (torch.arange(1100) * 7) % 251 + 3  # the prefill's window chunks and a ring that wraps; no pad token
    steps = 12
    want = model.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
                          max_new_tokens=steps, eos_token_id=model.config.vocab_size, pad_token_id=0)[0, prompt.numel():]
    tokens, done = {}, [lm.prefill(prompt)]
    for mode, selector in (("dense-resident", "same-layer"), ("sparse-resident", "same-layer"),
                           ("sparse-offload-sync", "same-layer"), ("sparse-resident", "forecast"),
                           ("sparse-offload-forecast", "forecast")):
        cfg = EngineConfig(mode=mode, selector=selector, budget=Budget(init=1, local=2, topk=3))
        with DecodeEngine(model, cfg, batch=1, max_tokens=1200) as eng:
            assert sorted(eng.kv) == ([0, 2] if eng.offload else [0, 1, 2, 3]) and sorted(eng.caches) == (
                [1, 3] if eng.offload else [])
            assert eng.kv[0].shape[:2] == (2, 2)  # K, V of 1 x 1 rows of (40 - 1) // 64 + 2 blocks, not the sequence
            first = eng.prefill([prompt], steps, prefilled=done)
            tokens[(mode, selector)] = torch.cat([first, eng.run(first, steps - 1, progress=False)[0][0]])
    assert tokens[("dense-resident", "same-layer")].tolist() == want.tolist()
    assert torch.equal(tokens[("sparse-offload-sync", "same-layer")], tokens[("sparse-resident", "same-layer")])
    assert torch.equal(tokens[("sparse-offload-forecast", "forecast")], tokens[("sparse-resident", "forecast")])


def test_int8k_int4v_store_sizes_keys_as_int8_rows_and_values_as_int4_groups():
    """"int8k-int4v": K rows of 128 one-byte codes + a float32 scale, V rows of 64 packed bytes + 4 float16 scales at
    head_dim 128 (204 bytes a K + V row: 0.77x FP8's 264); the existing stores keep their sizes; a store quantising
    one part only is refused."""
    from workbench_kernels.gather_ref import INT4

    from workbench.decode.engine.decoder import STORE_DTYPES

    def spec(quant):
        return StoreSpec(layers=2, batch=1, kv_heads=2, n_blocks=4, head_dim=128, dtype=torch.bfloat16, quant=quant)

    mixed = spec(STORE_DTYPES["int8k-int4v"])
    assert mixed.quant == (torch.int8, INT4) and [p.bytes for p in mixed.parts] == [128 + 4, 64 + 8]
    assert mixed.block_bytes == 64 * (132 + 72) and mixed.nbytes == 2 * (2 * 4 * 64) * (132 + 72)
    assert {k: spec(q).block_bytes for k, q in STORE_DTYPES.items()} == {
        "model": 2 * 64 * 256, "fp8": 2 * 64 * 132, "int8": 2 * 64 * 132, "int4": 2 * 64 * 72, "int8k-int4v": 64 * 204}
    assert mixed.block_bytes / spec(torch.float8_e4m3fn).block_bytes == pytest.approx(0.773, abs=1e-3)
    with BlockStore(mixed, pinned=False) as store:
        (k, v), (sk, sv) = store.view(1, 1, 4), store.scales(1, 1, 4)
        assert (k.shape, k.dtype, v.shape, v.dtype) == ((1, 2, 4, 64, 128), torch.int8, (1, 2, 4, 64, 64), torch.uint8)
        assert (sk.shape, sk.dtype, sv.shape, sv.dtype) == ((1, 2, 4, 64), torch.float32, (1, 2, 4, 64, 4),
                                                            torch.float16)
    with pytest.raises(ValueError, match="both K and V or for neither"):
        spec((torch.int8, None))


@pytest.mark.gpu
def test_gemma_offload_lossless_on_the_gpu_bf16_graphs():
    """Gemma-3 on CUDA (module path, Triton kernels at d = 256, sliding rings) under CUDA graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _tiny_gemma().to("cuda", torch.bfloat16)
    prompt = (torch.arange(1100) * 7) % 251 + 3
    out = {}
    for mode, selector in (("sparse-resident", "forecast"), ("sparse-offload-forecast", "forecast"),
                           ("sparse-resident", "same-layer"), ("sparse-offload-sync", "same-layer")):
        for store in ("model", "fp8", "int4", "int8k-int4v"):
            cfg = EngineConfig(mode=mode, selector=selector, budget=Budget(init=1, local=2, topk=3), store_dtype=store)
            with DecodeEngine(model, cfg, batch=1, max_tokens=1200) as eng:
                first = eng.prefill([prompt.cuda()], 16)
                out[(mode, selector, store)] = eng.run(first, 16, graph=True, progress=False)[0].cpu()
    for store in ("model", "fp8", "int4", "int8k-int4v"):
        assert torch.equal(out[("sparse-offload-forecast", "forecast", store)], out[("sparse-resident", "forecast", store)])
        assert torch.equal(out[("sparse-offload-sync", "same-layer", store)], out[("sparse-resident", "same-layer", store)])


@NEEDS_TRITON
def test_gemma_engine_triton_kernels_at_head_dim_256_match_the_reference():
    """Selection, cache plan, UVA gather, token append and decode kernels at d = 256 (interpreter on the CPU),
    inside the engine, against the PyTorch reference path."""
    model = _tiny_gemma()
    prompt = (torch.arange(300) * 7) % 251 + 3
    out = {}
    for kernels in ("torch", "triton"):
        cfg = EngineConfig(mode="sparse-offload-forecast", budget=Budget(init=1, local=1, topk=2), kernels=kernels,
                           store_dtype="int8")
        with DecodeEngine(model, cfg, batch=1, max_tokens=400) as eng:
            first = eng.prefill([prompt], 3)
            out[kernels] = eng.run(first, 3, keep_logits=True, progress=False)
    assert torch.equal(out["torch"][0], out["triton"][0])
    torch.testing.assert_close(out["triton"][1], out["torch"][1], rtol=1e-4, atol=1e-4)
    assert out["triton"][2].hit_rate == out["torch"][2].hit_rate


# ----------------------------------------------------------------------------- launches per layer (CPU proxy)

_NO_LAUNCH = {"view", "_unsafe_view", "reshape", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "expand",
              "permute", "as_strided", "alias", "detach", "empty", "empty_like", "empty_strided", "split", "unbind",
              "lift_fresh", "_reshape_alias", "new_empty", "view_as"}


def _launches(eng, tokens) -> int:
    """Kernels one eager step would launch on a GPU, counted on the CPU: Triton launches (interpreter) plus the
    ATen ops outside them that are not views or allocations (each is one kernel on CUDA; cuBLAS may add a split-K
    reduction per GEMM, which only the GPU profiler sees: `benchmarks/decode.py` reports that count)."""
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode

    count = {"n": 0, "inside": 0}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not count["inside"] and func.__name__.split(".")[0] not in _NO_LAUNCH:
                count["n"] += 1
            return func(*args, **(kwargs or {}))

    run = interp.InterpretedFunction.run

    def counted(self, *a, **k):
        count["n"] += 1
        count["inside"] += 1
        try:
            return run(self, *a, **k)
        finally:
            count["inside"] -= 1

    interp.InterpretedFunction.run = counted
    try:
        with Ops():
            eng.step(tokens)
    finally:
        interp.InterpretedFunction.run = run
    return count["n"]


@NEEDS_TRITON
def test_fused_decode_step_launches_at_most_15_kernels_per_layer():
    """The Triton path's launches per layer (the difference between a 4- and a 2-layer model) and per step, in
    every offload mode: the bar is <= 20 per layer on the GPU with cuBLAS's extra reductions and the split merge."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def model(layers):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                            max_position_embeddings=1024)).eval()

    for mode, selector in (("sparse-offload-sync", "same-layer"), ("sparse-offload-forecast", "forecast"),
                           ("forecast-without-prefetch", "forecast"), ("dense-resident", "same-layer")):
        counts = {}
        for layers in (2, 4):
            cfg = EngineConfig(mode=mode, selector=selector, budget=Budget(init=1, local=1, topk=2), kernels="triton",
                               store_dtype="int8")
            with DecodeEngine(model(layers), cfg, batch=2, max_tokens=512) as eng:
                assert eng.fused
                first = eng.prefill([torch.arange(300) % 127, torch.arange(200) % 113], 2)
                counts[layers] = _launches(eng, first)
        per_layer, per_step = (counts[4] - counts[2]) / 2, counts[2] - (counts[4] - counts[2])
        assert per_layer <= 13 and per_layer + per_step / 8 <= 15, (mode, counts)


def test_gather_warps_outside_1_2_4_8_is_refused_naming_the_field():
    from workbench.decode.engine.decoder import EngineConfig

    with pytest.raises(ValueError, match="gather_warps must be 1, 2, 4 or 8, got 3"):
        EngineConfig(gather_warps=3)
    assert EngineConfig(gather_warps=1).gather_warps == 1
