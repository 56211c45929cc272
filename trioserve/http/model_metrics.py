"""``/metrics`` series of the models' lifecycle (worker/lifecycle.py): states, memory, waits,
loads and unloads. Registered on the app's own registry beside http/metrics.py's series.

Read at scrape time from the lifecycle's snapshot:

- ``trioserve_model_state{model,state}``: 1 for the model's state (``not_loaded``,
  ``loading``, ``loaded``, ``unloading``), 0 for the others;
- ``trioserve_model_requests_waiting{model}``: requests waiting for the model to load;
- ``trioserve_model_memory_bytes{model}``: what the model counts against the budget now;
- ``trioserve_model_memory_budget_bytes``: the budget (absent when unlimited).

Recorded as they happen:

- ``trioserve_model_loads_total{model,reason,outcome}``: finished load attempts (reason
  ``demand``, ``preload``, ``admin``; outcome ``loaded``, ``failed``, ``too_large``,
  ``timeout``, ``cancelled``, ``abandoned``, ``no_room``: its last load failed and it would
  have had to unload a working model);
- ``trioserve_model_load_seconds{model}``: request (or startup) to serving, of the loads that
  succeeded, memory wait included;
- ``trioserve_model_unloads_total{model,reason}``: ``lru``, ``idle``, ``admin``, ``failed``,
  ``too_large``, ``shutdown``.

Model labels are bounded: they are the configured model ids, never a requested name.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from trioserve.worker.model_loader import LoadOutcome, ModelState

__all__ = ["LOAD_BUCKETS", "ModelLifecycleMetrics"]

STATES = ("not_loaded", "loading", "loaded", "unloading")
# A 135M model loads in a fraction of a second from a warm page cache; a large one from disk
# in minutes.
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], Sequence[ModelState]], budget: int | None) -> None:
        self._read = read
        self._budget = budget

    def collect(self) -> Iterable[Metric]:
        models = self._read()
        state = GaugeMetricFamily("trioserve_model_state",
                                  "1 for the model's lifecycle state, 0 for the others.",
                                  labels=["model", "state"])
        waiting = GaugeMetricFamily("trioserve_model_requests_waiting",
                                    "Requests waiting for the model to load.", labels=["model"])
        memory = GaugeMetricFamily("trioserve_model_memory_bytes",
                                   "Bytes the model counts against the memory budget now "
                                   "(weights + KV cache as its workers report them).",
                                   labels=["model"])
        for model in models:
            for name in STATES:
                state.add_metric([model.model_id, name], 1 if model.state == name else 0)
            waiting.add_metric([model.model_id], model.waiting)
            memory.add_metric([model.model_id], model.cost_bytes)
        yield state
        yield waiting
        yield memory
        if self._budget is not None:
            yield GaugeMetricFamily("trioserve_model_memory_budget_bytes",
                                    "The memory budget the models share.", value=self._budget)


class ModelLifecycleMetrics:
    """The lifecycle's series on ``registry``; ``load_finished`` and ``unloaded`` are the
    lifecycle's ``on_load`` / ``on_unload`` callbacks."""

    def __init__(self, registry: CollectorRegistry, read: Callable[[], Sequence[ModelState]],
                 budget: int | None) -> None:
        self.loads = Counter("trioserve_model_loads", "Finished model load attempts.",
                             ("model", "reason", "outcome"), registry=registry)
        self.load_seconds = Histogram("trioserve_model_load_seconds",
                                      "Request (or startup) to serving of successful model loads.",
                                      ("model",), buckets=LOAD_BUCKETS, registry=registry)
        self.unloads = Counter("trioserve_model_unloads", "Model unloads by reason.",
                               ("model", "reason"), registry=registry)
        registry.register(_StateCollector(read, budget))

    def load_finished(self, outcome: LoadOutcome) -> None:
        self.loads.labels(outcome.model_id, outcome.reason, outcome.outcome).inc()
        if outcome.outcome == "loaded":
            self.load_seconds.labels(outcome.model_id).observe(outcome.seconds)

    def unloaded(self, model_id: str, reason: str) -> None:
        self.unloads.labels(model_id, reason).inc()
