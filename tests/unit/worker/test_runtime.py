"""SessionRuntime against an in-memory worker (fakes.worker_client.FakeWorkerClient) on Trio's
MockClock with autojump: admission, routing, cancellation, deadlines and failures.

Deadlines are checked in virtual time (the clock only moves when every task is blocked),
so "nothing happened before the deadline" is exact, not a wall-clock guess. Every test
takes the ``autojump_clock`` fixture: pytest-trio installs a clock only for a test that
names it as an argument.
"""

from __future__ import annotations


import pytest
import trio

from trioserve.worker.runtime import GATHER_WINDOW, GenerateParams, Generation, GenerationError, SessionRuntime
from trioserve.worker.protocol import (
    Ping,
    Pong,
    ProtocolViolation,
    SessionOpen,
    Tokenize,
    Tokens,
    WorkerExited,
    WorkerHung,
)

from tests.fakes.worker_client import FakeWorkerClient, Serving, done, error, serving, settle, token



VIRTUAL_LIMIT = 10_000


def params(prompt: str = "p", **kw) -> GenerateParams:
    return GenerateParams(prompt=prompt, **kw)


async def collect(gen: Generation) -> str:
    return "".join([piece async for piece in gen])


async def failure_of(gen: Generation) -> GenerationError:
    with pytest.raises(GenerationError) as info:
        await collect(gen)
    return info.value


# -- admission ---------------------------------------------------------------------------


async def test_no_worker_means_worker_unavailable(autojump_clock):
    runtime = SessionRuntime()
    with pytest.raises(GenerationError) as info:
        runtime.submit(params())
    assert info.value.code == "worker_unavailable" and info.value.retryable


async def test_generates_are_sent_up_to_capacity_without_waiting_for_results(autojump_clock):
    async with serving(FakeWorkerClient(capacity=3)) as s:
        gens = [s.runtime.submit(params(f"p{i}")) for i in range(5)]
        await settle()
        assert [r["prompt"] for r in s.fake.generates()] == ["p0", "p1", "p2"]
        assert (s.runtime.in_flight, s.runtime.queued) == (3, 2)
        assert [g.request_id for g in gens[:3]] == [1, 2, 3]
        # A terminal record frees one slot; the oldest queued generation takes it (FIFO).
        s.fake.emit(done(2))
        await settle()
        assert [r["prompt"] for r in s.fake.generates()] == ["p0", "p1", "p2", "p3"]
        assert gens[3].request_id == 4 and gens[4].request_id is None


async def test_idle_worker_waits_for_arriving_requests_then_gets_the_burst_together(autojump_clock):
    async with serving(FakeWorkerClient(capacity=4)) as s:
        with s.runtime.arrival() as late:  # a second request is still being received
            t0 = trio.current_time()
            with s.runtime.arrival() as mine:
                first = s.runtime.submit(params("p0"), arrival=mine)
            await trio.sleep(0.004)
            assert s.fake.generates() == []  # held: the worker is idle and p1 is on its way
            s.runtime.submit(params("p1"), arrival=late)
            await settle()
            assert [r["prompt"] for r in s.fake.generates()] == ["p0", "p1"]  # FIFO, back to back
            assert trio.current_time() - t0 == pytest.approx(0.004)
            assert first.request_id == 1


async def test_the_wait_for_arriving_requests_is_bounded_and_only_when_idle(autojump_clock):
    async with serving(FakeWorkerClient(capacity=4)) as s:
        with s.runtime.arrival():  # a request that never submits (e.g. its body never came)
            t0 = trio.current_time()
            s.runtime.submit(params("p0"))
            while not s.fake.generates():
                await trio.sleep(0.001)
            assert trio.current_time() - t0 == pytest.approx(GATHER_WINDOW, abs=0.0015)
            # The worker is busy now: the next one goes at once, arrivals or not.
            t1 = trio.current_time()
            s.runtime.submit(params("p1"))
            await settle()
            assert [r["prompt"] for r in s.fake.generates()] == ["p0", "p1"]
            assert trio.current_time() == t1
        # A lone request (no other arrival open) is never held.
        s.fake.emit(done(1))
        s.fake.emit(done(2))
        await settle()
        t2 = trio.current_time()
        with s.runtime.arrival() as mine:
            s.runtime.submit(params("p2"), arrival=mine)
            await settle()
        assert [r["prompt"] for r in s.fake.generates()][-1] == "p2" and trio.current_time() == t2


async def test_queue_full_is_server_busy_and_admits_again_after_a_slot_frees(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1), queue_depth=1) as s:
        first = s.runtime.submit(params())
        s.runtime.submit(params())  # waits
        with pytest.raises(GenerationError) as info:
            s.runtime.submit(params())
        assert info.value.code == "server_busy" and info.value.retryable
        await settle()
        s.fake.emit(done(first.request_id))
        await settle()
        s.runtime.submit(params())  # the waiting one runs now, so the queue has room


async def test_queue_depth_zero_admits_while_slots_are_free(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2), queue_depth=0) as s:
        s.runtime.submit(params())
        s.runtime.submit(params())  # not yet dispatched: still counts against the slots
        with pytest.raises(GenerationError) as info:
            s.runtime.submit(params())
        assert info.value.code == "server_busy"
        await settle()
        assert len(s.fake.generates()) == 2


async def test_request_that_cannot_be_encoded_fails_alone_and_sends_nothing(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1, max_line_bytes=200)) as s:
        with pytest.raises(GenerationError) as info:
            s.runtime.submit(params("bad \ud800 text"))
        assert info.value.code == "invalid_unicode" and not info.value.retryable
        assert info.value.details["field"] == "prompt"
        with pytest.raises(GenerationError) as info:
            s.runtime.submit(params("x" * 300))
        assert info.value.code == "line_too_long"
        ok = s.runtime.submit(params("fine"))
        await settle()
        s.fake.emit(token(1, "yes"), done(1))
        assert await collect(ok) == "yes"
        assert [r["id"] for r in s.fake.sent] == [1]
        assert s.failure is None


# -- routing -----------------------------------------------------------------------------


async def test_interleaved_records_are_routed_by_id(autojump_clock):
    async with serving(FakeWorkerClient(capacity=3)) as s:
        gens = [s.runtime.submit(params()) for _ in range(3)]
        await settle()
        s.fake.emit(token(1, "a"), token(2, "x"), token(3, "1"), token(1, "b"), done(2),
                    token(3, "2"), token(1, "c"), done(1), token(3, "3"), done(3, finish_reason="length"))
        texts = [await collect(g) for g in gens]
        assert texts == ["abc", "x", "123"]
        assert [g.done.finish_reason for g in gens] == ["stop", "stop", "length"]
        assert [r["id"] for r in s.runtime.history] == [2, 1, 3]


async def test_slow_consumer_gets_coalesced_text_and_never_blocks_the_reader(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2)) as s:
        slow, fast = s.runtime.submit(params()), s.runtime.submit(params())
        await settle()
        s.fake.emit(*[token(1, str(i % 10)) for i in range(500)], token(2, "ok"), done(2))
        assert await collect(fast) == "ok"  # not stuck behind the unread generation
        s.fake.emit(done(1))
        await settle()
        assert await slow.receive() == "0123456789" * 50
        assert await slow.receive() is None


async def test_one_read_with_records_of_several_generations_wakes_each_once_with_all_its_text(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2)) as s:
        a, b = s.runtime.submit(params()), s.runtime.submit(params())
        await settle()
        s.fake.emit(token(1, "a1"), token(2, "b1"), token(1, "a2"), token(2, "b2"), token(1, "a3"))
        await settle()
        assert await a.receive() == "a1a2a3"  # one piece: the whole read's text for it
        assert await b.receive() == "b1b2"


async def test_cancel_between_records_of_one_read_ends_only_that_generation(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2)) as s:
        a, b = s.runtime.submit(params()), s.runtime.submit(params())
        await settle()
        s.fake.emit(token(1, "a1"), token(2, "b1"))
        await settle()
        assert await a.receive() == "a1"
        a.cancel()  # between two reads: the frame goes out at once
        assert s.fake.cancels == [1]
        # The worker had already written a's next token; its cancelled done follows in the
        # same read as more of b's output.
        s.fake.emit(token(1, "a2"), done(1, cancelled=True), token(2, "b2"))
        await settle()
        assert await a.receive() == "a2" and await a.receive() is None and a.done.cancelled
        assert s.runtime.in_flight == 1  # a's slot is free, b still runs
        s.fake.emit(done(2))
        assert await collect(b) == "b1b2"


async def test_worker_error_for_one_id_fails_only_that_generation(autojump_clock):
    async with serving(FakeWorkerClient(capacity=3)) as s:
        gens = [s.runtime.submit(params()) for _ in range(3)]
        await settle()
        s.fake.emit(token(1, "a"), error(2, "invalid_grammar", "bad rule"),
                    error(3, "context_length_exceeded", "too long", prompt_tokens=9, n_ctx=8))
        s.fake.emit(token(1, "b"), done(1))
        assert await collect(gens[0]) == "ab"
        err = await failure_of(gens[1])
        assert (err.code, err.message, err.retryable) == ("invalid_grammar", "bad rule", False)
        err = await failure_of(gens[2])
        assert err.code == "context_length_exceeded" and err.details == {"prompt_tokens": 9, "n_ctx": 8}
        assert s.runtime.in_flight == 0 and s.failure is None


@pytest.mark.parametrize("code", ["capacity_exhausted", "session_busy"])
async def test_busy_codes_fail_only_their_generation_and_are_retryable(code, autojump_clock):
    async with serving(FakeWorkerClient(capacity=2)) as s:
        a, b = s.runtime.submit(params()), s.runtime.submit(params())
        await settle()
        s.fake.emit(error(2, code), token(1, "fine"), done(1))
        assert await collect(a) == "fine"
        err = await failure_of(b)
        assert err.code == code and err.retryable


@pytest.mark.parametrize("records", [
    [token(9, "x")],  # never sent
    [done(1), token(1, "late")],  # after its terminal record
    [{"type": "pong", "id": 1}],  # a pong for a generation
])
async def test_records_for_unknown_ids_replace_the_worker(records, autojump_clock):
    async with serving(FakeWorkerClient(capacity=2)) as s:
        gen = s.runtime.submit(params())
        other = s.runtime.submit(params())
        await settle()
        s.fake.emit(*records)
        assert isinstance(await s.wait_failure(), ProtocolViolation)
        for g in (gen, other):
            if g.done is None:
                err = await failure_of(g)
                assert err.code == "worker_unavailable" and err.retryable


async def test_garbage_from_the_worker_fails_everything_and_is_retryable(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1)) as s:
        running, queued = s.runtime.submit(params()), s.runtime.submit(params())
        await settle()
        s.fake.emit_raw(b"this is not json\n")
        failure = await s.wait_failure()
        assert isinstance(failure, ProtocolViolation)
        for g in (running, queued):
            err = await failure_of(g)
            assert err.code == "worker_unavailable" and "not JSON" in err.message
        with pytest.raises(GenerationError) as info:
            s.runtime.submit(params())
        assert info.value.code == "worker_unavailable"


# -- cancellation ------------------------------------------------------------------------


async def test_cancel_one_of_n_frees_only_its_slot(autojump_clock):
    async with serving(FakeWorkerClient(capacity=3), cancel_grace=2.0) as s:
        gens = [s.runtime.submit(params()) for _ in range(4)]
        await settle()
        s.fake.emit(token(1, "a"), token(2, "b"), token(3, "c"))
        await settle()
        gens[1].cancel()
        gens[1].cancel()  # idempotent
        assert s.fake.cancels == [2]
        assert len(s.fake.generates()) == 3  # the slot is freed by the terminal record, not the frame
        s.fake.emit(done(2, cancelled=True))
        await settle()
        assert gens[3].request_id == 4  # the queued one took the freed slot
        s.fake.emit(token(1, "a"), done(1), token(3, "c"), done(3), token(4, "d"), done(4))
        assert [await collect(g) for g in gens] == ["aa", "b", "cc", "d"]
        assert gens[1].done.cancelled and not gens[0].done.cancelled
        assert s.fake.cancels == [2] and s.failure is None


async def test_cancel_while_queued_never_reaches_the_worker(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1)) as s:
        running, queued = s.runtime.submit(params("r")), s.runtime.submit(params("q"))
        await settle()
        queued.cancel()
        assert s.runtime.queued == 0
        assert (await failure_of(queued)).code == "cancelled"
        s.fake.emit(done(1))
        await collect(running)
        await settle()
        assert [r["prompt"] for r in s.fake.generates()] == ["r"]
        assert s.fake.cancels == []


async def test_cancel_while_waiting_for_the_write_lock_sends_the_frame_once_the_id_exists(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2), health_timeout=60) as s:
        s.fake.write_gate = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(s.runtime.call, Ping())  # holds the write lock
            await settle()
            gen = s.runtime.submit(params())
            await settle()  # the dispatcher took it and waits for the lock
            assert gen.request_id is None and s.runtime.in_flight == 1
            gen.cancel()
            assert s.fake.cancels == []
            s.fake.write_gate.set()
            await settle()
            assert gen.request_id == 2 and s.fake.cancels == [2]
            s.fake.emit({"type": "pong", "id": 1}, done(2, cancelled=True))
        assert (await collect(gen)) == "" and gen.done.cancelled


async def test_cancel_grace_bounds_the_wait_for_that_ids_terminal_record(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2), cancel_grace=2.0) as s:
        a, b = s.runtime.submit(params()), s.runtime.submit(params())
        queued = None
        await settle()
        s.fake.emit(token(1, "x"))
        await settle()
        start = trio.current_time()
        a.cancel()
        await trio.sleep(1.9)

        s.fake.emit(token(2, "still fine"))  # the other generation keeps streaming
        await settle()
        assert s.failure is None
        queued = s.runtime.submit(params())
        failure = await s.wait_failure()
        assert isinstance(failure, WorkerHung) and "request 1" in str(failure)
        assert trio.current_time() - start == pytest.approx(2.0)
        for g in (a, b, queued):
            err = await failure_of(g)
            assert err.code == "worker_unavailable" and err.retryable


async def test_terminal_record_within_the_grace_keeps_the_worker(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1), cancel_grace=2.0) as s:
        gen = s.runtime.submit(params())
        await settle()
        gen.cancel()
        await trio.sleep(1.5)
        s.fake.emit(done(1, cancelled=True))
        await collect(gen)
        await trio.sleep(10)
        assert s.failure is None and gen.done.cancelled


async def test_worker_without_cancel_support_is_killed_after_the_grace(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1, capabilities={"supports_cancel": False}),
                       cancel_grace=0.5) as s:
        gen = s.runtime.submit(params())
        await settle()
        gen.cancel()
        assert isinstance(await s.wait_failure(), WorkerHung)


# -- liveness ------------------------------------------------------------------------------


async def test_stall_with_generations_in_flight_pings_then_kills_without_a_pong(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2), stall_timeout=30, health_timeout=10) as s:
        gens = [s.runtime.submit(params()) for _ in range(2)]
        await settle()
        s.fake.emit(token(1, "a"))
        await settle()
        quiet_since = trio.current_time()
        await trio.sleep(29.9)
        assert s.fake.pings() == []
        await s.fake.wait_sent(1, "ping")
        assert trio.current_time() - quiet_since == pytest.approx(30)
        failure = await s.wait_failure()
        assert isinstance(failure, WorkerHung) and "ping" in str(failure)
        assert trio.current_time() - quiet_since == pytest.approx(40)
        for g in gens:
            assert (await failure_of(g)).code == "worker_unavailable"


async def test_stall_ping_answered_keeps_the_generation_going(autojump_clock):
    fake = FakeWorkerClient(capacity=1, auto_pong=True)
    async with serving(fake, stall_timeout=30, health_timeout=10) as s:
        gen = s.runtime.submit(params())
        await settle()
        await trio.sleep(95)  # a long prefill: silent but alive
        assert len(fake.pings()) == 3
        fake.emit(token(1, "late"), done(1))
        assert await collect(gen) == "late"
        assert s.failure is None


async def test_output_resets_the_stall_clock(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1), stall_timeout=30) as s:
        gen = s.runtime.submit(params())
        await settle()
        for _ in range(5):
            await trio.sleep(20)
            s.fake.emit(token(1, "."))
        s.fake.emit(done(1))
        assert await collect(gen) == "....."
        assert s.fake.pings() == []


async def test_idle_time_before_a_generation_does_not_count_as_a_stall(autojump_clock):
    fake = FakeWorkerClient(auto_pong=True)
    async with serving(fake, health_interval=100, stall_timeout=30) as s:
        await trio.sleep(90)  # idle: the worker owes nothing
        gen = s.runtime.submit(params())
        await trio.sleep(29.9)
        assert fake.pings() == []
        await trio.sleep(0.2)
        assert len(fake.pings()) == 1
        fake.emit(done(1))
        await collect(gen)


async def test_idle_worker_is_pinged_every_health_interval(autojump_clock):
    fake = FakeWorkerClient(auto_pong=True)
    async with serving(fake, health_interval=30, stall_timeout=5) as s:
        await trio.sleep(29)
        assert fake.pings() == []
        await trio.sleep(2)
        assert len(fake.pings()) == 1
        await trio.sleep(30)
        assert len(fake.pings()) == 2 and s.failure is None


async def test_a_write_the_worker_does_not_take_means_hung(autojump_clock):
    async with serving(FakeWorkerClient(capacity=1), health_timeout=10) as s:
        s.fake.write_gate = trio.Event()
        gen = s.runtime.submit(params())
        failure = await s.wait_failure()
        assert isinstance(failure, WorkerHung) and "stdin" in str(failure)
        assert (await failure_of(gen)).code == "worker_unavailable"


async def test_crash_with_n_in_flight_fails_all_n_and_the_queue(autojump_clock):
    async with serving(FakeWorkerClient(capacity=3)) as s:
        gens = [s.runtime.submit(params()) for _ in range(5)]
        await settle()
        s.fake.emit(token(1, "a"), token(3, "c"))
        await settle()
        s.fake.exit()
        assert isinstance(await s.wait_failure(), WorkerExited)
        errors = [await failure_of(g) for g in gens]
        assert {(e.code, e.retryable) for e in errors} == {("worker_unavailable", True)}
        assert s.runtime.in_flight == 0 and s.runtime.queued == 0


async def test_shutdown_fails_pending_work_with_worker_unavailable(autojump_clock):
    runtime = SessionRuntime()
    fake = FakeWorkerClient(capacity=1)
    with trio.fail_after(VIRTUAL_LIMIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.serve, fake)
            await settle()
            running, queued = runtime.submit(params()), runtime.submit(params())
            await settle()
            nursery.cancel_scope.cancel()
    for g in (running, queued):
        err = await failure_of(g)
        assert err.code == "worker_unavailable" and "shutting down" in err.message


# -- id-less errors ----------------------------------------------------------------------


async def test_null_id_error_with_one_silent_request_fails_only_that_one(autojump_clock):
    async with serving(FakeWorkerClient(capacity=3)) as s:
        gens = [s.runtime.submit(params()) for _ in range(3)]
        await settle()
        s.fake.emit(token(1, "a"), token(3, "c"))  # 2 has not been heard from
        s.fake.emit(error(None, "invalid_json", "line 2 is not JSON"))
        err = await failure_of(gens[1])
        assert err.code == "invalid_json" and "could not read" in err.message
        await settle()
        assert gens[0].done is None and gens[2].done is None  # untouched
        s.fake.emit(done(1), done(3))
        assert [await collect(gens[0]), await collect(gens[2])] == ["a", "c"]
        assert s.failure is None


async def test_null_id_error_is_attributed_once_the_others_are_heard_from(autojump_clock):
    async with serving(FakeWorkerClient(capacity=3)) as s:
        gens = [s.runtime.submit(params()) for _ in range(3)]
        await settle()
        s.fake.emit(error(None, "invalid_json"))  # three silent suspects
        await settle()
        assert all(g.done is None and g._error is None for g in gens)
        s.fake.emit(token(3, "c"))
        await settle()
        assert gens[0]._error is None and gens[1]._error is None
        s.fake.emit(done(1))  # 2 is the only one left that never spoke
        assert (await failure_of(gens[1])).code == "invalid_json"
        s.fake.emit(done(3))
        assert await collect(gens[0]) == "" and await collect(gens[2]) == "c"
        assert s.failure is None


async def test_unattributable_null_id_errors_are_tolerated_once_then_replace_the_worker(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2), null_id_limit=2) as s:
        gen = s.runtime.submit(params())
        await settle()
        s.fake.emit(token(1, "a"), error(None, "invalid_json"))  # nobody is silent
        await settle()
        assert s.failure is None and gen._error is None
        s.fake.emit(error(None, "invalid_json"))
        failure = await s.wait_failure()
        assert isinstance(failure, ProtocolViolation) and "match no request" in str(failure)
        assert (await failure_of(gen)).code == "worker_unavailable"


async def test_a_suspect_missing_its_cancel_grace_is_the_broken_line_not_a_hang(autojump_clock):
    async with serving(FakeWorkerClient(capacity=2), cancel_grace=1.0) as s:
        a, b = s.runtime.submit(params()), s.runtime.submit(params())
        await settle()
        s.fake.emit(error(None, "invalid_json"))
        await settle()
        b.cancel()  # b's line was the broken one: its terminal record will never come
        assert (await failure_of(b)).code == "invalid_json"
        s.fake.emit(token(1, "ok"), done(1))
        assert await collect(a) == "ok"
        assert s.failure is None


# -- calls ---------------------------------------------------------------------------------


async def call_in_background(s: Serving, request, nursery: trio.Nursery) -> list:
    """Start ``runtime.call(request)``; the list gets its reply or its GenerationError."""
    outcome: list = []

    async def run() -> None:
        try:
            outcome.append(await s.runtime.call(request))
        except GenerationError as exc:
            outcome.append(exc)

    nursery.start_soon(run)
    return outcome


async def test_call_returns_the_typed_reply_or_raises_the_workers_error(autojump_clock):
    async with serving(FakeWorkerClient()) as s:
        async with trio.open_nursery() as nursery:
            tokens = await call_in_background(s, Tokenize(text="ab"), nursery)
            session = await call_in_background(s, SessionOpen("s"), nursery)
            await s.fake.wait_sent(2)
            ids = {r["op"]: r["id"] for r in s.fake.sent}  # Trio may start the two in either order
            s.fake.emit(error(ids["session_open"], "unsupported_session", "capacity is 1", capacity=1),
                        {"type": "tokens", "id": ids["tokenize"], "ids": [97, 98]})
        assert tokens == [Tokens(ids["tokenize"], (97, 98))]
        (err,) = session
        assert err.code == "unsupported_session" and err.details == {"capacity": 1}
        assert s.failure is None


async def test_call_without_an_answer_times_out_and_a_late_reply_is_dropped(autojump_clock):
    async with serving(FakeWorkerClient(), health_timeout=5) as s:
        with pytest.raises(GenerationError) as info:
            await s.runtime.call(Ping(), timeout=1)
        assert info.value.code == "worker_unavailable"
        s.fake.emit({"type": "pong", "id": 1})
        await settle()
        assert s.failure is None
        async with trio.open_nursery() as nursery:
            got = []

            async def ping() -> None:
                got.append(await s.runtime.call(Ping()))

            nursery.start_soon(ping)
            await s.fake.wait_sent(2)
            s.fake.emit({"type": "pong", "id": 2})
        assert got == [Pong(2)]
