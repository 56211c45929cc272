"""ModelLifecycle (trioserve/worker/lifecycle.py) under Trio's MockClock with a scripted loader:
loads on demand, one load shared by its waiters, least-recently-used unloads within the memory
budget (and never of a model in use or pinned), refusals of models that cannot fit, failed and
crashed models that touch no other, bounded and cancellable waits, idle unloads, admin unloads.

The loader records every model's resident span (load start → stop end), so each test can check
that the memory of the models alive together never exceeded the budget."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import trio

from trioserve.errors import APIError
from trioserve.worker.lifecycle import FAILED_LOAD_BACKOFF_S, ModelLifecycle
from trioserve.worker.model_loader import CostEstimate, LoadOutcome, Loaded, ModelPolicy

MiB = 1 << 20


@dataclass
class Script:
    """How one model behaves: load and stop durations, estimated and measured cost, failures."""

    cost: int = 100 * MiB
    estimate: int | None = None  # default: the cost
    weights: int | None = None  # what it takes at least before measured; default: the estimate
    load_s: float = 1.0
    stop_s: float = 0.5
    fail_loads: int = 0  # the next N loads raise before serving
    crash_after_s: float | None = None  # the model stops on its own this long after serving


@dataclass
class ScriptedLoader:
    scripts: dict[str, Script]
    loads: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    resident: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    versions: dict[str, int] = field(default_factory=dict)  # a model's files, as identity

    def identity(self, model_id: str) -> object:
        return self.versions.get(model_id, 0)

    def estimate(self, model_id: str) -> CostEstimate:
        script = self.scripts[model_id]
        expected = script.cost if script.estimate is None else script.estimate
        return CostEstimate(expected, expected if script.weights is None else script.weights)

    async def run(self, model_id: str, *, task_status: trio.TaskStatus[Loaded[str]]) -> None:
        script = self.scripts[model_id]
        self.loads.append(model_id)
        assert model_id not in self.resident, "a model loaded twice at once"
        self.resident[model_id] = script.cost
        self.peak = max(self.peak, sum(self.resident.values()))
        try:
            await trio.sleep(script.load_s)
            if script.fail_loads:
                script.fail_loads -= 1
                raise RuntimeError(f"{model_id}: worker exited with status 1")
            task_status.started(Loaded(f"handle:{model_id}", script.cost))
            if script.crash_after_s is None:
                await trio.sleep_forever()
            await trio.sleep(script.crash_after_s)
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(script.stop_s)
            del self.resident[model_id]
            self.stops.append(model_id)


@dataclass
class Recorded:
    loads: list[LoadOutcome] = field(default_factory=list)
    unloads: list[tuple[str, str]] = field(default_factory=list)


def lifecycle(scripts: dict[str, Script], *, budget: int | None = None,
              policies: dict[str, ModelPolicy] | None = None, load_timeout: float = 60.0,
              idle_unload_s: float = 0.0, busy: set[str] | None = None,
              ) -> tuple[ModelLifecycle[str], ScriptedLoader, Recorded]:
    loader = ScriptedLoader(scripts)
    recorded = Recorded()
    policies = policies or {}
    manager = ModelLifecycle(loader, {m: policies.get(m, ModelPolicy()) for m in scripts},
                             budget_bytes=budget, load_timeout=load_timeout,
                             idle_unload_s=idle_unload_s, on_load=recorded.loads.append,
                             on_unload=lambda m, reason: recorded.unloads.append((m, reason)),
                             busy=lambda handle: handle in (busy or set()))
    return manager, loader, recorded


async def use(manager: ModelLifecycle[str], model_id: str, hold_s: float = 0.0) -> str:
    async with manager.lease(model_id) as handle:
        await trio.sleep(hold_s)
        return handle


async def use_quietly(manager: ModelLifecycle[str], model_id: str) -> None:
    """A background client whose refusal the test does not look at."""
    try:
        await use(manager, model_id)
    except APIError:
        pass


async def expect_error(manager: ModelLifecycle[str], model_id: str) -> APIError:
    with pytest.raises(APIError) as info:
        await use(manager, model_id)
    return info.value


async def test_a_lease_loads_on_demand_and_later_leases_enter_at_once(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(load_s=3.0)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        assert manager.state("a") == "not_loaded"
        start = trio.current_time()
        assert await use(manager, "a") == "handle:a"
        assert trio.current_time() - start == pytest.approx(3.0)
        assert manager.state("a") == "loaded"
        start = trio.current_time()
        assert await use(manager, "a") == "handle:a"
        assert trio.current_time() == start  # no wait, no second load
        assert loader.loads == ["a"]
        assert [(o.model_id, o.reason, o.outcome) for o in recorded.loads] == [("a", "demand", "loaded")]
        assert recorded.loads[0].seconds == pytest.approx(3.0)
        await manager.stop()
    assert loader.stops == ["a"] and recorded.unloads == [("a", "shutdown")]


async def test_concurrent_leases_share_one_load_and_are_counted_as_waiting(autojump_clock):
    manager, loader, _ = lifecycle({"a": Script(load_s=2.0)})
    handles: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)

        async def client() -> None:
            handles.append(await use(manager, "a"))

        for _ in range(3):
            nursery.start_soon(client)
        await trio.sleep(1.0)
        assert manager.state("a") == "loading" and manager.waiting == 3
        await trio.sleep(1.5)
        assert handles == ["handle:a"] * 3 and manager.waiting == 0
        assert loader.loads == ["a"]
        nursery.cancel_scope.cancel()


async def test_budget_for_one_model_unloads_the_idle_one_before_loading_the_other(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(), "b": Script()}, budget=150 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        for model in ["a", "b", "a", "b"]:
            assert await use(manager, model, hold_s=0.2) == f"handle:{model}"
        assert loader.loads == ["a", "b", "a", "b"]
        assert loader.stops == ["a", "b", "a"]
        assert loader.peak <= 150 * MiB  # the next load started only once the last one stopped
        assert [u for u in recorded.unloads] == [("a", "lru"), ("b", "lru"), ("a", "lru")]
        nursery.cancel_scope.cancel()


async def test_least_recently_used_idle_model_goes_first(autojump_clock):
    scripts = {m: Script() for m in "abc"}
    manager, loader, _ = lifecycle(scripts, budget=250 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        await use(manager, "b")
        await use(manager, "a")  # b is now the least recently used
        await use(manager, "c")
        assert loader.stops == ["b"]
        assert {m: manager.state(m) for m in "abc"} == {"a": "loaded", "b": "not_loaded", "c": "loaded"}
        nursery.cancel_scope.cancel()


async def test_a_model_with_a_request_in_flight_is_never_unloaded_for_another(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(), "b": Script()}, budget=150 * MiB)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)

        async def long_a() -> None:
            async with manager.lease("a"):
                order.append("a in")
                await trio.sleep(10)
                order.append("a out")

        async def b() -> None:
            await use(manager, "b")
            order.append("b in")

        nursery.start_soon(long_a)
        await trio.sleep(2)
        nursery.start_soon(b)
        await trio.sleep(5)
        assert manager.state("a") == "loaded" and manager.state("b") == "loading"
        assert loader.loads == ["a"]  # b waits for memory, it has not started
        await trio.sleep(10)
        assert order == ["a in", "a out", "b in"]
        assert loader.peak <= 150 * MiB and ("a", "lru") in recorded.unloads
        nursery.cancel_scope.cancel()


async def test_waiting_for_memory_is_bounded_and_names_the_models_in_use(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(), "b": Script()}, budget=150 * MiB,
                                          load_timeout=20)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        nursery.start_soon(use, manager, "a", 100)
        await trio.sleep(5)
        start = trio.current_time()
        error = await expect_error(manager, "b")
        assert trio.current_time() - start == pytest.approx(20)
        assert (error.status, error.code) == (503, "model_memory_busy")
        assert "'a'" in error.message and int(error.headers["Retry-After"]) >= 1
        await trio.sleep(0.1)  # the load's own deadline is this same moment: let it end
        assert loader.loads == ["a"] and manager.state("b") == "not_loaded"
        assert recorded.loads[-1].model_id == "b" and recorded.loads[-1].outcome == "timeout"
        nursery.cancel_scope.cancel()


async def test_pinned_model_is_loaded_at_start_and_never_unloaded(autojump_clock):
    scripts = {"p": Script(cost=50 * MiB), "a": Script(), "b": Script()}
    manager, loader, recorded = lifecycle(scripts, budget=160 * MiB, idle_unload_s=5,
                                          policies={"p": ModelPolicy(pinned=True)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await trio.sleep(2)
        assert manager.state("p") == "loaded" and loader.loads == ["p"]
        for model in ["a", "b", "a", "b"]:
            await use(manager, model)
        await trio.sleep(60)  # idle unload applies to a and b, never to p
        assert "p" not in loader.stops and manager.state("p") == "loaded"
        assert ("b", "idle") in recorded.unloads
        with pytest.raises(APIError) as info:
            await manager.unload("p")
        assert (info.value.status, info.value.code) == (409, "model_pinned")
        nursery.cancel_scope.cancel()


async def test_model_too_large_alone_is_refused_without_loading(autojump_clock):
    manager, loader, recorded = lifecycle({"big": Script(cost=300 * MiB), "a": Script()},
                                          budget=200 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        error = await expect_error(manager, "big")
        assert (error.status, error.code, error.param) == (507, "model_too_large", "model")
        assert "300 MiB" in error.message and "200 MiB" in error.message
        assert "Retry-After" not in error.headers
        assert loader.loads == ["a"] and manager.state("a") == "loaded"  # nothing evicted for it
        assert recorded.loads[-1].outcome == "too_large"
        nursery.cancel_scope.cancel()


async def test_model_that_fits_only_without_the_pinned_ones_is_refused(autojump_clock):
    scripts = {"p": Script(cost=120 * MiB), "a": Script(cost=100 * MiB)}
    manager, loader, _ = lifecycle(scripts, budget=200 * MiB, policies={"p": ModelPolicy(pinned=True)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        error = await expect_error(manager, "a")
        assert error.code == "model_too_large" and "pinned" in error.message
        assert loader.loads == ["p"]
        nursery.cancel_scope.cancel()


async def test_measured_cost_over_the_budget_is_refused_after_the_load_and_remembered(autojump_clock):
    manager, loader, _ = lifecycle({"a": Script(cost=300 * MiB, estimate=100 * MiB)}, budget=200 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        error = await expect_error(manager, "a")
        assert error.code == "model_too_large" and "300 MiB" in error.message
        assert manager.state("a") == "unloading"
        await trio.sleep(1)
        assert manager.state("a") == "not_loaded" and loader.stops == ["a"]
        error = await expect_error(manager, "a")  # refused at once: its cost is known now
        assert error.code == "model_too_large" and loader.loads == ["a"]
        nursery.cancel_scope.cancel()


async def test_an_unmeasured_estimate_over_the_budget_takes_the_whole_budget(autojump_clock):
    # The KV part of an estimate may be an upper bound: only the weights refuse a model unmeasured.
    scripts = {"a": Script(), "kv": Script(cost=150 * MiB, estimate=400 * MiB, weights=50 * MiB)}
    manager, loader, _ = lifecycle(scripts, budget=300 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        assert await use(manager, "kv") == "handle:kv"
        assert loader.stops == ["a"]  # every idle model made room for the unmeasured load
        assert manager.used_bytes == 150 * MiB  # then its measured cost counts
        await use(manager, "a")  # and a fits beside it
        assert loader.stops == ["a"]
        nursery.cancel_scope.cancel()


async def test_a_model_busy_outside_its_leases_is_not_unloaded(autojump_clock):
    busy: set[str] = set()
    manager, loader, _ = lifecycle({"a": Script(), "b": Script()}, budget=150 * MiB, busy=busy)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        busy.add("handle:a")  # a response still streams after its lease ended
        done = trio.Event()

        async def b() -> None:
            await use(manager, "b")
            done.set()

        nursery.start_soon(b)
        await trio.sleep(10)
        assert not done.is_set() and loader.stops == []
        busy.clear()
        manager.notify("a")  # the stream ended
        await done.wait()
        assert loader.stops == ["a"]
        nursery.cancel_scope.cancel()


async def test_measured_cost_replaces_the_estimate(autojump_clock):
    scripts = {"a": Script(cost=80 * MiB, estimate=150 * MiB), "b": Script(cost=80 * MiB)}
    manager, loader, _ = lifecycle(scripts, budget=200 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        await use(manager, "b")  # 80 + 80 fit; by the estimate a would have had to go
        assert loader.stops == [] and manager.used_bytes == 160 * MiB
        nursery.cancel_scope.cancel()


async def test_failed_load_fails_its_waiters_and_a_request_after_the_backoff_retries(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(fail_loads=1), "b": Script()})
    errors: list[APIError] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "b")

        async def client() -> None:
            try:
                await use(manager, "a")
            except APIError as exc:
                errors.append(exc)

        nursery.start_soon(client)
        nursery.start_soon(client)
        await trio.sleep(3)
        # Not to be retried blindly: 500, and the SDKs' x-should-retry header says no.
        assert [(e.status, e.code) for e in errors] == [(500, "model_load_failed")] * 2
        assert errors[0].headers == {"x-should-retry": "false"}
        assert "status 1" in errors[0].message
        assert manager.state("a") == "not_loaded" and manager.state("b") == "loaded"
        assert manager.failure("a") is not None and "status 1" in manager.failure("a")
        await trio.sleep(FAILED_LOAD_BACKOFF_S)
        assert await use(manager, "a") == "handle:a"  # a new load, once the backoff is over
        assert manager.failure("a") is None
        assert loader.loads == ["b", "a", "a"] and "b" not in loader.stops
        assert [o.outcome for o in recorded.loads if o.model_id == "a"] == ["failed", "loaded"]
        nursery.cancel_scope.cancel()


async def test_a_model_that_stops_on_its_own_touches_no_other_and_reloads(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(crash_after_s=5), "b": Script()})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        async with manager.lease("b"):
            await trio.sleep(10)  # a stops meanwhile; b's lease is undisturbed
            assert manager.state("a") == "not_loaded" and manager.state("b") == "loaded"
        assert ("a", "failed") in recorded.unloads and manager.snapshot()[0].last_error
        assert await use(manager, "a") == "handle:a"
        assert loader.loads == ["a", "b", "a"]
        nursery.cancel_scope.cancel()


async def test_a_cancelled_waiter_leaves_and_the_started_load_completes(autojump_clock):
    manager, loader, _ = lifecycle({"a": Script(load_s=10)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        with trio.move_on_after(2):  # the client disconnects while the model loads
            await use(manager, "a")
        assert manager.waiting == 0 and manager.state("a") == "loading"
        await trio.sleep(10)
        assert manager.state("a") == "loaded" and loader.loads == ["a"]
        nursery.cancel_scope.cancel()


async def test_a_load_waiting_for_memory_is_abandoned_when_its_only_waiter_leaves(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(), "b": Script()}, budget=150 * MiB)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        nursery.start_soon(use, manager, "a", 30)
        await trio.sleep(2)
        with trio.move_on_after(5):
            await use(manager, "b")
        await trio.sleep(0.1)
        assert manager.state("b") == "not_loaded"
        assert recorded.loads[-1].outcome == "abandoned"
        await trio.sleep(40)  # a became idle later: nothing unloads it for the abandoned load
        assert loader.loads == ["a"] and manager.state("a") == "loaded"
        nursery.cancel_scope.cancel()


async def test_a_load_slower_than_the_timeout_fails_and_frees_its_memory(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(load_s=100)}, budget=150 * MiB,
                                          load_timeout=30)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        nursery.start_soon(use_quietly, manager, "a")  # its own deadline meets the load's
        await trio.sleep(10)
        error = await expect_error(manager, "a")  # a later waiter sees the load's failure
        # At the load's deadline (30 s), once the loader's bounded stop (0.5 s) is over.
        assert (error.code, trio.current_time()) == ("model_load_failed", pytest.approx(30.5))
        assert "did not load within 30 s" in error.message
        assert manager.state("a") == "not_loaded" and manager.used_bytes == 0
        assert loader.stops == ["a"] and recorded.loads[-1].outcome == "timeout"
        nursery.cancel_scope.cancel()


async def test_a_later_waiter_fails_at_the_loads_deadline_not_its_own(autojump_clock):
    manager, _, _ = lifecycle({"a": Script(load_s=50)}, load_timeout=40)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        nursery.start_soon(use_quietly, manager, "a")  # starts the load at t=0 (deadline t=40)
        await trio.sleep(20)
        start = trio.current_time()
        with pytest.raises(APIError) as info:  # this waiter's deadline: t=60, after the load's
            await use(manager, "a")
        # The load's deadline (t=40) plus its bounded stop (0.5 s), before this waiter's own.
        assert info.value.code == "model_load_failed"
        assert trio.current_time() - start == pytest.approx(20.5)
        nursery.cancel_scope.cancel()


async def test_idle_models_unload_after_the_idle_time_but_not_while_in_use(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script()}, idle_unload_s=30)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        async with manager.lease("a"):
            await trio.sleep(100)  # in use all along: not idle
            assert manager.state("a") == "loaded"
        await trio.sleep(20)
        await use(manager, "a")  # used again: the idle time starts over
        await trio.sleep(29)
        assert manager.state("a") == "loaded"
        await trio.sleep(2)
        assert manager.state("a") in ("unloading", "not_loaded")
        await trio.sleep(1)
        assert manager.state("a") == "not_loaded" and recorded.unloads == [("a", "idle")]
        assert await use(manager, "a") == "handle:a" and loader.loads == ["a", "a"]
        nursery.cancel_scope.cancel()


async def test_idle_unload_zero_never_unloads(autojump_clock):
    manager, loader, _ = lifecycle({"a": Script()}, idle_unload_s=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        await trio.sleep(10_000)
        assert manager.state("a") == "loaded" and loader.stops == []
        nursery.cancel_scope.cancel()


async def test_admin_unload_refuses_a_model_in_use_and_waits_for_the_stop(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(stop_s=3)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        assert await manager.load("a") == "loaded"
        async with manager.lease("a"):
            with pytest.raises(APIError) as info:
                await manager.unload("a")
            assert (info.value.status, info.value.code) == (409, "model_busy")
        start = trio.current_time()
        assert await manager.unload("a") == "not_loaded"
        assert trio.current_time() - start == pytest.approx(3) and loader.stops == ["a"]
        assert recorded.unloads == [("a", "admin")]
        assert await manager.unload("a") == "not_loaded"  # not loaded: nothing to do
        nursery.cancel_scope.cancel()


async def test_a_lease_during_an_unload_waits_for_it_and_loads_again(autojump_clock):
    manager, loader, _ = lifecycle({"a": Script(stop_s=4, load_s=1)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        nursery.start_soon(manager.unload, "a")
        await trio.sleep(1)
        assert manager.state("a") == "unloading"
        start = trio.current_time()
        assert await use(manager, "a") == "handle:a"
        assert trio.current_time() - start == pytest.approx(3 + 1)
        assert loader.loads == ["a", "a"]
        nursery.cancel_scope.cancel()


async def test_preloaded_models_start_loading_at_startup(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(), "b": Script()},
                                          policies={"a": ModelPolicy(preload=True)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await trio.sleep(2)
        assert manager.state("a") == "loaded" and manager.state("b") == "not_loaded"
        assert recorded.loads[0].reason == "preload"
        nursery.cancel_scope.cancel()


def test_pinned_models_that_exceed_the_budget_together_are_a_startup_error():
    scripts = {"p": Script(cost=100 * MiB), "q": Script(cost=100 * MiB)}
    pinned = {"p": ModelPolicy(pinned=True), "q": ModelPolicy(pinned=True)}
    lifecycle(scripts, budget=200 * MiB, policies=pinned)[0].check_pinned_fit()
    with pytest.raises(ValueError, match="pinned models .p, q."):
        lifecycle(scripts, budget=150 * MiB, policies=pinned)[0].check_pinned_fit()


async def test_unknown_model_is_model_not_found(autojump_clock):
    manager, _, _ = lifecycle({"a": Script()})
    with pytest.raises(APIError) as info:
        await use(manager, "nope")
    assert (info.value.status, info.value.code) == (404, "model_not_found")


async def test_unlimited_budget_never_unloads_for_memory(autojump_clock):
    manager, loader, _ = lifecycle({m: Script(cost=10 << 40) for m in "abc"}, budget=None)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        for model in "abc":
            await use(manager, model)
        assert loader.stops == [] and manager.used_bytes == 30 << 40
        nursery.cancel_scope.cancel()


async def test_stop_unloads_every_model_and_refuses_new_leases(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(), "b": Script(load_s=100)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await use(manager, "a")
        waiter = trio.Event()
        errors: list[APIError] = []

        async def wait_for_b() -> None:
            try:
                await use(manager, "b")
            except APIError as exc:
                errors.append(exc)
            waiter.set()

        nursery.start_soon(wait_for_b)
        await trio.sleep(1)
        await manager.stop()
        await waiter.wait()
        assert sorted(loader.stops) == ["a", "b"] and errors[0].code == "worker_unavailable"
        assert ("a", "shutdown") in recorded.unloads
        assert math.isclose(manager.used_bytes, 0)
        with pytest.raises(APIError):
            await use(manager, "a")


async def test_a_failed_load_is_backed_off_until_its_files_change_or_the_time_is_over(autojump_clock):
    manager, loader, recorded = lifecycle({"a": Script(fail_loads=3)})
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        first = await expect_error(manager, "a")
        assert loader.loads == ["a"] and "status 1" in first.message
        for _ in range(10):  # a client retrying within the backoff: no load starts
            again = await expect_error(manager, "a")
            assert (again.status, again.code) == (500, "model_load_failed")
            assert "status 1" in again.message
            await trio.sleep(FAILED_LOAD_BACKOFF_S / 20)
        assert loader.loads == ["a"]
        assert [o.outcome for o in recorded.loads] == ["failed"]
        loader.versions["a"] = 1  # the file changed on disk: tried again at once
        await expect_error(manager, "a")
        assert loader.loads == ["a", "a"]
        # The second consecutive failure doubles the backoff.
        await trio.sleep(FAILED_LOAD_BACKOFF_S * 1.5)
        await expect_error(manager, "a")
        assert loader.loads == ["a", "a"]
        await trio.sleep(FAILED_LOAD_BACKOFF_S)
        await expect_error(manager, "a")  # its third failure
        assert loader.loads == ["a", "a", "a"]
        assert await manager.load("a") == "loaded"  # an admin load always tries
        assert loader.loads == ["a", "a", "a", "a"] and manager.failure("a") is None
        nursery.cancel_scope.cancel()
