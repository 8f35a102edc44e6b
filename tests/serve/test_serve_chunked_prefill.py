"""Chunked prefill in the server: a long prompt arriving while another request decodes is
prefilled a few tokens per round, in the same forward as the other request's tree (on the
kernels), the other request keeps committing tokens in between, and both outputs equal those of
a server that prefills whole prompts."""

from __future__ import annotations

import threading

import httpx
import pytest

from selfspec.batched_verify import verify_rows
from selfspec.generation import GenerationStream
from selfspec.serve import engine as engine_module

LONG = "Once upon a time there was a long prompt that goes on. " * 4
SHORT = "hi"
SHORT_TOKENS = 240  # decodes for long enough that the long prompt arrives while it runs


def _complete(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": "attn", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True}  # fmt: skip
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_long_prompt_is_prefilled_between_the_others_rounds(
    server_for, monkeypatch: pytest.MonkeyPatch
) -> None:
    with server_for(prefill_chunk=0) as (url, _, _):
        whole = [_complete(url, SHORT, SHORT_TOKENS), _complete(url, LONG, 8)]
    events: list[tuple[str, int]] = []  # ("prefill", remaining after) / ("decode", 0), in order
    absorb, after_step = GenerationStream.absorb_prefill, GenerationStream._after_step
    forwards: list[tuple[int, int]] = []  # (trees, prefill chunks) of each shared forward

    def spy_prefill(self: GenerationStream, *args: object):  # noqa: ANN202
        output = absorb(self, *args)  # a chunk taken in (from its own or a shared forward)
        events.append(("prefill", self.prefill_remaining))
        return output

    def spy_forward(target, requests, prefills=()):  # noqa: ANN001, ANN202
        forwards.append((len(requests), len(prefills)))
        return verify_rows(target, requests, prefills)

    def spy_step(self: GenerationStream, *args: object, **kwargs: object):  # noqa: ANN202
        events.append(("decode", 0))  # a decoding step committed (alone or in a batch)
        return after_step(self, *args, **kwargs)

    monkeypatch.setattr(GenerationStream, "absorb_prefill", spy_prefill)
    monkeypatch.setattr(GenerationStream, "_after_step", spy_step)
    monkeypatch.setattr(engine_module, "verify_rows", spy_forward)
    with server_for(prefill_chunk=4, max_running=4) as (url, state, _):
        assert state.engine.prefill_chunk == 4
        short: list[str] = []
        first = threading.Thread(target=lambda: short.append(_complete(url, SHORT, SHORT_TOKENS)))
        first.start()
        for _ in range(3000):  # until the short one is decoding
            if any(kind == "decode" for kind, _ in events):
                break
            threading.Event().wait(0.01)
        long = _complete(url, LONG, 8)
        first.join(120)
    assert [short[0], long] == whole
    chunks = [remaining for kind, remaining in events if kind == "prefill"]
    long_chunks = chunks[1:]  # after the short prompt's own (it fits one chunk)
    assert len(long_chunks) >= 10 and long_chunks[-1] == 0
    steps = [a - b for a, b in zip(long_chunks[:-1], long_chunks[1:], strict=True)]
    assert all(0 < step <= 4 for step in steps)  # at most 4 prompt tokens a round
    first_chunk = events.index(("prefill", long_chunks[0]))
    last_chunk = events.index(("prefill", 0), first_chunk)
    between = [kind for kind, _ in events[first_chunk:last_chunk]]
    assert between.count("decode") >= 5  # the short request kept decoding meanwhile
    # The chunks ran in the rounds' forward, beside the short request's tree (the tiny model
    # runs on the kernels' whole body here, which takes both back to back).
    assert sum(1 for trees, chunks in forwards if trees and chunks) >= 5
