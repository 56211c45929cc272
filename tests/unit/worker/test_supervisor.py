"""Supervisor restart policy and health states, with a scripted spawn (MockClock, no processes)."""

from __future__ import annotations

import errno
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio

from trioserve.worker.runtime import GenerateParams, SessionRuntime
from trioserve.worker.supervisor import RestartPolicy, RestartTracker, Supervisor
from trioserve.worker.protocol import WorkerError

from tests.fakes.worker_client import FakeWorkerClient, settle

# -- the pure policy --------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap():
    tracker = RestartTracker(RestartPolicy(backoff_initial=0.5, backoff_max=3, max_crashes=100))
    delays = [tracker.failure(at=float(i), served_for=None) for i in range(6)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_backoff_starts_over_after_a_healthy_period():
    tracker = RestartTracker(RestartPolicy(backoff_initial=0.5, healthy_after=60, max_crashes=100))
    assert [tracker.failure(at=t, served_for=1) for t in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert tracker.failure(at=70, served_for=60) == 0.5  # served a full healthy period
    assert tracker.failure(at=71, served_for=59.9) == 1.0


def test_backoff_starts_over_once_the_crash_window_passed():
    tracker = RestartTracker(RestartPolicy(backoff_initial=0.5, crash_window=60, max_crashes=100))
    assert [tracker.failure(at=t, served_for=None) for t in (0, 1, 2)] == [0.5, 1.0, 2.0]
    assert tracker.failure(at=62, served_for=None) == 0.5


def test_crash_loop_counts_failures_inside_the_window_only():
    tracker = RestartTracker(RestartPolicy(max_crashes=3, crash_window=60, healthy_after=1e9))
    assert tracker.failure(at=0, served_for=None) is not None
    assert tracker.failure(at=10, served_for=None) is not None
    assert tracker.failure(at=65, served_for=None) is not None  # the one at 0 left the window
    assert tracker.failure(at=66, served_for=None) is None  # 10, 65, 66


# -- the supervisor with a scripted spawn --------------------------------------------------


class ScriptedSpawn:
    """Stands in for WorkerClient.spawn. Each call takes the next outcome: an exception to
    raise, or ``(FakeWorkerClient, lifetime)``: a worker that exits ``lifetime`` s after it
    became ready (None: serves until stopped)."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.times: list[float] = []

    async def __call__(self, argv, *, nursery: trio.Nursery, env, ready_timeout) -> FakeWorkerClient:
        self.times.append(trio.current_time())
        outcome = self.outcomes.pop(0) if self.outcomes else (FakeWorkerClient(auto_pong=True), None)
        if isinstance(outcome, BaseException):
            raise outcome
        fake, lifetime = outcome
        if lifetime is not None:
            async def die() -> None:
                await trio.sleep(lifetime)
                fake.exit()
            nursery.start_soon(die)
        return fake

    def gaps(self) -> list[float]:
        return [round(b - a, 6) for a, b in zip(self.times, self.times[1:])]


@asynccontextmanager
async def limited_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery under a virtual-time limit: a wait that never ends fails instead of hanging."""
    with trio.fail_after(10_000):
        async with trio.open_nursery() as nursery:
            yield nursery


def emfile() -> WorkerError:
    return WorkerError(f"cannot create the cancel pipe: {OSError(errno.EMFILE, 'Too many open files')}")


def make_supervisor(spawn: ScriptedSpawn, **policy: Any) -> Supervisor:
    runtime = SessionRuntime(health_interval=1e9)
    return Supervisor(["worker"], runtime, spawn=spawn, policy=RestartPolicy(**policy))


async def test_spawn_failures_are_retried_with_loading_restarting_health(autojump_clock):
    spawn = ScriptedSpawn(emfile(), emfile())
    sup = make_supervisor(spawn, backoff_initial=0.5)
    async with limited_nursery() as nursery:
        await nursery.start(sup.run)
        await settle()
        assert (sup.state, sup.public_reason) == ("loading", "restarting")
        assert "Too many open files" in sup.reason  # detail stays internal
        await trio.sleep(0.3)
        assert (sup.state, sup.public_reason) == ("loading", "restarting")
        await trio.sleep(2)
        assert (sup.state, sup.public_reason) == ("ready", "")
        assert sup.restarts == 2 and spawn.gaps() == [0.5, 1.0]
        assert not sup.fatal.is_set()
        await sup.stop()
    assert (sup.state, sup.public_reason) == ("unavailable", "shutting down")


async def test_health_stays_loading_while_the_failed_worker_is_being_stopped(autojump_clock):
    dying = FakeWorkerClient(stop_delay=1.5)
    spawn = ScriptedSpawn((dying, 5.0))
    sup = make_supervisor(spawn)
    async with limited_nursery() as nursery:
        await nursery.start(sup.run)
        await trio.sleep(5.1)  # the worker exited at 5.0; its stop takes until 6.5
        assert dying.stopped_with is not None
        assert (sup.state, sup.public_reason) == ("loading", "restarting")
        assert "closed its stdout" in sup.reason
        await trio.sleep(2)
        assert sup.state == "ready" and sup.restarts == 1
        nursery.cancel_scope.cancel()


async def test_backoff_resets_after_a_worker_served_a_healthy_period(autojump_clock):
    spawn = ScriptedSpawn((FakeWorkerClient(), 1), (FakeWorkerClient(), 1), (FakeWorkerClient(), 1),
                          (FakeWorkerClient(), 61), (FakeWorkerClient(), 1))
    sup = make_supervisor(spawn, backoff_initial=0.5, healthy_after=60, crash_window=1000, max_crashes=100)
    async with limited_nursery() as nursery:
        await nursery.start(sup.run)
        while len(spawn.times) < 6:
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    # Each gap is the worker's life plus the backoff that followed its failure.
    assert spawn.gaps() == [1 + 0.5, 1 + 1.0, 1 + 2.0, 61 + 0.5, 1 + 1.0]


async def test_crash_loop_gives_up_with_a_public_reason(autojump_clock):
    spawn = ScriptedSpawn(*[emfile() for _ in range(10)])
    sup = make_supervisor(spawn, max_crashes=3)
    async with limited_nursery() as nursery:
        nursery.start_soon(sup.run)
        with trio.fail_after(100):
            await sup.fatal.wait()
    assert (sup.state, sup.public_reason) == ("unavailable", "crash loop")
    assert "crash loop: 3 worker failures" in sup.reason
    assert sup.restarts == 2


async def test_restarts_disabled_gives_up_at_the_first_failure(autojump_clock):
    sup = make_supervisor(ScriptedSpawn(emfile()), restart=False)
    async with limited_nursery() as nursery:
        nursery.start_soon(sup.run)
        await sup.fatal.wait()
    assert (sup.state, sup.public_reason) == ("unavailable", "restarts disabled")


async def test_hung_worker_is_stopped_without_waiting_for_an_orderly_exit(autojump_clock):
    hung = FakeWorkerClient(capacity=1)
    sup = Supervisor(["worker"], SessionRuntime(cancel_grace=1.0, health_interval=1e9),
                     spawn=ScriptedSpawn((hung, None)))
    async with limited_nursery() as nursery:
        await nursery.start(sup.run)
        await settle()
        gen = sup.runtime.submit(GenerateParams(prompt="p"))
        await settle()
        gen.cancel()  # never answered
        while hung.stopped_with is None:
            await trio.sleep(0.1)
        assert hung.stopped_with["exit_wait"] == 0
        assert sup.public_reason == "restarting"
        nursery.cancel_scope.cancel()
