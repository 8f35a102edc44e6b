"""What a benchmark records of the machine it ran on, so that every figure names its CPU."""

from __future__ import annotations

import platform
from typing import Any

import torch

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
