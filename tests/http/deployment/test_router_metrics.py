"""The metrics a router reads (metrics.py; docs/deployment.md), over real HTTP on the fake
worker: KV-cache use as a 0-1 gauge from the worker's resident tokens, the cache layout,
prefix-cache queries/hits, spill and restore counters, and the vLLM-named aliases an endpoint
picker reads on its default mapping.

The fake tokenizer is one token per byte and a generation that ends by EOS leaves its prompt
and every generated token resident (worker protocol §6), so resident tokens are exact."""

from __future__ import annotations

import os
import signal

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from trioserve.worker.routing import key_order

from ..conftest import chat_body, live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

CTX = 512


async def scrape(client) -> tuple[dict[tuple[str, tuple], float], dict[str, str]]:
    """Samples by (name, sorted labels), and each family's type."""
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    samples, types = {}, {}
    for family in text_string_to_metric_families(resp.text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, types


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def chat(client, content: str, **extra) -> dict:
    resp = await client.post("/v1/chat/completions", json=chat_body(content, **extra))
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


async def test_kv_usage_cache_info_and_prefix_counters(tmp_path):
    async with live_server(tmp_path, script=["ok then"], slots=2, max_context=CTX) as srv, \
            srv.client() as client:
        m, types = await scrape(client)
        assert value(m, "trioserve_kv_cache_usage_ratio") == 0  # a fresh worker holds nothing
        info = {"block_size": "16", "num_gpu_blocks": str(2 * CTX // 16), "slots": "2",
                "n_ctx": str(CTX)}
        assert value(m, "trioserve_cache_config_info", **info) == 1
        assert types["trioserve_kv_cache_usage_ratio"] == "gauge"
        assert types["trioserve_cache_config_info"] == "gauge"

        first = await chat(client, "first question", prompt_cache_key="A")  # binds a slot
        m, _ = await scrape(client)
        resident = first["prompt_tokens"] + first["completion_tokens"]
        assert value(m, "trioserve_kv_cache_usage_ratio") == pytest.approx(resident / (2 * CTX))

        # An anonymous request takes the other (empty) slot: both are resident now.
        second = await chat(client, "another one")
        m, _ = await scrape(client)
        resident += second["prompt_tokens"] + second["completion_tokens"]
        assert value(m, "trioserve_kv_cache_usage_ratio") == pytest.approx(resident / (2 * CTX))
        queries = first["prompt_tokens"] + second["prompt_tokens"]
        hits = (first["prompt_tokens_details"]["cached_tokens"]
                + second["prompt_tokens_details"]["cached_tokens"])
        assert value(m, "trioserve_prompt_tokens_total") == queries
        assert value(m, "trioserve_cached_prompt_tokens_total") == hits
        assert ("vllm:num_requests_waiting", ()) not in m  # aliases are opt-in


async def test_spills_and_restores_are_counted(tmp_path):
    """Two slots hold at most one named session: B evicts A (spill), A comes back (restore)."""
    async with live_server(tmp_path, script=["fine"], slots=2) as srv, srv.client() as client:
        await chat(client, "session a", prompt_cache_key="A")
        m, _ = await scrape(client)
        assert value(m, "trioserve_session_spills_total") == 0
        await chat(client, "session b", prompt_cache_key="B")
        usage = await chat(client, "session a", prompt_cache_key="A")
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # restored, not re-prefilled
        m, types = await scrape(client)
        assert value(m, "trioserve_session_spills_total") == 2  # A for B, then B for A
        assert value(m, "trioserve_session_restores_total") == 1
        assert value(m, "trioserve_restored_prompt_tokens_total") == \
            usage["prompt_tokens_details"]["cached_tokens"]
        assert types["trioserve_session_spills"] == "counter"


async def test_vllm_names_alias_the_same_values(tmp_path):
    async with live_server(tmp_path, script=["ok"], slots=2, max_context=CTX,
                           metrics_vllm_names=True) as srv, srv.client() as client:
        usage = await chat(client, "hello")
        m, types = await scrape(client)
    ratio = value(m, "trioserve_kv_cache_usage_ratio")
    assert ratio > 0
    assert value(m, "vllm:kv_cache_usage_perc") == ratio
    assert value(m, "vllm:gpu_cache_usage_perc") == ratio
    assert value(m, "vllm:num_requests_waiting") == value(m, "trioserve_queue_depth") == 0
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:cache_config_info", block_size="16", num_gpu_blocks=str(2 * CTX // 16),
                 slots="2", n_ctx=str(CTX)) == 1
    assert value(m, "vllm:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert value(m, "vllm:prefix_cache_hits_total") == usage["prompt_tokens_details"]["cached_tokens"]
    assert types["vllm:prefix_cache_queries"] == "counter"
    assert types["vllm:num_requests_waiting"] == "gauge"


def key_on(worker: int, workers: int) -> str:
    """A session key that the pool routes to ``worker`` (worker_routing.key_order)."""
    return next(k for k in (f"key-{n}" for n in range(1000)) if key_order(k, workers)[0] == worker)


async def test_two_workers_have_their_own_kv_gauge_and_the_replica_gauge_is_their_sum(tmp_path):
    """``--workers 2``: each worker's resident tokens stay its own (a generation finishing on
    one does not overwrite the other's), the unlabelled gauge and cache info describe the whole
    replica, and a restarted worker drops to 0 while the other keeps its count."""
    async with live_server(tmp_path, script=["ok then"], slots=2, max_context=CTX, workers=2,
                           metrics_vllm_names=True) as srv, srv.client() as client:
        pool = srv.quart_app.services.default.pool
        with trio.fail_after(15):
            while not all(w.supervisor.state == "ready" for w in pool.workers):
                await trio.sleep(0.02)
        resident = {}
        for worker, content in ((0, "a rather longer first question"), (1, "short")):
            resp = await client.post("/v1/chat/completions", json=chat_body(content),
                                     headers={"x-session-id": key_on(worker, 2)})
            assert resp.status_code == 200 and resp.headers["x-trioserve-worker"] == str(worker)
            usage = resp.json()["usage"]
            resident[worker] = usage["prompt_tokens"] + usage["completion_tokens"]
        assert resident[0] != resident[1]

        m, types = await scrape(client)
        for worker in (0, 1):
            assert value(m, "trioserve_pool_worker_kv_cache_usage_ratio", worker=str(worker)) == \
                pytest.approx(resident[worker] / (2 * CTX))
            assert value(m, "trioserve_pool_worker_cache_config_info", worker=str(worker),
                         block_size="16", num_gpu_blocks=str(2 * CTX // 16), slots="2",
                         n_ctx=str(CTX)) == 1
        total = (resident[0] + resident[1]) / (4 * CTX)
        assert value(m, "trioserve_kv_cache_usage_ratio") == pytest.approx(total)
        assert value(m, "vllm:kv_cache_usage_perc") == pytest.approx(total)
        replica = {"block_size": "16", "num_gpu_blocks": str(4 * CTX // 16), "slots": "4",
                   "n_ctx": str(CTX)}
        assert value(m, "trioserve_cache_config_info", **replica) == 1
        assert value(m, "vllm:cache_config_info", **replica) == 1
        assert types["trioserve_pool_worker_kv_cache_usage_ratio"] == "gauge"

        # Worker 1 dies and comes back empty; worker 0's resident tokens still count.
        os.kill(pool.workers[1].supervisor.worker_pid, signal.SIGKILL)
        with trio.fail_after(15):
            while not (pool.workers[1].supervisor.restarts == 1
                       and pool.workers[1].supervisor.state == "ready"):
                await trio.sleep(0.02)
        m, _ = await scrape(client)
        assert value(m, "trioserve_pool_worker_kv_cache_usage_ratio", worker="1") == 0
        assert value(m, "trioserve_kv_cache_usage_ratio") == pytest.approx(resident[0] / (4 * CTX))
