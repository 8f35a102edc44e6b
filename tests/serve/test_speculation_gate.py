"""The engine's speculation gate: each choice tried first, then the faster one, the other
explored ever more rarely while it keeps losing, per batch size."""

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
    # Another batch size learns on its own: there speculation is faster.
    assert _run(gate, 1, 20, {True: 40.0, False: 30.0})[6:].count(False) == 1  # round 10


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
