"""Sample generators: exact length, needle where asked, deterministic, clear errors."""
import pytest

from workbench.core.corpus import make_sample

pytestmark = pytest.mark.model


@pytest.mark.parametrize("task", ["passkey", "multikey", "vartrack", "code"])
@pytest.mark.parametrize("length", [300, 1000])
def test_exact_length_and_deterministic(embedded, task, length):
    tok = embedded[1]
    a, b = make_sample(task, tok, length, seed=3), make_sample(task, tok, length, seed=3)
    assert a.length == length and a.sha == b.sha
    assert make_sample(task, tok, length, seed=4).sha != a.sha
    for start, end in a.needles:
        assert 0 < start < end <= length


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_at_requested_depth(embedded, depth):
    tok = embedded[1]
    s = make_sample("passkey", tok, 2000, seed=1, depth=depth)
    (start, end), = s.needles
    assert s.answer in tok.decode(s.input_ids[start:end])
    assert abs(start / 2000 - depth) < 0.08  # header/question tokens and sentence boundaries shift it a little
    assert tok.decode(s.input_ids[-30:]).rstrip().endswith("The secret number is")


def test_text_file_and_errors(embedded, tmp_path):
    tok = embedded[1]
    f = tmp_path / "notes.txt"
    f.write_text("A short note about sparse attention. " * 3)
    s = make_sample(str(f), tok, 500)
    assert s.length == 500 and s.task == "file:notes.txt"
    with pytest.raises(ValueError, match="unknown sample task"):
        make_sample("nope", tok, 100)
    with pytest.raises(ValueError, match="too short"):
        make_sample("passkey", tok, 20)
    with pytest.raises(ValueError, match="exceeds the model's maximum"):
        make_sample("passkey", tok, 9000, max_length=8192)
    (tmp_path / "empty.txt").write_text("  ")
    with pytest.raises(ValueError, match="empty"):
        make_sample(str(tmp_path / "empty.txt"), tok, 100)
