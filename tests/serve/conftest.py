"""Fixtures of the server tests: a tiny Llama target on disk, untrained EAGLE heads, adapters."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from serve_helpers import make_adapter
from tiny_models import make_tiny_model, save_tiny_target

from selfspec.fingerprint import fingerprint_of
from selfspec.heads import build_heads, heads_config_for, save_heads
from selfspec.serve.background import running_server
from selfspec.serve.cli import ServeArgs, build_state

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    target = save_tiny_target(root / "tiny-llama")
    model = make_tiny_model("llama", 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        heads = build_heads(heads_config_for(model, "eagle"))
    save_heads(heads, root / "heads", fingerprint_of(model))
    adapters = root / "adapters"
    make_adapter(adapters / "attn", seed=1)
    make_adapter(adapters / "mlp", seed=2, targets=("down_proj", "up_proj"))
    return {"target": target, "heads": root / "heads", "adapters": adapters, "root": root}


@pytest.fixture(scope="session")
def server_for(assets) -> Callable[..., object]:
    """`server_for(**ServeArgs overrides)`: a context manager giving (url, state, uvicorn)."""
    from contextlib import contextmanager

    @contextmanager
    def start(**overrides: object) -> Iterator[tuple[str, object, object]]:
        fields = {
            "model": str(assets["target"]),
            "heads": str(assets["heads"]),
            "adapters_root": str(assets["adapters"]),
            # A fixed tree: on a tiny model the adaptive default may rightly decide that no
            # draft is worth verifying, and these tests check what speculation reports.
            "tree": "dynamic",
            # Every round drafts: the speculation gate, timing rounds, could rightly find plain
            # rounds faster here and skip drafting (tests/serve/test_serve_gate.py runs it).
            "speculation_gate": False,
            **overrides,
        }
        state = build_state(ServeArgs(**fields))
        with running_server(state) as (url, server):
            yield url, state, server

    return start


@pytest.fixture(scope="module")
def main_server(server_for) -> Iterator[tuple[str, object]]:
    with server_for(max_running=4, max_queue=8, enable_lora_management=True) as (url, state, _):
        yield url, state
