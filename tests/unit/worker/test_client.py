"""WorkerClient over real pipes and processes: every OS failure at spawn is a WorkerError,
lines go out whole with increasing ids, a worker that stops reading stdin is hung."""

from __future__ import annotations

import json
import os
import resource
import sys
import textwrap

import pytest
import trio

from trioserve.worker import child_process

from trioserve.worker import client as worker_client
from trioserve.worker.client import WorkerClient
from trioserve.worker.protocol import (
    Ping,
    Pong,
    ProtocolViolation,
    Tokenize,
    Tokens,
    WorkerError,
    WorkerExited,
    WorkerHung,
    prepare,
)

READY = {"type": "ready", "protocol": 2, "capacity": 2, "max_line_bytes": 1 << 22,
         "capabilities": {"supports_cancel": True}}

# A stand-in worker in Python: the v2 ready record, then one reply per request line
# (pong for ping, tokens = UTF-8 bytes for tokenize); cancel frames are echoed as pongs
# with the cancelled id, so the test sees them arrive.
ECHO_WORKER = textwrap.dedent("""
    import json, os, sys, threading
    fd = int(os.environ["TRIOSERVE_CANCEL_FD"])
    def cancels():
        while (frame := os.read(fd, 8)):
            out(json.dumps({"type": "pong", "id": int.from_bytes(frame, "little")}))
    lock = threading.Lock()
    def out(line):
        with lock:
            sys.stdout.write(line + "\\n"); sys.stdout.flush()
    out(sys.argv[1])
    threading.Thread(target=cancels, daemon=True).start()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "ping":
            out(json.dumps({"type": "pong", "id": req["id"]}))
        else:
            out(json.dumps({"type": "tokens", "id": req["id"], "ids": list(req["text"].encode())}))
""")


def python_worker(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


async def spawn(argv: list[str], nursery: trio.Nursery, **kw) -> WorkerClient:
    return await WorkerClient.spawn(argv, nursery=nursery, ready_timeout=kw.pop("ready_timeout", 20), **kw)


async def test_requests_and_records_round_trip_over_real_pipes(nursery):
    client = await spawn(python_worker(ECHO_WORKER, json.dumps(READY)), nursery)
    try:
        assert client.ready.capacity == 2 and client.supports_cancel
        seen: list[int] = []
        big = "é" * 300_000  # 600 kB: written in many pieces
        rid1 = await client.send_request(prepare(Ping(), max_line_bytes=client.max_line_bytes),
                                         progress_timeout=10, register=seen.append)
        rid2 = await client.send_request(prepare(Tokenize(text=big), max_line_bytes=client.max_line_bytes),
                                         progress_timeout=10, register=seen.append)
        assert (rid1, rid2) == (1, 2) and seen == [1, 2]
        assert await client.receive() == Pong(1)
        tokens = await client.receive()
        assert isinstance(tokens, Tokens) and tokens.id == 2 and bytes(tokens.ids) == big.encode()
        assert client.cancel(7)
        assert await client.receive() == Pong(7)
    finally:
        await client.stop(exit_wait=2, term_wait=2)
    assert client.process.returncode is not None


async def test_concurrent_senders_write_whole_lines_in_id_order(nursery):
    client = await spawn(python_worker(ECHO_WORKER, json.dumps(READY)), nursery)
    try:
        order: list[int] = []
        replies: list = []

        async def read_all() -> None:  # read while writing, as the runtime does
            while len(replies) < 20:
                replies.append(await client.receive())

        async with trio.open_nursery() as senders:
            senders.start_soon(read_all)
            for i in range(20):
                text = str(i) * (1000 * (i % 7) + 1)
                senders.start_soon(lambda t=text: client.send_request(
                    prepare(Tokenize(text=t), max_line_bytes=client.max_line_bytes),
                    progress_timeout=10, register=order.append))
        assert [r.id for r in replies] == list(range(1, 21)) == order  # every line parsed whole
    finally:
        await client.stop(exit_wait=2, term_wait=2)


async def test_a_worker_that_stops_reading_stdin_is_hung(nursery):
    sleeper = python_worker(f"import sys,time; print({json.dumps(json.dumps(READY))}, flush=True); time.sleep(60)")
    client = await spawn(sleeper, nursery)
    try:
        with pytest.raises(WorkerHung, match="did not read its stdin"):
            await client.send_request(prepare(Tokenize(text="x" * 1_000_000), max_line_bytes=1 << 22),
                                      progress_timeout=0.5)
        with pytest.raises(WorkerError, match="partly written"):
            await client.send_request(prepare(Ping(), max_line_bytes=100), progress_timeout=0.5)
    finally:
        assert await client.stop(exit_wait=0, term_wait=2) == "sigterm"


@pytest.mark.parametrize("argv, error, match", [
    (["/nonexistent/worker"], WorkerError, "cannot start worker"),
    (["/bin/true"], WorkerExited, "exited during startup"),
    (python_worker("print('{\"type\": \"ready\", \"protocol\": 1}')"), ProtocolViolation, "protocol 1"),
    (python_worker("print('hello')"), ProtocolViolation, "not JSON"),
])
async def test_spawn_failures_are_worker_errors(nursery, argv, error, match):
    with pytest.raises(error, match=match):
        await spawn(argv, nursery)


async def test_silent_worker_times_out_and_is_reaped(nursery):
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(WorkerError, match="no ready record"):
        await spawn(python_worker("import time; time.sleep(60)"), nursery, ready_timeout=0.3)
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1  # stderr until its forwarder sees EOF


async def test_fd_exhaustion_at_spawn_is_a_worker_error(nursery):
    """A real EMFILE: the soft fd limit is lowered to the lowest free fd for the spawn."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        with pytest.raises(WorkerError, match="Too many open files"):
            await spawn(["/bin/true"], nursery)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("where", ["pipe", "pidfd_open"])
async def test_os_failures_inside_spawn_are_worker_errors_and_leave_no_child(nursery, monkeypatch, where):
    def refuse(*args):
        raise OSError(24, "Too many open files")

    if where == "pipe":
        monkeypatch.setattr(worker_client.os, "pipe", refuse)
    else:
        monkeypatch.setattr(child_process.os, "pidfd_open", refuse)
    with pytest.raises(WorkerError, match="Too many open files"):
        await spawn(python_worker("import time; time.sleep(60)"), nursery)
    monkeypatch.undo()
    children = set()
    for task in os.listdir("/proc/self/task"):
        children |= set(open(f"/proc/self/task/{task}/children").read().split())
    assert not children, f"a child survived the failed spawn: {children}"
