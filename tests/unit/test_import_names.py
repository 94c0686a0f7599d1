"""The repository's kernels/ folder never stands in for Hugging Face's `kernels` package."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_root_on_sys_path_leaves_kernels_to_hugging_face():
    """`python -c` from the repository root puts it first on sys.path (as `python -m pytest` and notebooks
    started there do): transformers' model code still imports, our kernels import as `workbench_kernels`,
    and the name `kernels` is Hugging Face's package or nothing, never the folder kernels/."""
    code = ("import importlib.util, transformers.activations, workbench_kernels.tiling as t; "
            "s = importlib.util.find_spec('kernels'); print(t.BLOCK, getattr(s, 'origin', None))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    block, origin = done.stdout.split()
    assert block == "64"
    assert origin == "None" or not Path(origin).resolve().is_relative_to(ROOT / "kernels"), origin
