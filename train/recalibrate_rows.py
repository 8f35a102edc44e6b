"""Recalibration from rows at hand: fit an adapter's draft delta on rows its target already
produced (a server's served outputs, with the features it recorded while serving them), and
judge it on a held-back slice against the drafting it would replace.

`selfspec recalibrate` distils its own rows and measures τ by decoding; a server recalibrating in
the background (``selfspec.serve.recalibration``) already holds exact rows: every served output
is the adapted target's own, and its features were recorded during the verification forwards.
So this step needs no target forward at all: it trains the delta (``HeadsModule``, as
recalibration does) and compares teacher-forced top-1 agreement with the target on held-back
rows, the new delta against the shared heads plus the delta the adapter drafts with now, if any.

It runs as its own process (``python -m selfspec.train.recalibrate_rows JOB.json``) so a server
keeps its threads, memory and fate apart from the training: the job file names the inputs, the
process writes ``report.json`` (always, atomically) and ``delta/`` (only when the new delta
measures better) into the job's ``out``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from selfspec.atomic import write_text_atomic
from selfspec.heads import load_heads
from selfspec.heads.checkpoint import read_heads_config
from selfspec.heads.delta import DeltaBank, DeltaConfig, load_delta
from selfspec.target import TargetSpec
from selfspec.train.datamodule import DistilledDataModule
from selfspec.train.module import HeadsModule, OptimConfig
from selfspec.train.recalibrate import Agreement, agreement, fit_for_steps, recalibration_ttt
from selfspec.train.rows_job import DELTA_SUBDIR, REPORT_FILE, RowsJob


@dataclass(frozen=True)
class RowsVerdict:
    served: Agreement
    """The drafting in use for the adapter (shared heads, plus its current delta if any)."""
    shared: Agreement
    """The shared heads alone."""
    after: Agreement
    """The new delta."""
    train_before: Agreement
    train_after: Agreement
    """The shared heads and the new delta on the training rows (how far it fitted them)."""
    better: bool
    """``after.top1 >= served.top1 + min_gain``: the new delta is worth swapping in."""
    train_rows: int
    heldout_rows: int
    steps: int
    seconds: float

    def to_dict(self) -> dict:
        return {
            **{
                k: asdict(getattr(self, k))
                for k in ("served", "shared", "after", "train_before", "train_after")
            },
            "better": self.better,
            "train_rows": self.train_rows,
            "heldout_rows": self.heldout_rows,
            "steps": self.steps,
            "seconds": round(self.seconds, 2),
        }


def recalibrate_rows(job: RowsJob) -> RowsVerdict:
    """Train a delta on ``job.train``, judge it on ``job.heldout``; write ``delta/`` into
    ``job.out`` when it measures better, and ``report.json`` in any case."""
    started = time.perf_counter()
    torch.set_num_threads(job.threads)
    kind = read_heads_config(Path(job.heads))[0].kind
    module = HeadsModule(
        target=TargetSpec(model=job.model, dtype="float32", threads=job.threads),
        kind=kind.value,
        init_from=job.heads,
        optim=OptimConfig(lr=job.lr, warmup_steps=min(5, job.steps // 4)),
        eagle_depth=job.eagle_depth,
        ttt=recalibration_ttt(kind, job.eagle_depth),
        delta=DeltaConfig(rank=job.rank, alpha=job.alpha),
    )
    data = DistilledDataModule(
        train_data=job.train,
        val_data=job.heldout,
        batch_size=job.batch_size,
        seed=job.seed,
    )
    data.setup("fit")
    heldout = DataLoader(data.val_set, batch_size=job.batch_size, collate_fn=data.collate)
    train = DataLoader(data.train_set, batch_size=job.batch_size, collate_fn=data.collate)
    shared, train_before = agreement(module, heldout), agreement(module, train)
    served = shared
    if job.current_delta is not None:
        served = _agreement_with_delta(module, Path(job.heads), Path(job.current_delta), heldout)
    losses = fit_for_steps(module, data, job.steps, job.seed)
    after = agreement(module, heldout)
    verdict = RowsVerdict(
        served=served,
        shared=shared,
        after=after,
        train_before=train_before,
        train_after=agreement(module, train),
        better=after.top1 >= served.top1 + job.min_gain,
        train_rows=len(data.train_set),
        heldout_rows=len(data.val_set),
        steps=len(losses),
        seconds=time.perf_counter() - started,
    )
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    if verdict.better:
        module.export(
            out / DELTA_SUBDIR,
            extra={
                "source": "served outputs",
                "train_rows": verdict.train_rows,
                "steps": verdict.steps,
                "lr": job.lr,
                "heldout_top1_before": served.top1,
                "heldout_top1_after": after.top1,
            },
        )
    write_text_atomic(out / REPORT_FILE, json.dumps(verdict.to_dict(), indent=2) + "\n")
    return verdict


def _agreement_with_delta(
    module: HeadsModule, heads_dir: Path, delta_dir: Path, rows: DataLoader
) -> Agreement:
    """``agreement`` of the shared heads with ``delta_dir`` active (a copy of the heads; the
    module's own are left as they are)."""
    heads = load_heads(heads_dir, module.target.model, dtype=torch.float32)
    bank = DeltaBank(heads)
    bank.add("current", load_delta(delta_dir, heads, bank.hash))
    trained, module.heads = module.heads, heads
    try:
        with bank.active("current"):
            return agreement(module, rows)
    finally:
        module.heads = trained


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m selfspec.train.recalibrate_rows JOB.json", file=sys.stderr)
        return 2
    try:
        verdict = recalibrate_rows(RowsJob.read(Path(args[0])))
    except (OSError, ValueError, TypeError) as error:
        print(f"recalibrate_rows: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(verdict.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
