"""benchmarks/load_test.py: a cell's duration and request bound split over its phases."""

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
