"""The OpenAI-compatible API through real HTTP on localhost: endpoints, streaming, errors."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from selfspec.target import apply_chat_template

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def _sse(text: str) -> list[object]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _complete(url: str, model: str, /, **body: object) -> httpx.Response:
    payload = {"model": model, "prompt": PROMPT, **GREEDY, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=60)


def test_models_lists_base_and_each_adapter_with_parent(main_server) -> None:
    url, _ = main_server
    data = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [
        ("tiny-llama", None),
        ("attn", "tiny-llama"),
        ("mlp", "tiny-llama"),
    ]


def test_health_ok_while_serving(main_server) -> None:
    url, _ = main_server
    response = httpx.get(f"{url}/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_completion_usage_stats_and_lossless_speculation(main_server) -> None:
    url, state = main_server
    outputs = {}
    for model in ("tiny-llama", "attn", "mlp"):
        speculative = _complete(url, model).json()
        vanilla = _complete(url, model, speculation=False).json()
        assert speculative["choices"][0]["text"] == vanilla["choices"][0]["text"]
        prompt_tokens = len(state.tokenizer.encode(PROMPT))
        assert speculative["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 12,
            "total_tokens": prompt_tokens + 12,
        }
        assert speculative["choices"][0]["finish_reason"] == "length"
        assert speculative["object"] == "text_completion" and speculative["model"] == model
        stats, plain = speculative["selfspec"], vanilla["selfspec"]
        assert stats["speculation"] is True and stats["draft_tokens"] > 0
        assert stats["tau"] >= 1.0 and stats["target_forwards"] >= 1
        assert plain["speculation"] is False and plain["tau"] == 1.0
        assert plain["draft_tokens"] == 0 and plain["target_forwards"] == 11
        outputs[model] = speculative["choices"][0]["text"]
    assert len(set(outputs.values())) == 3, "adapters must change the output"


def test_token_id_prompt_and_stop_string(main_server) -> None:
    url, state = main_server
    ids = state.tokenizer.encode(PROMPT)
    by_ids = _complete(url, "attn", prompt=ids).json()["choices"][0]["text"]
    assert by_ids == _complete(url, "attn").json()["choices"][0]["text"]
    stop = by_ids[3:5]
    stopped = _complete(url, "attn", stop=[stop]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == by_ids[: by_ids.index(stop)]


def test_seeded_sampling_repeats(main_server) -> None:
    url, _ = main_server
    body = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7}
    first = _complete(url, "mlp", **body).json()["choices"][0]["text"]
    assert _complete(url, "mlp", **body).json()["choices"][0]["text"] == first


def test_chat_uses_the_chat_template(main_server) -> None:
    url, state = main_server
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "attn", "messages": messages, **GREEDY}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["prompt_tokens"] == len(apply_chat_template(state.tokenizer, messages))
    same = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    parts = httpx.post(f"{url}/v1/chat/completions", json=same, timeout=60).json()
    assert parts["choices"][0]["message"] == reply["choices"][0]["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_the_whole_response(main_server, chat: bool) -> None:
    url, _ = main_server
    if chat:
        endpoint = "/v1/chat/completions"
        body = {"model": "mlp", "messages": [{"role": "user", "content": PROMPT}], **GREEDY}
    else:
        endpoint, body = "/v1/completions", {"model": "mlp", "prompt": PROMPT, **GREEDY}
    whole = httpx.post(url + endpoint, json=body, timeout=60).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(url + endpoint, json=streamed, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(response.text)
    *content, final, usage = chunks
    if chat:
        assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
        expected = whole["choices"][0]["message"]["content"]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    else:
        text = "".join(c["choices"][0]["text"] for c in content)
        expected = whole["choices"][0]["text"]
    assert text == expected
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["selfspec"]["speculation"] is True
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["usage"] is None for c in [*content, final])
    plain = httpx.post(url + endpoint, json={**body, "stream": True}, timeout=60)
    assert all("usage" not in c for c in _sse(plain.text))


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_unknown_adapter_is_404_naming_it(main_server) -> None:
    url, _ = main_server
    error = _error(_complete(url, "no-such-adapter"), 404)
    assert "no-such-adapter" in error["message"] and error["param"] == "model"


def test_malformed_json_is_400(main_server) -> None:
    url, _ = main_server
    response = httpx.post(
        f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in _error(response, 400)["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [5, 1000]}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"speculation": "yes"}, "speculation"),
        ({"model": None}, "model"),
    ],
)
def test_invalid_parameter_is_400_naming_it(main_server, body, param) -> None:
    url, _ = main_server
    error = _error(_complete(url, "attn", **body), 400)
    assert error["param"] == param and param.split(".")[0] in error["message"]


def test_invalid_chat_message_is_400(main_server) -> None:
    url, _ = main_server
    body = {"model": "attn", "messages": [{"role": "user"}]}
    error = _error(httpx.post(f"{url}/v1/chat/completions", json=body), 400)
    assert error["param"] == "messages[0].content"


def test_prompt_plus_max_tokens_over_the_context_is_400_with_the_limit(main_server) -> None:
    url, _ = main_server
    error = _error(_complete(url, "attn", max_tokens=600), 400)
    assert "512" in error["message"] and error["param"] == "max_tokens"
    long_prompt = "a" * 520
    error = _error(_complete(url, "attn", prompt=long_prompt, max_tokens=None), 400)
    assert "512" in error["message"]


def test_unknown_route_has_the_error_shape(main_server) -> None:
    url, _ = main_server
    _error(httpx.get(f"{url}/v1/nothing"), 404)


def test_metrics_count_requests_tokens_and_speculation_by_adapter(main_server) -> None:
    url, _ = main_server
    _complete(url, "attn")
    text = httpx.get(f"{url}/metrics").text
    for line in (
        'selfspec_requests_total{adapter="attn",outcome="completed"}',
        'selfspec_generation_tokens_total{adapter="attn"}',
        'selfspec_request_latency_seconds_bucket{adapter="attn",le="+Inf"}',
        'selfspec_time_to_first_token_seconds_count{adapter="attn"}',
        'selfspec_spec_steps_total{adapter="attn"}',
        'selfspec_spec_draft_tokens_total{adapter="attn"}',
        'selfspec_spec_accepted_tokens_total{adapter="attn"}',
        'selfspec_spec_accepted_at_depth_total{adapter="attn",depth="1"}',
        'selfspec_spec_reached_depth_total{adapter="attn",depth="1"}',
        "selfspec_requests_running ",
    ):
        assert line in text, line


def test_runtime_adapter_load_and_unload_confined_to_the_root(main_server, assets) -> None:
    url, _ = main_server
    root = assets["adapters"]
    shutil.copytree(root / "attn", root / "attn2")
    broken = root / "broken"
    shutil.copytree(root / "mlp", broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # truncated
    outside = assets["root"] / "outside"
    shutil.copytree(root / "mlp", outside)
    load, unload = f"{url}/v1/load_lora_adapter", f"{url}/v1/unload_lora_adapter"

    error = _error(httpx.post(load, json={"lora_name": "broken", "lora_path": "broken"}), 400)
    assert "broken" in error["message"]
    error = _error(httpx.post(load, json={"lora_name": "out", "lora_path": str(outside)}), 400)
    assert error["param"] == "lora_path"
    _error(httpx.post(load, json={"lora_name": "x", "lora_path": "../outside"}), 400)
    _error(httpx.post(load, json={"lora_name": "attn", "lora_path": "attn"}), 400)  # loaded
    assert _complete(url, "attn").status_code == 200  # still serving everyone else

    assert httpx.post(load, json={"lora_name": "attn2", "lora_path": "attn2"}).status_code == 200
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert "attn2" in ids and "broken" not in ids and "out" not in ids
    same = _complete(url, "attn2").json()["choices"][0]["text"]
    assert same == _complete(url, "attn").json()["choices"][0]["text"]

    assert httpx.post(unload, json={"lora_name": "attn2"}).status_code == 200
    _error(_complete(url, "attn2"), 404)
    _error(httpx.post(unload, json={"lora_name": "attn2"}), 404)
    # the name is free again: loaded from other weights, it answers as those do
    assert httpx.post(load, json={"lora_name": "attn2", "lora_path": "mlp"}).status_code == 200
    swapped = _complete(url, "attn2").json()["choices"][0]["text"]
    assert swapped == _complete(url, "mlp").json()["choices"][0]["text"] != same
    assert httpx.post(unload, json={"lora_name": "attn2"}).status_code == 200


def test_adapter_management_is_off_by_default(server_for) -> None:
    with server_for() as (url, _, _):
        body = {"lora_name": "again", "lora_path": "attn"}
        error = _error(httpx.post(f"{url}/v1/load_lora_adapter", json=body), 403)
        assert "--enable-lora-management" in error["message"]
        _error(httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "attn"}), 403)


def test_adaptive_default_tree_serves_the_same_text(server_for, main_server) -> None:
    """`--tree auto` (the default): steps sized from the cost curve measured at start-up."""
    url, _ = main_server
    with server_for(tree="auto") as (auto_url, state, _):
        assert state.generator.cost_curve is not None and state.tree is None
        for model in ("tiny-llama", "attn"):
            adaptive = _complete(auto_url, model).json()
            fixed = _complete(url, model).json()
            assert adaptive["choices"][0]["text"] == fixed["choices"][0]["text"]
            assert adaptive["selfspec"]["speculation"] is True


def _adapter_with_heads(assets, root, kind: str, base_arch: str = "llama") -> None:
    """`root/attn`: the attn adapter carrying heads of its own (made for `base_arch`)."""
    from tiny_models import make_tiny_model

    from selfspec.fingerprint import fingerprint_of
    from selfspec.heads import build_heads, heads_config_for, save_heads

    shutil.copytree(assets["adapters"] / "attn", root / "attn")
    model = make_tiny_model(base_arch, 1 if base_arch == "llama" else 0)
    heads = build_heads(heads_config_for(model, kind, num_heads=2))
    save_heads(heads, root / "attn" / "heads", fingerprint_of(make_tiny_model(base_arch, 0)))


def test_adapter_carrying_its_own_heads_speculates_with_them(server_for, assets, tmp_path) -> None:
    from selfspec.heads.medusa import MedusaHeads

    _adapter_with_heads(assets, tmp_path, "medusa")
    texts = []
    for own in (True, False):
        settings = dict(adapters_root=str(tmp_path), adapter_heads=own, tree="chain:2")
        with server_for(**settings) as (url, state, _):
            reply = _complete(url, "attn").json()
            assert reply["selfspec"]["speculation"] is True
            texts.append(reply["choices"][0]["text"])
            texts.append(_complete(url, "attn", speculation=False).json()["choices"][0]["text"])
            used = state.generator_for("attn")
            assert isinstance(used.heads, MedusaHeads) == own
            assert (used is state.generator) != own
            assert state.generator_for(None) is state.generator
    assert len(set(texts)) == 1, "lossless with either heads"


def test_adapter_heads_for_another_base_are_a_400_naming_the_adapter(
    server_for, assets, tmp_path
) -> None:
    _adapter_with_heads(assets, tmp_path, "eagle", base_arch="qwen2")
    with server_for(adapters_root=str(tmp_path)) as (url, _, _):
        error = _error(_complete(url, "attn"), 400)
        assert "adapter 'attn' carries heads that cannot be used" in error["message"]
        assert _complete(url, "attn", speculation=False).status_code == 200
        assert _complete(url, "tiny-llama").status_code == 200
