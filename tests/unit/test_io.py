"""Atomic writes (`workbench.core.io.atomic_path`): ordinary permissions whoever writes the temp file, and a
failed write leaves the previous file and no temp file behind."""
import os
import stat

import pytest
import torch

from workbench.core.io import atomic_path, write_text


def test_the_written_file_gets_the_umasks_permissions_even_from_a_writer_that_makes_0600(tmp_path):
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        path = tmp_path / "heads.safetensors"
        with atomic_path(path) as tmp:
            save_file({"w": torch.zeros(3)}, str(tmp))  # safetensors replaces the file with a 0600 one
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        assert stat.S_IMODE(write_text(tmp_path / "a.txt", "x").stat().st_mode) == 0o644
    finally:
        os.umask(old)


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = write_text(tmp_path / "c.json", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("stopped")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["c.json"]
