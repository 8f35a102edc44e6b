"""Whether a round speculates: speculation must never lose to plain decoding. The server's
engine gates each round of a batch (``selfspec.serve.engine``), ``SpeculativeGenerator`` each
step of an adaptive request (batch size 1).

Adaptive trees are sized per request, but drafting itself costs each request a heads call per
depth before any tree is priced; in a batch of fp32 requests on a CPU that cost can exceed what
the accepted drafts save (measured: 4 clients, 49 vs 84 output tokens/s with and without
speculation). The gate measures both: per batch size, committed tokens per second of the rounds
that speculated and of those that did not (moving averages of tokens and of seconds, their
ratio the rate, so a round of many tokens weighs as much as its time), and runs each round with
the faster one; now and then a round of a batch size takes the other, so a change in load or
acceptance is seen: ``explore_every`` rounds after the last such round, an interval that doubles
(up to ``max_explore_every``) each time the explored choice is still the slower one and falls
back once it wins, so a settled choice pays ~1 % of rounds for exploring, not 10 %.

Until some batch size has measured both choices (``warmup`` rounds each), rounds alternate.
From then on each batch size decides by the speed ratio of the nearest batch size that has
observed both choices (itself, once its own explorations have), exploring on its own schedule: in a
server whose batch size moves with every arrival and departure, only the first batch size pays
the warm-up (measured: 16 clients, batch sizes 9-16, each warming up on its own cost 16 % of
the output tokens).
Outputs never depend on the gate: a round that does not speculate verifies each request's root
token alone (a request alone: with its context chains, which need no drafting), as a step whose
drafts were all rejected would (its draft-state advance deferred to the next round that
drafts).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpeculationGateConfig:
    explore_every: int = 10
    """Rounds of one batch size between explorations of the slower choice, at first."""
    max_explore_every: int = 160
    """The longest that interval grows while the explored choice keeps losing."""
    warmup: int = 3
    """Rounds of each choice, per batch size, before the faster one is preferred."""
    smoothing: float = 0.2
    """Weight of the newest round in the moving averages."""

    def __post_init__(self) -> None:
        if (
            self.explore_every < 2
            or self.max_explore_every < self.explore_every
            or self.warmup < 1
            or not 0.0 < self.smoothing <= 1.0
        ):
            raise ValueError(
                "explore_every must be >= 2, max_explore_every >= explore_every, warmup >= 1 "
                f"and smoothing in (0, 1], got {self.explore_every}, {self.max_explore_every}, "
                f"{self.warmup}, {self.smoothing}"
            )


@dataclass
class _Rates:
    tokens: dict[bool, float] = field(default_factory=dict)
    seconds: dict[bool, float] = field(default_factory=dict)
    """Moving averages per round, by whether the round speculated."""
    rounds: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    chosen: int = 0
    """Rounds chosen so far at this batch size."""
    interval: int = 0
    """Rounds from one exploration to the next (0: not yet set)."""
    next_explore: int = 0
    """The value of ``chosen`` at which the next round explores."""
    exploring: bool | None = None
    """The choice an exploration round just took, until its round is observed."""

    def rate(self, speculated: bool) -> float:
        return self.tokens[speculated] / self.seconds[speculated]

    def measured(self, warmup: int) -> bool:
        """Both choices observed ``warmup`` times here."""
        return min(self.rounds.values()) >= warmup

    def speedup(self) -> float:
        """Speculating rounds' rate over plain rounds'."""
        return self.rate(True) / self.rate(False)


class SpeculationGate:
    """Per batch size, speculate or not, whichever commits more tokens per second."""

    def __init__(self, config: SpeculationGateConfig | None = None) -> None:
        self.config = config or SpeculationGateConfig()
        self._by_batch: dict[int, _Rates] = {}
        self._lock = threading.Lock()

    def choose(self, batch_size: int) -> bool:
        """Whether the next round of ``batch_size`` requests speculates."""
        with self._lock:
            rates = self._by_batch.setdefault(batch_size, _Rates())
            rates.chosen += 1
            reference = self._reference(batch_size)
            if reference is None:  # nothing measured anywhere yet: warm up
                return rates.rounds[True] < self.config.warmup
            if rates.interval == 0:  # the first exploration at round explore_every, or now
                rates.interval = self.config.explore_every  # if already past it
                rates.next_explore = max(rates.interval, rates.chosen)
            faster = reference.speedup() >= 1.0
            if rates.chosen < rates.next_explore:
                return faster
            rates.next_explore = rates.chosen + rates.interval
            rates.exploring = not faster
            return not faster

    def _reference(self, batch_size: int) -> _Rates | None:
        """Whose speed ratio decides for ``batch_size``: the nearest batch size that has
        observed both choices (itself first; the smaller on a tie), once one has observed each
        ``warmup`` times; None until then."""
        warmup = self.config.warmup
        if not any(rates.measured(warmup) for rates in self._by_batch.values()):
            return None
        observed = [size for size, rates in self._by_batch.items() if rates.measured(1)]
        return self._by_batch[min(observed, key=lambda size: (abs(size - batch_size), size))]

    def observe(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A finished round: ``tokens`` committed over all its requests in ``seconds``."""
        if seconds <= 0.0:
            return
        with self._lock:
            rates = self._by_batch.setdefault(batch_size, _Rates())
            weight = self.config.smoothing
            for average, value in ((rates.tokens, float(tokens)), (rates.seconds, seconds)):
                old = average.get(speculated)
                average[speculated] = value if old is None else (1 - weight) * old + weight * value
            rates.rounds[speculated] += 1
            if rates.exploring is not None and rates.exploring == speculated:
                reference = self._reference(batch_size)
                still_slower = reference is not None and ((reference.speedup() < 1.0) == speculated)
                rates.interval = (
                    min(2 * rates.interval, self.config.max_explore_every)
                    if still_slower
                    else self.config.explore_every
                )
                rates.next_explore = rates.chosen + rates.interval
                rates.exploring = None

    def rates(self, batch_size: int) -> dict[bool, float]:
        """This batch size's own averages (tokens/s by whether speculating), for metrics and
        tests."""
        with self._lock:
            rates = self._by_batch.get(batch_size, _Rates())
            return {arm: rates.rate(arm) for arm in rates.tokens}
