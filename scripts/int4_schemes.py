"""Exploratory (CPU, fp32): what 4-bit KV schemes cost in quality on the embedded model, before the engine and
its kernels carry any of them. Every layer but layer 0 (resident in the engine) attends to K and V rounded by the
scheme (quantise then dequantise, post-RoPE, all tokens: a prefill stand-in for teacher-forced decode); the last
64 positions' next-token distributions are compared with the unrounded model's (KL, top-1 agreement).

    python scripts/int4_schemes.py OUT.json [LENGTH]
"""
from __future__ import annotations

import sys
import time

import torch
from workbench_kernels.gather_ref import INT4, dequantize_rows, quantize_rows

from workbench.core.attention import attention_override, dense_attention
from workbench.core.corpus import make_sample
from workbench.core.io import write_json
from workbench.core.model import load_model
from workbench.core.timing import environment


def rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The store's own rounding (`gather_ref`): per token row (FP8 / INT8) or per 32 elements (INT4)."""
    return dequantize_rows(*quantize_rows(x, dtype), torch.float32).to(x.dtype)


def int4_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """4-bit codes with a float16 scale per `group` elements of a row (the store's rounding at another group)."""
    xf = x.float().unflatten(-1, (-1, group))
    s = (xf.abs().amax(-1, keepdim=True) / 7).half().float()
    y = torch.floor((xf / s.clamp(min=torch.finfo(torch.float32).tiny)).clamp(-7, 7) + 0.5)
    return (y * s).flatten(-2).to(x.dtype)


def int4_channels(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """4-bit codes with a float16 scale per channel over each `block` tokens (KIVI's keys; the gather's unit).
    x `[B, H, N, D]`."""
    n = x.shape[2]
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, -n % block)).unflatten(2, (-1, block))
    s = (xf.abs().amax(3, keepdim=True) / 7).half().float()
    y = torch.floor((xf / s.clamp(min=torch.finfo(torch.float32).tiny)).clamp(-7, 7) + 0.5)
    return (y * s).flatten(2, 3)[:, :, :n].to(x.dtype)


SCHEMES = {  # name: (keys, values, bytes of a K row + a V row at head_dim 128)
    "fp8": (lambda k: rows(k, torch.float8_e4m3fn), lambda v: rows(v, torch.float8_e4m3fn), 2 * (128 + 4)),
    "int8": (lambda k: rows(k, torch.int8), lambda v: rows(v, torch.int8), 2 * (128 + 4)),
    "int4 (groups of 32, the store's)": (lambda k: rows(k, INT4), lambda v: rows(v, INT4), 2 * (64 + 8)),
    "int4, groups of 16": (lambda k: int4_groups(k, 16), lambda v: int4_groups(v, 16), 2 * (64 + 16)),
    "int4, keys per channel per 64 tokens, values groups of 32": (int4_channels, lambda v: rows(v, INT4),
                                                                  64 + 4 + 64 + 8),
    "fp8 keys, int4 values (groups of 32)": (lambda k: rows(k, torch.float8_e4m3fn), lambda v: rows(v, INT4),
                                             128 + 4 + 64 + 8),
    "int8 keys, int4 values (groups of 32)": (lambda k: rows(k, torch.int8), lambda v: rows(v, INT4),
                                              128 + 4 + 64 + 8),
}


def main() -> int:
    out_path, length = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    torch.set_grad_enabled(False)
    model, tok, _ = load_model(device="cpu", dtype=torch.float32)
    samples = {task: make_sample(task, tok, length, seed=0).input_ids.reshape(1, -1)
               for task in ("passkey", "multikey", "code")}
    t0 = time.time()
    ref = {task: model(ids).logits[0, -64:].float().log_softmax(-1) for task, ids in samples.items()}
    result = {"what": __doc__.split("\n\n")[0], "model": "SmolLM2-135M-Instruct (embedded), fp32, CPU",
              "length": length, "positions": 64, "environment": environment(),
              "schemes": {}}
    for name, (fk, fv, nbytes) in SCHEMES.items():
        def attend(module, query, key, value, attention_mask, **kw):
            if module.layer_idx > 0:
                key, value = fk(key), fv(value)
            return dense_attention(module, query, key, value, attention_mask, **kw)

        per_task = {}
        with attention_override(model, attend):
            for task, ids in samples.items():
                lp = model(ids).logits[0, -64:].float().log_softmax(-1)
                kl = (ref[task].exp() * (ref[task] - lp)).sum(-1)
                per_task[task] = {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                                  "top1": (lp.argmax(-1) == ref[task].argmax(-1)).float().mean().item()}
        result["schemes"][name] = {"bytes_per_kv_row_d128": nbytes, "bytes_vs_fp8": nbytes / 264, **{
            k: sum(t[k] for t in per_task.values()) / len(per_task) for k in ("kl_mean", "top1")}, "tasks": per_task}
        print(f"{name:60s} {nbytes:4d} B  KL {result['schemes'][name]['kl_mean']:.4f}  "
              f"top-1 {result['schemes'][name]['top1']:.3f}  ({time.time() - t0:.0f} s)", flush=True)
        write_json(out_path, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
