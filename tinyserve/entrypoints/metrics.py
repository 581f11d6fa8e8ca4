"""Prometheus metrics with vLLM's names under a ``tinyserve:`` prefix.

Each app gets its own CollectorRegistry (no global state), so several servers can live in one
process (the tests do this). Gauges and counters are read from the AsyncEngine's stats
snapshot at scrape time; histograms are fed by the AsyncEngine's timing events.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tinyserve.engine.async_engine import AsyncEngine
from tinyserve.engine.client import RequestTiming

PREFIX = "tinyserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _EngineStatsCollector(Collector):
    """Reads the engine's counters at scrape time (the engine keeps the running totals)."""

    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self._engine = async_engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        labels = ["model_name"]
        value = [self._model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_cache_usage
        )
        yield gauge("kv_cache_free_blocks", "KV-cache blocks in the free queue.", s.num_free_blocks)
        yield gauge("kv_cache_total_blocks", "KV-cache blocks in all.", s.num_total_blocks)
        yield gauge(
            "engine_healthy", "1 while the engine thread is alive.", float(self._engine.is_healthy)
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits
        )
        yield counter("num_preemptions", "Preemptions (by recompute).", s.num_preemptions)
        yield counter("prompt_tokens", "Prefill tokens computed.", s.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens_total)
        # The step counter the live engine view's snapshots carry ("step"): a scrape and a
        # snapshot with the same count saw the same step boundary.
        yield counter("engine_steps", "Engine steps run.", s.num_steps)
        if s.spec_decode is not None:
            yield from _spec_decode_metrics(s.spec_decode, counter, labels, value)


def _spec_decode_metrics(spec, counter, labels: list[str], value: list[str]) -> Iterator[Metric]:
    """vLLM's ``spec_decode_*`` counters (speculative decoding on)."""
    yield counter(
        "spec_decode_num_drafts", "Requests' steps verified with drafts.", spec.num_drafts
    )
    yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
    yield counter(
        "spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens
    )
    per_pos = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft.",
        labels=[*labels, "position"],
    )
    for pos, n in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([*value, str(pos)], n)
    yield per_pos


class ServerMetrics:
    """The per-app registry and the request histograms; implements RequestStatsListener."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def attach(self, async_engine: AsyncEngine) -> None:
        async_engine.stats_listener = self
        self.registry.register(_EngineStatsCollector(async_engine, self.model_name))

    # RequestStatsListener
    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, timing: RequestTiming) -> None:
        if timing.e2e is not None:
            self.e2e.observe(timing.e2e)
        self.request_success.labels(self.model_name, timing.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
