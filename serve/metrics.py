"""Prometheus metrics of one server, in a private registry (two apps in one process never mix).

Speculation counters are labelled by adapter (the base model's name for no adapter), which is
what tells an operator how much each adapter keeps of the shared heads' speed-up:
acceptance at depth d = ``selfspec_spec_accepted_at_depth_total``
/ ``selfspec_spec_reached_depth_total``, and τ = (accepted tokens + steps) / steps.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from selfspec.prefix_cache import PrefixCache
from selfspec.serve.drift import DriftMonitor
from selfspec.stats import GenerationStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.drift: DriftMonitor | None = None
        r = self.registry
        self.requests = Counter(
            "selfspec_requests",
            "Requests by adapter and outcome (completed, cancelled, error, rejected)",
            ["adapter", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "selfspec_prompt_tokens", "Prompt tokens of finished requests", ["adapter"], registry=r
        )
        self.generation_tokens = Counter(
            "selfspec_generation_tokens", "Generated tokens", ["adapter"], registry=r
        )
        self.latency = Histogram(
            "selfspec_request_latency_seconds",
            "Time from admission to the last token",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "selfspec_time_to_first_token_seconds",
            "Time from admission to the first token",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "selfspec_queue_wait_seconds",
            "Time waiting for a slot before the first step",
            ["adapter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.spec_steps = Counter(
            "selfspec_spec_steps",
            "Speculative decode steps (one draft tree verified per step)",
            ["adapter"],
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "selfspec_spec_draft_tokens",
            "Drafted tokens verified (tree nodes minus the root)",
            ["adapter"],
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "selfspec_spec_accepted_tokens",
            "Drafted tokens accepted by the target (bonus tokens excluded)",
            ["adapter"],
            registry=r,
        )
        self.spec_reached_depth = Counter(
            "selfspec_spec_reached_depth",
            "Speculative steps whose draft tree reached this depth",
            ["adapter", "depth"],
            registry=r,
        )
        self.spec_accepted_at_depth = Counter(
            "selfspec_spec_accepted_at_depth",
            "Speculative steps whose accepted path reached this depth",
            ["adapter", "depth"],
            registry=r,
        )
        self.batch_size = Histogram(
            "selfspec_verify_batch_requests",
            "Requests whose draft trees one target forward verified",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.recalibrations = Counter(
            "selfspec_background_recalibrations",
            "Background recalibrations from served outputs, by outcome (swapped: the new draft "
            "delta measured better and drafts from now on; kept: it did not; failed)",
            ["adapter", "outcome"],
            registry=r,
        )
        self._by_adapter = (
            self.requests,
            self.recalibrations,
            self.prompt_tokens,
            self.generation_tokens,
            self.latency,
            self.ttft,
            self.queue_wait,
            self.spec_steps,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
            self.spec_reached_depth,
            self.spec_accepted_at_depth,
        )
        """Every metric whose first label is the adapter."""
        self.running = Gauge("selfspec_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge(
            "selfspec_requests_waiting", "Requests admitted but not yet started", registry=r
        )

    def record_finished(self, adapter: str, stats: GenerationStats, speculated: bool) -> None:
        self.prompt_tokens.labels(adapter).inc(stats.prompt_tokens)
        if not speculated:
            return
        if self.drift is not None:
            self.drift.observe(adapter, stats.steps)
        steps = stats.steps
        self.spec_steps.labels(adapter).inc(len(steps))
        self.spec_draft_tokens.labels(adapter).inc(sum(s.tree_size - 1 for s in steps))
        self.spec_accepted_tokens.labels(adapter).inc(sum(s.accepted for s in steps))
        deepest = max((s.tree_depth for s in steps), default=0)
        for depth in range(1, deepest + 1):
            reached = sum(s.tree_depth >= depth for s in steps)
            accepted = sum(s.accepted >= depth for s in steps)
            self.spec_reached_depth.labels(adapter, str(depth)).inc(reached)
            self.spec_accepted_at_depth.labels(adapter, str(depth)).inc(accepted)

    def watch_drift(self, drift: DriftMonitor) -> None:
        """Feed finished speculative requests to ``drift`` and export its state."""
        self.drift = drift
        self.registry.register(_DriftCollector(drift))

    def watch_prefix_cache(self, cache: PrefixCache) -> None:
        """Export the prefix cache's counters (read when /metrics is scraped)."""
        self.registry.register(_PrefixCacheCollector(cache))

    def forget(self, adapter: str) -> None:
        """Drop every series labelled with ``adapter`` (it was unloaded): runtime-loaded names
        must not grow the exposition without bound."""
        if self.drift is not None:
            self.drift.forget(adapter)
        for metric in self._by_adapter:
            # prometheus_client keeps a labelled metric's children by their label values.
            for values in [v for v in list(metric._metrics) if v[0] == adapter]:
                metric.remove(*values)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCollector:
    """The prefix cache's own counters as Prometheus metrics, read at scrape time."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def collect(self):  # -> Iterator[Metric]
        stats = self.cache.stats
        yield CounterMetricFamily(
            "selfspec_prefix_cache_hits", "Prefills that reused cached prompt blocks", stats.hits
        )
        yield CounterMetricFamily(
            "selfspec_prefix_cache_misses", "Prefills that found no cached block", stats.misses
        )
        yield CounterMetricFamily(
            "selfspec_prefix_cache_hit_tokens", "Prompt tokens not recomputed", stats.hit_tokens
        )
        yield CounterMetricFamily(
            "selfspec_prefix_cache_evicted_blocks", "Blocks evicted (LRU)", stats.evicted_blocks
        )
        yield GaugeMetricFamily(
            "selfspec_prefix_cache_bytes", "Bytes of cached blocks", self.cache.nbytes
        )


class _DriftCollector:
    """Per-adapter moving averages of acceptance and the drift score, read at scrape time."""

    def __init__(self, drift: DriftMonitor) -> None:
        self.drift = drift

    def collect(self):  # -> Iterator[Metric]
        drift = self.drift
        tau = GaugeMetricFamily(
            "selfspec_spec_tau_ewma",
            "Moving average of tokens per verification",
            labels=["adapter"],
        )
        score = GaugeMetricFamily(
            "selfspec_adapter_drift_score",
            "Adapter / base draft acceptance (mean over the first depths, moving averages)",
            labels=["adapter"],
        )
        flagged = GaugeMetricFamily(
            "selfspec_adapter_drift_flagged",
            "1 while the adapter's drift score is below the threshold",
            labels=["adapter"],
        )
        below = drift.flagged()
        for label in drift.labels():
            value = drift.tau(label)
            if value is not None:
                tau.add_metric([label], value)
            ratio = drift.score(label)
            if ratio is not None:
                score.add_metric([label], ratio)
                flagged.add_metric([label], float(label in below))
        yield tau
        yield score
        yield flagged
