"""What a benchmark leaves behind: a record of the machine it ran on, so that every figure names
its CPU, and its report as JSON and as markdown tables."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import numpy as np
import torch

from selfspec.atomic import write_text_atomic
from selfspec.cost_curve import cpu_flags, cpu_model
from selfspec.kernels.ops import kernel_isa


def machine_record() -> dict[str, Any]:
    """CPU model and flags, the kernels' instruction-set path, torch threads and versions."""
    return {
        "cpu": cpu_model(),
        "flags": cpu_flags(),
        "kernels": kernel_isa(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of process ``pid`` (this one by default), from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (linear interpolation), None for no values."""
    return float(np.percentile(values, q)) if values else None


def write_report(out: Path, report: dict[str, Any], table: str, stem: str = "results") -> None:
    """OUT/STEM.json (the report) and OUT/STEM.md (its tables), each atomically; the tables
    printed."""
    write_text_atomic(out / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    write_text_atomic(out / f"{stem}.md", table)
    print(table)
