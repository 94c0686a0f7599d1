"""Shared fixtures. The embedded model is loaded once per test process (cached safetensors: ~1 s).

Two Triton settings hold for the whole test process, set here before any test module imports a kernel:
- TRITON_INTERPRET=1 where there is no GPU: `triton.jit` reads it when a kernel is defined.
- TRITON_F32_DEFAULT=ieee: fp32 parity is about tiles and indexes, not TF32 rounding (it also makes
  `pooled_scores`' default precision "ieee"). Triton reads it when a kernel compiles, and its in-memory kernel
  cache does not key on it, so a per-test setting would hand later tests whatever compiled first.
Compiles for a GPU that run without one use `compile_env()` (tests/kernels/test_kernels_compile.py): interpreter
off, no knob."""
from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread while a module's tests run: CI runs two test processes on two shared cores, where one
    thread per process is several times faster than each taking both."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer, ModelShape) of the embedded SmolLM2-135M-Instruct, fp32 on the CPU."""
    from workbench.core.model import load_model

    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="session")
def capture_256(embedded):
    """A Capture of all 30 layers on a 256-token real-text prompt, with hidden states."""
    from workbench.core.capture import capture_attention
    from workbench.core.corpus import make_sample

    model, tok, shape = embedded
    sample = make_sample("passkey", tok, 256, seed=0)
    return capture_attention(model, shape, sample.input_ids, hidden=True, progress=False)


@pytest.fixture(scope="session")
def gemma():
    """(model, tokenizer, ModelShape) of the real Gemma-3-270M, fp32 on the CPU (from the workbench cache:
    seconds; the first load ever dequantises the GGUF, ~5 min on 2 cores)."""
    from workbench.core.model import GEMMA, load_model

    return load_model(GEMMA)


TINY_GEMMA_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


@pytest.fixture(scope="session")
def tiny_gemma():
    """(model, ModelShape) of a random-weight Gemma-3 text model, fp32 on the CPU, built in ~3 s: 4 layers
    (sliding, full, sliding, full), 2 query heads of d=256 on 1 KV head, window 96 (not a tile multiple),
    query_pre_attn_scalar 64 (softmax scale 1/8, not head_dim's 1/16), QK-norm, RoPE 1e4 on sliding and 1e6
    on full layers, the embedded tokenizer's vocabulary (49152) so its token ids fit. Weights drawn with
    std 0.2 so that attention is far from uniform."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from workbench.core.model import model_shape

    config = Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=64,
                              sliding_window=96, max_position_embeddings=4096, layer_types=list(TINY_GEMMA_TYPES),
                              initializer_range=0.2)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    return model, model_shape(model, "tiny-gemma")


MODEL_FIXTURES = {"embedded", "capture_256", "gemma"}


def _calls_load_model(item: pytest.Item) -> bool:
    fn = getattr(item, "function", None)
    try:
        return fn is not None and "load_model(" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    """Tests that use the embedded model (its fixtures, or `load_model` in their body) carry the `model` marker;
    `gpu` tests skip without CUDA."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (marker gpu)")
    for item in items:
        if item.get_closest_marker("model") is None and (
                MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or _calls_load_model(item)):
            item.add_marker(pytest.mark.model)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium per test process, shared by the dashboard (tests/ui) and JupyterLab
    (tests/notebooks) tests: Playwright's sync API cannot start a second session in a thread that holds one."""
    from headless import ARGS, CHROMIUM
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()
