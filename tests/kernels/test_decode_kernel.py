"""Triton decode kernels against their PyTorch references (TRITON_INTERPRET=1 on the CPU; bf16 on a GPU)."""
from __future__ import annotations

import pytest
import torch
from workbench_kernels.block_select import select_blocks
from workbench_kernels.cache_plan import append_token, plan_blocks
from workbench_kernels.cache_plan_ref import append_token_ref, plan_blocks_ref
from workbench_kernels.decode import sparse_decode
from workbench_kernels.decode_ref import sparse_decode_ref
from workbench_kernels.gather import gather_blocks
from workbench_kernels.gather_ref import INT4, gather_blocks_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, Hq, Hkv, D, K, S, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, D, generator=g).to(DEV, dtype)
    kp = torch.randn(S, 64, D, generator=g).to(DEV, dtype)
    vp = torch.randn(S, 64, D, generator=g).to(DEV, dtype)
    lengths = torch.randint(64, 64 * (K + 2), (B,), generator=g)
    blocks = torch.full((B, Hkv, K), -1, dtype=torch.long)
    for b in range(B):
        last = int(lengths[b] - 1) // 64
        for h in range(Hkv):
            n = int(torch.randint(1, min(K, last + 1) + 1, (1,), generator=g))
            pick = torch.randperm(last, generator=g)[:n - 1] if last else torch.empty(0, dtype=torch.long)
            ids = torch.cat([pick, torch.tensor([last])]).sort().values  # the current block always selected
            blocks[b, h, :n] = ids
    slots = torch.randint(0, S, (B, Hkv, K), generator=g)
    return q, kp, vp, blocks.to(DEV), slots.to(DEV), lengths.to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,D,K", [(2, 6, 2, 64, 5), (3, 8, 2, 32, 7), (1, 9, 3, 64, 4), (2, 4, 1, 256, 3)])
def test_sparse_decode_matches_reference(dtype, B, Hq, Hkv, D, K):
    q, kp, vp, blocks, slots, lengths = _case(B, Hq, Hkv, D, K, 40, dtype, seed=B * 100 + K)
    ref = sparse_decode_ref(q.double(), kp.double(), vp.double(), lengths, D ** -0.5, blocks=blocks, slots=slots)
    for splits in (1, 2, K):
        out = sparse_decode(q, kp, vp, lengths, D ** -0.5, blocks=blocks, slots=slots, splits=splits)
        assert out.shape == (B, Hq, D) and out.dtype == dtype and torch.isfinite(out).all()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        tol = 3e-3 if dtype == torch.float16 or DEV == "cuda" else 1e-5  # fp32 tl.dot is tf32 on a GPU
        assert err < tol, (splits, err)


@pytest.mark.parametrize("D,window", [(32, 0), (32, 100), (256, 70)])
def test_sparse_decode_resident_ring_and_new_token_match_reference(D, window):
    """No selection: every block of a resident layer, or a sliding window's ring of row_blocks slots; the
    current token comes from k_new / v_new and is written into its slot (same pool bits as the reference)."""
    g = torch.Generator().manual_seed(D + window)
    B, Hq, Hkv, nb = 2, 4, 2, 6
    row_blocks = (window - 1) // 64 + 2 if window else nb
    kp = torch.randn(B * Hkv * row_blocks, 64, D, generator=g).to(DEV)
    vp = torch.randn(B * Hkv * row_blocks, 64, D, generator=g).to(DEV)
    q = torch.randn(B, Hq, D, generator=g).to(DEV)
    kn, vn = torch.randn(B, Hkv, D, generator=g).to(DEV), torch.randn(B, Hkv, D, generator=g).to(DEV)
    lengths = torch.tensor([300, 129], device=DEV)
    kr, vr = kp.clone(), vp.clone()
    ref = sparse_decode_ref(q.double(), kr, vr, lengths, 0.2, kv_heads=Hkv, row_blocks=row_blocks, window=window,
                            k_new=kn, v_new=vn)
    for splits in (1, 3):
        kt, vt = kp.clone(), vp.clone()
        out = sparse_decode(q, kt, vt, lengths, 0.2, kv_heads=Hkv, row_blocks=row_blocks, window=window, k_new=kn,
                            v_new=vn, splits=splits)
        assert torch.equal(kt, kr) and torch.equal(vt, vr)
        tol = 3e-3 if DEV == "cuda" else 1e-5
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    if window:  # a key just outside the window changes nothing
        kt, vt = kp.clone(), vp.clone()
        for b, n in enumerate(lengths.tolist()):
            p = n - 1 - window
            if p >= 0:
                rows = torch.arange(b * Hkv, (b + 1) * Hkv, device=DEV) * row_blocks + (p // 64) % row_blocks
                kt[rows, p % 64], vt[rows, p % 64] = 1e4, float("nan")
        out = sparse_decode(q, kt, vt, lengths, 0.2, kv_heads=Hkv, row_blocks=row_blocks, window=window, k_new=kn,
                            v_new=vn)
        assert ((out.double() - ref).norm() / ref.norm()).item() < (3e-3 if DEV == "cuda" else 1e-5)


def test_sparse_decode_masks_positions_past_length():
    """Garbage in keys/values past a sequence's length (inside its selected last block) changes nothing."""
    q, kp, vp, blocks, _, lengths = _case(2, 4, 2, 32, 3, 12, torch.float32, seed=7)
    slots = torch.randperm(12).view(2, 2, 3).to(DEV)  # every (sequence, head, entry) owns its slot
    out = sparse_decode(q, kp, vp, lengths, 0.2, blocks=blocks, slots=slots)
    kp2, vp2 = kp.clone(), vp.clone()
    for b in range(2):
        n, last = int(lengths[b]), (int(lengths[b]) - 1) // 64
        for h in range(2):
            s = slots[b, h][blocks[b, h] == last]
            kp2[s, n - last * 64:] = 1e4
            vp2[s, n - last * 64:] = float("nan")
            kp2[slots[b, h][blocks[b, h] < 0]] = float("nan")  # unused entries are never read
    torch.testing.assert_close(sparse_decode(q, kp2, vp2, lengths, 0.2, blocks=blocks, slots=slots), out, rtol=0,
                               atol=1e-6)


def test_sparse_decode_rejects_bad_shapes():
    q, kp, vp, blocks, slots, lengths = _case(2, 6, 2, 64, 5, 40, torch.float32, seed=1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sparse_decode(q[:, :5], kp, vp, lengths, 0.1, blocks=blocks, slots=slots)
    with pytest.raises(ValueError, match="k_pool and v_pool"):
        sparse_decode(q, kp[:, :32], vp, lengths, 0.1, blocks=blocks, slots=slots)
    with pytest.raises(ValueError, match="row_blocks and kv_heads"):
        sparse_decode(q, kp, vp, lengths, 0.1)


@pytest.mark.parametrize("ctas", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_blocks_matches_reference(ctas, dtype):
    g = torch.Generator().manual_seed(ctas)
    src_k, src_v = torch.randn(50, 2048, generator=g).to(dtype), torch.randn(50, 2048, generator=g).to(dtype)
    if DEV == "cuda":
        src_k, src_v = src_k.pin_memory(), src_v.pin_memory()  # read through UVA by the kernel
    M, n = 12, 9
    src_idx = torch.randperm(50, generator=g)[:M].to(DEV)
    dst_idx = torch.randperm(20, generator=g)[:M].to(DEV)
    count = torch.tensor([n], dtype=torch.int32, device=DEV)
    poison = torch.full((20, 2048), float("nan"), dtype=dtype, device=DEV)
    dk, dv, rk, rv = poison.clone(), poison.clone(), poison.clone(), poison.clone()
    gather_blocks(src_k, src_v, dk, dv, src_idx, dst_idx, count, ctas=ctas)
    gather_blocks_ref(src_k, src_v, rk, rv, src_idx, dst_idx, count)
    assert torch.equal(dk.nan_to_num(7.0), rk.nan_to_num(7.0)) and torch.equal(dv.nan_to_num(7.0), rv.nan_to_num(7.0))
    written = dst_idx[:n].cpu()
    assert not torch.isnan(dk.cpu()[written]).any()
    assert torch.isnan(dk.cpu()[dst_idx[n:].cpu()]).all()  # entries past count untouched


@pytest.mark.parametrize("ctas", [1, 3])
def test_gather_blocks_skips_hits_in_a_long_list(ctas):
    """The engine's copy list holds every selected block, most of them cache hits (dst -1): programs read the
    list in chunks and move the misses only. A list of several chunks per program, hits and misses mixed, a count
    that ends inside a chunk: the same pools as the reference."""
    g = torch.Generator().manual_seed(ctas)
    src_k, src_v = torch.randn(300, 1024, generator=g), torch.randn(300, 1024, generator=g)
    if DEV == "cuda":
        src_k, src_v = src_k.pin_memory(), src_v.pin_memory()
    M, n = 250, 231
    src_idx = torch.randint(0, 300, (M,), generator=g).to(DEV)
    dst_idx = torch.randperm(400, generator=g)[:M]
    dst_idx[torch.rand(M, generator=g) < 0.8] = -1  # hits
    dst_idx = dst_idx.to(DEV)
    count = torch.tensor([n], dtype=torch.int32, device=DEV)
    out = []
    for fn, kw in ((gather_blocks, {"ctas": ctas}), (gather_blocks_ref, {})):
        dk, dv = torch.zeros(400, 1024, device=DEV), torch.zeros(400, 1024, device=DEV)
        fn(src_k, src_v, dk, dv, src_idx, dst_idx, count, **kw)
        out.append((dk, dv))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert 20 < int((dst_idx[:n] >= 0).sum()) and out[0][0].abs().sum(-1).gt(0).sum() == (dst_idx[:n] >= 0).sum()


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn, INT4, (torch.int8, INT4)],
                         ids=["int8", "fp8", "int4", "int8k-int4v"])
def test_gather_blocks_dequantises_like_the_reference(D, codes):
    """An FP8 / INT8 store: one-byte codes and per-row float32 scales in, model-dtype rows out, bit for bit
    the reference's `dequantize_rows` (the interpreter reads FP8 exactly; it is its rounding *to* FP8 that
    is off, see the append test). INT4: packed bytes `[S, E / 2]` and float16 scales per 32 elements `[S, E / 32]`.
    "int8k-int4v": INT8 K rows with `[S, 64]` float32 scales beside INT4 V groups with `[S, E / 32]` float16 ones."""
    from workbench_kernels.gather_ref import dequantize_rows, kv_quant, quantize_rows

    g = torch.Generator().manual_seed(D)
    x = torch.randn(30, 64, D, generator=g) * torch.rand(30, 64, 1, generator=g) * 10
    y = torch.randn(30, 64, D, generator=g)
    codes, codes_v = kv_quant(codes)
    (qk, sk), (qv, sv) = quantize_rows(x, codes), quantize_rows(y, codes_v)
    pin = (lambda t: t.pin_memory()) if DEV == "cuda" else (lambda t: t)
    src = [pin(t.view(30, -1)) for t in (qk, qv)]
    scales = [pin(t.reshape(30, -1)) for t in (sk, sv)]
    src_idx = torch.randperm(30, generator=g)[:8].to(DEV)
    dst_idx = torch.randperm(10, generator=g)[:8].to(DEV)
    dst_idx[2] = -1  # a hit: nothing moves
    count = torch.tensor([7], dtype=torch.int32, device=DEV)
    out = []
    for fn, kw in ((gather_blocks, {"ctas": 3}), (gather_blocks_ref, {})):
        dk = torch.zeros(10, 64 * D, dtype=torch.float16, device=DEV)
        dv = torch.zeros_like(dk)
        fn(*src, dk, dv, src_idx, dst_idx, count, scale_k=scales[0], scale_v=scales[1], **kw)
        out.append((dk.cpu(), dv.cpu()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    moved = [(int(s), int(d)) for s, d in zip(src_idx[:7].cpu(), dst_idx[:7].cpu()) if d >= 0]
    for s, d in moved:
        assert torch.equal(out[0][0][d].view(64, D), dequantize_rows(qk[s], sk[s], torch.float16))
        assert torch.equal(out[0][1][d].view(64, D), dequantize_rows(qv[s], sv[s], torch.float16))
    err = (dequantize_rows(qk, sk, torch.float32) - x).abs().amax(-1) / x.abs().amax(-1)
    bound = {torch.int8: 1 / 127, torch.float8_e4m3fn: 1 / 16, INT4: 1.001 / 14}[codes]  # half a step (FP8: 3 bits;
    # INT4: of the group's float16 scale)
    assert err.max() < bound and (codes != INT4 or err.max() > 1 / 50)  # INT4 is coarse: a real 4-bit rounding


def test_int4_rows_round_trip_stay_within_half_a_step_and_refuse_a_bad_head_dim():
    """The INT4 codes: quantise(dequantise(.)) gives the same bytes and scales back, each element within half its
    group's scale of x (a group of 32 has its own scale: one large element does not flatten the others), the
    nibble layout is the documented one, and a head_dim that groups of 32 do not fit is refused naming the fix."""
    from workbench_kernels.cache_plan import append_token
    from workbench_kernels.gather_ref import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 128, generator=g) * torch.rand(40, 3, 1, generator=g) * 20
    x[0, 0, 5] = 1e3  # one outlier: only its group's scale grows
    codes, scale = quantize_rows(x, INT4)
    assert codes.shape == (40, 3, 64) and codes.dtype == torch.uint8 and scale.shape == (40, 3, 4)
    assert scale.dtype == torch.float16
    y = dequantize_rows(codes, scale, torch.float32)
    again = quantize_rows(y, INT4)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scale)
    err = (y - x).abs().unflatten(-1, (4, 32))
    assert (err <= scale.float()[..., None] / 2 * (1 + 1e-6)).all()
    assert err[0, 0, 1:].max() < 1e3 / 7 / 2 / 10  # the outlier's neighbours keep their own scales
    row = torch.zeros(32)
    row[[0, 16, 1, 17]] = torch.tensor([7.0, -7.0, 3.0, 0.49])  # scale 1: codes 7, -7, 3, 0 -> nibbles 15, 1, 11, 8
    c, s = quantize_rows(row, INT4)  # byte j: element j low, element j + 16 high
    assert float(s) == 1.0 and c[:2].tolist() == [15 | 1 << 4, 11 | 8 << 4] and (c[2:] == 8 | 8 << 4).all()
    assert torch.equal(dequantize_rows(*quantize_rows(torch.zeros(2, 64), INT4), torch.float32), torch.zeros(2, 64))
    for bad in (48, 16):
        with pytest.raises(ValueError, match=f"store_dtype 'int4' needs head_dim .* got head_dim={bad}: use store_dtype"):
            quantize_rows(torch.randn(2, bad), INT4)
    k = torch.randn(1, 2, 16).to(DEV)
    with pytest.raises(ValueError, match="got head_dim=16: use store_dtype 'fp8' or 'int8'"):
        append_token(k, k, torch.tensor([3]).to(DEV), quant=INT4, k_out=k.clone(), v_out=k.clone())


def test_plan_blocks_matches_reference_over_steps():
    g = torch.Generator().manual_seed(4)
    B, H, NB, K, C = 2, 3, 40, 6, 8

    def maps():
        return [torch.full((B, H, NB + 1), -1, dtype=torch.long, device=DEV),
                torch.full((B, H, C + 1), -1, dtype=torch.long, device=DEV),
                torch.zeros((), dtype=torch.long, device=DEV), torch.zeros((), dtype=torch.long, device=DEV)]

    ref, got = maps(), maps()
    for _ in range(10):
        sel = torch.stack([torch.randperm(NB, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
        sel[0, 0, -2:] = -1
        sel = sel.to(DEV)
        a, b = plan_blocks_ref(sel, *ref), plan_blocks(sel, *got)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(ref[0][..., :-1], got[0][..., :-1]) and torch.equal(ref[1][..., :-1], got[1][..., :-1])
        assert int(ref[2]) == int(got[2]) and int(ref[3]) == int(got[3])  # hit and miss counters
    assert int(got[2]) > 0 and int(got[3]) > 0


@pytest.mark.parametrize("D", [16, 64, 256])
@pytest.mark.parametrize("quant", [None, torch.int8, torch.float8_e4m3fn, INT4, (torch.int8, INT4)],
                         ids=["model", "int8", "fp8", "int4", "int8k-int4v"])
def test_append_token_matches_reference(D, quant):
    """Host store row (values, or codes + scales), the dequantised token the decoder attends to, and the
    compressed keys (95 completes a window, 300 does not). "int8k-int4v": INT8 key rows and their float32
    scales, INT4 value groups and their float16 ones, in one launch."""
    from workbench_kernels.gather_ref import SCALE_DTYPE, kv_quant

    if INT4 in kv_quant(quant) and D < 32:
        pytest.skip("INT4 groups 32 elements: head_dim 16 is refused (see the INT4 round-trip test)")
    H, W, nbk = 3, 32, 10
    pin = (lambda t: t.pin_memory()) if DEV == "cuda" else (lambda t: t)

    def rows(q: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:  # one part's zeroed codes and scales
        width, scales = (D // 2, (D // 32,)) if q == INT4 else (D, ())
        return (pin(torch.zeros(2, H, nbk * 64, width).to(q or torch.float32)),
                pin(torch.zeros(2, H, nbk * 64, *scales).to(SCALE_DTYPE.get(q, torch.float32))))

    outs = []
    for fn in (append_token_ref, append_token):
        g = torch.Generator().manual_seed(5)
        pos = torch.tensor([95, 300]).to(DEV)
        k, v = (torch.randn(2, H, D, generator=g) * 3).to(DEV), torch.randn(2, H, D, generator=g).to(DEV)
        tail, ck = torch.randn(2, H, W, D, generator=g).to(DEV), torch.zeros(2, H, 30, D, device=DEV)
        (hk, sk), (hv, sv) = (rows(q) for q in kv_quant(quant))
        ko, vo = torch.zeros(2, H, D, dtype=torch.float16, device=DEV), torch.zeros(2, H, D, dtype=torch.float16, device=DEV)
        kw = dict(host_scale_k=sk, host_scale_v=sv, quant=quant, k_out=ko, v_out=vo) if quant else {}
        fn(k, v, pos, host_k=hk, host_v=hv, tail=tail, ckeys=ck, **kw)
        if DEV == "cuda":
            torch.cuda.synchronize()
        outs.append([t.cpu().float() for t in (hk, hv, sk, sv, ko, vo, tail, ck[:, :, :-1])])  # ck: no sink
    (ref, got), names = outs, ("host k", "host v", "scale k", "scale v", "k out", "v out", "tail", "ckeys")
    interp_fp8 = quant == torch.float8_e4m3fn and DEV == "cpu"
    for i, (name, x, y) in enumerate(zip(names, ref, got)):
        if interp_fp8 and i in (0, 1, 4, 5):
            # The interpreter rounds float -> FP8 wrongly where rounding carries into the exponent (a value
            # rounding to 128 comes out as 64, 160 as 176): on the CPU the scales are exact and most codes equal
            # (a wrong scale or row would leave almost none); the GPU lane checks them bit for bit.
            written = x != 0
            assert (x[written] == y[written]).float().mean() > 0.8, name
        else:
            torch.testing.assert_close(y, x, rtol=0, atol=1e-6 if name == "ckeys" else 0,
                                       msg=lambda m, name=name, i=i: f"{name}: {m}{_own_codes(ref, got, i, pos, quant)}")
    assert got[7].abs().sum() > 0 and got[0].abs().sum() > 0 and (quant is None or got[4].abs().sum() > 0)


def _own_codes(ref: list[torch.Tensor], got: list[torch.Tensor], i: int, pos: torch.Tensor, quant: torch.dtype) -> str:
    """For a k / v out mismatch: whether each side's attended token equals its own stored codes x scale (on
    the CPU), i.e. which side's in-register dequantisation leaves its store (an H200 run once failed here
    with equal codes and scales)."""
    from workbench_kernels.gather_ref import kv_quant

    if i not in (4, 5):
        return ""
    quant = kv_quant(quant)[i - 4]
    b = torch.arange(len(pos))
    p = pos.cpu()

    def own(side: list[torch.Tensor]) -> bool:
        from workbench_kernels.gather_ref import dequantize_rows

        codes, scale = side[i - 4][b, :, p], side[i - 2][b, :, p]  # (as float)
        return torch.equal(dequantize_rows(codes.to(quant), scale, torch.float16).float(), side[i])

    return f"; equal to its own codes x scale: reference {own(ref)}, kernel {own(got)}"


@pytest.mark.parametrize("quant", [torch.int8, torch.float8_e4m3fn, INT4, (torch.int8, INT4)])
def test_append_token_without_a_host_store_still_quantises_the_attended_token(quant):
    """A resident quantised layer (no host store, `k_out` only): the token the decoder attends to is
    dequantize(quantize(k)), as the offloaded layer's, so resident@fp8 is the lossless reference of
    offload@fp8 (the FP8 codes were once cast to k's own dtype here: no rounding at all)."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 3, 64, generator=g) * 3).to(DEV), torch.randn(2, 3, 64, generator=g).to(DEV)
    outs = []
    for fn in (append_token_ref, append_token):
        ko, vo = torch.zeros(2, 3, 64, device=DEV), torch.zeros(2, 3, 64, device=DEV)
        fn(k, v, torch.tensor([7, 70]).to(DEV), quant=quant, k_out=ko, v_out=vo)
        outs.append(torch.stack([ko, vo]).cpu())
    ref, got = outs
    assert not torch.equal(ref, torch.stack([k, v]).cpu())  # the reference rounds
    if quant == torch.float8_e4m3fn and DEV == "cpu":  # the interpreter's FP8 rounding: see the test above
        assert (ref == got).float().mean() > 0.8
    else:
        assert torch.equal(ref, got)


@pytest.mark.parametrize("D", [32, 256])
def test_select_blocks_admits_into_the_cache_like_plan_blocks(D):
    """The fused selection + cache plan (one launch after the scores) equals select then plan_blocks_ref."""
    g = torch.Generator().manual_seed(D)
    B, H, G, nb, C = 2, 2, 4, 30, 10
    keys = torch.randn(B, H, (nb * 64 - 32) // 16 + 2, D, generator=g).to(DEV)
    pos = torch.tensor([1500, 1900], device=DEV)

    def maps():
        return [torch.full((B, H, nb + 1), -1, dtype=torch.long, device=DEV),
                torch.full((B, H, C + 1), -1, dtype=torch.long, device=DEV),
                torch.zeros((), dtype=torch.long, device=DEV), torch.zeros((), dtype=torch.long, device=DEV)]

    fused, ref = maps(), maps()
    for _ in range(3):
        q = torch.randn(B, H, G, D, generator=g).to(DEV)
        blocks, slots, src, dst = select_blocks(q, keys, pos, pos, nb, init=1, local=2, topk=5, cache=tuple(fused))
        want = select_blocks(q, keys, pos, pos, nb, init=1, local=2, topk=5)
        assert torch.equal(blocks, want)
        for x, y in zip((slots, src, dst), plan_blocks_ref(want, *ref)):
            assert torch.equal(x, y)
        assert torch.equal(fused[0][..., :-1], ref[0][..., :-1]) and torch.equal(fused[1][..., :-1], ref[1][..., :-1])
        assert int(fused[2]) == int(ref[2]) and int(fused[3]) == int(ref[3])
        pos = pos + 1
    assert int(fused[2]) > 0 and int(fused[3]) > 0


@pytest.mark.parametrize("B,H,G,D,visible_lag", [(3, 2, 3, 32, 0), (2, 2, 4, 16, 1), (2, 1, 4, 256, 1)])
def test_select_blocks_equals_infllm_selection(B, H, G, D, visible_lag):
    from workbench.decode.engine.select import CompressedKeyBuffer, select_decode
    from workbench.patterns.infllm import Budget

    g = torch.Generator().manual_seed(B * 10 + G)
    budget, nb = Budget(init=1, local=2, topk=5), 40
    buf = CompressedKeyBuffer(B, H, D, nb * 64, budget, DEV)
    buf.keys.copy_(torch.randn(buf.keys.shape, generator=g))
    q = torch.randn(B, H, G, D, generator=g).to(DEV)
    pos = torch.tensor([700, 2000, 64 * nb - 1][:B]).to(DEV)
    from workbench.patterns.infllm import group_scores, pool_to_blocks

    want = select_decode(q, buf, pos, pos - visible_lag, nb, budget)
    s = group_scores(q[:, :, :, None, :], buf.keys[:, :, :-1], (pos - visible_lag).view(B, 1, 1, 1))
    scores = pool_to_blocks(s, nb)[:, :, 0]  # [B, H, nb]
    for splits in (1, 3):
        got = select_blocks(q, buf.keys, pos, pos - visible_lag, nb, init=1, local=2, topk=5, splits=splits)
        differ = (got != want).any(-1)
        assert differ.float().mean() <= 0.2  # only near-ties may differ (fp32 sums in another order) ...
        for b, h in differ.nonzero().tolist():  # ... and then the picked blocks score the same
            a, w = scores[b, h, got[b, h]].sort().values, scores[b, h, want[b, h]].sort().values
            torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_select_blocks_bf16_tensor_cores_pick_the_reference_blocks():
    """bf16 keys take the tensor-core dot: the same blocks as the fp32 reference up to near-ties."""
    from workbench.decode.engine.select import CompressedKeyBuffer, select_decode
    from workbench.patterns.infllm import Budget, group_scores, pool_to_blocks

    g = torch.Generator().manual_seed(5)
    B, H, G, D, nb = 4, 8, 4, 128, 512
    budget = Budget(init=1, local=4, topk=32)
    buf = CompressedKeyBuffer(B, H, D, nb * 64, budget, "cuda", dtype=torch.bfloat16)
    buf.keys.copy_(torch.randn(buf.keys.shape, generator=g))
    q = torch.randn(B, H, G, D, generator=g).to("cuda", torch.bfloat16)
    pos = torch.tensor([5000, 12000, 20000, 64 * nb - 1], device="cuda")
    ref = CompressedKeyBuffer(B, H, D, nb * 64, budget, "cuda")  # the same keys in fp32
    ref.keys.copy_(buf.keys.float())
    want = select_decode(q.float(), ref, pos, pos, nb, budget)
    got = select_blocks(q, buf.keys, pos, pos, nb, init=1, local=4, topk=32)
    s = group_scores(q.float()[:, :, :, None, :], buf.keys.float()[:, :, :-1], pos.view(B, 1, 1, 1))
    scores = pool_to_blocks(s, nb)[:, :, 0]
    for b, h in (got != want).any(-1).nonzero().tolist():
        a, w = scores[b, h, got[b, h]].sort().values, scores[b, h, want[b, h]].sort().values
        torch.testing.assert_close(a, w, rtol=2e-3, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 Triton needs a GPU")
def test_sparse_decode_bf16_gpu():
    q, kp, vp, blocks, slots, lengths = _case(4, 32, 8, 128, 96, 4000, torch.bfloat16, seed=11)
    ref = sparse_decode_ref(q.double(), kp.double(), vp.double(), lengths, 128 ** -0.5, blocks=blocks, slots=slots)
    out = sparse_decode(q, kp, vp, lengths, 128 ** -0.5, blocks=blocks, slots=slots)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_reference_ignores_garbage_past_the_length():
    """Uninitialised pool memory (NaN) past a sequence's length must not reach the output."""
    from workbench_kernels.decode_ref import sparse_decode_ref

    torch.manual_seed(0)
    q = torch.randn(1, 4, 16)
    k_pool, v_pool = torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    k_pool[0, 10:], v_pool[0, 10:] = float("nan"), float("nan")
    blocks = torch.tensor([[[0], [0]]])
    out = sparse_decode_ref(q, k_pool, v_pool, torch.tensor([10]), 0.25, blocks=blocks, slots=blocks.clone())
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_glue_kernels_match_their_references_and_the_llama_modules(dtype):
    """add + RMSNorm, RoPE split (with the forecast queries in fp32) and silu * up: Triton == reference, and the
    reference == transformers' LlamaRMSNorm / apply_rotary_pos_emb / silu, where those round."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
    from workbench_kernels.layer import add_rmsnorm, rope_split, silu_mul
    from workbench_kernels.layer_ref import add_rmsnorm_ref, rope_split_ref, silu_mul_ref

    g = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEV, dtype)

    x, delta, w = rand(3, 576), rand(3, 576), rand(576)
    got, want = add_rmsnorm(x, delta, w, 1e-5), add_rmsnorm_ref(x, delta, w, 1e-5)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 1e-3)  # sum order
    norm = LlamaRMSNorm(576, 1e-5).to(DEV, dtype)
    norm.weight.data.copy_(w)
    assert torch.equal(norm(x + delta), want[1])
    H, Hkv, Hf, D = 4, 2, 2, 64
    qkvf, cos, sin = rand(3, (H + 2 * Hkv + Hf) * D), rand(3, D), rand(3, D)
    args = (qkvf, cos, sin, H, Hkv, Hf, cos.float(), sin.float())
    for a, b in zip(rope_split(*args), rope_split_ref(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0 if DEV == "cpu" else 1e-6)
    heads = qkvf.view(3, -1, D)[:, :H, None]  # [B, H, T=1, D]
    q_hf = apply_rotary_pos_emb(heads, heads, cos[:, None], sin[:, None])[0][:, :, 0]
    assert torch.equal(q_hf, rope_split_ref(*args)[0])
    gate, up = rand(3, 1536), rand(3, 1536)
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_ref(gate, up), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("quant", [INT4, (torch.int8, INT4)], ids=["int4", "int8k-int4v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_split_appends_int4_rows_like_the_reference(dtype, quant):
    """The fused RoPE split's append (`store_row` in `layer._rope_split_kernel`) into an INT4 host store: packed
    codes, float16 group scales and the dequantised token the decoder attends to, bit for bit the reference's;
    "int8k-int4v": the keys as INT8 rows with float32 scales in the same launch."""
    from workbench_kernels.gather_ref import SCALE_DTYPE, kv_quant, row_layout
    from workbench_kernels.layer import rope_split
    from workbench_kernels.layer_ref import rope_split_ref

    g = torch.Generator().manual_seed(7)
    B, H, Hkv, D, T = 2, 4, 2, 64, 256
    qkvf = (torch.randn(B, (H + 2 * Hkv) * D, generator=g) * 3).to(DEV, dtype)
    cos, sin = torch.randn(B, D, generator=g).to(DEV, dtype), torch.randn(B, D, generator=g).to(DEV, dtype)
    pos = torch.tensor([5, 200]).to(DEV)
    pin = (lambda t: t.pin_memory()) if DEV == "cuda" else (lambda t: t)
    outs = []
    for fn in (rope_split_ref, rope_split):
        hk, hv = (pin(torch.zeros(B, Hkv, T, row_layout(q, D)[0], dtype=q)) for q in kv_quant(quant))
        sk, sv = (pin(torch.zeros(B, Hkv, T, *((D // 32,) if q == INT4 else ()), dtype=SCALE_DTYPE[q]))
                  for q in kv_quant(quant))  # per group of 32 (INT4) or per row (INT8)
        ko, vo = torch.zeros(B, Hkv, D, dtype=dtype, device=DEV), torch.zeros(B, Hkv, D, dtype=dtype, device=DEV)
        q, k, v, _ = fn(qkvf, cos, sin, H, Hkv, 0, positions=pos, host_k=hk, host_v=hv, host_scale_k=sk,
                        host_scale_v=sv, quant=quant, k_out=ko, v_out=vo)
        if DEV == "cuda":
            torch.cuda.synchronize()
        outs.append([t.cpu() for t in (k, v, hk, hv, sk, sv, ko, vo)])
    for name, a, b in zip(("k", "v", "host k", "host v", "scale k", "scale v", "k out", "v out"), *outs):
        assert torch.equal(a, b), name
    ref = outs[0]
    assert ref[2].any() and not torch.equal(ref[6], ref[0])  # codes written; the attended token is rounded
