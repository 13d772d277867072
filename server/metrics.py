"""Prometheus metrics of one app, in its own `CollectorRegistry` (no process-wide state, so several apps can live
in one process, as the tests do). Handlers count requests and tokens and time each token; the engine gauges are
read from the engine loop's latest `EngineStats` when `/metrics` is scraped.

The engine-wide series (requests, tokens, KV-cache usage: rank 0 decides for every rank, and every rank holds the
same pages) carry no rank label. Each tensor-parallel rank's own numbers (`hybrid.rank_stats`: forward passes, its
CPU experts' seconds, its GPU's memory, whether its process lives) are series labelled `rank`, "0" to "N-1"; a
one-process server has them too, as rank "0", so a dashboard's queries need not know the size."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybrid.engine import EngineStats
from hybrid.rank_stats import RankStats

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
        self.ranks = RankCollector()
        registry.register(self.ranks)

    def render(self, stats: EngineStats, ranks: tuple[RankStats, ...] = ()) -> bytes:
        """The exposition text: `stats` for the engine gauges, `ranks` for the per-rank series (none: no series)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(1 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0)
        self.ranks.ranks = ranks
        return generate_latest(self.registry)


class RankCollector:
    """The per-rank series of the `RankStats` that `render` was handed (values others keep: no `set` of ours)."""

    def __init__(self):
        self.ranks: tuple[RankStats, ...] = ()

    def collect(self) -> Iterator[Metric]:
        ranks = self.ranks
        alive = GaugeMetricFamily("hybrid_rank_alive", "1 while the tensor-parallel rank's process runs, else 0",
                                  labels=["rank"])
        steps = CounterMetricFamily("hybrid_rank_steps", "forward passes (engine steps) the rank ran",
                                    labels=["rank"])
        cpu = CounterMetricFamily("hybrid_rank_cpu_experts_seconds", "seconds the rank's CPU experts computed (its "
                                  "slice of them, on its CPUs); per step: divide its rate by the steps'",
                                  labels=["rank"])
        allocated = GaugeMetricFamily("hybrid_rank_gpu_memory_allocated_bytes", "bytes torch's allocator holds in "
                                      "tensors on the rank's GPU (sampled at most once a second)", labels=["rank"])
        reserved = GaugeMetricFamily("hybrid_rank_gpu_memory_reserved_bytes", "bytes torch's allocator reserved on "
                                     "the rank's GPU (sampled at most once a second)", labels=["rank"])
        for r in ranks:
            label = [str(r.rank)]
            alive.add_metric(label, float(r.is_alive))
            steps.add_metric(label, r.num_steps)
            cpu.add_metric(label, r.cpu_experts_seconds)
            if r.gpu_allocated_bytes is not None:
                allocated.add_metric(label, r.gpu_allocated_bytes)
                reserved.add_metric(label, r.gpu_reserved_bytes)
        families = [alive, steps, cpu, allocated, reserved]
        yield from (family for family in families if family.samples)
