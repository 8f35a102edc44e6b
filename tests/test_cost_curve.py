"""The verification cost curve (measured, cached) and the tree sizer that reads it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

import selfspec.cost_curve as cost_curve_module
from selfspec.cost_curve import CostCurve, cached_cost_curve
from selfspec.drafting.sizing import JointCandidate, TreeSizer, joint_keep, ragged_keep
from selfspec.target_forward import TargetForward
from selfspec.tree import DynamicTree


def test_interpolates_and_extrapolates_linearly() -> None:
    curve = CostCurve(sizes=(1, 4, 8), seconds=(1.0, 1.3, 2.1))
    assert curve.at(1) == 1.0
    assert curve.at(2) == pytest.approx(1.1)
    assert curve.at(6) == pytest.approx(1.7)
    assert curve.at(16) == pytest.approx(2.1 + 0.2 * 8)
    assert curve.relative()[8] == pytest.approx(2.1)


def test_noise_never_makes_a_larger_tree_cheaper() -> None:
    curve = CostCurve(sizes=(1, 2, 4), seconds=(1.0, 0.9, 1.2))
    assert curve.seconds == (1.0, 1.0, 1.2)


@pytest.mark.parametrize(
    ("sizes", "seconds"),
    [
        ((1,), (1.0,)),
        ((2, 1), (1.0, 1.0)),
        ((0, 1), (1.0, 1.0)),
        ((1, 2), (1.0, 0.0)),
        ((1, 2), (1.0,)),
    ],
)
def test_invalid_curves_are_refused(sizes: tuple[int, ...], seconds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="cost curve"):
        CostCurve(sizes=sizes, seconds=seconds)


def test_measured_once_then_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = TargetForward(make_tiny_model("llama"))
    curve = cached_cost_curve(target, tmp_path, sizes=(1, 2, 4))
    assert curve.sizes == (1, 2, 4) and all(s > 0 for s in curve.seconds)
    (written,) = tmp_path.glob("cost-curve-*.json")

    def never(*args: object, **kwargs: object) -> CostCurve:
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(cost_curve_module, "measure_cost_curve", never)
    assert cached_cost_curve(target, tmp_path, sizes=(1, 2, 4)) == curve
    # A damaged cache file is measured again and replaced, not trusted.
    written.write_text("{not json")
    monkeypatch.undo()
    again = cached_cost_curve(target, tmp_path, sizes=(1, 2, 4))
    assert json.loads(written.read_text())["sizes"] == [1, 2, 4] and again.sizes == (1, 2, 4)


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_each_round_times_the_largest_tree_first() -> None:
    """A forward right after a much larger one runs slow for a while: each round goes from the
    largest size down, so every size follows one a little larger (as decoding's steps follow
    steps of about their size), never one token right after 64."""
    target = TargetForward(make_tiny_model("llama"))
    order: list[int] = []
    features = target.features

    def recorded(tokens, positions, cache, mask=None):
        order.append(tokens.shape[1])
        return features(tokens, positions, cache, mask)

    target.features = recorded
    curve = cost_curve_module.measure_cost_curve(target, sizes=(1, 2, 4, 16), context=8, repeats=2)
    assert curve.sizes == (1, 2, 4, 16)
    assert order[1:] == [16, 4, 2, 1] * 3  # after the prompt: a warm-up round, then 2


def test_sizer_keeps_nodes_while_they_pay_for_their_verification() -> None:
    # 1-token forward 10 ms, +1 ms per extra tree token; nothing spent drafting.
    curve = CostCurve(sizes=(1, 101), seconds=(0.010, 0.110))
    sizer = TreeSizer(curve)
    # A node adds p tokens for 1 ms: it pays while p exceeds the rate reached so far times 1 ms.
    # 3 nodes: 3.2 tokens / 13 ms = 246/s, so the 4th (p=0.2 < 0.246) is not worth it.
    scores = _log([0.9, 0.8, 0.5, 0.2, 0.05, 0.01])
    assert sizer.keep(scores, drafting_seconds=0.0) == 3
    # With 50 ms of drafting spent the rate is ~51/s, so p=0.2 pays and p=0.05 does not.
    assert sizer.keep(scores, drafting_seconds=0.050) == 4
    # Verification running 10x faster than the curve says (a calmer machine now): keep all six.
    assert TreeSizer(curve, cost_scale=0.1).keep(scores, drafting_seconds=0.050) == 6
    # A draft known to be 10x over-confident is not worth verifying at all: plain decoding.
    assert TreeSizer(curve, calibration=0.1).keep(scores, 0.0) == 0
    assert sizer.keep([], 0.0) == 0


def test_keep_as_drawn_decides_each_node_from_the_scores_at_and_above_it() -> None:
    """The stopping rule for sampled draws: node i's fate never depends on a later score, and
    it keeps at least the best count ``keep`` finds (its optimism may keep a little more)."""
    linear = CostCurve(sizes=(1, 101), seconds=(0.010, 0.110))
    # Flat from 2 to 8 tokens, as on CPUs whose small forwards cost the same: a dip at 2
    # tokens that only larger trees recover.
    stepped = CostCurve(sizes=(1, 2, 8, 16), seconds=(0.010, 0.016, 0.017, 0.030))
    generator = torch.Generator().manual_seed(0)
    for curve in (linear, stepped):
        for calibration in (0.3, 1.0):
            sizer = TreeSizer(curve, calibration=calibration, drafting_seconds=0.004)
            for _ in range(50):
                probs = torch.rand(12, generator=generator).sort(descending=True).values
                scores = _log(probs.tolist())
                kept = sizer.keep_as_drawn(scores, horizon=12)
                assert kept >= sizer.keep(scores, drafting_seconds=0.004)
                # Any later scores (still best first): the first `kept` stay kept, and the
                # node after them is dropped all the same.
                later = (probs[min(kept, 11)] * torch.rand(12, generator=generator)).tolist()
                changed = scores[: kept + 1] + _log(sorted(later, reverse=True))[kept + 1 :]
                assert sizer.keep_as_drawn(changed, horizon=12) == kept
    # On the stepped curve a lone confident node does not pay (1.9 tokens for 1.6x a step),
    # four of them do (4.4 tokens for 1.7x): the stopping rule keeps going past the dip.
    scores = _log([0.9, 0.9, 0.9, 0.7])
    assert TreeSizer(stepped).keep_as_drawn(scores, horizon=7) == 4
    with pytest.raises(ValueError, match="drafting_seconds"):
        TreeSizer(linear, drafting_seconds=-1.0)


def _random_batches(count: int = 40) -> Iterator[list[JointCandidate]]:
    """Batches of 3 requests with 1-8 drafted nodes each (random scores, best first), priced
    on a curve flat up to 4 tokens, 2 ms of drafting each."""
    curve = CostCurve(sizes=(1, 4, 8, 16, 32), seconds=(0.010, 0.010, 0.012, 0.020, 0.040))
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        lists = [
            torch.rand(int(n), generator=generator).sort(descending=True).values.tolist()
            for n in torch.randint(1, 9, (3,), generator=generator)
        ]
        yield [
            JointCandidate(TreeSizer(curve, drafting_seconds=0.002), _log(p), 0.002, horizon=8)
            for p in lists
        ]


def test_joint_keep_as_drawn_decides_each_count_from_the_ranks_up_to_it() -> None:
    """The batch's stopping rule: whether count c is kept depends on every request's scores at
    ranks up to c only, and it keeps at least the best count (drafting priced alike)."""
    for batch in _random_batches():
        kept = joint_keep(batch, batch_size=3, as_drawn=True)
        assert kept >= joint_keep(batch, batch_size=3)
        # Scores beyond rank kept + 1 changed (still best first): the same count.
        changed = [
            JointCandidate(
                c.sizer, c.scores[: kept + 1] + [s - 5.0 for s in c.scores[kept + 1 :]], 0.0, 8
            )
            for c in batch
        ]
        assert joint_keep(changed, batch_size=3, as_drawn=True) == kept


def _rate(batch: list[JointCandidate], counts: list[int], rows: int) -> float:
    """Expected committed tokens per second of a batch keeping ``counts`` nodes (free drafting,
    no overhead) in a forward of ``rows`` rows."""
    gain = sum(
        1 + sum(c.sizer.accept(s) for s in c.scores[:n]) for c, n in zip(batch, counts, strict=True)
    )
    return gain / (batch[0].sizer.curve.at(rows))


def test_ragged_keep_gives_sure_requests_deep_trees_and_unsure_ones_none() -> None:
    """Trees back to back (no padding): each request keeps its own count, the batch's likeliest
    nodes, which commits more per second than one count for all over padded rows."""
    curve = CostCurve(sizes=(1, 8, 32), seconds=(0.010, 0.014, 0.040))
    sure = JointCandidate(TreeSizer(curve), _log([0.95, 0.9, 0.85, 0.8, 0.7, 0.6]), 0.0)
    unsure = JointCandidate(TreeSizer(curve), _log([0.05, 0.02, 0.01, 0.01, 0.01, 0.01]), 0.0)
    batch = [sure, unsure, unsure]
    counts = ragged_keep(batch)
    assert counts[0] >= 4 and counts[1:] == [0, 0]
    joint = joint_keep(batch, batch_size=3)
    assert _rate(batch, counts, 3 + sum(counts)) > _rate(batch, [joint] * 3, 3 * (joint + 1))
    # Rows of trees sized elsewhere make every node dearer, never cheaper.
    assert sum(ragged_keep(batch, fixed_rows=40)) <= sum(counts)
    with pytest.raises(ValueError, match="fixed_rows"):
        ragged_keep(batch, fixed_rows=-1)
    with pytest.raises(ValueError, match="at least one request"):
        ragged_keep([])


def test_ragged_keep_as_drawn_decides_each_node_from_the_nodes_before_it() -> None:
    """The stopping rule over the batch's nodes in likelihood order: lowering any request's
    scores past the first node dropped changes no count, and it keeps at least the best total."""
    for batch in _random_batches():
        counts = ragged_keep(batch, as_drawn=True)
        assert sum(counts) >= sum(ragged_keep(batch))
        changed = [
            JointCandidate(
                c.sizer, c.scores[: n + 1] + [s - 5.0 for s in c.scores[n + 1 :]], 0.002, 8
            )
            for c, n in zip(batch, counts, strict=True)
        ]
        assert ragged_keep(changed, as_drawn=True) == counts


def test_sizer_prices_the_steps_fixed_work_into_every_tree() -> None:
    curve = CostCurve(sizes=(1, 101), seconds=(0.010, 0.110))
    scores = _log([0.9, 0.8, 0.5, 0.2, 0.05, 0.01])
    # 50 ms of verdict / commit / head advance per step: as with 50 ms of drafting, the rate is
    # ~51/s whatever the tree, so p=0.2 (0.2 tokens for 1 ms) now pays.
    assert TreeSizer(curve, overhead_seconds=0.050).keep(scores, drafting_seconds=0.0) == 4
    spec = DynamicTree(top_k=2, depth=6, budget=20)
    hopeful = _log([0.3, 0.3])
    assert not TreeSizer(curve).grow_deeper(hopeful, hopeful, 0.004, depth=1, spec=spec)
    sizer = TreeSizer(curve, overhead_seconds=0.050)
    assert sizer.grow_deeper(hopeful, hopeful, 0.004, depth=1, spec=spec)
    with pytest.raises(ValueError, match="overhead_seconds"):
        TreeSizer(curve, overhead_seconds=-1.0)


def test_sizer_stops_drafting_when_another_depth_cannot_pay() -> None:
    curve = CostCurve(sizes=(1, 101), seconds=(0.010, 0.110))
    spec = DynamicTree(top_k=2, depth=6, budget=20)
    sizer = TreeSizer(curve)
    confident = _log([0.9, 0.8])
    # A confident frontier is worth a 2 ms draft depth; a hopeless one is not.
    assert sizer.grow_deeper(confident, _log([0.8, 0.7]), 0.002, depth=1, spec=spec)
    assert not sizer.grow_deeper(confident, _log([1e-3, 1e-4]), 0.002, depth=1, spec=spec)
    # With the budget already used by better nodes, nothing deeper can be kept.
    full = DynamicTree(top_k=2, depth=6, budget=2)
    assert not sizer.grow_deeper(confident, _log([0.8, 0.7]), 0.002, depth=1, spec=full)


def test_sizer_prices_a_tree_by_its_share_of_the_batch_forward() -> None:
    # Flat up to 4 tokens, then linear: a 4-token tree is free alone, not in a batch of 4.
    curve = CostCurve(sizes=(1, 4, 8, 16, 32), seconds=(0.010, 0.010, 0.020, 0.040, 0.080))
    scores = _log([0.6, 0.5, 0.4])
    assert TreeSizer(curve).keep(scores, drafting_seconds=0.0) == 3
    in_batch = TreeSizer(curve, batch_size=4)
    # One request's share of a forward over 4 x n tokens: curve(4n) / 4.
    assert in_batch.verify_seconds(1) == pytest.approx(0.010 / 4)
    assert in_batch.verify_seconds(4) == pytest.approx(0.040 / 4)
    # Plain decoding: 1 token per 2.5 ms (400/s); the best tree, 1.6 tokens per 5 ms (320/s).
    assert in_batch.keep(scores, drafting_seconds=0.0) == 0
    # Where batched tokens stay cheap, a confident draft still pays, though less of it than alone:
    # 2 nodes give 2.7 tokens per curve(12) / 4 = 4 ms (675/s, above plain decoding's 400/s);
    # a third (p 0.5) would make it 3.2 tokens per curve(16) / 4 = 5 ms (640/s).
    gentle = CostCurve(sizes=(1, 4, 8, 16, 32), seconds=(0.010, 0.010, 0.012, 0.020, 0.040))
    confident = _log([0.9, 0.8, 0.5])
    assert TreeSizer(gentle).keep(confident, 0.0) == 3
    assert TreeSizer(gentle, batch_size=4).keep(confident, 0.0) == 2
    with pytest.raises(ValueError, match="batch_size"):
        TreeSizer(curve, batch_size=0)


def test_joint_keep_sizes_a_batch_for_its_padded_forward() -> None:
    """One node count for every tree of a batch: rows are padded to the largest tree, so the
    forward costs batch x (count + 1) rows whatever each request would have kept alone."""
    steep = CostCurve(sizes=(1, 4, 8, 16, 32), seconds=(0.010, 0.010, 0.020, 0.040, 0.080))
    weak, confident = _log([0.1]), _log([0.9, 0.8])

    def batch(*scores: list[float], curve: CostCurve = steep) -> list[JointCandidate]:
        return [JointCandidate(TreeSizer(curve), s, drafting_seconds=0.0) for s in scores]

    # 4 rows: 4 tokens per 10 ms (400/s); one node each: 5.2 tokens per 20 ms (260/s).
    assert joint_keep(batch(weak, weak, weak, confident), batch_size=4) == 0
    # A tree that is not resized (3 tokens) pads every row to 3 anyway: 2 nodes are free.
    assert joint_keep(batch(weak, weak, weak, confident), batch_size=4, min_tokens=3) == 2
    # Where a few rows cost what one does, the weak request keeps its nodes too: they ride
    # along in rows the confident one pays for (2 + 0.9 + 0.8 + 0.5 + 0.1 + 0.05 tokens).
    gentle = CostCurve(sizes=(1, 4, 8, 16, 32), seconds=(0.010, 0.010, 0.012, 0.020, 0.040))
    assert joint_keep(batch(_log([0.1, 0.05]), _log([0.9, 0.8, 0.5]), curve=gentle), 2) == 3
    # Alone, joint sizing is the request's own choice.
    for scores in (weak, confident, _log([0.9, 0.8, 0.5])):
        alone = joint_keep(batch(scores, curve=gentle), batch_size=1)
        assert alone == TreeSizer(gentle).keep(scores, drafting_seconds=0.0)
    with pytest.raises(ValueError, match="at least one"):
        joint_keep([], batch_size=1)
    with pytest.raises(ValueError, match="at least one"):
        joint_keep([], batch_size=1, as_drawn=True)
    with pytest.raises(ValueError, match="batch_size"):
        joint_keep(batch(weak, weak), batch_size=1)
