"""Online drift detection: does an adapter keep the shared heads' acceptance?

Every speculative step a request takes on an adapter updates that adapter's exponentially
weighted moving averages: of τ (tokens per verification, accepted drafts + 1) and, per depth d,
of acceptance (of the steps whose tree reached d, whether the accepted path did). The base model
(no adapter) keeps its own. Depth-d acceptance is compared rather than τ alone because it hardly
depends on how large the adaptive policy made the trees, which changes with load: the drift
score is the mean over the first ``depths`` depths of adapter / base acceptance. Once both have
seen ``min_steps`` steps, a score under ``threshold`` flags the adapter (a gauge, and one log
warning per crossing); it is cleared when the score recovers. Outputs never change: this only
watches.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from selfspec.stats import StepRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriftConfig:
    threshold: float = 0.8
    """Flag an adapter whose drift score falls below this; 0 never flags."""
    alpha: float = 0.005
    """Weight of each new step in the moving averages (~ the last 1/alpha steps count: a few
    requests; one request's ~50 steps are too few, its prompt's difficulty dominates)."""
    min_steps: int = 200
    """Steps both the adapter and the base need before a score is given (~4 requests of 64
    tokens; with 50, a mild adapter was flagged on its first request: score 0.45)."""
    depths: int = 3
    recover_margin: float = 0.05
    """A flagged adapter is cleared only at ``threshold + recover_margin``: one whose score hovers
    at the threshold stays flagged instead of warning at every crossing (a soak saw `docs` at
    0.78-0.79 warned three times)."""

    def __post_init__(self) -> None:
        if not 0 <= self.threshold <= 1 or not 0 < self.alpha <= 1:
            raise ValueError(
                f"need 0 <= threshold <= 1 and 0 < alpha <= 1, got {self.threshold}, {self.alpha}"
            )
        if self.min_steps < 1 or self.depths < 1:
            raise ValueError("min_steps and depths must be >= 1")
        if self.recover_margin < 0:
            raise ValueError(f"recover_margin must be >= 0, got {self.recover_margin}")


@dataclass
class _Average:
    value: float = 0.0
    weight: float = 0.0
    """Sum of the weights applied so far: corrects the start-up bias (value / weight)."""

    def add(self, sample: float, alpha: float) -> None:
        self.value = (1 - alpha) * self.value + alpha * sample
        self.weight = (1 - alpha) * self.weight + alpha

    @property
    def mean(self) -> float | None:
        return self.value / self.weight if self.weight > 0 else None


@dataclass
class AdapterAcceptance:
    steps: int = 0
    tau: _Average = field(default_factory=_Average)
    by_depth: list[_Average] = field(default_factory=list)

    def depth_rate(self, depth: int) -> float | None:
        return self.by_depth[depth - 1].mean if depth <= len(self.by_depth) else None


class DriftMonitor:
    def __init__(self, base: str, config: DriftConfig = DriftConfig()) -> None:
        self.base = base
        self.config = config
        self._seen: dict[str, AdapterAcceptance] = {}
        self._flagged: set[str] = set()
        self._lock = threading.Lock()

    def observe(self, label: str, steps: list[StepRecord]) -> None:
        """Fold one finished request's speculative steps into ``label``'s averages."""
        alpha = self.config.alpha
        with self._lock:
            seen = self._seen.setdefault(label, AdapterAcceptance())
            for step in steps:
                seen.steps += 1
                seen.tau.add(step.accepted + 1, alpha)
                while len(seen.by_depth) < min(step.tree_depth, self.config.depths):
                    seen.by_depth.append(_Average())
                for depth in range(1, min(step.tree_depth, self.config.depths) + 1):
                    seen.by_depth[depth - 1].add(float(step.accepted >= depth), alpha)
            self._check(label)

    def tau(self, label: str) -> float | None:
        seen = self._seen.get(label)
        return None if seen is None else seen.tau.mean

    def score(self, label: str) -> float | None:
        """Mean over depths of ``label``'s acceptance / the base's; None until both have
        ``min_steps`` steps (or for the base itself)."""
        seen, base = self._seen.get(label), self._seen.get(self.base)
        if label == self.base or seen is None or base is None:
            return None
        if min(seen.steps, base.steps) < self.config.min_steps:
            return None
        ratios = []
        for depth in range(1, self.config.depths + 1):
            ours, theirs = seen.depth_rate(depth), base.depth_rate(depth)
            if ours is not None and theirs:
                ratios.append(ours / theirs)
        return sum(ratios) / len(ratios) if ratios else None

    def flagged(self) -> set[str]:
        with self._lock:
            return set(self._flagged)

    def labels(self) -> list[str]:
        with self._lock:
            return list(self._seen)

    def forget(self, label: str) -> None:
        with self._lock:
            self._seen.pop(label, None)
            self._flagged.discard(label)

    def _check(self, label: str) -> None:
        for name in [label] if label != self.base else list(self._seen):
            score = self.score(name)
            if score is None:
                continue
            if score < self.config.threshold and name not in self._flagged:
                self._flagged.add(name)
                logger.warning(
                    "adapter %r keeps %.2f of the base's draft acceptance (threshold %.2f): its "
                    "traffic speculates poorly with the shared heads; consider `selfspec "
                    "recalibrate --adapter %s`",
                    name,
                    score,
                    self.config.threshold,
                    name,
                )
            elif score >= self.config.threshold + self.config.recover_margin and (
                name in self._flagged
            ):
                self._flagged.discard(name)
                logger.info("adapter %r recovered: %.2f of the base's acceptance", name, score)
