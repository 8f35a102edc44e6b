"""logprobs over the API: chat (logprobs + top_logprobs) and completions (logprobs, echo) in
OpenAI's shapes, the same with speculation on and off and streamed or not, on every adapter."""

from __future__ import annotations

import json

import httpx
import pytest

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def _post(url: str, route: str, body: dict) -> dict:
    reply = httpx.post(f"{url}{route}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _streamed(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{route}", json={**body, "stream": True}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("model", ["tiny-llama", "attn"])
def test_chat_logprobs_shape_and_speculation_changes_nothing(main_server, model: str) -> None:
    url, _ = main_server
    body = {"model": model, "messages": [{"role": "user", "content": "hi there"}], **GREEDY,
            "logprobs": True, "top_logprobs": 3}  # fmt: skip
    spec = _post(url, "/v1/chat/completions", body)
    plain = _post(url, "/v1/chat/completions", {**body, "speculation": False})
    content = spec["choices"][0]["logprobs"]["content"]
    assert len(content) == spec["usage"]["completion_tokens"] == 12
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: the best
    assert spec["selfspec"]["tau"] > 1.0
    assert spec["choices"][0]["message"] == plain["choices"][0]["message"]
    got = [e["logprob"] for e in content]
    want = [e["logprob"] for e in plain["choices"][0]["logprobs"]["content"]]
    assert got == pytest.approx(want, abs=1e-5)
    streamed = _streamed(url, "/v1/chat/completions", body)
    pieces = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0].get("logprobs")]
    streamed_content = [e for p in pieces for e in p["content"]]
    # The same tokens; log-probabilities up to float noise: the speculation gate times rounds,
    # so two runs may verify a token in trees of different sizes (torch ops on this model).
    assert [e["token"] for e in streamed_content] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed_content] == pytest.approx(got, abs=1e-5)


def test_chat_without_logprobs_has_none(main_server) -> None:
    url, _ = main_server
    body = {"model": "attn", "messages": [{"role": "user", "content": "hi"}], **GREEDY}
    assert _post(url, "/v1/chat/completions", body)["choices"][0]["logprobs"] is None


def test_completion_logprobs_and_echo(main_server) -> None:
    url, state = main_server
    body = {"model": "mlp", "prompt": "hello world", **GREEDY, "logprobs": 2}
    plain = _post(url, "/v1/completions", body)["choices"][0]
    logprobs = plain["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 12
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    assert "".join(logprobs["tokens"]) == plain["text"]
    echoed = _post(url, "/v1/completions", {**body, "echo": True})["choices"][0]
    prompt_ids = state.tokenizer.encode("hello world")
    assert echoed["text"].startswith("hello world") and echoed["text"].endswith(plain["text"])
    scores = echoed["logprobs"]
    assert len(scores["tokens"]) == len(prompt_ids) + 12
    assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
    assert all(v <= 0 for v in scores["token_logprobs"][1:])
    assert scores["token_logprobs"][len(prompt_ids) :] == logprobs["token_logprobs"]
    streamed = _streamed(url, "/v1/completions", {**body, "echo": True})
    text = "".join(c["choices"][0]["text"] for c in streamed if c["choices"])
    assert text == echoed["text"]
    streamed_scores = [
        v for c in streamed if c["choices"] and c["choices"][0]["logprobs"]
        for v in c["choices"][0]["logprobs"]["token_logprobs"]
    ]  # fmt: skip
    assert streamed_scores == scores["token_logprobs"]


def test_echo_without_logprobs_repeats_the_prompt(main_server) -> None:
    url, _ = main_server
    body = {"model": "tiny-llama", "prompt": "abc", **GREEDY, "echo": True}
    choice = _post(url, "/v1/completions", body)["choices"][0]
    assert choice["text"].startswith("abc") and choice["logprobs"] is None


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
    ],
)
def test_bad_logprobs_options_are_400s(main_server, route: str, extra: dict, param: str) -> None:
    url, _ = main_server
    body = {"model": "attn", **GREEDY, **extra}
    body.update(
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "x"}
    )
    reply = httpx.post(f"{url}{route}", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
