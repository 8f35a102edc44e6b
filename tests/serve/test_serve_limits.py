"""Limits and access over real HTTP: API key, allowed hosts and origins, JSON-only POSTs, body
size, malformed bodies, a catch-all 500, request deadlines, drain-then-unload, and draining with
503s. After every refusal the server keeps serving."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from selfspec.serve import app as app_module
from selfspec.serve.cli import API_KEY_ENV, ServeArgs, build_state

BODY = {"model": "tiny-llama", "prompt": "abc", "max_tokens": 2, "temperature": 0}
LONG = {"model": "attn", "prompt": "abc", "temperature": 0, "max_tokens": 400,
        "ignore_eos": True, "speculation": False}  # fmt: skip


def _serves(url: str, **headers: str) -> None:
    reply = httpx.post(f"{url}/v1/completions", json=BODY, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def _error(reply: httpx.Response, status: int, code: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def _wait_running(url: str, running: int, headers: dict | None = None) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").json()["running"] != running:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def test_api_key_guards_every_route_but_health(server_for) -> None:
    with server_for(api_key="s3cret") as (url, _, _):
        assert httpx.get(f"{url}/health").status_code == 200
        for route in ("/v1/models", "/metrics"):
            reply = httpx.get(f"{url}{route}")
            _error(reply, 401, "invalid_api_key")
            assert reply.headers["www-authenticate"] == "Bearer"
        wrong_key = {"authorization": "Bearer x"}
        wrong = httpx.post(f"{url}/v1/completions", json=BODY, headers=wrong_key)
        _error(wrong, 401, "invalid_api_key")
        unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"})
        _error(unload, 401, "invalid_api_key")  # management routes too
        key = {"authorization": "Bearer s3cret"}
        assert httpx.get(f"{url}/v1/models", headers=key).status_code == 200
        assert httpx.get(f"{url}/metrics", headers=key).status_code == 200
        _serves(url, **key)
    with server_for(api_key="s3cret", public_metrics=True) as (url, _, _):
        assert httpx.get(f"{url}/metrics").status_code == 200
        _error(httpx.get(f"{url}/v1/models"), 401)


def test_api_key_from_the_environment(assets, monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    state = build_state(ServeArgs(model=str(assets["target"]), heads="none"))
    assert state.access.api_key == "from-env"
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        ServeArgs(api_key=" ")


def test_foreign_hosts_origins_and_non_json_posts_are_refused(server_for) -> None:
    with server_for(enable_lora_management=True) as (url, state, _):
        assert state.access.allowed_hosts == ("localhost", "127.0.0.1", "::1")
        _error(httpx.get(f"{url}/v1/models", headers={"host": "evil.example"}), 400)
        foreign = {"origin": "http://evil.example"}
        _error(httpx.post(f"{url}/v1/completions", json=BODY, headers=foreign), 403)
        # The cross-site request of the finding: text/plain, foreign Origin and Host.
        sneaky = httpx.post(
            f"{url}/v1/unload_lora_adapter",
            content=json.dumps({"lora_name": "attn"}),
            headers={"content-type": "text/plain", "origin": "http://evil.example"},
        )
        assert sneaky.status_code in (403, 415)
        plain = httpx.post(
            f"{url}/v1/unload_lora_adapter",
            content=json.dumps({"lora_name": "attn"}),
            headers={"content-type": "text/plain"},
        )
        _error(plain, 415, "unsupported_media_type")
        assert "attn" in state.served
        same_origin = {"origin": url}
        _serves(url, **same_origin)


def test_oversize_bodies_get_413_whether_announced_or_streamed(server_for) -> None:
    with server_for(max_body_bytes=4096) as (url, _, _):
        big = {**BODY, "prompt": "x" * 10_000}
        _error(httpx.post(f"{url}/v1/completions", json=big), 413, "request_too_large")

        def chunks():  # no Content-Length: the limit is enforced as the body arrives
            data = json.dumps(big).encode()
            for start in range(0, len(data), 1000):
                yield data[start : start + 1000]

        streamed = httpx.post(
            f"{url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        _error(streamed, 413, "request_too_large")
        _serves(url)


@pytest.mark.parametrize(
    "raw,field",
    [
        ('{"model": "tiny-llama", "prompt": "a", "temperature": 1%s}' % ("0" * 400), "temperature"),
        ('{"model": "tiny-llama", "prompt": "a", "top_p": 1%s}' % ("0" * 400), "top_p"),
        ('{"model": "tiny-llama", "prompt": "a", "seed": 1%s}' % ("0" * 4400), None),
        ('{"model": "tiny-llama", "prompt": "\\ud800"}', None),
        ('{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\udfff"}]}', None),
        ("[" * 100_000 + "]" * 100_000, None),
    ],
    ids=["401-digit-temperature", "401-digit-top-p", "4400-digit-seed", "lone-surrogate",
         "lone-surrogate-chat", "100k-deep"],
)  # fmt: skip
def test_malformed_bodies_are_400s_not_500s(main_server, raw: str, field: str | None) -> None:
    url, _ = main_server
    route = "/v1/chat/completions" if '"messages"' in raw else "/v1/completions"
    with httpx.Client() as client:  # one connection: it must survive the error
        reply = client.post(
            f"{url}{route}", content=raw, headers={"content-type": "application/json"}
        )
        error = _error(reply, 400)
        assert error["param"] == field
        assert len(error["message"]) < 300
        assert client.post(f"{url}/v1/completions", json=BODY).status_code == 200


def test_an_unexpected_error_is_a_json_500_and_the_connection_lives(
    main_server, monkeypatch
) -> None:
    url, _ = main_server

    def broken(state, parsed):
        raise RuntimeError("boom")

    with httpx.Client() as client:
        monkeypatch.setattr(app_module, "_prompt_ids", broken)
        error = _error(client.post(f"{url}/v1/completions", json=BODY), 500)
        assert error["type"] == "server_error" and "boom" not in error["message"]
        monkeypatch.undo()
        assert client.post(f"{url}/v1/completions", json=BODY).status_code == 200


def test_a_request_past_its_deadline_is_cancelled_with_504(server_for) -> None:
    with server_for(request_timeout=0.1) as (url, state, _):
        started = time.monotonic()
        reply = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 500}, timeout=30)
        _error(reply, 504, "request_timeout")
        assert time.monotonic() - started < 10
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**LONG, "max_tokens": 500, "stream": True}
        ) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
        _wait_running(url, 0)
        _serves(url)


def test_unload_drains_the_adapter_first_and_forgets_its_metrics(server_for) -> None:
    with server_for(enable_lora_management=True) as (url, state, _):
        done: dict[str, httpx.Response] = {}
        client = threading.Thread(
            target=lambda: done.update(r=httpx.post(f"{url}/v1/completions", json=LONG, timeout=60))
        )
        client.start()
        _wait_running(url, 1)
        route = f"{url}/v1/unload_lora_adapter"
        busy = httpx.post(route, json={"lora_name": "attn", "wait": False})
        _error(busy, 409, "adapter_busy")
        assert "attn" in state.served
        assert 'adapter="attn"' in httpx.get(f"{url}/metrics").text
        unloaded = httpx.post(route, json={"lora_name": "attn"}, timeout=60)
        assert unloaded.status_code == 200, unloaded.text
        client.join(timeout=60)
        assert done["r"].status_code == 200
        assert done["r"].json()["usage"]["completion_tokens"] == LONG["max_tokens"]
        gone = httpx.post(f"{url}/v1/completions", json={**BODY, "model": "attn"})
        _error(gone, 404)
        assert 'adapter="attn"' not in httpx.get(f"{url}/metrics").text


def test_an_adapter_may_not_take_the_base_models_name(server_for) -> None:
    with server_for(enable_lora_management=True) as (url, state, _):
        body = {"lora_name": state.model_name, "lora_path": "attn"}
        error = _error(httpx.post(f"{url}/v1/load_lora_adapter", json=body), 400)
        assert "base model" in error["message"]


def test_draining_answers_503_and_ends_cut_streams_properly(server_for) -> None:
    with server_for(drain_timeout=0.1) as (url, state, server):
        lines: list[str] = []

        def stream() -> None:
            body = {**LONG, "max_tokens": 500, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
                lines.extend(line for line in reply.iter_lines() if line.startswith("data: "))

        client = threading.Thread(target=stream)
        client.start()
        _wait_running(url, 1)
        server.drain()
        deadline = time.monotonic() + 5
        while state.engine.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        _error(httpx.post(f"{url}/v1/completions", json=BODY), 503)  # the socket still listens
        client.join(timeout=30)
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2][6:])
