"""Fixtures for the adapter tests: a tiny Llama base, heads, and a root of real LoRA adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import make_adapter
from tiny_models import make_tiny_model

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the CI machine is shared


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three adapters of the tiny Llama: attention-only, all-linear, MLP-only."""
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(root / "attn", seed=1)
    make_adapter(root / "all.linear", seed=2, targets=ALL_LINEAR, rank=8)
    make_adapter(root / "mlp_down", seed=3, targets=("down_proj",), rank=2, std=1.5)
    return root


@pytest.fixture
def base() -> torch.nn.Module:
    return make_tiny_model("llama", 0)
