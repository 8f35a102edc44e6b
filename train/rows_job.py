"""The job file of a recalibration from rows (``selfspec.train.recalibrate_rows``): what a
server writes for its training process and what that process reads. Light on purpose: a server
imports it without the training stack."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from selfspec.atomic import write_text_atomic
from selfspec.heads.delta import DeltaConfig

REPORT_FILE = "report.json"
DELTA_SUBDIR = "delta"


@dataclass(frozen=True)
class RowsJob:
    """One recalibration from rows: where everything is and how to train."""

    heads: str
    """The shared heads' directory (what the server drafts with)."""
    train: str
    """Distilled-format rows to train on (``selfspec.train.shards``)."""
    heldout: str
    """Rows kept out of training, to judge the delta on."""
    out: str
    model: str | None = None
    """The target (a local model dir or .gguf; None: the embedded default)."""
    current_delta: str | None = None
    """The delta the adapter drafts with now, if any: the new one must beat it."""
    rank: int = 16
    alpha: float = 32.0
    steps: int = 150
    lr: float = 3e-3
    batch_size: int = 8
    eagle_depth: int = 2
    min_gain: float = 0.01
    """Held-back top-1 agreement the new delta must add to what is served now."""
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        DeltaConfig(rank=self.rank, alpha=self.alpha)  # validates both
        if self.steps < 1 or self.batch_size < 1 or self.eagle_depth < 1 or self.threads < 1:
            raise ValueError("steps, batch_size, eagle_depth and threads must be >= 1")
        if not self.lr > 0 or not 0 <= self.min_gain < 1:
            raise ValueError(f"need lr > 0 and 0 <= min_gain < 1, got {self.lr}, {self.min_gain}")

    def write(self, path: Path) -> Path:
        """The job as JSON (what ``read`` and the training process take)."""
        return write_text_atomic(Path(path), json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> RowsJob:
        record = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"{path}: unknown job fields {unknown}")
        return cls(**record)
