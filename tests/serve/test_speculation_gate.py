"""The engine's speculation gate: each choice tried first, then the faster one, the other
explored ever more rarely while it keeps losing, per batch size; a new batch size starts from
its nearest measured neighbour's verdict instead of warming up again."""

from __future__ import annotations

import pytest

from selfspec.speculation_gate import SpeculationGate, SpeculationGateConfig


def _run(gate: SpeculationGate, batch: int, rounds: int, rate: dict[bool, float]) -> list[bool]:
    choices = []
    for _ in range(rounds):
        speculate = gate.choose(batch)
        choices.append(speculate)
        gate.observe(batch, speculate, tokens=int(rate[speculate]), seconds=1.0)
    return choices


def test_the_faster_choice_wins_and_the_slower_is_explored() -> None:
    gate = SpeculationGate(SpeculationGateConfig(explore_every=10, warmup=3))
    choices = _run(gate, 4, 40, {True: 49.0, False: 84.0})
    assert choices[:6] == [True] * 3 + [False] * 3  # each tried warmup times
    later = choices[6:]
    # Only exploring: at round 10, then 20 rounds later, then 40 later (it kept losing).
    assert [i + 7 for i, c in enumerate(later) if c] == [10, 30]
    assert gate.rates(4) == {True: 49.0, False: 84.0}
    # Another batch size starts from batch 4's verdict (plain), explores speculation at its
    # 10th round, finds it faster there, and speculates from then on (exploring plain at 20).
    choices = _run(gate, 1, 24, {True: 40.0, False: 30.0})
    assert choices == [False] * 9 + [True] * 10 + [False] + [True] * 4
    assert gate.rates(1) == {True: 40.0, False: 30.0}


def test_a_new_batch_size_takes_the_nearest_verdict_without_warming_up() -> None:
    gate = SpeculationGate(SpeculationGateConfig(explore_every=10, warmup=3))
    _run(gate, 4, 6, {True: 90.0, False: 60.0})  # the warm-up, once: speculation wins
    # 16 speculates at once, no warm-up, until its first exploration (round 10) finds plain
    # rounds faster there; from then on its own rates decide.
    assert _run(gate, 16, 14, {True: 60.0, False: 84.0}) == [True] * 9 + [False] * 5
    assert gate.rates(16) == {True: 60.0, False: 84.0}
    # 12 is nearer 16: plain; 10 is as near 4 as 16 (ties go to the smaller): it speculates.
    assert _run(gate, 12, 9, {True: 50.0, False: 70.0}) == [False] * 9
    assert _run(gate, 10, 9, {True: 50.0, False: 70.0}) == [True] * 9


def test_the_rate_weighs_rounds_by_their_time() -> None:
    """Moving averages of tokens and of seconds, not of per-round rates: a 3-token round of
    0.1 s and a 1-token round of 0.9 s commit 4 tokens a second, not (30 + 1.1) / 2."""
    gate = SpeculationGate(SpeculationGateConfig(smoothing=0.5))
    gate.observe(2, True, tokens=3, seconds=0.1)
    gate.observe(2, True, tokens=1, seconds=0.9)
    assert gate.rates(2)[True] == pytest.approx(2.0 / 0.5)


def test_exploring_backs_off_to_a_bound_and_resets_when_the_choice_turns() -> None:
    config = SpeculationGateConfig(explore_every=4, max_explore_every=16, warmup=1, smoothing=1.0)
    gate = SpeculationGate(config)
    choices = _run(gate, 3, 80, {True: 10.0, False: 20.0})
    explored = [i + 1 for i, c in enumerate(choices) if c][1:]  # after the warm-up round
    assert explored == [4, 12, 28, 44, 60, 76]  # intervals 8, 16, then capped at 16
    choices = _run(gate, 3, 20, {True: 30.0, False: 20.0})  # round 92 explores: it wins now
    assert choices[11:16] == [True] * 4 + [False]  # rounds 92-95 speculate; 96 explores plain


def test_a_change_in_speed_turns_the_choice() -> None:
    gate = SpeculationGate(SpeculationGateConfig(explore_every=4, warmup=1, smoothing=1.0))
    first = _run(gate, 2, 8, {True: 10.0, False: 20.0})
    assert first[2:] == [False, True, False, False, False, False]  # round 4 explores, then 12
    choices = _run(gate, 2, 8, {True: 30.0, False: 20.0})  # speculation got faster
    assert choices[-3:].count(True) >= 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="explore_every"):
        SpeculationGateConfig(explore_every=1)
    with pytest.raises(ValueError, match="max_explore_every"):
        SpeculationGateConfig(explore_every=8, max_explore_every=4)
    with pytest.raises(ValueError, match="smoothing"):
        SpeculationGateConfig(smoothing=0.0)
