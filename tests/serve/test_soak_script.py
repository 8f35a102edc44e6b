"""benchmarks/soak.py: clients loop against a server while its RSS is sampled; the summary."""

from __future__ import annotations

import os

from benchmark_scripts import load_benchmark

soak = load_benchmark("soak")

PROMPTS = ["hello there", "tell me about cats", "count to five"]


def test_a_short_soak_sends_every_kind_counts_errors_and_summarizes(server_for, tmp_path) -> None:
    config = soak.SoakConfig(duration=6.0, clients=2, warmup=1.0, sample_every=0.5, max_tokens=6)
    with server_for() as (url, state, _server):
        # "nope" is no served model: its requests are the errors the soak must count.
        models = [state.model_name, "attn", "nope"]
        report = soak.soak(url, os.getpid(), models, PROMPTS, config)
    statuses = {r["status"] for r in report["request_log"]}
    assert statuses == {"200", "404"}, statuses
    assert report["errors"]["404"] == sum(r["model"] == "nope" for r in report["request_log"])
    assert report["requests"] >= 8
    # Both clients go through chat / completion x streamed or not (and greedy / sampled).
    assert set(report["kinds"]) == {"chat", "chat+stream", "completion", "completion+stream"}
    streamed = [
        r for r in report["request_log"] if r["kind"].endswith("+stream") and r["status"] == "200"
    ]
    assert streamed and all(r["first_token_seconds"] is not None for r in streamed)
    # Every answered request ran to max_tokens (completions ignore EOS; the tiny chat model
    # rarely ends early): the soak's load is what it says.
    done = [r for r in report["request_log"] if r["status"] == "200"]
    assert sum(r["tokens"] == config.max_tokens for r in done) >= 0.9 * len(done)
    assert report["rss_mb"]["min"] <= report["rss_mb"]["warmup_end"] <= report["rss_mb"]["max"]
    assert report["latency_s"]["p50"] <= report["latency_s"]["p99"]
    table = soak.markdown(report)
    assert "RSS largest deviation" in table and "404: " in table
    assert soak.plot(report, tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"


def test_rss_deviation_is_measured_from_the_end_of_warm_up() -> None:
    log = soak.SoakLog()
    mib = 2**20
    log.rss = [(0.0, 100 * mib), (5.0, 200 * mib), (6.0, 204 * mib), (9.0, 211 * mib)]
    report = soak.summarize(log, soak.SoakConfig(duration=10.0, warmup=5.0))
    assert report["rss_mb"]["warmup_end"] == 200  # growth during warm-up does not count
    assert abs(report["rss_max_deviation_pct"] - 5.5) < 1e-9
    assert not report["rss_within_5pct"]
