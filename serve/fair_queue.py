"""Waiting requests, one queue per adapter, started round-robin across adapters.

A flood of requests on one adapter must not starve the others (as LoRAX schedules): each time a
running place frees up, the next adapter in turn (the base model counting as one) starts its
oldest waiting job, so a request on a quiet adapter waits for at most one job per busy adapter,
not for the whole flood. Jobs of one adapter keep their arrival order.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class _Labelled(Protocol):
    label: str


J = TypeVar("J", bound=_Labelled)


class FairQueue(Generic[J]):
    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[J]] = OrderedDict()
        """Adapters with waiting jobs, the next to start first."""
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[J]:
        for queue in self._queues.values():
            yield from queue

    def __contains__(self, job: object) -> bool:
        return any(job in queue for queue in self._queues.values())

    def waiting(self, label: str) -> int:
        """Jobs waiting on ``label``."""
        queue = self._queues.get(label)
        return 0 if queue is None else len(queue)

    def extend(self, jobs: list[J]) -> None:
        for job in jobs:
            self._queues.setdefault(job.label, deque()).append(job)
            self._size += 1

    def popleft(self) -> J:
        """The oldest job of the adapter whose turn it is; that adapter goes to the back."""
        if not self._size:
            raise IndexError("pop from an empty FairQueue")
        label, queue = next(iter(self._queues.items()))
        job = queue.popleft()
        del self._queues[label]
        if queue:
            self._queues[label] = queue  # to the back of the turn order
        self._size -= 1
        return job

    def remove(self, job: J) -> None:
        queue = self._queues[job.label]
        queue.remove(job)
        if not queue:
            del self._queues[job.label]
        self._size -= 1
