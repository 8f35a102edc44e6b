"""Start a real selfspec server on a free loopback port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import uvicorn
from peft import LoraConfig, get_peft_model
from tiny_models import make_tiny_model

from selfspec.serve.app import ServerState, create_app


def make_adapter(path: Path, seed: int, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A LoRA adapter of the tiny Llama with random non-zero weights (moves the output)."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(make_tiny_model("llama", 0), lora)
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(state: ServerState) -> Iterator[tuple[str, uvicorn.Server]]:
    """(base URL, uvicorn server) of `state` served on 127.0.0.1; stopped on exit."""
    config = uvicorn.Config(
        create_app(state),
        host="127.0.0.1",
        port=free_port(),
        log_level="warning",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
