"""Fairness across adapters: waiting requests start round-robin by adapter, and a flood on one
adapter holds at most its share of the queue, so a request on another is neither refused nor
kept waiting behind the flood."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from selfspec.serve.fair_queue import FairQueue


@dataclass(eq=False)
class _Job:
    label: str
    n: int


def test_the_queue_takes_turns_across_adapters_in_arrival_order_within_each() -> None:
    queue: FairQueue[_Job] = FairQueue()
    jobs = [_Job("a", i) for i in range(4)] + [_Job("b", 0), _Job("c", 0), _Job("b", 1)]
    queue.extend(jobs)
    assert len(queue) == 7 and queue.waiting("a") == 4 and jobs[4] in queue
    queue.remove(jobs[1])
    order = [(j.label, j.n) for j in (queue.popleft() for _ in range(6))]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 2), ("b", 1), ("a", 3)]
    assert not queue and list(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_a_flood_on_one_adapter_neither_refuses_nor_delays_another(server_for) -> None:
    flood = {"model": "attn", "prompt": "abc", "temperature": 0, "max_tokens": 400,
             "ignore_eos": True, "speculation": False}  # fmt: skip
    with server_for(max_running=1, max_queue=8) as (url, state, _):
        assert state.engine.max_queue_per_adapter == 6
        finished: list[str] = []
        lock = threading.Lock()

        def send(body: dict, name: str) -> None:
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            with lock:
                finished.append(name)

        threads = [
            threading.Thread(target=send, args=(flood, f"attn{i}")) for i in range(7)
        ]  # one running, six waiting: attn's whole share
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while sum(httpx.get(f"{url}/health").json()[k] for k in ("running", "waiting")) < 7:
            assert time.monotonic() < deadline, "the flood was not admitted"
            time.sleep(0.01)
        refused = httpx.post(f"{url}/v1/completions", json=flood)
        assert refused.status_code == 429 and "max_queue_per_adapter" in refused.text
        quiet = {**flood, "model": "mlp", "max_tokens": 4}
        threads.append(threading.Thread(target=send, args=(quiet, "mlp")))
        threads[-1].start()
        for thread in threads:
            thread.join(timeout=120)
        # FIFO would finish mlp last; round-robin starts it right after the running job.
        assert finished.index("mlp") <= 2, finished
