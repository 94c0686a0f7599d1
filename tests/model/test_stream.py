"""The layer-major streaming forward reproduces the model's own forward, `capture_attention` and today's
statistics and search evidence; bad input is refused before the forward; a stopped run says where."""
import json
import subprocess
import sys

import pytest
import torch

from workbench.analysis.head_kinds import profile_layer
from workbench.analysis.layer_profiles import PROFILE_MAPS, LayerProfiles
from workbench.analysis.stats import layer_stats
from workbench.core.capture import capture_attention
from workbench.core.model import ModelError
from workbench.core.stream import (
    LayerRunner,
    ModelMask,
    RunStopped,
    check_mask,
    check_memory,
    stopped_midway,
    stream_capture,
)
from workbench.search.search import choose, collect_evidence, default_candidates

pytestmark = pytest.mark.model

LAYERS = [0, 14, 29]


@pytest.fixture(scope="module")
def prompt(embedded):
    from workbench.core.corpus import make_sample

    return make_sample("passkey", embedded[1], 512, seed=0).input_ids


@pytest.fixture(scope="module")
def captured(embedded, prompt):
    model, _, shape = embedded
    return capture_attention(model, shape, prompt, layers=LAYERS, progress=False)


def test_layer_major_forward_equals_the_model(embedded, prompt):
    model, _, _ = embedded
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
    whole = LayerRunner(model, chunk=512, progress=False).forward(prompt)
    assert torch.equal(whole, out.hidden_states[-1])  # one chunk: the model's own computation, bit for bit
    assert not whole.requires_grad  # no autograd graph kept (the final norm's fp32 copy of [N, hidden])
    chunked = LayerRunner(model, chunk=200, progress=False).forward(prompt)  # ragged chunks: 200, 200, 112
    assert (chunked - out.hidden_states[-1]).abs().max() <= 1e-3 * out.hidden_states[-1].abs().max()
    logits = model.lm_head(chunked)
    assert (logits - out.logits).abs().max() <= 1e-3 * out.logits.abs().max()
    assert torch.equal(logits[0].argmax(-1), out.logits[0].argmax(-1))


@pytest.mark.parametrize("chunk", [512, 200])
def test_streamed_qkv_equal_the_capture(embedded, prompt, captured, chunk):
    model, _, shape = embedded
    cap = stream_capture(model, shape, prompt, layers=LAYERS, chunk=chunk, progress=False)
    assert (cap.layers, cap.n, cap.scale) == (captured.layers, captured.n, captured.scale)
    for layer in LAYERS:
        for got, want in zip(cap.layer_qkv(layer), captured.layer_qkv(layer)):
            if chunk == 512:
                assert torch.equal(got, want), layer
            else:
                assert (got - want).abs().max() <= 1e-4 * want.abs().max(), layer
    assert torch.equal(cap.head_qkv(29, 4)[1], cap.layer_qkv(29)[1][shape.kv_head(4)])
    assert cap.passes == 1
    cap.layer_qkv(0)  # an earlier layer: a new forward
    assert cap.passes == 2


def test_streaming_statistics_and_evidence_equal_today(embedded, prompt, captured):
    """Profiles (analyze) and evidence (search) from a chunked streaming run equal today's capture + functions;
    the search picks the same candidate for every head."""
    model, _, shape = embedded
    cap = stream_capture(model, shape, prompt, layers=LAYERS, chunk=200, progress=False)
    profiles = LayerProfiles(cap.scale)
    cap.on_layer(profiles)
    cands = default_candidates(cap.n)
    ev = collect_evidence([cap], [{}], [cap.n], cands, shape.n_layers, shape.n_heads, progress=False)
    assert cap.passes == 1  # statistics and evidence in one forward
    want = [p for l in LAYERS for p in profile_layer(
        layer_stats(*captured.layer_qkv(l)[:2], captured.scale, maps=PROFILE_MAPS), l)]
    assert [(p.layer, p.head, p.kind) for p in profiles.profiles] == [(p.layer, p.head, p.kind) for p in want]
    for got, ref in zip(profiles.profiles, want):
        for metric in ("sink", "local", "vertical", "slash", "block", "entropy"):
            assert abs(getattr(got, metric) - getattr(ref, metric)) <= 1e-4, (got, metric)
    top, top_map = profiles.top["vertical"]
    assert (top.layer, top.head) == max(((p.layer, p.head, p.vertical) for p in want), key=lambda x: x[2])[:2]
    assert top_map.max_map.shape[0] == 1
    ev0 = collect_evidence([captured], [{}], [cap.n], cands, shape.n_layers, shape.n_heads, progress=False)
    for name in ("mass", "tail", "oracle", "tiles", "edges"):
        assert (getattr(ev, name) - getattr(ev0, name)).abs().max() <= 1e-4, name
    ev.done[:], ev0.done[:] = 1, 1
    assert torch.equal(choose(ev)[LAYERS], choose(ev0)[LAYERS])


def test_sliding_window_layers_follow_the_model():
    """A tiny Gemma-3 (sliding and full layers, window 48): chunks shorter and longer than the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=48,
                           query_pre_attn_scalar=32, max_position_embeddings=4096, attn_implementation="sdpa",
                           layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 512, (300,))
    with torch.no_grad():
        want = model.model(ids[None]).last_hidden_state
    assert torch.equal(LayerRunner(model, chunk=300, progress=False).forward(ids), want)
    for chunk in (37, 100):
        got = LayerRunner(model, chunk=chunk, progress=False).forward(ids)
        assert (got - want).abs().max() <= 1e-4, chunk
    model.config.use_bidirectional_attention = True  # the model's own masks change: the runner refuses
    with pytest.raises(ModelError, match="mask is not causal"):
        LayerRunner(model, chunk=100, progress=False).forward(ids)


def test_the_mask_check_reads_the_models_mask_function():
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function
    from transformers.masking_utils import sliding_window_causal_mask_function as sliding

    check_mask(ModelMask(causal_mask_function), None, 300)
    check_mask(ModelMask(sliding(48)), 48, 300)
    check_mask(None, None, 300)  # no mask function given: nothing to check
    for fn, window in ((bidirectional_mask_function, None), (causal_mask_function, 48), (sliding(48), None),
                       (sliding(47), 48)):
        with pytest.raises(ModelError, match="mask is not causal"):
            check_mask(ModelMask(fn), window, 300)


def test_bad_input_is_refused_before_the_forward(embedded, prompt):
    model, _, shape = embedded
    with pytest.raises(ModelError, match="at most 8192"):
        stream_capture(model, shape, torch.zeros(9000, dtype=torch.long))
    with pytest.raises(ModelError, match="layers 0..29"):
        stream_capture(model, shape, prompt, layers=[3, 30])
    with pytest.raises(ModelError, match="positive number of query rows"):
        stream_capture(model, shape, prompt, chunk=0)
    free = 600 * 2 ** 20
    with pytest.raises(ModelError, match=r"at most (\d+) tokens fit. Use --length <= \1") as err:
        check_memory(model, shape, 8192, 4096, free=free)
    fits = int(str(err.value).split("at most ")[1].split()[0])
    assert 0 < fits < 8192
    check_memory(model, shape, fits, 4096, free=free)  # the number it names does fit
    with pytest.raises(ModelError):
        check_memory(model, shape, fits + 1, 4096, free=free)


def test_a_stopped_run_says_which_layer_it_reached(embedded, prompt):
    model, _, shape = embedded
    cap = stream_capture(model, shape, prompt, layers=LAYERS, progress=False)

    def stop(layer, q, k, v, lse=None):
        if layer == 14:
            raise KeyboardInterrupt

    cap.on_layer(stop)
    with pytest.raises(RunStopped, match=r"interrupted while analysing layer 14 .*: nothing was written"):
        with stopped_midway():
            cap.run()


def test_cli_random_weights_and_no_half_written_report(tmp_path):
    """`--random-weights` with a config.json: the report says so; bad lengths/layers are refused before
    the model is built; a run stopped midway writes nothing."""
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
                                  "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 2048}))
    out = tmp_path / "rep"
    base = [sys.executable, "-m", "workbench", "analyze", "--random-weights", str(config), "--out", str(out)]
    r = subprocess.run(base + ["--length", "256", "--layers", "0,2", "--chunk", "100"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "random weights (3 of 4 layers" in summary["random_weights"] and summary["layers"] == [0, 2]
    assert summary["stream"] == {"chunk": 100, "forward_passes": 1} and summary["sample"]["task"] == "random"
    assert "RANDOM WEIGHTS" in (out / "index.html").read_text() and "time and memory only" in r.stdout
    for flags, message in ((["--length", "4096"], "allows at most 2048"), (["--layers", "4"], "layers 0..3")):
        r = subprocess.run(base[:-1] + [str(tmp_path / "bad"), "--length", "256"] + flags, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 2 and message in r.stderr and "random weights" not in r.stderr, r.stderr
    stopped = tmp_path / "stopped"
    code = subprocess.run([sys.executable, "-c", (
        "import sys; from workbench.analysis.layer_profiles import LayerProfiles\n"
        "def stop(self, layer, *a, **kw):\n"
        "    raise KeyboardInterrupt\n"
        "LayerProfiles.__call__ = stop\n"
        "from workbench.cli import main\n"
        f"sys.exit(main({base[3:-1] + [str(stopped), '--length', '256']!r}))")],
        capture_output=True, text=True, timeout=600)
    assert code.returncode == 2 and "interrupted while analysing layer 0" in code.stderr, code.stderr
    assert "no report was written" in code.stderr and not stopped.exists()
