"""WorkerPool's aggregation and routing over stand-in workers (no processes): the pool's
state is the best worker's, routing skips workers that are not serving, one worker is
always chosen when it is the only one. The whole pool over real fake workers is
tests/http/workers/test_worker_pool.py."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from trioserve.worker.pool import PoolWorker, WorkerPool
from trioserve.worker.protocol import GenerateParams
from trioserve.worker.routing import key_order


def worker(index: int, state: str = "ready", *, serving: bool | None = None, busy: int = 0,
           capacity: int = 4, restarts: int = 0, public_reason: str = "") -> PoolWorker:
    runtime = SimpleNamespace(serving=state == "ready" if serving is None else serving,
                              in_flight=busy, queued=0, capacity=capacity, dispatched=0)
    supervisor = SimpleNamespace(state=state, restarts=restarts, reason="", fatal=trio.Event(),
                                 public_reason=public_reason)
    return PoolWorker(index, runtime, supervisor)  # type: ignore[arg-type]


def test_state_is_the_best_workers_and_counters_are_totals():
    pool = WorkerPool([worker(0, "unavailable", public_reason="crash loop"),
                       worker(1, "loading", public_reason="restarting", restarts=2),
                       worker(2, "ready", busy=3)])
    assert pool.state == "ready" and pool.in_flight == 3 and pool.restarts == 2
    pool.workers[2].supervisor.state = "unavailable"
    pool.workers[2].supervisor.public_reason = "restarts disabled"
    assert pool.state == "loading" and pool.public_reason == "restarting"
    pool.workers[1].supervisor.state = "unavailable"
    pool.workers[1].supervisor.public_reason = "crash loop"  # as Supervisor sets them together
    assert pool.state == "unavailable" and pool.public_reason == "unavailable"
    health = pool.health()
    assert [h["status"] for h in health] == ["unavailable"] * 3
    assert all(h["reason"] == "unavailable" for h in health)


def test_keyed_requests_skip_workers_that_are_not_serving():
    pool = WorkerPool([worker(i) for i in range(3)])
    key = "some-session"
    order = key_order(key, 3)
    assert pool.key_worker(key).index == order[0]
    pool.workers[order[0]].runtime.serving = False
    assert pool.key_worker(key).index == order[1]
    for w in pool.workers:
        w.runtime.serving = False
    assert pool.key_worker(key).index == order[0]  # it refuses with worker_unavailable


def test_anonymous_requests_go_to_the_least_loaded_serving_worker():
    pool = WorkerPool([worker(0, busy=1), worker(1, busy=3), worker(2, "loading")])
    assert pool.route(GenerateParams(prompt="hi")).index == 0
    pool.workers[0].runtime.in_flight = 4
    assert pool.route(GenerateParams(prompt="hi")).index == 1


def test_one_worker_is_always_the_one():
    pool = WorkerPool([worker(0, busy=9, capacity=1)])
    assert pool.route(GenerateParams(prompt="x")).index == 0
    assert pool.route(GenerateParams(prompt="x", session_id="k")).index == 0
    pool.workers[0].runtime.serving = False
    assert pool.route(GenerateParams(prompt="x")).index == 0
