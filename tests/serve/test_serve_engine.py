"""The engine through real HTTP: interleaved requests keep their own output, cancellation on
disconnect, backpressure (429), graceful drain on shutdown."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

LONG = {"temperature": 0, "max_tokens": 480, "ignore_eos": True, "speculation": False}


def _post(url: str, body: dict[str, object], timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def _wait_for(url: str, timeout: float = 10, **counts: int) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health").json()
        if all(health[k] == v for k, v in counts.items()):
            return health
        assert time.monotonic() < deadline, f"engine never reached {counts}: {health}"
        time.sleep(0.02)


def _metric(url: str, line: str) -> float:
    for row in httpx.get(f"{url}/metrics").text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    return 0.0


def _hold_until_queued(engine, count: int, timeout: float = 30) -> None:
    """Hold the engine's worker before its next round until ``count`` jobs wait, so that
    requests sent at once also start at once (their threads may reach the server a round
    apart otherwise, and a late one would run its last rounds alone)."""

    def hold() -> None:
        deadline = time.monotonic() + timeout
        while engine.counts()["waiting"] < count and time.monotonic() < deadline:
            time.sleep(0.005)

    engine.between_rounds(hold)


REQUESTS = [
    {"model": "attn", "prompt": "abc", "temperature": 0},
    {"model": "mlp", "prompt": "hello world", "temperature": 0},
    {"model": "tiny-llama", "prompt": "xyz", "temperature": 0},
    {"model": "attn", "prompt": "hello world", "temperature": 0, "speculation": False},
    {"model": "mlp", "prompt": "abc", "temperature": 0},
    {"model": "tiny-llama", "prompt": "The fox", "temperature": 0, "speculation": False},
    {"model": "attn", "prompt": "xyz", "temperature": 0.8, "seed": 3},
    {"model": "mlp", "prompt": "xyz", "temperature": 0},
]


@pytest.mark.parametrize(
    ("batch_verify", "backend"),
    [(True, "fast"), (True, "peft"), (False, "fast")],
    ids=["one-forward", "one-forward-peft", "interleaved"],
)
def test_concurrent_requests_on_different_adapters_equal_serial(
    server_for, batch_verify: bool, backend: str
) -> None:
    settings = dict(max_running=8, max_queue=8, batch_verify=batch_verify, lora_backend=backend)
    with server_for(**settings) as (url, state, _):
        bodies = [{**b, "max_tokens": 24, "ignore_eos": True} for b in REQUESTS]
        serial = [_post(url, body).json()["choices"][0]["text"] for body in bodies]
        assert state.engine.peak_running == 1
        forwards = _metric(url, "selfspec_verify_batch_requests_count")
        rows = _metric(url, "selfspec_verify_batch_requests_sum")
        assert rows == forwards, "a request running alone was verified with others"
        _hold_until_queued(state.engine, len(bodies))
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda body: _post(url, body), bodies))
        assert [r.json()["choices"][0]["text"] for r in replies] == serial
        assert state.engine.peak_running == len(bodies), "the requests never all ran together"
        forwards = _metric(url, "selfspec_verify_batch_requests_count") - forwards
        rows = _metric(url, "selfspec_verify_batch_requests_sum") - rows
        if batch_verify:  # mixed adapters, speculating or not, greedy or sampled: one forward
            assert rows / forwards > 2, f"{rows} trees in {forwards} forwards: barely batched"
        else:  # one request per forward
            assert forwards == rows > 0
        # Streamed concurrently too: same text.
        with ThreadPoolExecutor(len(bodies)) as pool:
            streamed = list(pool.map(lambda body: _stream_text(url, body), bodies))
        assert streamed == serial


def test_a_failed_batched_forward_is_retried_one_by_one(server_for, monkeypatch) -> None:
    """The shared forward fails after appending KV entries to the caches: every request verifies
    its tree again alone (and runs its prefill chunk alone), from a cache with those entries
    dropped, and its output is unchanged."""
    import selfspec.serve.engine as engine_module

    real = engine_module.verify_rows
    failures = []

    def fails_after_the_forward(target, requests, prefills=()):
        real(target, requests, prefills)  # the caches now hold the trees' and chunks' entries
        failures.append((len(requests), len(prefills)))
        raise RuntimeError("injected failure after the batched forward")

    # Chunks of 2 prompt tokens: a prompt's earlier chunks share the rounds' forward.
    with server_for(max_running=8, max_queue=8, prefill_chunk=2) as (url, state, _):
        bodies = [{**b, "max_tokens": 16, "ignore_eos": True} for b in REQUESTS]
        serial = [_post(url, body).json()["choices"][0]["text"] for body in bodies]
        monkeypatch.setattr(engine_module, "verify_rows", fails_after_the_forward)
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda body: _post(url, body), bodies))
        monkeypatch.undo()
        assert any(trees > 1 for trees, _ in failures), "no batched forward of trees ran"
        assert any(chunks for _, chunks in failures), "no prefill ran in a shared forward"
        assert [r.status_code for r in replies] == [200] * len(bodies)
        assert [r.json()["choices"][0]["text"] for r in replies] == serial
        assert httpx.get(f"{url}/health").status_code == 200


def test_requests_of_one_adapter_draft_together_and_a_failed_draft_retries_alone(
    server_for, monkeypatch
) -> None:
    """The round's requests on one adapter draft in one batched heads call; should it fail,
    each of them drafts alone and its output is unchanged."""
    from selfspec.generation import GenerationStream

    real = GenerationStream.draft_together
    groups: list[int] = []

    def counted(streams, *args):
        groups.append(len(streams))
        return real(streams, *args)

    def fails(streams, *args):
        groups.append(-len(streams))
        raise RuntimeError("injected failure in batched drafting")

    with server_for(max_running=8, max_queue=8) as (url, _, _):
        # Six requests on one adapter (one of them seeded sampling), long enough to overlap.
        prompts = ("abc", "hello world", "xyz", "The fox", "a b c d")
        bodies = [
            {"model": "attn", "prompt": p, "temperature": 0, "max_tokens": 32, "ignore_eos": True}
            for p in prompts
        ]
        bodies.append({**bodies[0], "temperature": 0.8, "seed": 3})
        serial = [_post(url, body).json()["choices"][0]["text"] for body in bodies]
        for patched in (counted, fails):
            groups.clear()
            monkeypatch.setattr(GenerationStream, "draft_together", staticmethod(patched))
            with ThreadPoolExecutor(len(bodies)) as pool:
                replies = list(pool.map(lambda body: _post(url, body), bodies))
            monkeypatch.undo()
            assert [r.status_code for r in replies] == [200] * len(bodies)
            assert [r.json()["choices"][0]["text"] for r in replies] == serial
            assert groups and max(abs(g) for g in groups) >= 2, "no adapter's requests met"
        assert httpx.get(f"{url}/health").status_code == 200


def test_every_verification_is_timed_for_tree_sizing(server_for, monkeypatch) -> None:
    """Batched or alone, each verified tree reports its forward's time and padded token count
    to its generator, which keeps the request's cost scale (adaptive tree sizing under load)."""
    from selfspec.generation import SpeculativeGenerator

    seen: list[tuple[float, int]] = []
    real = SpeculativeGenerator.observe_verification

    def record(self, state, seconds: float, tokens: int) -> None:
        seen.append((seconds, tokens))
        real(self, state, seconds, tokens)

    monkeypatch.setattr(SpeculativeGenerator, "observe_verification", record)
    with server_for(max_running=8, max_queue=8) as (url, _, _):
        before = _metric(url, "selfspec_verify_batch_requests_sum")
        bodies = [{**b, "max_tokens": 16, "ignore_eos": True} for b in REQUESTS]
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda body: _post(url, body), bodies))
        assert [r.status_code for r in replies] == [200] * len(bodies)
        verified = _metric(url, "selfspec_verify_batch_requests_sum") - before
    assert len(seen) == verified > len(bodies)
    assert all(seconds > 0 for seconds, _ in seen)
    # Batched forwards count every row's padded tree: more tokens than any request drafts alone.
    assert max(tokens for _, tokens in seen) > 2 * len(bodies)


def _fixed_sizing(monkeypatch) -> tuple[list[str], list[int], list[tuple[int, int]]]:
    """Patch the engine's two batch sizers with fixed answers (so tests do not depend on
    timing): ``joint_keep`` keeps 2 nodes in every tree, ``ragged_keep`` 2, 0, 2, 0, ... Returns
    (which sizer each round used, the counts handed out in order, (size before, after) of each
    ``GenerationStream.resize``)."""
    from selfspec.generation import GenerationStream
    from selfspec.serve import engine as engine_module

    kinds: list[str] = []
    counts: list[int] = []
    resized: list[tuple[int, int]] = []

    def joint(candidates, batch_size: int, min_tokens: int = 1, as_drawn=False) -> int:
        kinds.append("joint")
        counts.extend([2] * len(candidates))
        return 2

    def ragged(candidates, fixed_rows: int = 0, as_drawn=False) -> list[int]:
        kinds.append("ragged")
        given = [2 if index % 2 == 0 else 0 for index in range(len(candidates))]
        counts.extend(given)
        return given

    real_resize = GenerationStream.resize

    def record(self, drafted, count: int, as_drawn: bool = False):
        out = real_resize(self, drafted, count, as_drawn)
        resized.append((drafted.tree.size, out.tree.size))
        return out

    monkeypatch.setattr(engine_module, "joint_keep", joint)
    monkeypatch.setattr(engine_module, "ragged_keep", ragged)
    monkeypatch.setattr(GenerationStream, "resize", record)
    return kinds, counts, resized


@pytest.mark.parametrize("backend", ["fast", "peft"])
def test_adaptive_trees_of_a_round_are_sized_together(server_for, monkeypatch, backend) -> None:
    """In a batched round every adaptive tree keeps the node count chosen for the whole
    forward, cut with ``GenerationStream.resize``: each its own where the trees run back to
    back (the kernels' whole body, the LoRA bank's adapters mixed: ``ragged_keep``), one count
    for all where they are padded (peft's adapters: ``joint_keep``); greedy outputs stay those
    of the requests alone."""
    kinds, counts, resized = _fixed_sizing(monkeypatch)
    greedy = [
        {**b, "max_tokens": 16, "ignore_eos": True, "speculation": True}
        for b in REQUESTS
        if b["temperature"] == 0
    ]
    settings = dict(max_running=8, max_queue=8, tree="adaptive", lora_backend=backend)
    with server_for(**settings) as (url, _, _):
        serial = [_post(url, body).json()["choices"][0]["text"] for body in greedy]
        kinds.clear(), counts.clear(), resized.clear()
        with ThreadPoolExecutor(len(greedy)) as pool:
            replies = list(pool.map(lambda body: _post(url, body), greedy))
    assert [r.json()["choices"][0]["text"] for r in replies] == serial
    # Rounds of several requests were sized, on the tiny model's kernels unless peft's hooks
    # are in the way (a round without an adapter on peft would be ragged: there is none here).
    assert set(kinds) == {"ragged" if backend == "fast" else "joint"}
    assert len(resized) == len(counts)
    assert all(
        after == min(before, count + 1)
        for (before, after), count in zip(resized, counts, strict=True)
    )


def test_sampled_trees_of_a_round_stay_sampled_when_sized_together(server_for, monkeypatch) -> None:
    """Sampling requests in one round: the joint count comes from the stopping rule
    (``as_drawn``), and the resized trees keep their draws as samples (verified with their
    proposals, not as point masses)."""
    from selfspec.generation import GenerationStream
    from selfspec.serve import engine as engine_module
    from selfspec.tree import DraftSampling

    real_joint_keep, real_ragged_keep = engine_module.joint_keep, engine_module.ragged_keep
    modes: list[bool] = []
    kept_sampling: list[DraftSampling] = []

    def record_joint(candidates, batch_size: int, min_tokens: int = 1, as_drawn=False) -> int:
        modes.append(as_drawn)
        return max(1, real_joint_keep(candidates, batch_size, min_tokens, as_drawn))

    def record_ragged(candidates, fixed_rows: int = 0, as_drawn=False) -> list[int]:
        modes.append(as_drawn)
        return [max(1, n) for n in real_ragged_keep(candidates, fixed_rows, as_drawn)]

    real_resize = GenerationStream.resize

    def record_resize(self, drafted, count: int, as_drawn: bool = False):
        out = real_resize(self, drafted, count, as_drawn)
        kept_sampling.append(out.tree.sampling)
        return out

    monkeypatch.setattr(engine_module, "joint_keep", record_joint)
    monkeypatch.setattr(engine_module, "ragged_keep", record_ragged)
    monkeypatch.setattr(GenerationStream, "resize", record_resize)
    sampled = [
        {"model": m, "prompt": p, "temperature": 1.0, "max_tokens": 16}  # unseeded: sizable
        for m, p in (("attn", "abc"), ("mlp", "hello world"), ("attn", "xyz"), ("mlp", "abc"))
    ]
    sampled = [{**b, "ignore_eos": True, "speculation": True} for b in sampled]
    with server_for(max_running=8, max_queue=8, tree="adaptive") as (url, _, _):
        _post(url, sampled[0])  # warm: the engine's first round
        modes.clear()
        kept_sampling.clear()
        with ThreadPoolExecutor(len(sampled)) as pool:
            replies = list(pool.map(lambda body: _post(url, body), sampled))
    assert all(r.status_code == 200 for r in replies)
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in replies)
    assert modes and all(modes)
    assert kept_sampling and set(kept_sampling) == {DraftSampling.WITHOUT_REPLACEMENT}


def _stream_text(url: str, body: dict[str, object]) -> str:
    import json

    response = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


@pytest.fixture(scope="module")
def one_slot(server_for):
    """One running slot and one waiting place."""
    with server_for(max_running=1, max_queue=1) as (url, state, _):
        yield url, state


def test_client_disconnect_cancels_the_request(one_slot) -> None:
    url, _ = one_slot
    cancelled = 'selfspec_requests_total{adapter="attn",outcome="cancelled"}'
    before = _metric(url, cancelled)
    body = {"model": "attn", "prompt": "abc", **LONG, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        next(lines)  # decoding has started
    _wait_for(url, running=0, waiting=0)
    assert _metric(url, cancelled) == before + 1
    # A non-streaming client that gives up once its request runs is cancelled as well.
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({"model": "attn", "prompt": "abc", **LONG}).encode()
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        _wait_for(url, running=1)
    _wait_for(url, running=0, waiting=0)
    assert _metric(url, cancelled) == before + 2
    assert _metric(url, 'selfspec_requests_total{adapter="attn",outcome="completed"}') == 0


def test_full_queue_is_429_and_the_waiting_request_runs_after(one_slot) -> None:
    url, _ = one_slot
    body = {"model": "mlp", "prompt": "abc", **LONG, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept: a dropped line iterator closes the connection
        next(lines)  # the one slot is taken
        waiting: dict[str, httpx.Response] = {}
        short = {"model": "attn", "prompt": "abc", "temperature": 0, "max_tokens": 4}
        thread = threading.Thread(target=lambda: waiting.update(r=_post(url, short)))
        thread.start()
        _wait_for(url, running=1, waiting=1)
        rejected = _post(url, short)
        assert rejected.status_code == 429
        assert rejected.json()["error"]["type"] == "rate_limit_error"
    thread.join(timeout=30)  # closing the stream cancelled it, so the waiting one ran
    assert waiting["r"].status_code == 200
    assert waiting["r"].json()["usage"]["completion_tokens"] == 4
    assert _metric(url, 'selfspec_requests_total{adapter="attn",outcome="rejected"}') == 1


def test_shutdown_drains_in_flight_requests_then_refuses(server_for) -> None:
    with server_for() as (url, state, _):
        body = {"model": "attn", "prompt": "abc", **{**LONG, "max_tokens": 120}}
        done: dict[str, httpx.Response] = {}
        client = threading.Thread(target=lambda: done.update(r=_post(url, body)))
        client.start()
        _wait_for(url, running=1)
        drained: list[bool] = []
        stopper = threading.Thread(target=lambda: drained.append(state.engine.shutdown(30)))
        stopper.start()
        deadline = time.monotonic() + 5
        while state.engine.serving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.get(f"{url}/health").status_code == 503
        refused = _post(url, {**body, "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_serving"
        client.join(timeout=30)
        stopper.join(timeout=30)
        assert drained == [True]
        assert done["r"].status_code == 200
        assert done["r"].json()["usage"]["completion_tokens"] == 120


def test_a_failing_request_leaves_the_others_running(assets) -> None:
    from serve_helpers import running_server

    from selfspec.adapters.store import AdapterStore, StoreConfig
    from selfspec.generation import SpeculativeGenerator
    from selfspec.serve.app import ServerState
    from selfspec.target import TargetSpec, load_target

    target = load_target(TargetSpec(model=str(assets["target"])))
    # One resident adapter at most: a second adapter cannot load while the first is pinned.
    store = AdapterStore(target.model, root=assets["adapters"], config=StoreConfig(max_resident=1))
    generator = SpeculativeGenerator(target.model, None, target.tokenizer)
    state = ServerState(generator, target.tokenizer, target.name, store, max_running=2)
    with running_server(state) as (url, _):
        # Long enough (480 tokens) that it is still running when the second request arrives: the
        # server does not wait for the client to read, and 60 tokens of the tiny model could
        # finish in between.
        body = {"model": "attn", "prompt": "abc", **LONG, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            busy = _post(url, {"model": "mlp", "prompt": "abc", "max_tokens": 2})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "adapters_busy"
            rest = "\n".join(lines)
        assert '"finish_reason": "length"' in rest and rest.rstrip().endswith("data: [DONE]")
        assert _post(url, {"model": "mlp", "prompt": "abc", "max_tokens": 2}).status_code == 200
