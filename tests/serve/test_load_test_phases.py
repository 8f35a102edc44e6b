"""benchmarks/load_test.py: phases of a cell, and sampled load."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark


def test_a_phase_takes_its_share_of_the_cell() -> None:
    load_test = load_benchmark("load_test")
    config = load_test.LoadConfig(duration=40.0, max_requests=9, phases=2)
    phase = config.phase()
    assert phase.duration == 20.0
    assert phase.max_requests == 5  # rounded up: the phases together send at least 9
    assert load_test.LoadConfig(phases=4).phase().max_requests is None
    with pytest.raises(ValueError, match="--phases"):
        load_test.LoadConfig(phases=0)


def test_sampled_load_is_sent_as_asked_and_not_checked_against_greedy() -> None:
    load_test = load_benchmark("load_test")
    config = load_test.LoadConfig(temperature=1.0)
    assert load_test.request_body("base", "hi", config, True)["temperature"] == 1.0
    assert load_test.request_body("base", "hi", load_test.LoadConfig(), True)["temperature"] == 0
    row = {"equal_to_serial_vanilla": None, "requests": 3}
    assert load_test._equal(row) == "n/a (sampled)"
    assert load_test._equal({**row, "equal_to_serial_vanilla": 3}) == "3/3"
    with pytest.raises(ValueError, match="--temperature"):
        load_test.LoadConfig(temperature=-1.0)
