"""Shared fixtures. The embedded model is loaded once per test process (cached safetensors: ~1 s)."""
from __future__ import annotations

import inspect

import pytest
import torch


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


MODEL_FIXTURES = {"embedded", "capture_256"}


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
