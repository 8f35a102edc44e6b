"""The server with its speculation gate on (the default): concurrent greedy requests, some
rounds drafting and some not as the gate times them, each output equal to plain decoding."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ("hello world", "the quick brown fox", "one two three four", "a b c")


def _complete(url: str, model: str, prompt: str, speculation: bool) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
            "speculation": speculation}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_gated_speculation_under_concurrency_equals_plain_decoding(server_for) -> None:
    with server_for(max_running=4, speculation_gate=True) as (url, state, _):
        assert state.engine.speculation_gate is not None
        cases = [(m, p) for m in ("tiny-llama", "attn") for p in PROMPTS]
        with ThreadPoolExecutor(4) as pool:
            gated = list(pool.map(lambda c: _complete(url, *c, speculation=True), cases))
        plain = [_complete(url, *c, speculation=False) for c in cases]
        assert gated == plain
        rates = state.engine.speculation_gate.rates
        assert any(rates(size) for size in range(1, 5))  # the gate timed some rounds
