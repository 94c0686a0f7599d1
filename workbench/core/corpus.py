"""Deterministic long-context samples of an exact token length, built offline.

Filler prose comes from the Python documentation topics that ship with CPython (`pydoc_data`),
code from the standard library's own source files; nothing is downloaded. A sample is a token
sequence: the context is cut to the exact length and the needles are inserted at whole-sentence
token boundaries at the requested depth.
"""
from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TASKS = ("passkey", "multikey", "vartrack", "code")
_HEADER = "<|im_start|>user\nRead the document and answer the question at the end.\n\n"
_FOOTER = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class Sample:
    """One prompt. input_ids `[N]`; `needles` are the (start, end) token spans of planted facts."""

    task: str
    input_ids: torch.Tensor
    answer: str
    seed: int
    depth: float | None = None
    needles: list[tuple[int, int]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.numel())

    @property
    def sha(self) -> str:
        """sha256 of the token ids (provenance)."""
        return hashlib.sha256(self.input_ids.numpy().astype("int64").tobytes()).hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, "length": self.length, "seed": self.seed, "depth": self.depth,
                "sha": self.sha, **self.meta}


def _prose_sentences() -> list[str]:
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    sentences = [s.strip().replace("\n", " ") + "." for s in text.split(". ")]
    return [" ".join(s.split()) for s in sentences if 40 <= len(s) <= 400]


def _code_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)


def _encode(tok: Any, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _filler(tok: Any, n_tokens: int, rng: random.Random, source: str) -> list[list[int]]:
    """Whole sentences (prose) or whole lines (code), as token lists, totalling >= n_tokens."""
    if source == "code":
        files = _code_files()
        units: list[list[int]] = []
        total = 0
        while total < n_tokens:
            path = files[rng.randrange(len(files))]
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
            for i in range(0, len(lines), 8):
                ids = _encode(tok, "".join(lines[i:i + 8]))
                units.append(ids)
                total += len(ids)
                if total >= n_tokens:
                    break
        return units
    sentences = _prose_sentences()
    units, total = [], 0
    start = rng.randrange(len(sentences))
    i = start
    while total < n_tokens:
        ids = _encode(tok, " " + sentences[i % len(sentences)])
        units.append(ids)
        total += len(ids)
        i += 1
    return units


def _assemble(tok: Any, length: int, rng: random.Random, needles: list[tuple[float, str]], question: str,
              answer_prefix: str = "", source: str = "prose",
              text_units: list[list[int]] | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Header + filler with needles at relative depths + question + footer + the start of the
    assistant's answer, exactly `length` tokens."""
    head = _encode(tok, _HEADER)
    tail = _encode(tok, "\n\n" + question + _FOOTER + answer_prefix) if question else []
    needle_ids = [(d, _encode(tok, " " + t)) for d, t in needles]
    budget = length - len(head) - len(tail) - sum(len(ids) for _, ids in needle_ids)
    if budget < 1:
        raise ValueError(f"length={length} is too short for task text of {length - budget} tokens: "
                         f"use a length of at least {length - budget + 16}")
    units = text_units if text_units is not None else _filler(tok, budget, rng, source)
    flat = [t for u in units for t in u]
    while len(flat) < budget:  # a short user text is repeated
        flat += flat[: budget - len(flat)]
    flat = flat[:budget]
    # sentence boundaries (token offsets) where a needle may go
    bounds, pos = [0], 0
    for u in units:
        pos += len(u)
        if pos >= budget:
            break
        bounds.append(pos)
    out, spans, prev = list(head), [], 0
    for depth, ids in sorted(needle_ids, key=lambda x: x[0]):
        cut = min(bounds, key=lambda b: abs(b - depth * budget))
        cut = max(cut, prev)
        out += flat[prev:cut]
        spans.append((len(out), len(out) + len(ids)))
        out += ids
        prev = cut
    out += flat[prev:] + tail
    assert len(out) == length, (len(out), length)
    return out, spans


def depths(count: int) -> list[float]:
    """`count` needle depths (fractions of the prompt) spread evenly over [0.05, 0.95], for `make_sample`."""
    return [0.5] if count == 1 else [round(0.05 + 0.9 * i / (count - 1), 4) for i in range(count)]


def make_sample(task: str, tokenizer: Any, length: int, seed: int = 0, depth: float = 0.5,
                max_length: int | None = None) -> Sample:
    """Build a sample of exactly `length` tokens.

    task: "passkey" (a 5-digit key at `depth` in [0, 1]), "multikey" (4 keyed numbers, one asked),
    "vartrack" (a chain of 4 variable assignments spread over the context), "code" (standard-library
    Python source, no question), or the path of a UTF-8 text file (cut or repeated to length).
    """
    if length < 1:
        raise ValueError(f"length must be >= 1 token, got {length}")
    if max_length is not None and length > max_length:
        raise ValueError(f"length={length} exceeds the model's maximum of {max_length} tokens: use --length <= {max_length}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (fraction of the context before the needle), got {depth}")
    rng = random.Random(f"{task}:{length}:{seed}")
    if task == "passkey":
        key = str(rng.randrange(10000, 100000))
        needle = f"The secret number is {key}. Remember it. {key} is the secret number."
        ids, spans = _assemble(tokenizer, length, rng, [(depth, needle)],
                               "What is the secret number?", "The secret number is")
        return Sample(task, torch.tensor(ids), key, seed, depth, spans)
    if task == "multikey":
        words = ["amber", "cobalt", "crimson", "indigo", "jade", "scarlet", "silver", "violet"]
        names = rng.sample(words, 4)
        values = [str(rng.randrange(100000, 1000000)) for _ in names]
        target = rng.randrange(4)
        depths = [depth if i == target else rng.random() for i in range(4)]
        facts = [(d, f"The special magic number for {w} is {v}.") for d, w, v in zip(depths, names, values)]
        ids, spans = _assemble(tokenizer, length, rng, facts,
                               f"What is the special magic number for {names[target]}?",
                               f"The special magic number for {names[target]} is")
        return Sample(task, torch.tensor(ids), values[target], seed, depth, spans, {"keys": names})
    if task == "vartrack":
        names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(4)]
        value = str(rng.randrange(10000, 100000))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
        ids, spans = _assemble(tokenizer, length, rng, list(zip(depths, chain)),
                               f"Which variables are assigned the value {value}?", "Answer: VAR")
        return Sample(task, torch.tensor(ids), " ".join(names), seed, None, spans)
    if task == "code":
        ids, spans = _assemble(tokenizer, length, rng, [], "", source="code")
        return Sample(task, torch.tensor(ids), "", seed, None, spans)
    path = Path(task)
    if not path.is_file():
        raise ValueError(f"unknown sample task {task!r}: use one of {', '.join(TASKS)} or the path of a text file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"{path} is empty: give a text file with some content")
    units = [_encode(tokenizer, text)]
    ids, spans = _assemble(tokenizer, length, rng, [], "", text_units=units)
    return Sample(f"file:{path.name}", torch.tensor(ids), "", seed, None, spans, {"path": str(path)})
