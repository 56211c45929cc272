"""Prometheus metrics for ``GET /metrics`` (text exposition format 0.0.4).

Each app owns its own ``CollectorRegistry`` (never prometheus-client's global one), so
several servers in one process — tests, benchmarks — keep separate counts.

Two kinds of values:

* **Event counts and distributions** recorded as they happen: requests by route and
  status, requests in flight (the HTTP layer), and per-generation TTFT, decode rate and
  token counters (from ``GenerationStats``).
* **State read at scrape time** from the runtime and supervisor through callables, so
  nothing has to keep a copy in sync: queue depth, running generations, worker restarts,
  worker ready (totals over the workers), and the same per worker of a pool
  (``trioserve_pool_worker_*{worker="<index>"}``, one series per worker, also with one).

Route labels are bounded: a path that is not one of the app's routes is counted as
``other``, so a scanner probing random URLs cannot grow the label set.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .stats import GenerationStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
ROUTES = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics"})

# Buckets for the model sizes this server targets: a 135M model on a laptop CPU decodes
# hundreds of tokens/s; a big model on a small CPU a few.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DECODE_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class _RuntimeCollector(Collector):
    """Gauges and counters whose values live in the runtime and supervisor."""

    def __init__(self, *, queued: Callable[[], int], running: Callable[[], int],
                 restarts: Callable[[], int], ready: Callable[[], bool]) -> None:
        self._queued = queued
        self._running = running
        self._restarts = restarts
        self._ready = ready

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("trioserve_queue_depth", "Requests waiting for the worker.",
                                value=self._queued())
        yield GaugeMetricFamily("trioserve_running_generations",
                                "Generations the worker is running now.", value=self._running())
        yield GaugeMetricFamily("trioserve_worker_ready", "1 while a worker is ready to serve.",
                                value=1 if self._ready() else 0)
        yield CounterMetricFamily("trioserve_worker_restarts", "Worker restarts since start.",
                                  value=self._restarts())


class _WorkerCollector(Collector):
    """Per-worker state of a worker pool, labelled ``worker`` with the index that the
    ``x-trioserve-worker`` response header shows (worker_pool.py)."""

    def __init__(self, workers: Sequence[Any]) -> None:
        self._workers = workers

    def collect(self) -> Iterable[Metric]:
        families = (
            (GaugeMetricFamily, "trioserve_pool_worker_queue_depth",
             "Requests waiting for this worker.", lambda w: w.runtime.queued),
            (GaugeMetricFamily, "trioserve_pool_worker_running_generations",
             "Generations this worker is running now.", lambda w: w.runtime.in_flight),
            (GaugeMetricFamily, "trioserve_pool_worker_ready", "1 while this worker is ready.",
             lambda w: 1 if w.supervisor.state == "ready" else 0),
            (CounterMetricFamily, "trioserve_pool_worker_restarts",
             "Restarts of this worker since start.", lambda w: w.supervisor.restarts),
            (CounterMetricFamily, "trioserve_pool_worker_generations",
             "Generations this worker was sent.", lambda w: w.runtime.dispatched),
        )
        for family, name, doc, read in families:
            metric = family(name, doc, labels=["worker"])
            for worker in self._workers:
                metric.add_metric([str(worker.index)], read(worker))
            yield metric


class Metrics:
    """The metrics of one app; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, *, queued: Callable[[], int], running: Callable[[], int],
                 restarts: Callable[[], int], ready: Callable[[], bool],
                 workers: Sequence[Any] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("trioserve_http_requests", "HTTP requests by route and status.",
                                ("route", "status"), registry=r)
        self.in_flight = Gauge("trioserve_http_requests_in_flight",
                               "HTTP requests being served now.", registry=r)
        self.ttft = Histogram("trioserve_time_to_first_token_seconds",
                              "Admission to first output of a generation.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.decode_rate = Histogram("trioserve_decode_tokens_per_second",
                                     "Decode rate of a generation after its first token.",
                                     buckets=DECODE_RATE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("trioserve_prompt_tokens", "Prompt tokens processed.",
                                     registry=r)
        self.cached_tokens = Counter("trioserve_cached_prompt_tokens",
                                     "Prompt tokens reused from the worker's cache.", registry=r)
        self.completion_tokens = Counter("trioserve_completion_tokens", "Tokens generated.",
                                         registry=r)
        self.generations = Counter("trioserve_generations", "Generations by finish reason.",
                                   ("finish_reason",), registry=r)
        r.register(_RuntimeCollector(queued=queued, running=running, restarts=restarts, ready=ready))
        r.register(_WorkerCollector(workers))

    @staticmethod
    def route_label(path: str) -> str:
        return path if path in ROUTES else "other"

    def request_finished(self, path: str, status: int | None) -> None:
        """Count one finished request; ``status`` None: the client left before a response."""
        self.requests.labels(self.route_label(path), str(status) if status else "none").inc()

    def observe_generation(self, stats: GenerationStats) -> None:
        self.generations.labels(stats.finish_reason).inc()
        if stats.ttft_ms is not None:
            self.ttft.observe(stats.ttft_ms / 1000)
        if stats.decode_tps is not None:
            self.decode_rate.observe(stats.decode_tps)
        self.prompt_tokens.inc(stats.prompt_tokens or 0)
        self.cached_tokens.inc(stats.cached_tokens or 0)
        self.completion_tokens.inc(stats.completion_tokens or 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
