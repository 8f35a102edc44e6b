"""Shared fixtures: tiny random models built from configs (see tiny_models.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tiny_models import make_tiny_model
from transformers import PreTrainedModel

# Tiny models gain nothing from a second thread, and on a shared 2-core machine oversubscribed
# threads make every forward many times slower.
torch.set_num_threads(1)


@pytest.fixture
def tiny_model_factory() -> Callable[..., PreTrainedModel]:
    """`make(arch, seed=0)`: a tiny random causal LM; arch is one of tiny_models.ARCHS."""
    return make_tiny_model
