"""Example LoRA adapters shipped for the embedded default target (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from pathlib import Path

EXAMPLES_DIR = Path(__file__).parent / "examples"
"""One subdirectory per example adapter, named by the adapter."""


def examples_root() -> Path | None:
    """The shipped examples directory, or None when no example is installed."""
    if EXAMPLES_DIR.is_dir() and any(EXAMPLES_DIR.glob("*/adapter_config.json")):
        return EXAMPLES_DIR
    return None
