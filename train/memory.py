"""Catch out-of-memory-sized settings before any work starts, with a message naming them."""

from __future__ import annotations

import os

import torch

USABLE_FRACTION = 0.8
"""Share of the device's memory a run may plan to use; the rest is for everything else."""


class MemoryBudgetError(ValueError):
    """The settings would need more memory than the device has."""


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits(needed_bytes: int, device: torch.device, settings: str) -> None:
    """Raise `MemoryBudgetError` when ``needed_bytes`` exceeds the usable share of ``device``."""
    available = int(device_memory_bytes(device) * USABLE_FRACTION)
    if needed_bytes > available:
        raise MemoryBudgetError(
            f"{settings} needs about {needed_bytes / 2**30:.1f} GiB, more than the "
            f"{available / 2**30:.1f} GiB usable on {device}; lower the batch size or lengths"
        )
