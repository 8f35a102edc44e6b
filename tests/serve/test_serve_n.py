"""`n` choices per request through real HTTP: seeded repeats, streaming indexes and usage,
greedy choices, validation, backpressure and cancellation of all choices."""

from __future__ import annotations

import json
import time

import httpx
import pytest

PROMPT = "The quick brown fox"
SAMPLED = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, "seed": 11}
LONG = {"temperature": 0, "max_tokens": 480, "ignore_eos": True, "speculation": False}


def _complete(url: str, /, **body: object) -> httpx.Response:
    payload = {"model": "attn", "prompt": PROMPT, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=60)


def _texts(reply: dict[str, object]) -> list[str]:
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices)))
    return [c["text"] for c in choices]


def _sse(text: str) -> list[dict[str, object]]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _metric(url: str, line: str) -> float:
    for row in httpx.get(f"{url}/metrics").text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    return 0.0


def _wait_for(url: str, timeout: float = 10, **counts: int) -> None:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health").json()
        if all(health[k] == v for k, v in counts.items()):
            return
        assert time.monotonic() < deadline, f"engine never reached {counts}: {health}"
        time.sleep(0.02)


def test_seeded_n_repeats_exactly_and_choices_differ(main_server) -> None:
    url, state = main_server
    first = _complete(url, n=3, **SAMPLED).json()
    again = _complete(url, n=3, **SAMPLED).json()
    texts = _texts(first)
    assert len(texts) == 3 and _texts(again) == texts
    assert len(set(texts)) == 3, "sampled choices with different seeds should differ"
    prompt_tokens = len(state.tokenizer.encode(PROMPT))
    assert first["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 36,
        "total_tokens": prompt_tokens + 36,
    }
    assert all(c["finish_reason"] == "length" for c in first["choices"])
    # Choice i is the single-choice request seeded with seed + i.
    for index in (0, 2):
        single = _complete(url, **{**SAMPLED, "seed": SAMPLED["seed"] + index}).json()
        assert _texts(single) == [texts[index]]
    stats = first["selfspec"]
    assert stats["speculation"] is True and stats["draft_tokens"] > 0
    # Pooled over the choices: 11 decode steps at most per choice (the first token is prefill's).
    assert 3 <= stats["target_forwards"] <= 33 and stats["tau"] >= 1.0


def test_greedy_choices_are_identical_to_the_single_output(main_server) -> None:
    url, _ = main_server
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    single = _texts(_complete(url, **greedy).json())
    both = _complete(url, n=2, **greedy).json()
    assert _texts(both) == single * 2
    assert both["usage"]["completion_tokens"] == 24
    plain = _complete(url, n=2, speculation=False, **greedy).json()
    assert _texts(plain) == single * 2
    assert plain["selfspec"]["tau"] == 1.0 and plain["selfspec"]["target_forwards"] == 22


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_n_indexes_each_choice_and_usage_covers_all(main_server, chat: bool) -> None:
    url, _ = main_server
    if chat:
        endpoint = "/v1/chat/completions"
        body = {"model": "mlp", "messages": [{"role": "user", "content": PROMPT}]}
    else:
        endpoint, body = "/v1/completions", {"model": "mlp", "prompt": PROMPT}
    body = {**body, **SAMPLED, "n": 2}
    whole = httpx.post(url + endpoint, json=body, timeout=60).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse(httpx.post(url + endpoint, json=streamed, timeout=60).text)
    *content, usage = chunks
    assert all(len(c["choices"]) == 1 for c in content)
    assert {c["choices"][0]["index"] for c in content} == {0, 1}
    texts = ["", ""]
    for chunk in content:
        choice = chunk["choices"][0]
        piece = choice["delta"].get("content", "") if chat else choice["text"]
        texts[choice["index"]] += piece
    if chat:
        roles = [c["choices"][0] for c in content if c["choices"][0]["delta"].get("role")]
        assert sorted(r["index"] for r in roles) == [0, 1]
        expected = [c["message"]["content"] for c in whole["choices"]]
    else:
        expected = [c["text"] for c in whole["choices"]]
    assert texts == expected
    finals = [c for c in content if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]
    assert all(c["choices"][0]["finish_reason"] == "length" for c in finals)
    # The request-wide stats ride on the last chunk before usage, as with one choice.
    assert "selfspec" not in finals[0] and finals[1] is content[-1]
    assert finals[1]["selfspec"]["target_forwards"] == whole["selfspec"]["target_forwards"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert usage["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("n", [0, 100, "x", -1, 2.5, True])
def test_invalid_n_is_400_naming_it(main_server, n: object) -> None:
    url, _ = main_server
    response = _complete(url, n=n, max_tokens=2)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "'n'" in error["message"]


def test_n_over_the_server_capacity_is_400(main_server) -> None:
    url, _ = main_server  # max_running 4 + max_queue 8
    response = _complete(url, n=13, max_tokens=2)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and "capacity of 12" in error["message"]


def test_n_needs_all_its_places_free_or_429_and_disconnect_cancels_all(server_for) -> None:
    with server_for(max_running=2, max_queue=2) as (url, _, _):
        cancelled = 'selfspec_requests_total{adapter="attn",outcome="cancelled"}'
        rejected = 'selfspec_requests_total{adapter="mlp",outcome="rejected"}'
        body = {"model": "attn", "prompt": "abc", **LONG, "stream": True, "n": 3}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)  # decoding has started
            _wait_for(url, running=2, waiting=1)
            # One free place left: two choices are refused together, one is admitted.
            short = {"model": "mlp", "prompt": "abc", "temperature": 0, "max_tokens": 2}
            refused = httpx.post(f"{url}/v1/completions", json={**short, "n": 2}, timeout=60)
            assert refused.status_code == 429, refused.text
            assert "needs 2 places" in refused.json()["error"]["message"]
            assert _metric(url, rejected) == 2
            _wait_for(url, running=2, waiting=1)  # nothing of it was admitted
        _wait_for(url, running=0, waiting=0)
        assert _metric(url, cancelled) == 3
        # With the places free again, all four choices of a request fit (two wait).
        after = httpx.post(f"{url}/v1/completions", json={**short, "n": 4}, timeout=60)
        assert after.status_code == 200 and len(after.json()["choices"]) == 4
