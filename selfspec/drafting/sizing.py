"""Choosing a dynamic tree's depth and size per step from the measured cost of verification.

A step that verifies the tree S commits, in expectation, ``1 + sum_{v in S} P(v accepted)``
tokens (the bonus token plus every accepted draft: acceptance of a node is an event, and the
accepted length counts the accepted nodes). The draft's cumulative probability of a node
estimates P(v accepted); the estimate is scaled by a per-request calibration (accepted drafts /
predicted drafts so far), since heads can be over- or under-confident. The step costs the
drafting already done, one verification forward over |S| + 1 tokens, read off the cost curve,
and the step's fixed work after it (verdict, KV commit, head advance), measured per request:
left out, that fixed cost would make every tree look dearer per token than it is.

``keep`` picks the number of best-scored nodes that maximises expected tokens per second (zero
nodes is plain decoding). That count follows from every node's score, so a sampled draw could
be kept for what it drew (its descendants' scores follow from it); ``keep_as_drawn`` decides
node by node instead, from the scores ranked at or above each, and keeps sampled draws samples
of their proposals (``DraftSampling``). ``grow_deeper`` drafts another depth only if what it
could add (at most the frontier's probability mass) is worth its time at the rate already
reachable. EAGLE-2 takes a fixed size from a short list tuned by timing; this chooses per step,
from this machine's curve, and prices a tree by its share of the batch's forward when requests
are verified together.

When requests are verified together their trees are padded to the largest, so the forward costs
B x the largest tree whatever the others keep. ``joint_keep`` therefore sizes a batch's trees
together, after all of them are drafted: one node count for every request, the one that
maximises the batch's expected tokens per second (a request whose own choice would have been
smaller gets the padding's rows for free; one whose would have been larger is cut back to what
the batch can afford).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from selfspec.cost_curve import CostCurve
from selfspec.tree import DynamicTree


@dataclass(frozen=True)
class TreeSizer:
    curve: CostCurve
    calibration: float = 1.0
    """Observed / predicted accepted drafts of this request so far (1: trust the draft)."""
    cost_scale: float = 1.0
    """Observed / curve verification time of this request's recent steps: the curve's shape is
    kept, its level follows the machine's current load (the curve may be cached from a calmer
    or busier moment)."""
    batch_size: int = 1
    """Requests whose trees share this step's verification forward (the server's batch)."""
    overhead_seconds: float = 0.0
    """A step's work besides drafting and the verification forward, whatever the tree's size."""
    drafting_seconds: float = 0.0
    """This request's drafting time per step so far (a moving average over the steps before
    this one): what ``keep_as_drawn`` prices drafting at, since this step's own drafting time
    follows from how deep its draws led the tree."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        for name in ("overhead_seconds", "drafting_seconds"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def verify_seconds(self, size: int) -> float:
        """This request's share of a verification forward when its tree has ``size`` tokens.

        Alone, the forward itself. In a batch of B the forward runs every request's tree (each
        padded to the largest), so the step is priced as if all B trees had this size: 1/B of a
        forward over B x size tokens. Where the curve is flat for small forwards and steep for
        large ones, a tree that is nearly free alone costs real time in a batch; the sizer then
        keeps fewer nodes, down to none (plain decoding) when the batch is large."""
        batch = self.batch_size
        return self.cost_scale * self.curve.at(batch * size) / batch

    def keep(self, scores: list[float], drafting_seconds: float) -> int:
        """How many of the nodes to verify. scores: cumulative draft log-probs, best first."""
        return self._best(scores, drafting_seconds)[0]

    def keep_as_drawn(self, scores: list[float], horizon: int) -> int:
        """How many of the nodes to verify, as a stopping rule: node i is kept while some tree
        of i..``horizon`` nodes could still beat the best rate so far if every node after it
        were as likely as it (scores are best first, so none is likelier). Whether node i is
        kept depends only on the scores of nodes ranked at or above it, never on its own
        descendants'. Keeps at least ``keep``'s count when that count beats smaller trees.
        scores: cumulative draft log-probs, best first; horizon: the most nodes a tree holds
        (a constant of the spec, not how many were drafted)."""
        seconds = [self.drafting_seconds + self._step_seconds(t) for t in range(1, horizon + 2)]
        return _kept_as_drawn([self.accept(s) for s in scores[:horizon]], seconds, 1.0)

    def grow_deeper(
        self,
        scores: list[float],
        frontier: list[float],
        drafting_seconds: float,
        depth: int,
        spec: DynamicTree,
    ) -> bool:
        """Whether drafting depth ``depth + 1`` (expanding ``frontier``) can pay for itself.
        scores: every drafted node's cumulative log-prob; frontier: those to be expanded."""
        ranked = sorted(scores, reverse=True)[: spec.budget]
        size, rate = self._best(ranked, drafting_seconds)
        gain = 1.0 + sum(self.accept(s) for s in ranked[:size])
        added = sum(self.accept(s) for s in frontier)  # children never outweigh their parent
        new_nodes = min(len(frontier) * spec.top_k, spec.budget - size)
        if new_nodes <= 0:
            return False
        per_depth = drafting_seconds / depth
        deeper = (gain + added) / (
            drafting_seconds + per_depth + self._step_seconds(size + new_nodes + 1)
        )
        return deeper > rate

    def _step_seconds(self, tokens: int) -> float:
        """The step's time after drafting, with a tree of ``tokens`` tokens root included."""
        return self.verify_seconds(tokens) + self.overhead_seconds

    def accept(self, score: float) -> float:
        """The calibrated probability that a node of cumulative draft log-prob ``score`` is
        accepted."""
        return min(1.0, self.calibration * math.exp(score))

    def _best(self, scores: list[float], drafting_seconds: float) -> tuple[int, float]:
        """(size, expected tokens per second) of the best prefix of ``scores``."""
        best_size, gain = 0, 1.0
        best_rate = gain / (drafting_seconds + self._step_seconds(1))
        for size, score in enumerate(scores, start=1):
            gain += self.accept(score)
            rate = gain / (drafting_seconds + self._step_seconds(size + 1))
            if rate > best_rate:
                best_size, best_rate = size, rate
        return best_size, best_rate


@dataclass(frozen=True)
class JointCandidate:
    """One request's part in a batch's joint tree sizing."""

    sizer: TreeSizer
    scores: Sequence[float]
    """Cumulative draft log-probs of its drafted nodes, best first."""
    drafting_seconds: float
    horizon: int = 0
    """The most nodes its tree may hold (its spec's budget), for ``as_drawn`` sizing."""


def joint_keep(
    candidates: Sequence[JointCandidate],
    batch_size: int,
    min_tokens: int = 1,
    as_drawn: bool = False,
) -> int:
    """How many drafted nodes each of ``candidates`` keeps (the same count for all, each
    capped by what it drafted) when their trees share one verification forward of
    ``batch_size`` rows padded to the largest tree: the count that maximises the batch's
    expected committed tokens per second. ``min_tokens``: the largest tree in the forward that
    is not resized (root included), below which padding costs nothing more. 0: no drafts.

    ``as_drawn``: count by count instead, by the stopping rule of ``TreeSizer.keep_as_drawn``
    (up to the candidates' ``horizon``), pricing drafting by each request's past steps: whether
    a request's node at rank c is kept then follows from scores at ranks up to c, its own and
    the other requests' (independent draws), so sampled draws stay samples of their
    proposals."""
    if not candidates:
        raise ValueError("joint_keep needs at least one request")
    if batch_size < len(candidates) or min_tokens < 1:
        raise ValueError(
            f"batch_size must cover the {len(candidates)} requests and min_tokens be >= 1, got "
            f"{batch_size} and {min_tokens}"
        )
    accepts = [[c.sizer.accept(score) for score in c.scores] for c in candidates]
    scale = sum(c.sizer.cost_scale for c in candidates) / len(candidates)
    curve = candidates[0].sizer.curve
    if as_drawn:
        horizon = max(c.horizon for c in candidates)
        past = sum(c.sizer.drafting_seconds + c.sizer.overhead_seconds for c in candidates)
        seconds = [
            past + scale * curve.at(batch_size * max(count + 1, min_tokens))
            for count in range(horizon + 1)
        ]
        likely = [
            sum(a[count] for a in accepts if len(a) > count) for count in range(horizon)
        ]  # non-increasing: every request's scores are, and fewer requests reach each rank
        return _kept_as_drawn(likely, seconds, float(len(candidates)))
    fixed = sum(c.drafting_seconds + c.sizer.overhead_seconds for c in candidates)
    widest = max(map(len, accepts))
    best_count, best_rate, gain = 0, 0.0, float(len(candidates))
    for count in range(widest + 1):
        if count:
            gain += sum(a[count - 1] for a in accepts if len(a) >= count)
        rows = batch_size * max(count + 1, min_tokens)
        rate = gain / (fixed + scale * curve.at(rows))
        if rate > best_rate:
            best_count, best_rate = count, rate
    return best_count


def ragged_keep(
    candidates: Sequence[JointCandidate], fixed_rows: int = 0, as_drawn: bool = False
) -> list[int]:
    """How many drafted nodes each of ``candidates`` keeps when their trees run back to back in
    one verification forward (``batched_verify``: no padding), beside ``fixed_rows`` rows of
    trees not sized here: the nodes likeliest to be accepted across all the requests, as many
    as maximise the batch's expected committed tokens per second. So a request whose drafts
    look sure keeps a deep tree while an unsure one keeps its root alone, where ``joint_keep``
    (rows padded to the largest tree) gives all the same count.

    ``as_drawn``: node by node in that order (each request's nodes up to its ``horizon``), by
    the stopping rule of ``TreeSizer.keep_as_drawn``: whether a node is kept follows from the
    nodes before it in the order (never its own descendants, which score no higher) and the
    other requests' (independent draws), so sampled draws stay samples of their proposals."""
    if not candidates:
        raise ValueError("ragged_keep needs at least one request")
    if fixed_rows < 0:
        raise ValueError(f"fixed_rows must be >= 0, got {fixed_rows}")
    accepts = [
        [c.sizer.accept(score) for score in (c.scores[: c.horizon] if as_drawn else c.scores)]
        for c in candidates
    ]
    # Likeliest first; a stable sort keeps each request's own (non-increasing) order.
    order = sorted(
        ((value, index) for index, values in enumerate(accepts) for value in values),
        key=lambda pair: -pair[0],
    )
    scale = sum(c.sizer.cost_scale for c in candidates) / len(candidates)
    curve = candidates[0].sizer.curve
    fixed = sum(c.drafting_seconds + c.sizer.overhead_seconds for c in candidates)
    roots = fixed_rows + len(candidates)
    seconds = [fixed + scale * curve.at(roots + count) for count in range(len(order) + 1)]
    gain = float(len(candidates))
    if as_drawn:
        kept = _kept_as_drawn([value for value, _ in order], seconds, gain, window=64)
    else:
        kept, best_rate = 0, gain / seconds[0]
        for count, (value, _) in enumerate(order, start=1):
            gain += value
            if gain / seconds[count] > best_rate:
                kept, best_rate = count, gain / seconds[count]
    counts = [0] * len(candidates)
    for _, index in order[:kept]:
        counts[index] += 1
    return counts


def _kept_as_drawn(
    likely: Sequence[float], seconds: Sequence[float], gain: float, window: int | None = None
) -> int:
    """How many nodes to keep, decided node by node: node i (``likely[i - 1]``, its expected
    committed tokens; non-increasing) is kept while some count from i to ``len(seconds) - 1``
    (at most ``window`` counts ahead) could still beat the best rate so far if every later node
    were as likely as it. ``seconds[c]``: the step's seconds with c nodes; ``gain``: its tokens
    with none."""
    horizon = len(seconds) - 1
    kept, best_rate = 0, gain / seconds[0]
    for i, value in enumerate(likely[:horizon], start=1):
        last = horizon if window is None else min(horizon, i + window - 1)
        reachable = max((gain + value * (c - i + 1)) / seconds[c] for c in range(i, last + 1))
        if reachable <= best_rate:
            break
        gain, kept = gain + value, i
        best_rate = max(best_rate, gain / seconds[i])
    return kept
