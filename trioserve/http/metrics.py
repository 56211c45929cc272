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

**For routers** (the Gateway API Inference Extension's model-server protocol; mapping and an
endpoint-picker configuration in docs/deployment.md): requests waiting
(``trioserve_queue_depth``) and running (``trioserve_running_generations``), KV-cache use as
a 0–1 gauge (``trioserve_kv_cache_usage_ratio``: tokens resident over all slots of all
workers, as each worker's last done record reported them, over their slots × per-slot
context), the cache layout (``trioserve_cache_config_info``: ``block_size`` and
``num_gpu_blocks`` labels summed over the workers, value 1), the same two per worker
(``trioserve_pool_worker_kv_cache_usage_ratio`` / ``_cache_config_info``, label ``worker``),
prefix-cache queries and hits in tokens (``trioserve_prompt_tokens_total``,
``trioserve_cached_prompt_tokens_total``), and session spills and restores. With
``vllm_names`` the same values are also exposed under vLLM's names, so an endpoint picker
with its default (vLLM) metric mapping reads trioserve unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trioserve.core.stats import GenerationStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
ROUTES = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics"})

# Buckets for the model sizes this server targets: a 135M model on a laptop CPU decodes
# hundreds of tokens/s; a big model on a small CPU a few.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DECODE_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
DRAFT_ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


# trioserve reuses prompt prefixes per token, not in blocks; routers size their prefix
# indexes from block_size × num_gpu_blocks, so the capacity is reported in blocks of this
# many tokens (vLLM's default block size).
KV_BLOCK_TOKENS = 16


class KvCacheState:
    """What the KV-cache gauges are computed from: a worker's slots and per-slot context
    (``configure``, at each worker start, which also zeroes the resident count: a new worker
    holds nothing) and the tokens resident after its last generation (``observe``)."""

    def __init__(self) -> None:
        self.slots = 0
        self.n_ctx = 0
        self.capacity_tokens = 0  # slots x n_ctx for one worker; the sum for a pool's total
        self.resident_tokens = 0

    def configure(self, slots: int, n_ctx: int) -> None:
        self.slots, self.n_ctx, self.resident_tokens = slots, n_ctx, 0
        self.capacity_tokens = slots * n_ctx

    def observe(self, resident_tokens: int) -> None:
        self.resident_tokens = resident_tokens

    @property
    def usage(self) -> float:
        """Resident tokens over capacity, clamped to 0–1 (0 before a worker was ready)."""
        if self.capacity_tokens <= 0:
            return 0.0
        return min(1.0, max(0.0, self.resident_tokens / self.capacity_tokens))

    def config_labels(self) -> dict[str, str]:
        blocks = -(-self.capacity_tokens // KV_BLOCK_TOKENS)  # ceil
        return {"block_size": str(KV_BLOCK_TOKENS), "num_gpu_blocks": str(blocks),
                "slots": str(self.slots), "n_ctx": str(self.n_ctx)}


class KvCachePool:
    """One ``KvCacheState`` per worker index (created at the worker's first ready) and their
    sum, which is what a router scraping the replica must see: the resident tokens of all
    workers over the capacity of all workers, slots and blocks summed. A worker that died
    keeps its last numbers until it is ready again (its restart zeroes them), so the layout a
    router sizes its index from does not flicker with restarts. With one worker the sum is
    that worker's state, number for number."""

    def __init__(self) -> None:
        self.workers: dict[int, KvCacheState] = {}

    def worker(self, index: int) -> KvCacheState:
        return self.workers.setdefault(index, KvCacheState())

    def total(self) -> KvCacheState:
        total = KvCacheState()
        states = list(self.workers.values())
        total.slots = sum(s.slots for s in states)
        # n_ctx is per slot, and every worker of a pool runs the same settings.
        total.n_ctx = max((s.n_ctx for s in states), default=0)
        total.capacity_tokens = sum(s.capacity_tokens for s in states)
        # Each worker's count clamped to its own capacity first, as its own gauge is.
        total.resident_tokens = sum(min(s.resident_tokens, s.capacity_tokens) for s in states)
        return total


class _RouterCollector(Collector):
    """KV-cache gauges and cache info (the pool's sum, and per worker), plus (``vllm_names``)
    vLLM-named aliases of the values the endpoint picker reads by default."""

    def __init__(self, metrics: Metrics, kv: KvCachePool, *, queued: Callable[[], int],
                 running: Callable[[], int], vllm_names: bool) -> None:
        self._metrics = metrics
        self._kv = kv
        self._queued = queued
        self._running = running
        self._vllm_names = vllm_names

    def collect(self) -> Iterable[Metric]:
        kv = self._kv.total()
        yield GaugeMetricFamily("trioserve_kv_cache_usage_ratio",
                                "KV cache in use over all workers, 0-1: resident tokens over "
                                "slots x context.", value=kv.usage)
        labels = kv.config_labels()
        info = GaugeMetricFamily("trioserve_cache_config_info",
                                 "KV cache layout of all workers (value 1): block_size x "
                                 "num_gpu_blocks = slots x n_ctx.", labels=list(labels))
        info.add_metric(list(labels.values()), 1)
        yield info
        yield from self._per_worker()
        if not self._vllm_names:
            return
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Alias of trioserve_queue_depth.",
                                value=self._queued())
        yield GaugeMetricFamily("vllm:num_requests_running",
                                "Alias of trioserve_running_generations.", value=self._running())
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            yield GaugeMetricFamily(name, "Alias of trioserve_kv_cache_usage_ratio (0-1).",
                                    value=kv.usage)
        alias = GaugeMetricFamily("vllm:cache_config_info", "Alias of trioserve_cache_config_info.",
                                  labels=list(labels))
        alias.add_metric(list(labels.values()), 1)
        yield alias
        m = self._metrics
        yield CounterMetricFamily("vllm:prefix_cache_queries", "Alias of trioserve_prompt_tokens.",
                                  value=m.prefix_queries)
        yield CounterMetricFamily("vllm:prefix_cache_hits",
                                  "Alias of trioserve_cached_prompt_tokens.",
                                  value=m.prefix_hits)

    def _per_worker(self) -> Iterable[Metric]:
        """The same two per worker (label ``worker``, the ``x-trioserve-worker`` index), for
        every worker that was ready at least once."""
        workers = sorted(self._kv.workers.items())
        usage = GaugeMetricFamily("trioserve_pool_worker_kv_cache_usage_ratio",
                                  "KV cache in use by this worker, 0-1.", labels=["worker"])
        names = ["worker", *KvCacheState().config_labels()]
        info = GaugeMetricFamily("trioserve_pool_worker_cache_config_info",
                                 "KV cache layout of this worker (value 1).", labels=names)
        for index, state in workers:
            usage.add_metric([str(index)], state.usage)
            info.add_metric([str(index), *state.config_labels().values()], 1)
        yield usage
        yield info


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
    ``x-trioserve-worker`` response header shows (worker/pool.py)."""

    def __init__(self, workers: Callable[[], Sequence[Any]]) -> None:
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
            for worker in self._workers():
                metric.add_metric([str(worker.index)], read(worker))
            yield metric
        yield from _state_store_metrics(self._workers())
        yield from _checkpoint_metrics(self._workers())


# The persistent state store (spec/worker-protocol.md §6.4): each worker's counters as its
# latest done record reports them (they restart with the worker, as counters may).
_STATE_STORE = (
    (GaugeMetricFamily, "files", "State files of this worker's model in the store."),
    (GaugeMetricFamily, "bytes", "Bytes of those files."),
    (CounterMetricFamily, "hits", "Generations that started from a stored state."),
    (CounterMetricFamily, "writes", "States written to the store."),
    (CounterMetricFamily, "write_failures", "State writes that failed (full disk, read-only directory...)."),
)


def _state_store_metrics(workers: Sequence[Any]) -> Iterable[Metric]:
    latest = [(w.index, stats) for w in workers if isinstance(stats := _latest(w, "state_store"), dict)]
    if not latest:
        return
    for family, key, doc in _STATE_STORE:
        metric = family(f"trioserve_state_store_{key}", doc, labels=["worker"])
        for index, stats in latest:
            value = stats.get(key)
            if isinstance(value, int):
                metric.add_metric([str(index)], value)
        yield metric


def _checkpoint_metrics(workers: Sequence[Any]) -> Iterable[Metric]:
    """Host memory of each worker's state checkpoints (spec/worker-protocol.md §6.3), as its
    latest done record reports it; absent for workers without checkpoints."""
    latest = [(w.index, n) for w in workers if isinstance(n := _latest(w, "checkpoint_bytes"), int)]
    if latest:
        metric = GaugeMetricFamily("trioserve_checkpoint_bytes",
                                   "Host memory held by this worker's state checkpoints (recurrent or window states).",
                                   labels=["worker"])
        for index, n in latest:
            metric.add_metric([str(index)], n)
        yield metric


def _latest(worker: Any, key: str) -> Any:
    """``key`` of the newest done record of ``worker`` that has it, else None."""
    for entry in reversed(getattr(worker.runtime, "history", ())):
        if key in entry:
            return entry[key]
    return None


class _ModelCollector(Collector):
    """Per served model (label ``model``): its state, queue, running generations and
    restarts, read from its pool at scrape time (spec/README.md §2.1)."""

    def __init__(self, models: Callable[[], Sequence[tuple[str, Any]]],
                 kv: dict[str, KvCachePool]) -> None:
        self._models = models
        self._kv = kv

    def collect(self) -> Iterable[Metric]:
        families = (
            (GaugeMetricFamily, "trioserve_model_ready", "1 while a worker of this model is ready.",
             lambda p: 1 if p.state == "ready" else 0),
            (GaugeMetricFamily, "trioserve_model_queue_depth",
             "Requests waiting for this model's workers.", lambda p: p.queued),
            (GaugeMetricFamily, "trioserve_model_running_generations",
             "Generations this model's workers are running now.", lambda p: p.in_flight),
            (CounterMetricFamily, "trioserve_model_worker_restarts",
             "Restarts of this model's workers since start.", lambda p: p.restarts),
        )
        models = list(self._models())
        for family, name, doc, read in families:
            metric = family(name, doc, labels=["model"])
            for model_id, pool in models:
                metric.add_metric([model_id], read(pool))
            yield metric
        usage = GaugeMetricFamily("trioserve_model_kv_cache_usage_ratio",
                                  "KV cache in use over this model's workers, 0-1.", labels=["model"])
        for model_id, _ in models:
            usage.add_metric([model_id], self._kv[model_id].total().usage
                             if model_id in self._kv else 0.0)
        yield usage


class _CacheCollector(Collector):
    """The bytes each in-memory cache holds now (spec §17.4), read at scrape time: one gauge
    per cache, ``trioserve_<cache>_cache_bytes``, beside its bound in trioserve/limits.py."""

    def __init__(self, caches: Mapping[str, tuple[str, Callable[[], int]]]) -> None:
        self._caches = caches

    def collect(self) -> Iterable[Metric]:
        for name, (doc, read) in self._caches.items():
            yield GaugeMetricFamily(f"trioserve_{name}_cache_bytes", doc, value=read())


class Metrics:
    """The metrics of one app; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, *, queued: Callable[[], int], running: Callable[[], int],
                 restarts: Callable[[], int], ready: Callable[[], bool],
                 workers: Sequence[Any] | Callable[[], Sequence[Any]] = (), vllm_names: bool = False,
                 models: Callable[[], Sequence[tuple[str, Any]]] | None = None,
                 caches: Mapping[str, tuple[str, Callable[[], int]]] | None = None) -> None:
        """``workers``: the pool workers of the per-worker series (read at scrape time when a
        callable); ``models``: ``(model id, pool)`` of every served model for the per-model
        series (label ``model``); ``caches``: cache name → (help text, its bytes now), each a
        ``trioserve_<name>_cache_bytes`` gauge."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.kv = KvCachePool()
        # The prompt and cached token totals again, as plain numbers for the vLLM aliases.
        self.prefix_queries = 0
        self.prefix_hits = 0
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
        self.session_spills = Counter("trioserve_session_spills",
                                      "Idle sessions evicted from their slot with their state kept.",
                                      registry=r)
        self.session_restores = Counter("trioserve_session_restores",
                                        "Generations that resumed a spilled session's state.",
                                        registry=r)
        self.restored_tokens = Counter("trioserve_restored_prompt_tokens",
                                       "Prompt tokens reused from restored session states.",
                                       registry=r)
        self._branch_counters(r)
        self.drafted_tokens = Counter("trioserve_drafted_tokens",
                                      "Self-speculative draft tokens verified (spec §4.6).",
                                      registry=r)
        self.accepted_draft_tokens = Counter("trioserve_accepted_draft_tokens",
                                             "Self-speculative draft tokens accepted (emitted "
                                             "without a step of their own).", registry=r)
        self.draft_acceptance = Histogram("trioserve_draft_acceptance_ratio",
                                          "Accepted over drafted tokens of each drafted "
                                          "generation.", buckets=DRAFT_ACCEPTANCE_BUCKETS,
                                          registry=r)
        r.register(_RuntimeCollector(queued=queued, running=running, restarts=restarts, ready=ready))
        if caches:
            r.register(_CacheCollector(caches))
        r.register(_WorkerCollector(workers if callable(workers) else lambda: workers))
        # Per served model (spec/README.md §2.1): the same events again, labelled ``model``,
        # and each model's KV cache use; the unlabelled series above are the totals.
        self.model_kv: dict[str, KvCachePool] = {}
        self.model_generations = Counter("trioserve_model_generations",
                                         "Generations by model and finish reason.",
                                         ("model", "finish_reason"), registry=r)
        self.model_prompt_tokens = Counter("trioserve_model_prompt_tokens",
                                           "Prompt tokens processed, by model.", ("model",), registry=r)
        self.model_completion_tokens = Counter("trioserve_model_completion_tokens",
                                               "Tokens generated, by model.", ("model",), registry=r)
        self.model_ttft = Histogram("trioserve_model_time_to_first_token_seconds",
                                    "Admission to first output of a generation, by model.",
                                    ("model",), buckets=TTFT_BUCKETS, registry=r)
        if models is not None:
            r.register(_ModelCollector(models, self.model_kv))
        r.register(_RouterCollector(self, self.kv, queued=queued, running=running,
                                    vllm_names=vllm_names))

    def _branch_counters(self, r: CollectorRegistry) -> None:
        """Session branches (spec §12): opened beyond a key's first, evicted (least recently
        used beyond --session-branches), and prompts that stopped matching, by what changed."""
        self.session_branches = Counter("trioserve_session_branches",
                                        "Session branches opened by diverging prompts.", registry=r)
        self.branch_evictions = Counter("trioserve_session_branch_evictions",
                                        "Session branches evicted to keep the bound.", registry=r)
        self.prompt_divergences = Counter("trioserve_prompt_divergences",
                                          "Prompts that stopped matching their session or nearest "
                                          "prompt, by change.", ("change",), registry=r)

    def worker_ready(self, slots: int, n_ctx: int, worker: int = 0, *, model: str | None = None,
                     kv: bool = True) -> None:
        """Worker ``worker`` (its pool index) of ``model`` became ready with ``slots`` slots of
        ``n_ctx`` tokens, holding nothing; ``kv``: it feeds the server's KV-cache gauges."""
        if kv:
            self.kv.worker(worker).configure(slots, n_ctx)
        if model is not None:
            self.model_kv.setdefault(model, KvCachePool()).worker(worker).configure(slots, n_ctx)

    @staticmethod
    def route_label(path: str) -> str:
        return path if path in ROUTES else "other"

    def request_finished(self, path: str, status: int | None) -> None:
        """Count one finished request; ``status`` None: the client left before a response."""
        self.requests.labels(self.route_label(path), str(status) if status else "none").inc()

    def observe_generation(self, stats: GenerationStats, *, kv: bool = True,
                           model: str | None = None) -> None:
        """Count one generation (of ``model``, when given, also in the per-model series);
        ``kv``: its resident tokens feed the server's KV-cache gauges (the default model's
        workers)."""
        if model is not None:
            self._observe_model(stats, model)
        self.generations.labels(stats.finish_reason).inc()
        if stats.ttft_ms is not None:
            self.ttft.observe(stats.ttft_ms / 1000)
        if stats.decode_tps is not None:
            self.decode_rate.observe(stats.decode_tps)
        self.prompt_tokens.inc(stats.prompt_tokens or 0)
        self.cached_tokens.inc(stats.cached_tokens or 0)
        self.completion_tokens.inc(stats.completion_tokens or 0)
        self.prefix_queries += stats.prompt_tokens or 0
        self.prefix_hits += stats.cached_tokens or 0
        if stats.spilled_session:
            self.session_spills.inc()
        if stats.restored_tokens:  # 0: the loaded state had to be reset (nothing reused)
            self.session_restores.inc()
            self.restored_tokens.inc(stats.restored_tokens)
        if stats.branch_opened:
            self.session_branches.inc()
        self.branch_evictions.inc(stats.branch_evictions)
        if stats.divergence is not None:
            self.prompt_divergences.labels(stats.divergence).inc()
        if kv and stats.resident_tokens is not None:
            self.kv.worker(stats.worker).observe(stats.resident_tokens)
        if stats.drafted_tokens:  # None: not drafted; 0: drafting never paid
            accepted = stats.accepted_draft_tokens or 0
            self.drafted_tokens.inc(stats.drafted_tokens)
            self.accepted_draft_tokens.inc(accepted)
            self.draft_acceptance.observe(accepted / stats.drafted_tokens)

    def _observe_model(self, stats: GenerationStats, model: str) -> None:
        self.model_generations.labels(model, stats.finish_reason).inc()
        self.model_prompt_tokens.labels(model).inc(stats.prompt_tokens or 0)
        self.model_completion_tokens.labels(model).inc(stats.completion_tokens or 0)
        if stats.ttft_ms is not None:
            self.model_ttft.labels(model).observe(stats.ttft_ms / 1000)
        if stats.resident_tokens is not None:
            self.model_kv.setdefault(model, KvCachePool()).worker(stats.worker).observe(
                stats.resident_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
