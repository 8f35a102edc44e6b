"""Online drift detection: per-adapter moving averages of acceptance against the base's, a
flag and one warning when an adapter falls below the threshold, cleared on recovery; exported
on /metrics; outputs untouched."""

from __future__ import annotations

import logging

import httpx
import pytest

from selfspec.serve.drift import DriftConfig, DriftMonitor
from selfspec.stats import StepRecord


def _steps(accepted: list[int], depth: int = 4) -> list[StepRecord]:
    return [StepRecord(accepted=a, tree_size=8, tree_depth=depth) for a in accepted]


def test_an_adapter_below_the_threshold_is_flagged_once_and_cleared(caplog) -> None:
    monitor = DriftMonitor("base", DriftConfig(threshold=0.8, alpha=0.1, min_steps=20))
    monitor.observe("base", _steps([3, 2, 3, 4] * 10))  # deep acceptance
    monitor.observe("shout", _steps([0, 1, 0, 0] * 4))
    assert monitor.score("shout") is None  # 16 steps < min_steps: no verdict yet
    with caplog.at_level(logging.WARNING, logger="selfspec.serve.drift"):
        monitor.observe("shout", _steps([0, 1, 0, 0] * 2))
        monitor.observe("shout", _steps([0, 0] * 5))
    assert monitor.score("shout") < 0.5 and monitor.flagged() == {"shout"}
    assert sum("shout" in r.getMessage() for r in caplog.records) == 1  # one warning per crossing
    monitor.observe("shout", _steps([3, 3, 4, 2] * 30))  # it recovers
    assert monitor.score("shout") > 0.8 and monitor.flagged() == set()
    assert monitor.tau("base") == pytest.approx(4.0, abs=0.3)
    monitor.forget("shout")
    assert monitor.score("shout") is None and "shout" not in monitor.labels()


def test_an_adapter_hovering_at_the_threshold_warns_once(caplog) -> None:
    """Cleared only at threshold + recover_margin: a score going 0.79, 0.81, 0.79 ... stays one
    flag and one warning."""
    # alpha tiny: every step weighs alike, so a score is the share of steps accepted
    monitor = DriftMonitor("base", DriftConfig(threshold=0.8, alpha=1e-6, min_steps=1, depths=1))
    monitor.observe("base", _steps([1] * 10, depth=1))  # base: accepted at depth 1 always
    with caplog.at_level(logging.WARNING, logger="selfspec.serve.drift"):
        for rate in (0.79, 0.81, 0.79, 0.82, 0.78):
            monitor._seen.pop("docs", None)  # each score exactly ``rate``: a fresh average
            monitor.observe(
                "docs", _steps([1] * round(rate * 100) + [0] * round(100 - rate * 100), 1)
            )
            assert monitor.score("docs") == pytest.approx(rate, abs=0.02)
            assert monitor.flagged() == {"docs"}
    assert sum("docs" in r.getMessage() for r in caplog.records) == 1
    monitor._seen.pop("docs")
    monitor.observe("docs", _steps([1] * 86 + [0] * 14, depth=1))  # 0.86 >= 0.8 + 0.05
    assert monitor.flagged() == set()


def test_a_mild_adapter_is_not_flagged_and_the_base_has_no_score() -> None:
    monitor = DriftMonitor("base", DriftConfig(threshold=0.8, min_steps=10))
    monitor.observe("base", _steps([2, 3] * 20))
    monitor.observe("code", _steps([2, 3, 2, 2] * 10))
    assert 0.8 < monitor.score("code") <= 1.0 and monitor.flagged() == set()
    assert monitor.score("base") is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold"):
        DriftConfig(threshold=1.5)
    with pytest.raises(ValueError, match="recover_margin"):
        DriftConfig(recover_margin=-0.1)


def test_the_server_exports_acceptance_averages_per_adapter(server_for) -> None:
    body = {"prompt": "abc", "temperature": 0, "max_tokens": 40, "ignore_eos": True}
    with server_for(drift_threshold=0.5) as (url, state, _):
        for model in ("tiny-llama", "attn"):
            reply = httpx.post(f"{url}/v1/completions", json={**body, "model": model})
            assert reply.status_code == 200
        exposition = httpx.get(f"{url}/metrics").text
        assert 'selfspec_spec_tau_ewma{adapter="attn"}' in exposition
        assert 'selfspec_spec_tau_ewma{adapter="tiny-llama"}' in exposition
        assert state.metrics.drift.config.threshold == 0.5
