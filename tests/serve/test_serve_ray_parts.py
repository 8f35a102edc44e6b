"""The parts of the Ray Serve scale-out that need no Ray: the ingress' relay (retries before the
first answer, a clean end after a failure mid-way), replicas' expositions merged by a ``replica``
label, and the CLI's ``--replicas`` options."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from selfspec.serve.cli import ServeArgs
from selfspec.serve.errors import APIError
from selfspec.serve.ray_cli import RAY_MISSING, serve_on_ray
from selfspec.serve.ray_forward import (
    ReplicaFailed,
    ResponseStart,
    adapter_of,
    end_to_end,
    first_answer,
    relay_body,
)
from selfspec.serve.ray_metrics import ReplicaReport, fleet_exposition

SSE = ResponseStart(200, (("content-type", "text/event-stream"),), "r1")
JSON = ResponseStart(200, (("content-type", "application/json"),), "r1")


class ReplicaDied(Exception):
    """Stands for Ray's ActorDiedError."""


async def _items(*items: object) -> AsyncIterator[object]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


async def _collect(body: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in body])


def test_first_answer_retries_an_attempt_that_failed_before_answering() -> None:
    attempts = [_items(ReplicaDied("gone")), _items(SSE, b"data: 1\n\n")]
    failed: list[str] = []
    start, stream = asyncio.run(_first(attempts, retries=1, failed=failed))
    assert start == SSE and failed == ["before_answer"] and not attempts


def test_first_answer_gives_503_when_every_attempt_fails() -> None:
    attempts = [_items(ReplicaDied("gone")), _items(ReplicaDied("gone too"))]
    with pytest.raises(APIError) as raised:
        asyncio.run(_first(attempts, retries=1, failed=[]))
    assert raised.value.status == 503 and "2 attempt(s)" in str(raised.value.body())


async def _first(attempts: list, retries: int, failed: list[str]):
    return await first_answer(lambda: attempts.pop(0), retries, failed.append)


def test_a_stream_whose_replica_fails_ends_with_an_error_event_and_done() -> None:
    failed: list[str] = []
    body = asyncio.run(
        _collect(relay_body(SSE, _items(b"data: 1\n\n", ReplicaDied()), failed.append))
    )
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[0] == "1" and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "replica_failed"
    assert failed == ["mid_response"]


def test_another_body_whose_replica_fails_is_aborted_not_truncated() -> None:
    with pytest.raises(ReplicaFailed, match="r1"):
        asyncio.run(_collect(relay_body(JSON, _items(b'{"a": ', ReplicaDied()))))


def test_request_parts() -> None:
    assert adapter_of(b'{"model": "attn"}', "base") == "attn"
    assert adapter_of(b'{"model": "base"}', "base") is None
    assert adapter_of(b"not json", "base") is None and adapter_of(b"[1]", "base") is None
    headers = end_to_end([("Content-Length", "3"), ("Authorization", "x"), ("Date", "d")], {"date"})
    assert headers == (("authorization", "x"),)


def _exposition(completed: int) -> str:
    registry = CollectorRegistry()
    counter = Counter("selfspec_requests", "Requests", ["adapter"], registry=registry)
    counter.labels("attn").inc(completed)
    return generate_latest(registry).decode()


def test_fleet_exposition_labels_every_replica_and_counts_them() -> None:
    reports = [
        ReplicaReport("r1", _exposition(2), serving=True, running=0, waiting=0),
        ReplicaReport("r2", _exposition(3), serving=False, running=0, waiting=0),
    ]
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(fleet_exposition(reports).decode())
        for sample in family.samples
    }
    assert samples["selfspec_requests_total", (("adapter", "attn"), ("replica", "r1"))] == 2
    assert samples["selfspec_requests_total", (("adapter", "attn"), ("replica", "r2"))] == 3
    assert samples["selfspec_replicas_reporting", ()] == 2
    assert samples["selfspec_replicas_serving", ()] == 1


def test_replicas_options_are_checked() -> None:
    with pytest.raises(ValueError, match="--replicas"):
        ServeArgs(replicas=0)
    with pytest.raises(ValueError, match="--replica-cpus"):
        ServeArgs(replicas=2, replica_cpus=0)
    with pytest.raises(ValueError, match="--enable-lora-management"):
        ServeArgs(replicas=2, enable_lora_management=True)


def test_replicas_without_ray_is_a_clear_error(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` finds without Ray
    assert serve_on_ray(ServeArgs(replicas=2)) == 2
    assert RAY_MISSING in capsys.readouterr().err
