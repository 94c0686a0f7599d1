"""Files in and out. Writes are atomic: a reader sees the old file or the whole new one, never half of one.
JSON is written as JSON (NaN and infinities, which JSON has no numbers for, become null); reads name the
file and the fix when it is missing, a folder, unreadable, not UTF-8 text or not JSON."""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success rename it over `path`, on error delete it."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give a file path to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask)  # ordinary permissions: mkstemp makes 0600, and so does safetensors' writer
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def json_safe(obj: Any) -> Any:
    """`obj` with every NaN / infinite float replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any) -> Path:
    """Write `obj` as indented JSON (atomic); NaN and infinities are written as null."""
    return write_text(path, json.dumps(json_safe(obj), indent=1, sort_keys=False, allow_nan=False) + "\n")


def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of `path`; errors say which `what` (e.g. "head config") and how to fix it."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist: check the path") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{what} {path} is a folder: give the file inside it") from None
    except PermissionError:
        raise PermissionError(f"{what} {path} cannot be read (permission denied): fix its permissions or "
                              "copy it somewhere readable") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}): it looks binary or "
                         "saved in another encoding such as Latin-1; give the text file itself, or re-save it "
                         "as UTF-8") from None


def read_json(path: str | Path, what: str = "JSON file", **kwargs: Any) -> Any:
    """The JSON value in `path` (`kwargs` go to `json.loads`, e.g. object_pairs_hook); errors name the
    file, the place and the fix. NaN and Infinity, which Python writes but JSON does not allow, are read
    as floats."""
    text = read_text(path, what)
    if not text.strip():
        raise ValueError(f"{what} {path} is empty: give the complete file")
    try:
        return json.loads(text, **kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): the "
                         "file looks truncated or edited by hand; restore the complete file") from None
