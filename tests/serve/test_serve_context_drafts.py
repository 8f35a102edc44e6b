"""The server's context drafts (on by default): concurrent greedy requests, batched, give the
same text with them and without them (`--no-context-drafts`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

# Prompts that repeat themselves, so copied chains are offered (and some accepted).
PROMPTS = ("one two one two one two", "abc abc abc abc", "hello world hello world", "a b a b a")


def _complete(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0.0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _serve_all(server_for, context_drafts: bool) -> list[str]:
    with server_for(max_running=4, context_drafts=context_drafts) as (url, state, _):
        assert (state.context_drafts is not None) == context_drafts
        cases = [(m, p) for m in ("tiny-llama", "attn") for p in PROMPTS]
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(lambda c: _complete(url, *c), cases))


def test_context_drafts_leave_served_text_unchanged(server_for) -> None:
    with_context = _serve_all(server_for, context_drafts=True)
    heads_only = _serve_all(server_for, context_drafts=False)
    assert with_context == heads_only
