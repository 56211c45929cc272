"""Liveness from progress (spec §4.4): the runtime's watchdog on Trio's MockClock.

A worker inside a long step writes ``progress`` records (its heartbeat). A record whose step
or work counter moved is progress and resets the stall clock; one whose counter stands still
is not, so a stuck step is still pinged and killed. A call (the stall ping included) waits as
long as the worker progresses. Virtual time: "not killed after 300 s" is exact.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from trioserve.worker.runtime import GenerateParams, Generation, GenerationError
from trioserve.worker.protocol import (
    Progress,
    ProtocolViolation,
    StepPart,
    Tokenize,
    Tokens,
    WorkerHung,
    decode_record,
)

from tests.fakes.worker_client import FakeWorkerClient, done, serving, settle, token
from trioserve.worker.launch import argv_for


def progress(step: int, work: int, *, elapsed_ms: int = 0, stalled_ms: int = 0,
             batch: tuple[tuple[int, str, int], ...] = ((1, "prefill", 512),)) -> dict[str, Any]:
    return {"type": "progress", "step": step, "work": work, "elapsed_ms": elapsed_ms,
            "stalled_ms": stalled_ms,
            "batch": [{"id": i, "kind": k, "tokens": n} for i, k, n in batch]}


async def heartbeats(fake: FakeWorkerClient, *, seconds: float, every: float = 5.0, step: int = 3,
                     work_per_beat: int = 100, start_work: int = 0) -> int:
    """Emit a heartbeat every ``every`` s for ``seconds`` s; returns the last work count."""
    work = start_work
    beats = int(seconds / every)
    for k in range(1, beats + 1):
        await trio.sleep(every)
        work += work_per_beat
        fake.emit(progress(step, work, elapsed_ms=int(k * every * 1000)))
    return work


async def failure_of(gen: Generation) -> GenerationError:
    with pytest.raises(GenerationError) as info:
        async for _ in gen:
            pass
    return info.value


async def test_a_long_step_that_progresses_is_never_pinged_or_killed(autojump_clock):
    fake = FakeWorkerClient(capacity=2)
    async with serving(fake, stall_timeout=30, health_timeout=10) as s:
        gens = [s.runtime.submit(GenerateParams(prompt="p")) for _ in range(2)]
        await settle()
        # Ten minutes inside one step, far beyond stall + health timeouts: still computing.
        await heartbeats(fake, seconds=600)
        assert fake.pings() == [] and s.failure is None
        fake.emit(token(1, "a"), done(1), token(2, "b"), done(2))
        assert ["".join([p async for p in g]) for g in gens] == ["a", "b"]
        assert s.failure is None


async def test_a_step_whose_counter_stands_still_is_pinged_then_killed(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger="trioserve.worker.runtime")
    fake = FakeWorkerClient(capacity=2)
    async with serving(fake, stall_timeout=30, health_timeout=10) as s:
        gens = [s.runtime.submit(GenerateParams(prompt="p")) for _ in range(2)]
        await settle()
        await heartbeats(fake, seconds=20)  # computing for 20 s ...
        stuck_since = trio.current_time()
        # ... then stuck: the heartbeats go on (the thread lives), the counter does not move.
        for k in range(1, 100):
            await trio.sleep(1)
            if s.ended.is_set():
                break
            fake.emit(progress(3, 400, elapsed_ms=20_000 + k * 1000, stalled_ms=k * 1000,
                               batch=((1, "prefill", 256), (2, "prefill", 256))))
        failure = s.failure
        assert isinstance(failure, WorkerHung)
        assert trio.current_time() - stuck_since == pytest.approx(40, abs=1)
        assert len(fake.pings()) == 1
        message = str(failure)
        assert "no progress for 40 s in step 3" in message
        assert "2 prefill pieces (256+256 tokens: ids 1, 2); 512 tokens" in message
        assert "ping" in message
        for g in gens:
            assert (await failure_of(g)).code == "worker_unavailable"
    stall_logs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker stalled")]
    assert len(stall_logs) == 1 and "no progress for 30 s in step 3" in stall_logs[0]


async def test_progress_that_resumes_after_the_ping_keeps_the_worker(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger="trioserve.worker.runtime")
    fake = FakeWorkerClient(capacity=1)
    async with serving(fake, stall_timeout=30, health_timeout=10) as s:
        gen = s.runtime.submit(GenerateParams(prompt="p"))
        await settle()
        fake.emit(progress(1, 10))
        await fake.wait_sent(1, "ping")  # 30 s without progress: pinged
        await trio.sleep(4)  # the first heartbeat below comes 9 s after the ping, before its deadline
        # The step moves again before the pong deadline; the pong only comes at its end.
        await heartbeats(fake, seconds=120, step=1, start_work=10)
        assert s.failure is None and len(fake.pings()) == 1
        fake.emit({"type": "pong", "id": fake.pings()[0]["id"]}, token(1, "x"), done(1))
        assert "".join([p async for p in gen]) == "x"
        assert s.failure is None
    assert any("making progress again" in r.getMessage() for r in caplog.records)


async def test_a_call_waits_while_the_worker_progresses_and_fails_without_progress(autojump_clock):
    fake = FakeWorkerClient(capacity=1)
    async with serving(fake, stall_timeout=30, health_timeout=10) as s:
        s.runtime.submit(GenerateParams(prompt="p"))
        await settle()
        async with trio.open_nursery() as nursery:
            replies: list[Any] = []

            async def tokenize() -> None:
                replies.append(await s.runtime.call(Tokenize(text="abc")))

            nursery.start_soon(tokenize)
            await fake.wait_sent(1, "tokenize")
            started = trio.current_time()
            await heartbeats(fake, seconds=60)  # one long step: answered at its end
            fake.emit({"type": "tokens", "id": fake.sent[-1]["id"], "ids": [97, 98, 99]})
        assert trio.current_time() - started == pytest.approx(60)
        assert replies == [Tokens(id=fake.sent[1]["id"], ids=(97, 98, 99))]
        # Without progress the same call fails after the timeout, and only the call.
        started = trio.current_time()
        with pytest.raises(GenerationError) as info:
            await s.runtime.call(Tokenize(text="abc"))
        assert info.value.code == "worker_unavailable"
        # The health timeout, plus a tokenize's allowance for the length of its line.
        assert 10 <= trio.current_time() - started < 10.01


async def test_a_cancel_waiting_for_a_long_step_is_not_taken_for_an_ignored_one(autojump_clock):
    fake = FakeWorkerClient(capacity=2)
    async with serving(fake, stall_timeout=30, health_timeout=10, cancel_grace=2) as s:
        gens = [s.runtime.submit(GenerateParams(prompt="p")) for _ in range(2)]
        await settle()
        fake.emit(progress(5, 10, elapsed_ms=500))
        await trio.sleep(0.1)
        gens[0].cancel()  # its decode shares step 5 with the other's prompt: ends with the step
        await settle()
        await heartbeats(fake, seconds=20, every=0.5, step=5, start_work=10)
        assert s.failure is None
        fake.emit(done(1, cancelled=True), token(2, "b"), done(2))
        assert "".join([p async for p in gens[1]]) == "b"
        assert s.failure is None


async def test_a_cancel_in_a_step_that_stopped_progressing_runs_out_its_grace(autojump_clock):
    fake = FakeWorkerClient(capacity=1)
    async with serving(fake, stall_timeout=30, health_timeout=10, cancel_grace=2) as s:
        gen = s.runtime.submit(GenerateParams(prompt="p"))
        await settle()
        fake.emit(progress(5, 10, elapsed_ms=500))
        await trio.sleep(0.1)
        gen.cancel()
        await settle()
        work = await heartbeats(fake, seconds=5, every=0.5, step=5, start_work=10)
        stopped = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def still() -> None:
                for _ in range(20):  # the same step, its counter standing still
                    await trio.sleep(0.5)
                    fake.emit(progress(5, work))

            nursery.start_soon(still)
            await s.ended.wait()
            nursery.cancel_scope.cancel()
        assert isinstance(s.failure, WorkerHung) and "cancel grace" in str(s.failure)
        assert trio.current_time() - stopped == pytest.approx(2, abs=0.01)


def test_progress_records_decode_and_compare():
    line = (b'{"type":"progress","step":17,"work":812,"elapsed_ms":4200,"stalled_ms":0,'
            b'"batch":[{"id":3,"kind":"prefill","tokens":256},{"id":2,"kind":"decode","tokens":1}]}')
    record = decode_record(line)
    assert record == Progress(step=17, work=812, elapsed_ms=4200.0, stalled_ms=0.0,
                              batch=(StepPart(3, True, 256), StepPart(2, False, 1)))
    assert record.describe() == "1 prefill piece (256 tokens: id 3), 1 decode (id 2); 257 tokens"
    assert record.advanced_since(None)
    assert not record.advanced_since(record)
    assert record.advanced_since(Progress(17, 811, 0, 0, ()))
    assert record.advanced_since(Progress(16, 812, 0, 0, ()))  # a new step: the last one ended
    for bad in (b'{"type":"progress","step":1}',
                b'{"type":"progress","step":1,"work":-1}',
                b'{"type":"progress","step":1,"work":1,"batch":[{"id":1,"kind":"other","tokens":1}]}',
                b'{"type":"progress","step":1,"work":1,"batch":[7]}'):
        with pytest.raises(ProtocolViolation):
            decode_record(bad)


def test_the_server_asks_for_heartbeats_and_bounded_steps():
    from trioserve.config import Settings

    def flag(argv: list[str], name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    llama = argv_for(Settings(worker_bin="/w", model_path="/m.gguf", threads=1))
    assert flag(llama, "--heartbeat-ms") == "500"  # a quarter of the 2 s cancel grace
    assert flag(llama, "--max-step-ms") == "5000"
    quick = argv_for(Settings(worker_bin="/w", model_path="/m.gguf", threads=1, stall_timeout=1.0,
                     cancel_grace=10.0, max_step_ms=0))
    assert flag(quick, "--heartbeat-ms") == "250" and "--max-step-ms" not in quick
    slow = Settings(worker_bin="/w", model_path="/m.gguf", stall_timeout=60, cancel_grace=30)
    assert slow.heartbeat_ms() == 1000  # at most once a second
    fake = argv_for(Settings(engine="fake", worker_bin="/f"))
    assert flag(fake, "--heartbeat-ms") == "500" and "--max-step-ms" not in fake
    executorch = argv_for(Settings(engine="executorch", worker_bin="/e", model_path="/m.pte",
                          tokenizer_path="/t.json"))
    assert flag(executorch, "--heartbeat-ms") == "500"
