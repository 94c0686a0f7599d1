"""Lists of indices written as ranges, e.g. layers "0-3,7" <-> [0, 1, 2, 3, 7], and lists of counts such as
lengths "4096,8192" (the command line, the dashboard's inputs and error messages all use these spellings)."""
from __future__ import annotations


def parse_ranges(text: str, what: str = "layers") -> list[int]:
    """"0-3,7" -> [0, 1, 2, 3, 7] (sorted, each index once). Raises ValueError naming `what` and the
    spelling for anything else (negative numbers, "3-1", empty parts)."""
    out: set[int] = set()
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if dash else int(a)
            if lo < 0 or hi < lo:
                raise ValueError
        except ValueError:
            raise ValueError(f"{what} {text!r}: write indices and ranges such as 0-3,7 (from 0, low-high "
                             "with low <= high, comma-separated)") from None
        out.update(range(lo, hi + 1))
    return sorted(out)


def parse_counts(text: str, what: str = "") -> list[int]:
    """"4096, 8192" -> [4096, 8192]: comma-separated whole numbers >= 1, at least one, in the order given.
    Raises ValueError naming `what` and the spelling."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{what + ' ' if what else ''}{text!r}: write comma-separated whole numbers >= 1, "
                         "e.g. 4096,8192")
    return values


def format_ranges(ids: list[int]) -> str:
    """[28, 29, 30, 31, 40] -> "28-31, 40"."""
    ids = sorted(ids)
    if not ids:
        return "none"
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)
