"""Prometheus metrics of one app, in its own `CollectorRegistry` (no process-wide state, so several apps can live
in one process, as the tests do). Handlers count requests and tokens and time each token; the engine gauges are
read from the engine loop's latest `EngineStats` when `/metrics` is scraped."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hybrid.engine import EngineStats

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("hybrid_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("hybrid_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("hybrid_generation_tokens", "tokens generated", registry=registry)
        self.time_to_first_token = Histogram("hybrid_time_to_first_token_seconds",
                                             "from the request's arrival to its first token", buckets=TTFT_BUCKETS,
                                             registry=registry)
        self.inter_token_latency = Histogram("hybrid_inter_token_latency_seconds",
                                             "between consecutive tokens of a request", buckets=ITL_BUCKETS,
                                             registry=registry)
        self.num_running = Gauge("hybrid_num_requests_running", "requests in the engine's running batch",
                                 registry=registry)
        self.num_waiting = Gauge("hybrid_num_requests_waiting", "requests queued in the engine",
                                 registry=registry)
        self.kv_cache_usage = Gauge("hybrid_kv_cache_usage_ratio", "fraction of KV-cache pages in use (0-1)",
                                    registry=registry)

    def render(self, stats: EngineStats) -> bytes:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(1 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0)
        return generate_latest(self.registry)
