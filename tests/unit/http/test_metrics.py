"""KvCacheState (metrics.py): the KV-cache gauge and cache info a router reads."""

from trioserve.http.metrics import KvCacheState, Metrics
from trioserve.core.stats import GenerationStats


def test_usage_is_resident_over_slots_times_context_clamped():
    kv = KvCacheState()
    assert kv.usage == 0.0  # no worker ready yet: no capacity, nothing in use
    kv.configure(4, 1000)
    kv.observe(1000)
    assert kv.usage == 0.25
    kv.observe(10_000)  # never above 1, whatever the worker reports
    assert kv.usage == 1.0
    kv.configure(4, 1000)  # a restarted worker holds nothing
    assert kv.usage == 0.0
    assert kv.config_labels() == {"block_size": "16", "num_gpu_blocks": "250", "slots": "4",
                                  "n_ctx": "1000"}
    kv.configure(3, 100)  # 300 tokens: 19 blocks of 16 cover them
    assert kv.config_labels()["num_gpu_blocks"] == "19"


def stats(**kw):
    base = dict(request_id="r", prompt_tokens=10, cached_tokens=4, completion_tokens=2,
                ttft_ms=1.0, decode_tps=None, finish_reason="stop", cancelled=False)
    return GenerationStats(**{**base, **kw})


def test_generations_feed_spill_restore_and_resident_counts():
    m = Metrics(queued=lambda: 0, running=lambda: 0, restarts=lambda: 0, ready=lambda: True)
    m.worker_ready(2, 100)
    m.observe_generation(stats(spilled_session=True, restored_tokens=7, resident_tokens=50))
    m.observe_generation(stats(restored_tokens=0))  # a restore that had to reset: nothing reused
    m.observe_generation(stats(prompt_tokens=None, cached_tokens=None, completion_tokens=None,
                               finish_reason="error"))  # no done record: resident unchanged
    text = m.render().decode()
    assert "trioserve_session_spills_total 1.0" in text
    assert "trioserve_session_restores_total 1.0" in text
    assert "trioserve_restored_prompt_tokens_total 7.0" in text
    assert "trioserve_kv_cache_usage_ratio 0.25" in text
    assert (m.prefix_queries, m.prefix_hits) == (20, 8)


def test_pool_total_sums_the_workers_and_each_worker_keeps_its_own_state():
    m = Metrics(queued=lambda: 0, running=lambda: 0, restarts=lambda: 0, ready=lambda: True,
                vllm_names=True)
    m.worker_ready(2, 100, worker=0)
    m.worker_ready(2, 100, worker=1)
    m.observe_generation(stats(resident_tokens=150, worker=1))
    m.observe_generation(stats(resident_tokens=50, worker=0))  # does not overwrite worker 1's
    text = m.render().decode()
    assert "trioserve_kv_cache_usage_ratio 0.5" in text  # (50 + 150) / (2 x 2 x 100)
    assert "vllm:kv_cache_usage_perc 0.5" in text
    assert 'trioserve_pool_worker_kv_cache_usage_ratio{worker="0"} 0.25' in text
    assert 'trioserve_pool_worker_kv_cache_usage_ratio{worker="1"} 0.75' in text
    # The layout: blocks and slots summed for the replica, each worker's own per worker.
    assert ('trioserve_cache_config_info{block_size="16",n_ctx="100",num_gpu_blocks="25",'
            'slots="4"} 1.0') in text
    assert ('trioserve_pool_worker_cache_config_info{block_size="16",n_ctx="100",'
            'num_gpu_blocks="13",slots="2",worker="1"} 1.0') in text
    m.worker_ready(2, 100, worker=1)  # worker 1 restarted: it holds nothing, worker 0 still does
    text = m.render().decode()
    assert "trioserve_kv_cache_usage_ratio 0.125" in text
    assert 'trioserve_pool_worker_kv_cache_usage_ratio{worker="1"} 0.0' in text


def test_a_worker_over_its_capacity_counts_as_full_not_more():
    m = Metrics(queued=lambda: 0, running=lambda: 0, restarts=lambda: 0, ready=lambda: True)
    m.worker_ready(1, 100, worker=0)
    m.worker_ready(1, 100, worker=1)
    m.observe_generation(stats(resident_tokens=500, worker=0))  # a bogus report
    assert "trioserve_kv_cache_usage_ratio 0.5" in m.render().decode()


def test_one_worker_is_the_pool_of_one():
    m = Metrics(queued=lambda: 0, running=lambda: 0, restarts=lambda: 0, ready=lambda: True)
    text = m.render().decode()  # before any worker was ready: zero, and no per-worker series
    assert "trioserve_kv_cache_usage_ratio 0.0" in text
    assert 'num_gpu_blocks="0"' in text and "pool_worker_kv_cache_usage_ratio{" not in text
    m.worker_ready(4, 1000)
    m.observe_generation(stats(resident_tokens=1000))
    text = m.render().decode()
    assert "trioserve_kv_cache_usage_ratio 0.25" in text
    assert 'trioserve_pool_worker_kv_cache_usage_ratio{worker="0"} 0.25' in text
