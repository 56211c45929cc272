"""An in-memory stand-in for WorkerClient: same interface, records scripted by the test.

What the "worker" writes goes through the real RecordDecoder (as JSON lines), so the
runtime sees exactly the typed records a real worker's bytes would produce. What the
runtime writes is recorded (decoded back to dicts) in ``sent``; cancel frames in
``cancels``.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import trio
from trio.testing import wait_all_tasks_blocked

from trioserve.worker.protocol import WorkerError
from trioserve.worker.runtime import SessionRuntime
from trioserve.worker.protocol import (
    CLOSED,
    NEED_DATA,
    PreparedRequest,
    Ready,
    Record,
    RecordDecoder,
    WorkerExited,
    WorkerHung,
)


def ready_record(**overrides: Any) -> dict[str, Any]:
    record = {"type": "ready", "protocol": 2, "engine": "fake", "model": {"name": "fake"},
              "n_ctx": 4096, "n_vocab": 257, "capacity": 2, "max_line_bytes": 1 << 20,
              "max_batch_tokens": 512,
              "capabilities": {"supports_cancel": True, "multiplexed": True, "grammar": False},
              "special_tokens": {}, "chat_template": None}
    record.update(overrides)
    return record


class FakeWorkerClient:
    """Scripted worker. ``auto_pong`` answers pings at once; ``auto_cancel`` answers a
    cancel frame with that id's ``done`` (cancelled). ``write_gate``: while it is an
    unset Event, writes block (inside the write lock) until it is set or the progress
    timeout passes (WorkerHung, as the real client)."""

    _pids = iter(range(1000, 100000))

    def __init__(self, *, auto_pong: bool = False, auto_cancel: bool = False, stop_delay: float = 0.0,
                 **ready: Any) -> None:
        decoder = RecordDecoder()
        decoder.receive_data(json.dumps(ready_record(**ready)).encode() + b"\n")
        self.ready: Ready = decoder.next_record()  # type: ignore[assignment]
        self._decoder = decoder
        self.process = SimpleNamespace(pid=next(self._pids), returncode=None)
        self.auto_pong = auto_pong
        self.auto_cancel = auto_cancel
        self.stop_delay = stop_delay
        self.sent: list[dict[str, Any]] = []
        self.cancels: list[int] = []
        self.write_gate: trio.Event | None = None
        self.stopped_with: dict[str, Any] | None = None
        self._chunks_in, self._chunks_out = trio.open_memory_channel[bytes](math.inf)
        self._lock = trio.StrictFIFOLock()
        self._next_id = 1
        self._sent_changed = trio.Event()

    # -- the WorkerClient interface ------------------------------------------------------

    @property
    def max_line_bytes(self) -> int:
        return self.ready.max_line_bytes

    @property
    def supports_cancel(self) -> bool:
        return self.ready.supports_cancel

    async def send_request(self, request: PreparedRequest, *, progress_timeout: float,
                           register: Callable[[int], None] = lambda rid: None) -> int:
        async with self._lock:
            rid = self._next_id
            self._next_id += 1
            line = request.line(rid)
            register(rid)
            if self.write_gate is not None and not self.write_gate.is_set():
                with trio.move_on_after(progress_timeout) as scope:
                    await self.write_gate.wait()
                if scope.cancelled_caught:
                    raise WorkerHung(f"worker did not read its stdin for {progress_timeout:g} s")
            await trio.lowlevel.checkpoint()
            wire = json.loads(line)
            self.sent.append(wire)
            self._sent_changed.set()
            self._sent_changed = trio.Event()
            if self.auto_pong and wire["op"] == "ping":
                self.emit({"type": "pong", "id": rid})
            return rid

    async def receive(self) -> Record:
        while True:
            record = self._decoder.next_record()
            if record is CLOSED:
                raise WorkerExited("worker closed its stdout")
            if record is not NEED_DATA:
                return record
            self._decoder.receive_data(await self._chunks_out.receive())

    async def receive_batch(self) -> list[Record]:
        """As the real client: every complete record buffered (one chunk the script emitted
        may hold several, or part of one)."""
        while True:
            batch = self._decoder.next_records()
            if batch is CLOSED:
                raise WorkerExited("worker closed its stdout")
            if batch is not NEED_DATA:
                assert isinstance(batch, list)
                return batch
            self._decoder.receive_data(await self._chunks_out.receive())

    def cancel(self, request_id: int) -> bool:
        self.cancels.append(request_id)
        if not self.supports_cancel:
            return False
        if self.auto_cancel:
            self.emit(done(request_id, cancelled=True))
        return True

    async def stop(self, **kwargs: Any) -> str:
        self.stopped_with = kwargs
        await trio.sleep(self.stop_delay)  # the real stop's bounded waits
        return "exited"

    # -- scripting ---------------------------------------------------------------------------

    def emit(self, *records: dict[str, Any]) -> None:
        """The worker writes these records (one JSON line each)."""
        self._chunks_in.send_nowait(b"".join(json.dumps(r).encode() + b"\n" for r in records))

    def emit_raw(self, data: bytes) -> None:
        self._chunks_in.send_nowait(data)

    def exit(self) -> None:
        """The worker dies: EOF on its stdout."""
        self._chunks_in.send_nowait(b"")

    def generates(self) -> list[dict[str, Any]]:
        return [r for r in self.sent if r["op"] == "generate"]

    def pings(self) -> list[dict[str, Any]]:
        return [r for r in self.sent if r["op"] == "ping"]

    async def wait_sent(self, n: int, op: str | None = None) -> None:
        """Wait until ``n`` lines (of ``op``, if given) were written."""
        while len([r for r in self.sent if op is None or r["op"] == op]) < n:
            await self._sent_changed.wait()


def token(rid: int, text: str) -> dict[str, Any]:
    return {"type": "token", "id": rid, "text": text}


def done(rid: int, *, cancelled: bool = False, finish_reason: str = "stop", **extra: Any) -> dict[str, Any]:
    return {"type": "done", "id": rid, "finish_reason": finish_reason, "cancelled": cancelled,
            "stop_string": None, "prompt_tokens": 3, "completion_tokens": 2, **extra}


def error(rid: int | None, code: str, message: str = "failed", **extra: Any) -> dict[str, Any]:
    return {"type": "error", "id": rid, "code": code, "message": message, **extra}


async def settle() -> None:
    """Let every task run until all are blocked, without advancing the mock clock."""
    await wait_all_tasks_blocked()


# Virtual seconds: a test waiting for something that never happens fails instead of hanging.
VIRTUAL_LIMIT = 10_000


@dataclass
class Serving:
    runtime: SessionRuntime
    fake: FakeWorkerClient
    failure: BaseException | None = None
    ended: trio.Event = field(default_factory=trio.Event)

    async def wait_failure(self) -> BaseException:
        await self.ended.wait()
        assert self.failure is not None
        return self.failure


@asynccontextmanager
async def serving(fake: FakeWorkerClient | None = None, **settings) -> AsyncIterator[Serving]:
    """Run ``runtime.serve(fake)`` in the background for the block; record how it ended."""
    runtime = SessionRuntime(**settings)
    state = Serving(runtime, fake or FakeWorkerClient())
    # Virtual seconds: a test waiting for something that never happens fails instead of hanging.
    with trio.fail_after(VIRTUAL_LIMIT):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                try:
                    await state.runtime.serve(state.fake)
                except WorkerError as exc:
                    state.failure = exc
                finally:
                    state.ended.set()

            nursery.start_soon(serve)
            await settle()
            yield state
            nursery.cancel_scope.cancel()
