"""The prefix cache in the server: concurrent greedy requests sharing a long system prompt over
several adapters and the base give exactly the outputs of a server without it, and hit it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

SYSTEM = "You are a careful assistant. " * 12  # ~100 tokens shared by every request
BODIES = [
    {"model": model, "prompt": SYSTEM + question, "temperature": 0, "max_tokens": 16,
     "ignore_eos": True, "speculation": speculation}
    for model in ("attn", "mlp", "tiny-llama")
    for question in ("What is 2 + 2?", "Name a colour.")
    for speculation in (True, False)
]  # fmt: skip


def _texts(url: str, bodies: list[dict], workers: int) -> list[str]:
    def post(body: dict) -> str:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(post, bodies))


def _metric(url: str, name: str) -> float:
    for row in httpx.get(f"{url}/metrics").text.splitlines():
        if row.startswith(name + " "):
            return float(row.split()[-1])
    raise AssertionError(f"{name} is not exported")


def test_concurrent_requests_with_the_prefix_cache_equal_a_server_without(server_for) -> None:
    with server_for(prefix_cache_mb=0, max_running=8) as (url, state, _):
        assert state.prefix_cache is None
        serial = _texts(url, BODIES, workers=1)
    with server_for(prefix_cache_mb=64, max_running=8) as (url, state, _):
        assert state.prefix_cache is not None
        warm = _texts(url, BODIES[:1], workers=1)  # the base of every later hit on "attn"
        concurrent = _texts(url, BODIES * 2, workers=8)
        assert warm == serial[:1]
        mismatches = sum(a != b for a, b in zip(concurrent, serial * 2, strict=True))
        assert mismatches == 0
        assert _metric(url, "selfspec_prefix_cache_hits_total") >= len(BODIES)
        assert _metric(url, "selfspec_prefix_cache_hit_tokens_total") >= 32 * len(BODIES)
        assert _metric(url, "selfspec_prefix_cache_bytes") > 0
