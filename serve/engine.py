"""The engine: ONE worker thread owns the model and advances the running requests in rounds.

Iteration-level scheduling: each round, new requests take a chunk of their prompt (up to the
round's `prefill_chunk` budget; a prompt's last chunk runs at once, alone, so that its first token
waits for nobody), and every decoding request drafts its tree (the requests on one adapter
together, one heads call per depth for all of them: `GenerationStream.draft_together`, which
first advances their draft states over the last round's accepted paths, also in one call); then
the trees of all of them, and the earlier chunks of long prompts, run in ONE target forward
(`selfspec.batched_verify`: ragged caches and trees, back to back where the kernels' whole body
runs them, else the trees padded and masked per row and each chunk in a forward of its own; each
request's tree sized for that forward) under a mixed-adapter scope (`AdapterStore.batch_scope`:
row i runs request i's adapter), and each request
concludes its step (verify, commit, stream). Waiting requests join between rounds and finished or
cancelled ones leave. Requests whose adapters fell back to peft form a batch of their own (one
forward cannot mix the two LoRA paths). A request's state (KV cache, draft state, generator) is its
own and a row of the batch sees only its own cache, so output never depends on what else is running
(up to float summation order in batched kernels; the tests check that greedy outputs equal the
requests run alone). `batch_verify=False` interleaves one forward per request instead (the
behaviour before batching, kept for comparison).

The HTTP side talks to the worker through `RequestHandle`s, one per HTTP request: an HTTP
request asking for `n` choices is `n` engine requests (jobs) admitted together, all or none,
each scheduled like any other. Events, tagged with their choice's index, are handed to the
request's asyncio loop with `call_soon_threadsafe`, and `cancel()` marks every job of the request
for the worker, which drops them (cache and adapter pin released) before their next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch

from selfspec.adapters.errors import StoreFull
from selfspec.adapters.store import AdapterStore, LoraBackend
from selfspec.batched_verify import ragged_possible, verify_rows
from selfspec.cost_curve import elapsed_seconds
from selfspec.drafting.sizing import JointCandidate, joint_keep, ragged_keep
from selfspec.generation import DraftedStep, GenerationResult, GenerationStream, StepOutput
from selfspec.kv_commit import drop_uncommitted
from selfspec.prefill import PrefillChunk, PrefillProgress
from selfspec.serve.errors import APIError, overloaded, unavailable
from selfspec.serve.fair_queue import FairQueue
from selfspec.serve.metrics import ServerMetrics
from selfspec.speculation_gate import SpeculationGate
from selfspec.tree import DraftSampling

logger = logging.getLogger(__name__)


@dataclass
class Event:
    kind: str
    """"delta" (a step's committed tokens), "done", "error" or "cancelled"; the last three end."""
    output: StepOutput | None = None
    result: GenerationResult | None = None
    error: APIError | None = None
    index: int = 0
    """The choice (job of its HTTP request) the event belongs to."""


@dataclass
class Job:
    stream: GenerationStream | None
    """Dropped when the request leaves, with its KV cache and draft state."""
    adapter: str | None
    label: str
    """Metrics label: the adapter's name, or the base model's."""
    speculate: bool
    handle: RequestHandle
    index: int = 0
    """The choice of its HTTP request this job generates."""
    admitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_token: float | None = None
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queue_seconds: float = 0.0
    """Seconds the job waited for a slot before its first step."""


class RequestHandle:
    """The HTTP side of one request: the events of all its jobs (each job's in order), and a way
    to cancel them all."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._pending: asyncio.Future[Event] | None = None
        self.jobs: list[Job] = []
        """One per choice, in choice order; empty until admitted."""

    @property
    def queue_seconds(self) -> float:
        """Seconds until the last of the request's jobs started (its longest wait)."""
        return max((job.queue_seconds for job in self.jobs), default=0.0)

    def emit(self, event: Event) -> None:
        """Called by the worker thread."""
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next_event(self, timeout: float) -> Event | None:
        """The next event, or None after `timeout` seconds without one.

        The pending `get` survives a timeout (not `asyncio.wait_for`, which before Python 3.12
        can drop an item that arrives just as the timeout fires)."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            return None
        event, self._pending = self._pending.result(), None
        return event

    def cancel(self) -> None:
        """Called on the event loop; cancels every job still in flight (a no-op for finished
        ones)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        for job in self.jobs:
            self._engine.cancel(job)


@dataclass(frozen=True)
class _Prefill:
    """A prefilling job's chunk for this round."""

    job: Job
    progress: PrefillProgress
    chunk: PrefillChunk

    @property
    def last(self) -> bool:
        """Whether the chunk ends the prompt (its forward gives the first token)."""
        return self.chunk.end == int(self.progress.prompt.shape[0])


def _or_empty(action: Callable[..., StepOutput | None], *args: object) -> StepOutput:
    """``action``'s output, or an empty one while a prefill is not done."""
    output = action(*args)
    return output if output is not None else StepOutput([], "")


class Engine:
    """Runs admitted requests on one worker thread. `max_running` requests run together (their
    trees verified in one forward when `batch_verify`); up to `max_queue` more wait, started
    round-robin across adapters (`FairQueue`), one adapter holding at most
    `max_queue_per_adapter` of those places (default: all but a quarter); beyond that `submit`
    answers 429."""

    def __init__(
        self,
        store: AdapterStore | None,
        metrics: ServerMetrics,
        max_running: int = 16,
        max_queue: int = 64,
        batch_verify: bool = True,
        max_queue_per_adapter: int | None = None,
        speculation_gate: SpeculationGate | None = None,
        prefill_chunk: int | None = None,
    ) -> None:
        """``speculation_gate``: decides per round whether the batch speculates, so speculation
        never runs slower than plain decoding; None: every round of a speculating request
        drafts. ``prefill_chunk``: prompt tokens the prefills of one round may run together,
        so a long prompt is prefilled over several rounds while the others decode (where chunks
        are exact: the row-invariant kernels; elsewhere a prompt is prefilled whole); None: each
        new request's whole prompt in its first round."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 tokens or None, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if max_running < 1 or max_queue < 0:
            raise ValueError(
                f"max_running must be >= 1 and max_queue >= 0, got {max_running}, {max_queue}"
            )
        if max_queue_per_adapter is None:
            max_queue_per_adapter = max_queue - max_queue // 4  # a quarter kept for the others
        if not 0 <= max_queue_per_adapter <= max_queue:
            raise ValueError(
                f"max_queue_per_adapter must be in [0, max_queue={max_queue}], got "
                f"{max_queue_per_adapter}"
            )
        self.max_queue_per_adapter = max_queue_per_adapter
        self.store = store
        self.metrics = metrics
        self.max_running = max_running
        self.max_queue = max_queue
        self.batch_verify = batch_verify
        self.speculation_gate = speculation_gate
        self._committed_tokens = 0
        """Tokens delivered so far (the gate times rounds by them)."""
        self.peak_running = 0
        """Most requests ever interleaved at once."""
        self._waiting: FairQueue[Job] = FairQueue()  # round-robin across adapters
        self._running: list[Job] = []
        self._chores: deque[Callable[[], None]] = deque()
        """Work for the worker between two rounds (``between_rounds``)."""
        self.on_finished: Callable[[Job, GenerationResult], None] | None = None
        """Called on the worker with each job that completed and its result (a failure in it is
        logged, never the request's)."""
        self._cond = threading.Condition()
        self._accepting = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the engine was already started")
            self._accepting = True
            self._thread = threading.Thread(target=self._work, name="selfspec-engine", daemon=True)
            self._thread.start()

    @property
    def serving(self) -> bool:
        thread = self._thread
        return self._accepting and thread is not None and thread.is_alive()

    def shutdown(self, timeout: float) -> bool:
        """Stop admitting, let in-flight requests finish within `timeout` seconds, cancel the
        rest, stop the worker. True if everything in flight finished."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._accepting = False
            while self._waiting or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            drained = not (self._waiting or self._running)
            for job in [*self._waiting, *self._running]:
                job.cancelled.set()
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(deadline - time.monotonic(), 0) + 10)
        return drained

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {
                "running": len(self._running),
                "waiting": len(self._waiting),
                "peak_running": self.peak_running,
            }

    def in_flight(self, adapter: str) -> int:
        """Admitted jobs (waiting or running) on ``adapter``."""
        with self._cond:
            return sum(job.adapter == adapter for job in [*self._waiting, *self._running])

    def wait_for_adapter(self, adapter: str, timeout: float) -> bool:
        """Wait until no admitted job runs on ``adapter`` (their pins released), at most
        ``timeout`` seconds. True if none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(job.adapter == adapter for job in [*self._waiting, *self._running]):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def between_rounds(self, chore: Callable[[], None]) -> None:
        """Run ``chore`` on the worker before its next round (at once when idle): a change to
        what the rounds read (a draft delta swapped in) never lands in the middle of one. A
        chore that raises is logged and dropped; the engine goes on."""
        with self._cond:
            self._chores.append(chore)
            self._cond.notify_all()

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        streams: Sequence[GenerationStream],
        adapter: str | None,
        label: str,
        speculate: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> RequestHandle:
        """Admit one HTTP request's jobs (one stream per choice) together, or none of them:
        429 unless all fit into the free running and waiting places."""
        if not streams:
            raise ValueError("submit needs at least one stream")
        handle = RequestHandle(self, loop)
        jobs = [
            Job(
                stream=stream,
                adapter=adapter,
                label=label,
                speculate=speculate,
                handle=handle,
                index=index,
            )
            for index, stream in enumerate(streams)
        ]
        with self._cond:
            if not self.serving:
                self.metrics.requests.labels(label, "rejected").inc(len(jobs))
                raise unavailable("the engine is not serving (starting or shutting down)")
            in_flight = len(self._waiting) + len(self._running)
            own = self._waiting.waiting(label)
            # Of this request's jobs, those that will wait (the others start at once):
            will_wait = min(len(jobs), max(0, in_flight + len(jobs) - self.max_running))
            if will_wait and own + will_wait > self.max_queue_per_adapter:
                self.metrics.requests.labels(label, "rejected").inc(len(jobs))
                raise overloaded(
                    f"{own} requests on {label!r} are already waiting, this adapter's share of "
                    f"the queue (max_queue_per_adapter {self.max_queue_per_adapter}); retry later"
                )
            if in_flight + len(jobs) > self.max_running + self.max_queue:
                self.metrics.requests.labels(label, "rejected").inc(len(jobs))
                needs = f"; this request needs {len(jobs)} places (n)" if len(jobs) > 1 else ""
                raise overloaded(
                    f"the server is full: {in_flight} requests admitted of "
                    f"{self.max_running + self.max_queue} places (max_running "
                    f"{self.max_running} + max_queue {self.max_queue}){needs}; retry later"
                )
            handle.jobs = jobs
            self._waiting.extend(jobs)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        return handle

    def cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled.set()
            if job in self._waiting:  # never started: nothing to free but its place
                self._waiting.remove(job)
                self.metrics.waiting.set(len(self._waiting))
                self._finish(job, Event("cancelled", index=job.index), "cancelled")
            self._cond.notify_all()

    # -- the worker --------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._stopping or self._chores):
                    self._cond.wait()
                chores = list(self._chores)
                self._chores.clear()
            for chore in chores:
                try:
                    chore()
                except Exception:
                    logger.exception("a chore between engine rounds failed")
            with self._cond:
                if self._stopping and not (self._waiting or self._running):
                    return
                if not (self._waiting or self._running):
                    continue
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                self.peak_running = max(self.peak_running, len(self._running))
                self.metrics.waiting.set(len(self._waiting))
                self.metrics.running.set(len(self._running))
                round_ = list(self._running)
            left = self._round(round_)
            if left:
                with self._cond:
                    for job in left:
                        self._running.remove(job)
                    self.metrics.running.set(len(self._running))
                    self._cond.notify_all()

    def _round(self, jobs: list[Job]) -> list[Job]:
        """One step of every job (a prefill chunk for new ones). Returns the jobs that left.

        A prompt's last chunk runs at once, in a forward of its own, so its first token waits
        for no other request's rows (on a CPU every row costs: in the round's forward, 4
        decoding requests' rows put ~15 ms on a short prompt's time to first token); its
        earlier chunks ride along the round's forward, saving a pass over the weights."""
        left, decoding, prefilling = [], [], []
        budget = self.prefill_chunk  # prompt tokens this round's prefills may run
        for job in jobs:
            if job.cancelled.is_set():
                self._finish(job, Event("cancelled", index=job.index), "cancelled")
                left.append(job)
            elif job.stream.state is None:  # prefilling: a chunk while the budget lasts
                if budget is not None and budget <= 0:
                    continue
                prefill = self._next_chunk(job, budget)
                if prefill is None:
                    left.append(job)
                    continue
                if budget is not None:
                    budget -= int(prefill.chunk.tokens.shape[0])
                if not prefill.last:
                    prefilling.append(prefill)
                elif not self._prefill_alone(prefill):
                    left.append(job)
            else:
                decoding.append(job)
        if not self.batch_verify:
            for prefill in prefilling:
                if not self._prefill_alone(prefill):
                    left.append(prefill.job)
            for job in decoding:
                self.metrics.batch_size.observe(1)
                if not self._guarded(job, job.stream.step):
                    left.append(job)
            return left
        chunks = {id(prefill.job): prefill for prefill in prefilling}
        for batch in self._batches([prefill.job for prefill in prefilling] + decoding):
            steps = [job for job in batch if id(job) not in chunks]
            left += self._step_together(steps, [chunks[id(j)] for j in batch if id(j) in chunks])
        return left

    def _next_chunk(self, job: Job, max_tokens: int | None) -> _Prefill | None:
        """``job``'s next prefill chunk (the first pins its adapter), or None when that fails
        (the job has left)."""
        try:
            if job.started is None:
                job.started = time.perf_counter()
                job.queue_seconds = job.started - job.admitted
                self.metrics.queue_wait.labels(job.label).observe(job.queue_seconds)
                if self.store is not None:
                    # Resident for the whole request: never evicted between its steps.
                    job.resources.enter_context(self.store.pinned(job.adapter))
            progress, chunk = job.stream.next_prefill_chunk(max_tokens)
        except Exception as error:
            self._fail(job, error)
            return None
        return _Prefill(job, progress, chunk)

    def _prefill_alone(self, prefill: _Prefill) -> bool:
        """Run ``prefill``'s chunk in a forward of its own; False once its job has left."""
        job = prefill.job
        return self._guarded(job, partial(_or_empty, job.stream.run_chunk, prefill.chunk))

    def _batches(self, jobs: list[Job]) -> list[list[Job]]:
        """Jobs whose trees can share one forward: the same target (their heads may differ), and
        adapters on one LoRA path (the fast path's per-row weights or peft's per-row adapter
        names, never both)."""
        batches: dict[tuple[int, bool], list[Job]] = {}
        for job in jobs:
            try:
                on_peft = (
                    self.store is not None
                    and job.adapter is not None
                    and self.store.backend_of(job.adapter) is LoraBackend.PEFT
                )
            except Exception:  # the store cannot say: this job runs in a batch of its own
                logger.exception("no LoRA backend for adapter %r; verifying alone", job.adapter)
                batches[id(job), False] = [job]
                continue
            batches.setdefault((id(job.stream.owner.target.model), on_peft), []).append(job)
        return list(batches.values())

    def _step_together(self, jobs: list[Job], prefills: Sequence[_Prefill] = ()) -> list[Job]:
        """One round of ``jobs`` (and the chunks of ``prefills``, in the same forward),
        speculating or not as the gate says (timed for it, in rounds without prefill chunks,
        whose time is not the decoding's); a seeded sampled request speculates always, so that
        its seed repeats its output."""
        gate = self.speculation_gate
        gated = gate is not None and any(
            job.speculate and job.stream.trees_may_vary for job in jobs
        )
        speculate = gate.choose(len(jobs)) if gated else True
        started, committed = time.perf_counter(), self._committed_tokens
        left = self._draft_and_verify(jobs, speculate, prefills)
        if gated and not prefills:
            seconds = time.perf_counter() - started
            gate.observe(len(jobs), speculate, self._committed_tokens - committed, seconds)
        return left

    def _draft_and_verify(
        self, jobs: list[Job], speculate: bool, prefills: Sequence[_Prefill] = ()
    ) -> list[Job]:
        """Draft each job's tree (unless ``speculate``, its root alone, or with its context
        chains when it is the only job: ``SpeculativeGenerator.draft``), verify them all in one
        target forward under a mixed-adapter scope, conclude each. Returns the jobs that left.
        The chunks of ``prefills`` run in that forward too where it runs its rows back to back
        (``batched_verify.ragged_possible``), else each in a forward of its own. Should the
        shared forward fail, each drafted tree is verified alone and each chunk run alone, so
        one bad request cannot fail the others."""
        left: list[Job] = []
        drafted = self._draft_groups(jobs, speculate, left) if jobs else []
        drafted = self._sized_together(drafted, left)
        owner = drafted[0][0] if drafted else prefills[0].job if prefills else None
        if owner is None:
            return left
        target = owner.stream.owner.target
        if prefills and not ragged_possible(target):
            left += [p.job for p in prefills if not self._prefill_alone(p)]
            prefills = ()
        if len(drafted) == 1 and not prefills:
            job, step = drafted[0]
            self.metrics.batch_size.observe(1)
            return left + ([] if self._guarded(job, partial(job.stream.verify, step)) else [job])
        sizes = [step.tree.size for _, step in drafted]
        try:
            names = [job.adapter for job, _ in drafted] + [p.job.adapter for p in prefills]
            scope = self.store.batch_scope(names) if self.store is not None else nullcontext()
            started = time.perf_counter()
            with torch.inference_mode(), scope:
                verified = verify_rows(
                    target,
                    [(job.stream.state, step) for job, step in drafted],
                    [(p.progress, p.chunk) for p in prefills],
                )
                features = verified.features
                if drafted:  # [T_b, vocab] each
                    logits = target.logits(torch.cat(features)).split(sizes)
            seconds = elapsed_seconds(started, target.device)
        except Exception:
            logger.exception(
                "a shared forward of %d trees and %d prefill chunks failed; one by one",
                len(drafted),
                len(prefills),
            )
            for job, step in drafted:
                state = job.stream.state
                drop_uncommitted(state.cache, state.committed_len)  # what the forward appended
                self.metrics.batch_size.observe(1)
                if not self._guarded(job, partial(job.stream.verify, step)):
                    left.append(job)
            for prefill in prefills:
                drop_uncommitted(prefill.progress.cache, prefill.progress.done)
                if not self._prefill_alone(prefill):
                    left.append(prefill.job)
            return left
        if drafted:
            self.metrics.batch_size.observe(len(drafted))
        for (job, step), own, own_logits in zip(
            drafted, features, logits if drafted else (), strict=True
        ):
            job.stream.owner.observe_verification(
                job.stream.state, seconds, verified.forward_tokens
            )
            # The draft states advance at the next round, all in one heads call.
            conclude = partial(job.stream.conclude, step, own, own_logits, defer_advance=True)
            if not self._guarded(job, conclude):
                left.append(job)
        for prefill, (own, tapped) in zip(prefills, verified.prefills, strict=True):
            share = seconds * int(prefill.chunk.tokens.shape[0]) / verified.forward_tokens
            absorb = partial(prefill.job.stream.absorb_prefill, prefill.chunk, own, tapped, share)
            if not self._guarded(prefill.job, partial(_or_empty, absorb)):
                left.append(prefill.job)
        return left

    def _draft_groups(
        self, jobs: list[Job], speculate: bool, left: list[Job]
    ) -> list[tuple[Job, DraftedStep]]:
        """Each job's tree (its root alone unless ``speculate``; seeded sampling speculates
        always), the jobs of one generator and adapter drafted in one batched heads call
        (``GenerationStream.draft_together``). Should a group's call fail, its jobs draft one
        by one, so one bad request cannot fail the others; a job that fails alone leaves (in
        ``left``). Adaptive trees that may vary are sized together afterwards (joint)."""
        together = len(jobs) > 1
        groups: dict[tuple[int, str | None], list[Job]] = {}
        for job in jobs:
            groups.setdefault((id(job.stream.owner), job.adapter), []).append(job)
        drafted = []
        for group in groups.values():
            vary = [job.stream.trees_may_vary for job in group]
            own = [speculate or not may_vary for may_vary in vary]
            joint = [together and may_vary for may_vary in vary]
            if len(group) > 1:
                try:
                    streams = [job.stream for job in group]
                    steps = GenerationStream.draft_together(streams, len(jobs), own, joint)
                    drafted += zip(group, steps, strict=True)
                    continue
                except Exception:
                    logger.exception("drafting %d requests together failed; one by one", len(group))
            for job, speculating, shared in zip(group, own, joint, strict=True):
                try:
                    step = job.stream.draft(
                        batch_size=len(jobs), speculate=speculating, joint=shared
                    )
                    drafted.append((job, step))
                except Exception as error:
                    self._fail(job, error)
                    left.append(job)
        return drafted

    def _sized_together(
        self, drafted: list[tuple[Job, DraftedStep]], left: list[Job]
    ) -> list[tuple[Job, DraftedStep]]:
        """The round's adaptive trees cut to the node counts chosen for the whole forward:
        where the trees run back to back (``ragged_possible``), each its own count, the
        batch's likeliest nodes (``ragged_keep``); else one count for all (``joint_keep``: rows
        are padded to the largest tree, so that count is what the batch pays for). Other trees
        as drafted. A job whose resize fails leaves (in ``left``)."""
        sized = [step for _, step in drafted if step.sizer is not None]
        if not sized:
            return drafted
        unsized = [s.tree.size for _, s in drafted if s.sizer is None]
        target = drafted[0][0].stream.owner.target
        ragged = ragged_possible(target)
        candidates = [
            JointCandidate(
                step.sizer,
                step.tree.scores[1:].sort(descending=True).values.tolist(),
                step.drafting_seconds,
                step.horizon,
            )
            for step in sized
        ]
        # Sampled draws stay samples only if the count never follows from their own draws.
        as_drawn = any(s.tree.sampling is DraftSampling.WITHOUT_REPLACEMENT for s in sized)
        if ragged:
            counts = iter(ragged_keep(candidates, sum(unsized), as_drawn))
        else:
            count = joint_keep(candidates, len(drafted), max(unsized, default=1), as_drawn)
            counts = iter([count] * len(candidates))
        out = []
        for job, step in drafted:
            try:
                resized = job.stream.resize(step, next(counts), as_drawn) if step.sizer else step
                out.append((job, resized))
            except Exception as error:
                self._fail(job, error)
                left.append(job)
        return out

    def _guarded(self, job: Job, action: Callable[[], StepOutput]) -> bool:
        """Run one piece of `job`'s decoding and deliver its output; False once it has left
        (finished or failed). A failure ends only this job."""
        try:
            output = action()
        except Exception as error:
            self._fail(job, error)
            return False
        if output.token_ids:
            if job.first_token is None:
                job.first_token = time.perf_counter()
                self.metrics.ttft.labels(job.label).observe(job.first_token - job.admitted)
            self.metrics.generation_tokens.labels(job.label).inc(len(output.token_ids))
            self._committed_tokens += len(output.token_ids)
            job.handle.emit(Event("delta", output=output, index=job.index))
        if not job.stream.done:
            return True
        result = job.stream.result
        self.metrics.latency.labels(job.label).observe(time.perf_counter() - job.admitted)
        self.metrics.record_finished(job.label, result.stats, job.speculate)
        if self.on_finished is not None:
            try:
                self.on_finished(job, result)
            except Exception:
                logger.exception("the finished-request hook failed for a request on %s", job.label)
        self._finish(job, Event("done", result=result, index=job.index), "completed")
        return False

    def _fail(self, job: Job, error: Exception) -> None:
        if isinstance(error, StoreFull):  # every resident slot is pinned by a request
            logger.warning("request on %s refused: %s", job.label, error)
            api_error = APIError(503, str(error), "service_unavailable", code="adapters_busy")
        else:
            logger.error("request on %s failed", job.label, exc_info=error)
            api_error = APIError(
                500, f"generation failed: {type(error).__name__}: {error}", "server_error"
            )
        self._finish(job, Event("error", error=api_error, index=job.index), "error")

    def _finish(self, job: Job, event: Event, outcome: str) -> None:
        try:
            job.resources.close()
        finally:
            job.stream = None  # the request's KV cache and draft state go with them
            self.metrics.requests.labels(job.label, outcome).inc()
            job.handle.emit(event)
