"""`selfspec serve` as a user runs it: a real process, the curl hint, Ctrl-C stops it cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_helpers import free_port

from selfspec.serve.cli import ServeArgs, build_state, how_to_call


def test_serve_command_starts_prints_how_to_call_and_stops_on_sigint(assets) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "selfspec.cli", "serve",
        "--model", str(assets["target"]), "--heads", str(assets["heads"]),
        "--adapters-root", str(assets["adapters"]), "--port", str(port), "--threads", "1",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 45
        while True:
            assert process.poll() is None, process.communicate()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        body = {"model": "attn", "prompt": "abc", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
        # Ctrl-C while a request is in flight: it is drained, not dropped.
        long = {**body, "max_tokens": 100, "ignore_eos": True, "speculation": False}
        in_flight: dict[str, httpx.Response] = {}
        client = threading.Thread(
            target=lambda: in_flight.update(r=httpx.post(f"{url}/v1/completions", json=long))
        )
        client.start()
        while httpx.get(f"{url}/health").json()["running"] == 0:
            time.sleep(0.02)
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    client.join(timeout=30)
    assert in_flight["r"].status_code == 200
    assert in_flight["r"].json()["usage"]["completion_tokens"] == 100
    assert process.returncode == 0, err
    assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in out
    assert '"model": "tiny-llama"' in out


def test_explicit_lora_modules_without_a_root(assets) -> None:
    args = ServeArgs(
        model=str(assets["target"]),
        heads="none",
        lora_modules=(f"mine={assets['adapters'] / 'mlp'}",),
    )
    state = build_state(args)
    assert state.served == {"mine"} and not state.can_speculate


def test_an_adapter_named_like_the_base_model_is_refused_at_startup(assets) -> None:
    from selfspec.adapters import AdapterError

    args = ServeArgs(
        model=str(assets["target"]),
        heads="none",
        lora_modules=(f"tiny-llama={assets['adapters'] / 'mlp'}",),
    )
    with pytest.raises(AdapterError, match="tiny-llama"):
        build_state(args)


def test_bad_arguments_are_refused_with_the_flag_named() -> None:
    with pytest.raises(ValueError, match="--lora-modules"):
        ServeArgs(lora_modules=("no-equals-sign",))
    with pytest.raises(ValueError, match="--port"):
        ServeArgs(port=70000)
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N"):
        ServeArgs(device="gpu")
    with pytest.raises(ValueError, match="--device cuda does not run dtype 'int4'"):
        ServeArgs(device="cuda", dtype="int4")
    with pytest.raises(ValueError, match="--replicas runs its engine replicas on the CPU"):
        ServeArgs(device="cuda", replicas=2)


def test_the_device_reaches_the_target() -> None:
    spec = ServeArgs(device="cuda:0", dtype="bfloat16", kernels=False).target_spec()
    assert (spec.device, spec.dtype, spec.kernels) == ("cuda:0", "bfloat16", False)


def test_how_to_call_points_at_loopback_for_a_wildcard_host() -> None:
    assert how_to_call("0.0.0.0", 9000, "m").startswith("curl http://127.0.0.1:9000/")
