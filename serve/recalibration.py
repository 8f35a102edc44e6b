"""Background recalibration from served outputs (opt-in: ``selfspec serve --recalibrate``).

An adapter the drift monitor flags (``serve.drift``: its draft acceptance fell below the
threshold share of the base's) speculates poorly with the shared heads. Its own served outputs
are exact training rows for a draft delta: every token is what the adapted target produced, and
the target's last hidden states at each position, what the heads read (and, for EAGLE-3 heads,
its states entering their layers), were computed anyway by the verification forwards. So while
an adapter is flagged, its speculating requests record them (``GenerationConfig.record_features``)
and this class gathers them:

1. **collect**: up to ``conversations`` finished requests of one adapter at a time (prompt +
   output ids and their float16 features, each cut to ``max_tokens``);
2. **train**: in a separate, niced process (``selfspec.train.recalibrate_rows``), with its own
   thread count, so a crash or a kill never touches the server: a rank-``rank`` delta of the
   shared heads is fitted on all but a held-back slice (every ``1 / held_back``-th row);
3. **judge**: the new delta's teacher-forced top-1 agreement with the target on the held-back
   rows against that of the drafting in use (the shared heads, plus the adapter's current delta);
   only a gain of at least ``min_gain`` counts;
4. **swap**: the delta is loaded and validated, then swapped into the heads' delta bank by the
   engine's worker between two rounds (``Engine.between_rounds``), so no step drafts half with
   the old pair; the adapter's acceptance averages restart, so the drift score then measures the
   new delta. With ``save`` it is also written atomically to ``<adapter>/heads-delta/``.

Outputs never change: drafts only decide how many tokens a verification commits, never which.
An adapter gets at most ``max_attempts`` tries per server run; one trains at a time; an adapter
unloaded meanwhile has its rows and any pending result dropped. Every attempt counts in
``selfspec_background_recalibrations_total{adapter, outcome}`` and ``outcomes``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from selfspec.generation import GenerationResult, split_recorded
from selfspec.heads.checkpoint import read_heads_config
from selfspec.serve.drift import DriftMonitor

logger = logging.getLogger(__name__)

TRAINER_MODULE = "selfspec.train.recalibrate_rows"


@dataclass(frozen=True)
class RecalibrationPolicy:
    """When and how a server recalibrates adapters' draft deltas from their served outputs."""

    trigger: Literal["drift", "always"] = "drift"
    """"drift": adapters the drift monitor flags; "always": every adapter drafting with the
    shared heads, once (then again only if flagged)."""
    conversations: int = 64
    """Finished requests gathered per attempt (training + held-back rows)."""
    held_back: float = 0.25
    """Share of them kept out of training to judge the delta."""
    max_tokens: int = 512
    """A gathered request's prompt + output are cut to this many tokens."""
    steps: int = 150
    lr: float = 3e-3
    rank: int = 16
    batch_size: int = 8
    min_gain: float = 0.01
    """Held-back top-1 agreement the new delta must add to the drafting in use."""
    max_attempts: int = 3
    """Attempts per adapter per server run."""
    threads: int = 1
    """CPU threads of the training process (it runs at a lower priority than the server)."""
    timeout_s: float = 3600.0
    save: bool = False
    """Also write a swapped-in delta to ``<adapter>/heads-delta/`` (else it lives in memory)."""

    def __post_init__(self) -> None:
        if self.trigger not in ("drift", "always"):
            raise ValueError(f"trigger must be 'drift' or 'always', got {self.trigger!r}")
        if self.conversations < 4 or not 0 < self.held_back < 1:
            raise ValueError(
                f"need conversations >= 4 and 0 < held_back < 1, got {self.conversations}, "
                f"{self.held_back}"
            )
        for name in ("max_tokens", "steps", "rank", "batch_size", "max_attempts", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.min_gain < 1 or not self.timeout_s > 0:
            raise ValueError("need lr > 0, 0 <= min_gain < 1 and timeout_s > 0")

    @property
    def held_back_every(self) -> int:
        """Row i is held back when i % this == 0."""
        return max(2, round(1 / self.held_back))


@dataclass(frozen=True)
class Outcome:
    adapter: str
    outcome: Literal["swapped", "kept", "failed"]
    detail: str
    seconds: float
    report: dict | None = None
    """The training process's verdict (agreements before and after, rows, steps)."""


@dataclass
class _Row:
    input_ids: list[int]
    prompt_len: int
    features: np.ndarray  # [len - 1, H] float16; EAGLE-3: [len - 1, k*H + H], taps first


@dataclass
class _Adapter:
    generation: int
    """Unique per entry: an adapter forgotten (unloaded) and seen again is a new entry, and a
    result of training for the old one is stale."""
    attempts: int = 0
    delta_dir: Path | None = None
    """The delta this recalibrator swapped in last (kept in its work directory)."""
    rows: list[_Row] = field(default_factory=list)


class ServedRecalibrator:
    def __init__(
        self,
        policy: RecalibrationPolicy,
        heads_dir: Path,
        model: str | None,
        drift: DriftMonitor,
        install: Callable[[str, Path], None],
        current_delta: Callable[[str], Path | None],
        on_outcome: Callable[[Outcome], None] | None = None,
        work_root: Path | None = None,
    ) -> None:
        """``install(adapter, delta_dir)``: validate and swap the delta in (raises if it cannot
        be used); ``current_delta(adapter)``: the directory of the delta it drafts with now
        from elsewhere (its own ``heads-delta/``), or None; ``model``: the target as the
        training process loads it (a local dir or .gguf; None: the embedded default)."""
        self.policy = policy
        self.heads_dir = Path(heads_dir)
        self.model = model
        self.drift = drift
        self._install = install
        self._current_delta = current_delta
        self._on_outcome = on_outcome
        self._work = Path(tempfile.mkdtemp(prefix="selfspec-recalibrate-", dir=work_root))
        self._adapters: dict[str, _Adapter] = {}
        self._generations = itertools.count()
        self._collecting: str | None = None
        self._training: str | None = None
        self._process: subprocess.Popen | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.outcomes: list[Outcome] = []

    # -- the server's side --------------------------------------------------------------------

    def wants(self, adapter: str | None) -> bool:
        """Whether a request on ``adapter`` (drafting with the shared heads) should record its
        features for this recalibrator."""
        if adapter is None:
            return False
        with self._lock:
            if self._closed or self._collecting not in (None, adapter):
                return False
            if self._training is not None and self._collecting is None:
                return False  # one adapter trains; the next starts gathering after it
            seen = self._adapters.get(adapter)
            if seen is not None and (
                seen.attempts >= self.policy.max_attempts
                or len(seen.rows) >= self.policy.conversations
            ):
                return False
            flagged = adapter in self.drift.flagged()
            first = self.policy.trigger == "always" and (seen is None or seen.attempts == 0)
            return flagged or first

    def collect(self, adapter: str | None, prompt_ids: list[int], result: GenerationResult) -> None:
        """Keep a finished request's row (if it recorded features); a full set starts training."""
        if adapter is None or result.features is None:
            return
        length = min(len(prompt_ids) + len(result.token_ids), self.policy.max_tokens)
        if length <= len(prompt_ids):  # nothing of the output fits: no response row
            return
        row = _Row(
            input_ids=[*prompt_ids, *result.token_ids][:length],
            prompt_len=len(prompt_ids),
            features=result.features[: length - 1].numpy(),
        )
        with self._lock:
            if self._closed or self._collecting not in (None, adapter):
                return
            seen = self._adapters.get(adapter)
            if seen is None:
                seen = self._adapters[adapter] = _Adapter(next(self._generations))
            if len(seen.rows) >= self.policy.conversations:
                return
            self._collecting = adapter
            seen.rows.append(row)
            if len(seen.rows) < self.policy.conversations or self._training is not None:
                return
            self._start(adapter, seen)

    def forget(self, adapter: str) -> None:
        """``adapter`` was unloaded: drop its rows, and any result of training still running."""
        with self._lock:
            seen = self._adapters.pop(adapter, None)
            if seen is not None and seen.delta_dir is not None:
                shutil.rmtree(seen.delta_dir.parent.parent, ignore_errors=True)
            if self._collecting == adapter:
                self._collecting = None

    @property
    def training(self) -> str | None:
        """The adapter whose delta is being trained, if any."""
        return self._training

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no training runs (tests, shutdown). True if none does."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._training is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True

    def close(self) -> None:
        """Stop: kill a training process, drop everything gathered, remove the work files."""
        with self._lock:
            self._closed = True
            process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        self.wait_idle(30)
        shutil.rmtree(self._work, ignore_errors=True)

    # -- training -----------------------------------------------------------------------------

    def _start(self, adapter: str, seen: _Adapter) -> None:
        """Hand ``seen.rows`` to a training thread (the lock is held)."""
        current = seen.delta_dir or self._current_delta(adapter)
        rows, seen.rows = seen.rows, []
        seen.attempts += 1
        self._collecting = None
        self._training = adapter
        thread = threading.Thread(
            target=self._train,
            args=(adapter, seen.generation, seen.attempts, rows, current),
            name=f"selfspec-recalibrate-{adapter}",
            daemon=True,
        )
        thread.start()

    def _train(
        self, adapter: str, generation: int, attempt: int, rows: list[_Row], current: Path | None
    ) -> None:
        started = time.perf_counter()
        job_dir = self._work / f"{_safe(adapter)}-{attempt}"
        try:
            report = self._run_job(job_dir, rows, current)
            outcome = self._conclude(adapter, generation, job_dir, report, started)
        except Exception as error:  # the server goes on; the attempt is recorded as failed
            logger.warning("background recalibration of %r failed: %s", adapter, error)
            outcome = Outcome(adapter, "failed", str(error), time.perf_counter() - started)
        if outcome.outcome != "swapped":
            shutil.rmtree(job_dir, ignore_errors=True)
        with self._idle:
            self.outcomes.append(outcome)
            self._training = None
            # Rows of a request admitted before this training began may have filled a set.
            waiting = self._adapters.get(self._collecting) if self._collecting else None
            if not self._closed and waiting and len(waiting.rows) >= self.policy.conversations:
                self._start(self._collecting, waiting)
            self._idle.notify_all()
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    def _run_job(self, job_dir: Path, rows: list[_Row], current: Path | None) -> dict:
        """Write the rows and the job file, run the training process, read its report."""
        from selfspec.train.distill import tapped_schema
        from selfspec.train.rows_job import REPORT_FILE, RowsJob
        from selfspec.train.shards import shard_dir, write_shard

        every = self.policy.held_back_every
        parts = {
            "train": [row for i, row in enumerate(rows) if i % every],
            "heldout": [row for i, row in enumerate(rows) if not i % every],
        }
        # EAGLE-3 heads read the target's states at these layers; served requests record them.
        layers = tuple(read_heads_config(self.heads_dir)[0].target_layers or ())
        width = rows[0].features.shape[-1] // (len(layers) + 1)  # H
        for part, chosen in parts.items():
            split = [split_recorded(row.features, len(layers)) for row in chosen]  # (taps, last)
            columns = {
                "input_ids": [row.input_ids for row in chosen],
                "prompt_len": [row.prompt_len for row in chosen],
                "response_len": [len(row.input_ids) - row.prompt_len for row in chosen],
                "finished": [True] * len(chosen),
                "source_index": list(range(len(chosen))),
                "features": [last for _, last in split],
            }
            extra = None
            if layers:  # EAGLE-3 heads: the states entering their layers, as training reads them
                columns["layer_features"] = [tapped for tapped, _ in split]
                columns["layer_ids"] = [list(layers)] * len(chosen)
                extra = tapped_schema(layers, width)
            meta = {"key": "served-outputs", "rows": len(chosen)}
            write_shard(shard_dir(job_dir / part, 0), columns, meta, features=width, extra=extra)
        policy = self.policy
        RowsJob(  # validated here, read back by the training process
            heads=str(self.heads_dir),
            train=str(job_dir / "train"),
            heldout=str(job_dir / "heldout"),
            out=str(job_dir / "out"),
            model=self.model,
            current_delta=None if current is None else str(current),
            rank=policy.rank,
            steps=policy.steps,
            lr=policy.lr,
            batch_size=policy.batch_size,
            min_gain=policy.min_gain,
            threads=policy.threads,
        ).write(job_dir / "job.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(policy.threads)}
        with open(job_dir / "train.log", "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", TRAINER_MODULE, str(job_dir / "job.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_lower_priority,  # noqa: PLW1509 (no threads touched before exec)
            )
            with self._lock:
                self._process = process
                if self._closed:  # closed while it started: close() did not see it
                    process.kill()
            try:
                code = process.wait(timeout=policy.timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise RuntimeError(f"training took longer than {policy.timeout_s:g} s") from None
            finally:
                with self._lock:
                    self._process = None
        if code != 0:
            tail = (job_dir / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"the training process exited with {code}: {' | '.join(tail)}")
        return json.loads((job_dir / "out" / REPORT_FILE).read_text())

    def _conclude(
        self, adapter: str, generation: int, job_dir: Path, report: dict, started: float
    ) -> Outcome:
        before, after = report["served"]["top1"], report["after"]["top1"]
        detail = f"held-back top-1 agreement {before:.3f} -> {after:.3f}"
        seconds = time.perf_counter() - started
        if not report["better"]:
            logger.info(
                "background recalibration of %r kept the drafting in use: %s", adapter, detail
            )
            return Outcome(adapter, "kept", detail, seconds, report)
        with self._lock:
            seen = self._adapters.get(adapter)
            if self._closed or seen is None or seen.generation != generation:
                return Outcome(adapter, "failed", "the adapter was unloaded meanwhile", seconds)
        from selfspec.train.rows_job import DELTA_SUBDIR

        delta_dir = job_dir / "out" / DELTA_SUBDIR
        self._install(adapter, delta_dir)  # validates; the engine swaps it between rounds
        with self._lock:
            previous, seen.delta_dir = seen.delta_dir, delta_dir
        if previous is not None:
            shutil.rmtree(previous.parent.parent, ignore_errors=True)
        logger.info(
            "background recalibration of %r swapped in a new draft delta: %s", adapter, detail
        )
        return Outcome(adapter, "swapped", detail, seconds, report)


def _lower_priority() -> None:
    os.nice(10)


def _safe(name: str) -> str:
    """A file name for ``name`` (adapter names may hold '/')."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "adapter"
