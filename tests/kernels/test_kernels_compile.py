"""The Triton kernels compile for the H200 (sm_90) on any machine, and their default configurations fit its
shared memory: Triton's own compiler pipeline ahead of time (`triton.compile` for a `GPUTarget`, with the
ptxas the triton wheel ships), no GPU needed. Catches what the CPU interpreter cannot: layout and lowering
errors, TMA descriptors, software pipelining (K/V tiles two pieces ahead) and shared-memory overflows.

The compiles run in a fresh process (this file as a script): in a process where the interpreter ran
kernels, or imported them under TRITON_INTERPRET=1, `triton.compile` fails."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from workbench_kernels.prefill import SMEM_SM90

pytestmark = pytest.mark.xdist_group("sm90_compile")  # one worker compiles every case once (~2.5 min cold, 2 cores)

PREFILL_CASES = {  # id: (d, pack, rows, block, piece, split, tma, window, persistent[, q/k/v dtype])
    "vs_per_head": (128, 1, 64, 64, 64, True, False, False, False),  # Vertical-Slash off Hopper
    "vs_per_head_persistent": (128, 1, 64, 64, 64, True, False, False, True),  # the Vertical-Slash default on Hopper
    "ashape_per_head_tma_persistent": (128, 1, 64, 64, 64, True, True, True, True),
    "block_packed": (128, 4, 32, 64, 64, False, False, False, False),  # the group-shared block-sparse default
    "vs_128x64": (128, 1, 128, 128, 64, True, False, False, False),  # 128-row tiles over 64-wide pieces
    "d256_per_head_tma": (256, 1, 64, 64, 64, True, True, True, False),  # Gemma-3: head_dim 256
    "d256_packed": (256, 4, 16, 64, 64, True, False, True, False),  # head_dim 256, GQA-packed (split loop)
    "d64_per_head": (64, 1, 64, 64, 64, True, False, False, False),  # the embedded model's head_dim
    "d256_packed_tma_fp32": (256, 4, 16, 64, 64, True, True, True, False, "fp32"),  # fp32 parity runs: one stage
    "d128_per_head_tma_fp32": (128, 1, 64, 64, 64, True, True, True, False, "fp32"),  # fp32 at head_dim 128
}
PREFILL_PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "BlockCount": "*i32",
                "BlockOffset": "*i32", "ColumnCount": "*i32", "ColumnIndex": "*i32", "Sink": "*i32", "Window": "*i32",
                "Order": "*i32"}
STRIDES = ("sqb", "sqh", "sqn", "skb", "skh", "skn", "svb", "svh", "svn", "sob", "soh", "son")


def compile_env() -> dict[str, str]:
    """The environment of a compile process: this one's with the interpreter off (tests/conftest.py turns it
    on where there is no GPU) and without TRITON_F32_DEFAULT, which conftest sets to "ieee": under it an fp32
    kernel's dots compile to IEEE emulation (~200 s a compile, not ~14 s)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_F32_DEFAULT"}
    return {**env, "TRITON_INTERPRET": "0"}


def compile_sm90(fn, types: dict[str, str], constants: dict[str, object], aligned: tuple[str, ...], num_warps: int,
                 num_stages: int = 3, **options):
    """`fn` compiled for sm_90: pointers and `aligned` integers 16-divisible (as torch tensors and their
    strides are at run time), other arguments i32 unless `types` says otherwise."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, **options})


def loop_waits(ttgir: str) -> list[list[int]]:
    """Per scf.for loop with async copies: the `num` of its async_wait ops (pending copy groups allowed)."""
    loops = []
    for body in ttgir.split("scf.for")[1:]:
        body = body.split("scf.yield")[0]
        if "async_copy_global_to_local" in body:
            loops.append([int(x) for x in re.findall(r"async_wait[^{]*\{num = (\d+)", body)])
    return loops


def compile_all() -> dict[str, dict]:
    """Every case's shared memory, stages and per-loop waits (or its error)."""
    from workbench_kernels import antidiagonal, index_build, layer, prefill, prefill_ws

    out: dict[str, dict] = {}
    for case, (d, pack, rows, block, piece, split, tma, window, persistent, *dtype) in PREFILL_CASES.items():
        warps, stages = prefill.default_config(d, rows, pack, piece, 4 if dtype == ["fp32"] else 2)
        predicted = stages
        constants = dict(D=d, BLOCK=block, BLOCK_N=piece, PACK=pack, ROWS=rows, HAS_WINDOW=window,
                         LONGEST_FIRST=True, SPLIT=split, CUT=False, TMA=tma, PERSISTENT=persistent)
        types = {**PREFILL_PTRS, "qk_scale": "fp32", **{x: f"*{dtype[0]}" for x in ("Q", "K", "V", "O") if dtype}}
        try:
            kernel = compile_sm90(prefill._sparse_prefill_kernel, types, constants, (*PREFILL_PTRS, *STRIDES), warps,
                                  stages)
            while kernel.metadata.shared > SMEM_SM90 and stages > 1:  # sparse_prefill's fallback: fewer stages
                stages -= 1
                kernel = compile_sm90(prefill._sparse_prefill_kernel, types, constants, (*PREFILL_PTRS, *STRIDES),
                                      warps, stages)
            out[case] = {"shared": kernel.metadata.shared, "stages": stages, "predicted": predicted,
                         "waits": loop_waits(kernel.asm["ttgir"])}
        except Exception as e:  # noqa: BLE001 - reported by the test of this case
            out[case] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    try:
        cover_ptrs = {"Offsets": "*i64", "Columns": "*i64", "Ends": "*i32", "Covered": "*i8", "Cols": "*i32"}
        compile_sm90(index_build._vs_cover_kernel, cover_ptrs, dict(B_ROW=64, W=64, KPAD=8192, CPAD=1024, sok=1, sck=1),
                     (*cover_ptrs, "sob", "soh", "scb", "sch"), 16)
        compile_sm90(index_build._expand_tiles_kernel,
                     {name: "*i32" for name in ("Ends", "Cols", "BlockCount", "BlockOffset", "ColumnCount",
                                                "ColumnIndex")} | {"Covered": "*i8"},
                     dict(BLOCK=64, W=64, CHUNK=256), ("Ends", "Covered", "Cols"), 4)
        keep_ptrs = {"Cols": "*i32", "ColCount": "*i32", "Covered": "*i8", "Keep": "*i32"}
        compile_sm90(prefill_ws._strip_keep_kernel, keep_ptrs, dict(BLOCK=64, CHUNK=256), tuple(keep_ptrs), 4)
        qk_strides = ("sqb", "sqh", "sqn", "skb", "skh", "skn")
        compile_sm90(index_build._row_stats_kernel, {"Q": "*bf16", "K": "*bf16", "Mpart": "*fp32", "Lpart": "*fp32",
                                                     "qk_scale": "fp32"},
                     dict(D=256, R=64, BN=64), ("Q", "K", "Mpart", "Lpart", *qk_strides), 4)
        compile_sm90(index_build._col_diag_kernel, {"Q": "*bf16", "K": "*bf16", "Lse": "*fp32", "Col": "*fp32",
                                                    "Diag": "*fp32", "qk_scale": "fp32"},
                     dict(D=256, R=64), ("Q", "K", "Lse", "Col", "Diag", *qk_strides), 4)
        # the two launch kinds of a 128K layer (`_launch_bands(2048)`): widths 128..1024 in one, 2048 alone
        for (log_lo, log_hi), per_head, tiles in (((7, 10), False, False), ((11, 11), True, True)):
            compile_sm90(index_build._block_topk_kernel, {"Score": "*fp32", "Budget": "*i32", "Out": "*i32",
                                                          "Count": "*i32", "ColCount": "*i32", "ColIndex": "*i32"},
                         dict(LOG_LO=log_lo, LOG_HI=log_hi, KPAD=128, PER_HEAD=per_head, TILES=tiles,
                              UNIT=64 if tiles else 1),
                         ("Score", "Budget", "Out", "Count", "ColCount", "ColIndex"), max(1, (1 << log_hi) // 1024))
        compile_sm90(index_build._combine_lse_kernel, {"Mpart": "*fp32", "Lpart": "*fp32", "Lse": "*fp32"},
                     dict(R=64, CHUNK=64), ("Mpart", "Lpart", "Lse"), 4)
        dots = {}
        for precision in ("ieee", "tf32x3"):
            for d in (128, 256):  # head_dim 256 in two 128-wide chunks: tensor cores there too
                scores = compile_sm90(index_build._block_scores_kernel, {"QP": "*fp32", "KP": "*fp32", "Score": "*fp32"},
                                      dict(D=d, DK=128, BT=64, PRECISION=precision), ("QP", "KP", "Score"), 4)
                dots[f"{precision}/{d}"] = scores.asm["ttgir"].count("warp_group_dot ")
        out["index"] = {"tensor_core_dots": dots}
    except Exception as e:  # noqa: BLE001 - reported by the index test
        out["index"] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    out["antidiagonal"] = {}
    for d in (64, 128, 256):  # XAttention's scores at stride 8: S * D = 512, 1024, 2048 per group
        try:
            kernel = compile_sm90(antidiagonal._antidiagonal_kernel, {"QS": "*bf16", "KS": "*bf16", "Out": "*fp32",
                                                                      "qk_scale": "fp32"},
                                  dict(GROUP=4, SD=8 * d, STRIDE=8, BK=64, IEEE=False, BQ=antidiagonal.TILE[0],
                                       BC=antidiagonal.TILE[1]), ("QS", "KS", "Out"), *antidiagonal.TILE[2:])
            out["antidiagonal"][d] = {"shared": kernel.metadata.shared, "local": kernel.asm["ptx"].count(".local"),
                                      "wgmma": kernel.asm["ptx"].count("wgmma.mma_async")}
        except Exception as e:  # noqa: BLE001 - reported by the antidiagonal test
            out["antidiagonal"][d] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    out["rope"] = {}
    for dt in ("fp16", "bf16"):
        types = {n: f"*{dt}" for n in ("X", "Cos", "Sin", "Q", "K", "V", "HostK", "HostV", "Kout", "Vout", "Tail",
                                      "CKeys")} | {n: "*fp32" for n in ("CosF", "SinF", "F", "HostSK", "HostSV")}
        rope = compile_sm90(layer._rope_split_kernel, {**types, "Pos": "*i64", "QMAX_K": "fp32", "QMAX_V": "fp32"},
                            dict(D=64, APPEND=False, W=32, HOST=False, QUANT_K=False, INT8_K=False, INT4_K=False,
                                 QUANT_V=False, INT8_V=False, INT4_V=False, OUT=False, COMPRESS=False), (), 2,
                            **layer.ROPE_LAUNCH)
        out["rope"][dt] = re.findall(r"\b(?:fma|mul|add)\.rn\.\w+", rope.asm["ptx"])
    return out


@pytest.fixture(scope="session")  # once per worker: xdist interleaves other modules' tests, and a module-scoped
def compiled() -> dict[str, dict]:  # fixture was torn down and compiled everything again
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=compile_env(), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_kernel_compiles_for_sm90_within_shared_memory(compiled, case):
    result = compiled[case]
    assert "error" not in result, result.get("error")
    assert result["shared"] <= SMEM_SM90
    # `default_config`'s estimate asks for no stage that does not fit (each costs a compile before a failed launch)
    assert result["stages"] == result["predicted"], result
    if not PREFILL_CASES[case][6] and result["stages"] == 3:  # cp.async K/V: every piece loop keeps copies in flight
        waits = result["waits"][1:] if PREFILL_CASES[case][8] else result["waits"]  # persistent: the first loop is
        # the one over work items (its Q rows load once per item, no copy to keep in flight)
        assert waits and all(w and min(w) >= 1 for w in waits), result["waits"]


def test_index_kernels_compile_for_sm90(compiled):
    """The VS score passes at head_dim 256, the VS cover, tile expansion, the strip keep bits, VS top-k (with and without per-head
    budgets), block scores and top-k kernels at the sizes a 128K-token layer gives them; the 3xTF32 scores on
    the tensor cores, the IEEE ones on FMA."""
    result = compiled["index"]
    assert "error" not in result, result.get("error")
    assert result["tensor_core_dots"] == {"ieee/128": 0, "ieee/256": 0, "tf32x3/128": 3, "tf32x3/256": 6}


def test_antidiagonal_scores_compile_for_sm90_on_the_tensor_cores(compiled):
    """XAttention's score kernel at head_dim 64 / 128 / 256 (stride 8): bf16 wgmma, within shared memory, no local
    memory (its K loop reuses one tile buffer: unrolled, the 16 steps of S * D = 1024 held 512 KB)."""
    for d, result in compiled["antidiagonal"].items():
        assert "error" not in result, (d, result.get("error"))
        assert result["wgmma"] > 0 and result["local"] == 0 and result["shared"] <= SMEM_SM90, (d, result)


def test_rope_rounds_like_transformers_for_sm90(compiled):
    """The decode step's RoPE in 16 bits: each product rounded, then the sum (transformers' rotary embedding on
    the GPU), no fused multiply-add: with one, the engine's q and k leave the model's by an ulp of a product."""
    for dt, ops in compiled["rope"].items():
        assert not [op for op in ops if op.startswith("fma")], (dt, ops)
        ptx = {"fp16": "f16", "bf16": "bf16"}[dt]
        assert f"mul.rn.{ptx}" in ops and f"add.rn.{ptx}" in ops, (dt, ops)


if __name__ == "__main__":
    print(json.dumps(compile_all()))
