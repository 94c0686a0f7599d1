"""Files shipped inside the package, found from any folder (also after a wheel install). README.md says
how each was made.

    configs/<model>.json              the head config searched for a model (`shipped_config`)
    configs/head_config.schema.json   the head-config JSON Schema (`SCHEMA_FILE`)
    forecast/<model>.safetensors      trained SparDA Forecast heads for a model (`shipped_forecast_heads`)
    latency/prefill_<gpu>.json        the kernel times the latency estimate reads, one table per GPU
                                      (`shipped_latency`; `LATENCY_BENCH`, the H200's, by default): the rows of
                                      a committed `workbench bench kernels` result

<model> is `ModelShape.name` with characters other than letters, digits, '.', '_' and '-' replaced by
'-' (`file_stem`). Nothing writes here: commands write under reports/ unless --out says otherwise.
"""
from __future__ import annotations

import re
from pathlib import Path

DATA = Path(__file__).resolve().parent
SCHEMA_FILE = DATA / "configs" / "head_config.schema.json"
LATENCY = DATA / "latency"
LATENCY_BENCH = LATENCY / "prefill_h200.json"


def file_stem(model_name: str) -> str:
    """A model name as a file name: "org/My Model" -> "org-My-Model"."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", model_name)


def shipped_config(model_name: str) -> Path | None:
    """The head config shipped for `model_name`, or None when there is none."""
    path = DATA / "configs" / f"{file_stem(model_name)}.json"
    return path if path.is_file() else None


def shipped_forecast_heads(model_name: str) -> Path | None:
    """The Forecast heads shipped for `model_name`, or None when there are none."""
    path = DATA / "forecast" / f"{file_stem(model_name)}.safetensors"
    return path if path.is_file() else None


def shipped_latency(gpu: str) -> Path | None:
    """The kernel-time table shipped for a GPU named as `core.timing.gpu_tag` names it ("h100"), or None."""
    path = LATENCY / f"prefill_{gpu.lower()}.json"
    return path if path.is_file() else None


def latency_gpus() -> list[str]:
    """The GPUs a kernel-time table is shipped for ("h100", "h200", ...)."""
    return [p.stem.removeprefix("prefill_") for p in sorted(LATENCY.glob("prefill_*.json"))]
