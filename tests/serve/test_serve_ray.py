"""Scale-out on Ray Serve: two engine replicas of the tiny model behind one ingress on loopback.

Greedy outputs equal the single-process server's; adapter affinity (Ray Serve multiplexing)
keeps loads per replica near one per adapter; /metrics merges the replicas; a replica killed
mid-traffic fails its streams cleanly while the other keeps serving.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

try:
    import ray
    from ray import serve
except ImportError:
    pytest.skip(
        "Ray Serve is not installed (pip install 'selfspec[ray]'); scale-out tests skipped",
        allow_module_level=True,
    )

from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import free_port, make_adapter

from selfspec.serve.cli import ServeArgs
from selfspec.serve.ray_app import APP_NAME, RayServeConfig, build_app
from selfspec.serve.ray_forward import REPLICA_HEADER

pytestmark = pytest.mark.slow  # a Ray instance and two model replicas: about a minute or more

EXTRA_ADAPTERS = ("x0", "x1", "x2", "x3")
PROMPTS = ("The quick brown fox", "Once upon a time")
GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
REPORT_S = 0.5


@pytest.fixture(scope="module")
def fleet_args(assets, tmp_path_factory: pytest.TempPathFactory) -> ServeArgs:
    """The conftest's target and heads; its two adapters plus four more, for affinity."""
    root: Path = tmp_path_factory.mktemp("ray-adapters")
    for name in ("attn", "mlp"):
        shutil.copytree(assets["adapters"] / name, root / name)
    for index, name in enumerate(EXTRA_ADAPTERS):
        make_adapter(root / name, seed=10 + index)
    return ServeArgs(
        model=str(assets["target"]),
        heads=str(assets["heads"]),
        adapters_root=str(root),
        tree="dynamic",
        max_running=4,
        max_queue=8,
    )


@pytest.fixture(scope="module")
def fleet(fleet_args: ServeArgs) -> Iterator[str]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = RayServeConfig(replicas=2, report_interval_s=REPORT_S)
        serve.run(build_app(fleet_args, config), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(f"{url}/health").json().get("replicas") == 2, "two replicas")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _sse(text: str) -> list[dict]:
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _outputs(url: str, models: tuple[str, ...]) -> dict[tuple[str, str, str], str]:
    """Greedy text of each (model, prompt) as a completion and as a streamed chat."""
    out = {}
    for model in models:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, **GREEDY}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            out[model, prompt, "completion"] = response.json()["choices"][0]["text"]
            messages = [{"role": "user", "content": prompt}]
            chat = {"model": model, "messages": messages, "stream": True, **GREEDY}
            response = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
            assert response.status_code == 200, response.text
            deltas = [e["choices"][0]["delta"].get("content", "") for e in _sse(response.text)]
            out[model, prompt, "chat"] = "".join(deltas)
    return out


def _samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(f"{url}/metrics").text
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def _completed(url: str, adapters: tuple[str, ...]) -> float:
    """Completed requests on ``adapters``, summed over the replicas' labelled series."""
    return sum(
        value
        for labels, value in _samples(url, "selfspec_requests_total")
        if labels["adapter"] in adapters and labels["outcome"] == "completed"
    )


def test_greedy_outputs_equal_the_single_process_server(fleet, fleet_args, server_for) -> None:
    models = ("tiny-llama", "attn", "mlp")
    # The same adapters (other tests add some to the conftest's folder).
    root = fleet_args.adapters_root
    with server_for(max_running=4, max_queue=8, adapters_root=root) as (single_url, _, _):
        expected = _outputs(single_url, models)
        listed = httpx.get(f"{single_url}/v1/models").json()["data"]
    got = _outputs(fleet, models)
    equal = sum(got[key] == text for key, text in expected.items())
    print(f"ray scale-out: {equal}/{len(expected)} greedy outputs equal the single process")
    assert got == expected
    assert len(set(expected.values())) > 1
    fleet_models = httpx.get(f"{fleet}/v1/models").json()["data"]
    assert {m["id"] for m in fleet_models} == {m["id"] for m in listed}


def test_affinity_loads_each_adapter_about_once_and_metrics_merge(fleet) -> None:
    adapters = ("attn", "mlp", *EXTRA_ADAPTERS)
    time.sleep(3 * REPORT_S)  # the earlier tests' requests are all in the replicas' reports
    before = _completed(fleet, adapters)
    served_by: dict[str, Counter[str]] = {name: Counter() for name in adapters}
    rounds = 5
    for _ in range(rounds):
        for name in adapters:
            body = {"model": name, "prompt": "abc", "temperature": 0, "max_tokens": 2}
            response = httpx.post(f"{fleet}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            served_by[name][response.headers[REPLICA_HEADER]] += 1
    requests = rounds * len(adapters)
    _wait(
        lambda: _completed(fleet, adapters) - before == requests,
        "the replicas' reports",
        timeout=10 * REPORT_S + 10,
    )
    loads = {
        (labels["replica"], labels["adapter"]): value
        for labels, value in _samples(fleet, "selfspec_adapter_loads_total")
    }
    replicas = {labels["replica"] for labels, _ in _samples(fleet, "selfspec_requests_total")}
    per_replica = {
        replica: int(sum(v for (r, _), v in loads.items() if r == replica)) for replica in replicas
    }
    print(
        f"ray scale-out: {requests} requests on {len(adapters)} adapters -> adapter loads per "
        f"replica {sorted(per_replica.values())} (total {int(sum(loads.values()))})"
    )
    assert len(replicas) == 2, "both replicas report, each labelled"
    # Routing information spreads asynchronously: an adapter asked for again within a moment
    # of its first load may load on the other replica too (the earlier test's attn and mlp);
    # without affinity, these 30 requests would load nearly every adapter on both replicas.
    assert len(adapters) <= sum(loads.values()) <= len(adapters) + 2, (loads, served_by)
    for name, replicas_of in served_by.items():
        for replica in replicas_of:  # a replica that served an adapter loaded it, once
            assert loads.get((replica, name)) == 1, (name, replica, loads)
    health = httpx.get(f"{fleet}/health").json()
    assert health["status"] == "ok" and health["replicas"] == 2


def test_management_routes_refused(fleet) -> None:
    body = {"lora_name": "y", "lora_path": "attn"}
    response = httpx.post(f"{fleet}/v1/load_lora_adapter", json=body)
    assert response.status_code == 501 and "--replicas" in response.json()["error"]["message"]
    unknown = httpx.post(f"{fleet}/v1/completions", json={"model": "nope", "prompt": "a"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


def test_replica_killed_mid_traffic_fails_cleanly_and_the_other_serves(fleet) -> None:
    long = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    streamed = ("tiny-llama", "tiny-llama", "attn", "mlp")
    unstreamed = ("tiny-llama", "attn", "mlp", "x0", "x1", "x2")
    started = [threading.Event() for _ in streamed]
    replica_of: dict[int, str] = {}
    ends: dict[int, str] = {}
    answers: dict[int, tuple[int, str]] = {}

    def stream(index: int, model: str) -> None:
        body = {"model": model, "prompt": "Once upon a time", "stream": True, **long}
        with httpx.stream("POST", f"{fleet}/v1/completions", json=body, timeout=60) as response:
            replica_of[index] = response.headers[REPLICA_HEADER]
            text = []
            for line in response.iter_lines():
                started[index].set()
                text.append(line)
        events = _sse("\n".join(text))
        last = events[-1]
        ends[index] = "error" if "error" in last else last["choices"][0]["finish_reason"]

    def ask(index: int, model: str) -> None:
        body = {"model": model, "prompt": "Once upon a time", **long}
        response = httpx.post(f"{fleet}/v1/completions", json=body, timeout=60)
        finish = response.json()["choices"][0]["finish_reason"] if response.is_success else ""
        answers[index] = (response.status_code, finish)

    threads = [
        threading.Thread(target=ask, args=(i, m), daemon=True) for i, m in enumerate(unstreamed)
    ]
    threads += [
        threading.Thread(target=stream, args=(i, m), daemon=True) for i, m in enumerate(streamed)
    ]
    actors = _replica_actors()  # looked up first: the kill then takes no time
    failures_before = _ingress_failures(fleet)
    for thread in threads:  # the unstreamed first: they are in flight once the streams run
        thread.start()
    for event in started:
        assert event.wait(60), "every stream starts"
    running = [index for index in range(len(streamed)) if index not in ends]
    assert running, "a stream still runs"
    victim = replica_of[running[0]]
    ray.kill(actors[victim], no_restart=True)
    killed_at = time.monotonic()
    finished_before = set(ends)
    # The other replica keeps serving, every model, while the killed one is being replaced.
    for model in ("tiny-llama", "attn", "mlp"):
        body = {"model": model, "prompt": "abc", "temperature": 0, "max_tokens": 2}
        response = httpx.post(f"{fleet}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.headers[REPLICA_HEADER] != victim
    for thread in threads:
        thread.join(90)
        assert not thread.is_alive(), "no request hangs"
    settled_s = time.monotonic() - killed_at
    failures = {k: v - failures_before.get(k, 0) for k, v in _ingress_failures(fleet).items()}
    cut = [index for index, end in ends.items() if end == "error"]
    on_victim = [index for index, replica in replica_of.items() if replica == victim]
    print(
        f"ray scale-out: replica killed with {len(streamed)} streams and {len(unstreamed)} "
        f"unstreamed requests in flight: {len(cut)} of its {len(on_victim)} streams ended with "
        f"an error event (the others had finished), {len(streamed) - len(on_victim)} on the "
        f"other replica finished; unstreamed answers {sorted(answers.values())}; ingress "
        f"failures {failures}; all settled in {settled_s:.1f} s"
    )
    for index, replica in replica_of.items():
        if replica != victim or index in finished_before:
            assert ends[index] == "length", (index, ends)
        else:  # cut by the kill, unless it finished in the instant before
            assert ends[index] in ("error", "length"), (index, ends)
    # Streams of the victim still running when it was killed are cut (the one chosen as running
    # may itself have finished in the instant before the kill: then nothing was left to cut).
    unfinished = [index for index in on_victim if index not in finished_before]
    assert set(cut) <= set(on_victim) and (cut or not unfinished), (cut, on_victim, ends)
    assert failures.get("mid_response", 0) == len(cut)
    # Unstreamed requests answer nothing before they finish: those on the killed replica
    # failed before answering and were retried on the other one.
    assert sorted(answers.values()) == [(200, "length")] * len(unstreamed), answers


def _replica_actors() -> dict[str, object]:
    """Replica tag -> the engine replica's Ray actor (Ray Serve names it by the tag)."""
    actors = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if "EngineReplica" in actor["name"]:
            tag = actor["name"].rsplit("#", 1)[-1]
            actors[tag] = ray.get_actor(actor["name"], namespace=actor["namespace"])
    return actors


def _ingress_failures(url: str) -> dict[str, float]:
    return {
        labels["when"]: value
        for labels, value in _samples(url, "selfspec_ingress_replica_failures_total")
    }
