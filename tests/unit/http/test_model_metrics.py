"""model_metrics.py: the lifecycle's series as a scrape shows them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from trioserve.http.model_metrics import ModelLifecycleMetrics
from trioserve.worker.model_loader import LoadOutcome, ModelState


def scrape(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_states_waits_memory_loads_and_unloads():
    models = [ModelState("a", "loaded", False, 300, 300, 1, 0, None),
              ModelState("b", "loading", False, 100, None, 0, 2, None)]
    registry = CollectorRegistry()
    metrics = ModelLifecycleMetrics(registry, lambda: models, budget=1000)
    metrics.load_finished(LoadOutcome("a", "demand", "loaded", 1.5))
    metrics.load_finished(LoadOutcome("b", "demand", "failed", 0.2))
    metrics.unloaded("a", "lru")
    text = scrape(registry)
    assert 'trioserve_model_state{model="a",state="loaded"} 1.0' in text
    assert 'trioserve_model_state{model="a",state="loading"} 0.0' in text
    assert 'trioserve_model_state{model="b",state="loading"} 1.0' in text
    assert 'trioserve_model_requests_waiting{model="b"} 2.0' in text
    assert 'trioserve_model_memory_bytes{model="a"} 300.0' in text
    assert "trioserve_model_memory_budget_bytes 1000.0" in text
    assert 'trioserve_model_loads_total{model="a",outcome="loaded",reason="demand"} 1.0' in text
    assert 'trioserve_model_loads_total{model="b",outcome="failed",reason="demand"} 1.0' in text
    assert 'trioserve_model_load_seconds_count{model="a"} 1.0' in text
    assert 'trioserve_model_load_seconds_count{model="b"}' not in text  # failures are counted, not timed
    assert 'trioserve_model_unloads_total{model="a",reason="lru"} 1.0' in text


def test_an_unlimited_budget_has_no_budget_series():
    registry = CollectorRegistry()
    ModelLifecycleMetrics(registry, lambda: [], budget=None)
    assert "trioserve_model_memory_budget_bytes" not in scrape(registry)
