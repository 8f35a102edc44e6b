"""The server on a GPU (`selfspec serve --device cuda`): adapters hot-swapped, lossless.

Skipped without a CUDA GPU (``scripts/gpu_check.sh`` runs it on a GPU machine).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BODIES = [
    {"model": "attn", "prompt": "abc"},
    {"model": "mlp", "prompt": "abc"},
    {"model": "tiny-llama", "prompt": "abc"},
    {"model": "attn", "prompt": "The fox"},
]


def _text(url: str, body: dict[str, object]) -> str:
    full = {**body, "temperature": 0, "max_tokens": 24, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", json=full, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("backend", ["fast", "peft"])
def test_the_server_on_the_gpu_speculates_losslessly_on_every_adapter(
    server_for, backend: str
) -> None:
    with server_for(device="cuda", lora_backend=backend, max_running=4) as (url, state, _):
        assert state.generator.target.device.type == "cuda"
        vanilla = [_text(url, {**b, "speculation": False}) for b in BODIES]
        assert len(set(vanilla[:3])) == 3, "an adapter changed nothing"
        assert [_text(url, b) for b in BODIES] == vanilla
        with ThreadPoolExecutor(len(BODIES)) as pool:  # verified together in one forward
            assert list(pool.map(lambda b: _text(url, b), BODIES)) == vanilla
        resident = [p for p in state.store.base_model.parameters()]
        assert all(p.device.type == "cuda" for p in resident)  # peft's LoRA weights included
