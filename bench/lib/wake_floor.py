"""The floor under the control plane's per-token CPU: a process that does nothing but wait
for a pipe, read what arrived and write it to a socket, one record every ``period_ms``.

    python -m bench.lib.wake_floor {trio,trio2,epoll} PERIOD_MS TOKENS

prints ``{"relay": ..., "period_ms": ..., "cpu_us_per_token": ...}``. The relay runs in this
process; a forked child writes the records on a fixed grid and drains the socket, so the
figure is the relay's own CPU (``/proc/thread-self/schedstat``: the relay's thread only; trio's
run loop is that thread) per record.

* ``trio``: one trio task, ``wait_readable`` on the pipe, ``os.read``, a non-blocking
  ``send``: the fewest trio operations that can forward a token (trioserve's path adds its
  tasks, HTTP and SSE on top of this).
* ``trio2``: the same with two tasks, as a server has them: a reader task that waits and
  reads, and hands the bytes to a consumer task (parked with ``wait_task_rescheduled``, the
  cheapest hand-over trio has) that writes them. Two task steps and two passes of trio's
  run loop per record instead of one.
* ``epoll``: the same three system calls in a bare ``select.epoll`` loop, no event loop.

Each does one wake-up per record. The period matters: a process that sleeps between records
wakes up with cold caches, so the same instructions cost more at a real model's 30 ms than
at a fake engine's 2 ms. Never asserts on time.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
from collections.abc import Callable

import trio
import trio.testing


def _thread_cpu_ns() -> int:
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[0])


def _read(r: int) -> bytes:
    """What the writer wrote since the last read; raises if it is gone (EOF), which would
    otherwise leave a relay spinning on a readable, empty pipe."""
    data = os.read(r, 1 << 16)
    if not data:
        raise RuntimeError("the writer exited before the relay got all its records")
    return data


def _write_on_grid(w: int, sock: socket.socket, period_s: float, count: int) -> None:
    """The child: one newline-terminated record every ``period_s`` on a fixed grid (a late
    wake-up does not shift the next record), draining the relay's socket as it goes."""
    sock.setblocking(False)
    due = time.monotonic()
    for i in range(count):
        due += period_s
        if (left := due - time.monotonic()) > 0:
            time.sleep(left)
        os.write(w, b'{"token":%d}\n' % i)
        try:
            while sock.recv(1 << 16):
                pass
        except BlockingIOError:
            pass


async def _trio_relay(r: int, sock: socket.socket, tokens: int) -> float:
    seen, t0 = 0, _thread_cpu_ns()
    while seen < tokens:
        await trio.lowlevel.wait_readable(r)
        data = _read(r)
        seen += data.count(b"\n")
        sock.send(data)  # a few bytes into an empty socket buffer: never blocks here
    return (_thread_cpu_ns() - t0) / seen / 1e3


async def _two_task_relay(r: int, sock: socket.socket, tokens: int) -> float:
    pending: list[bytes] = []
    consumer: list[trio.lowlevel.Task] = []

    async def write_loop() -> None:
        consumer.append(trio.lowlevel.current_task())
        while True:
            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)
            sock.send(b"".join(pending))
            pending.clear()

    seen = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_loop)
        await trio.testing.wait_all_tasks_blocked()
        t0 = _thread_cpu_ns()
        while seen < tokens:
            await trio.lowlevel.wait_readable(r)
            data = _read(r)
            seen += data.count(b"\n")
            if not pending:
                trio.lowlevel.reschedule(consumer[0])
            pending.append(data)
        await trio.testing.wait_all_tasks_blocked()
        us = (_thread_cpu_ns() - t0) / seen / 1e3
        nursery.cancel_scope.cancel()
    return us


def _epoll_relay(r: int, sock: socket.socket, tokens: int) -> float:
    ep = select.epoll()
    ep.register(r, select.EPOLLIN)
    seen, t0 = 0, _thread_cpu_ns()
    while seen < tokens:
        ep.poll()
        data = _read(r)
        seen += data.count(b"\n")
        sock.send(data)
    ep.close()
    return (_thread_cpu_ns() - t0) / seen / 1e3


RELAYS: dict[str, Callable[[int, socket.socket, int], float]] = {
    "trio": lambda r, sock, tokens: trio.run(_trio_relay, r, sock, tokens),
    "trio2": lambda r, sock, tokens: trio.run(_two_task_relay, r, sock, tokens),
    "epoll": _epoll_relay,
}


def measure(relay: str, period_ms: float, tokens: int) -> float:
    """CPU µs per forwarded record of ``relay`` (a key of RELAYS) at one record per
    ``period_ms``."""
    r, w = os.pipe()
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the writer: exits without running the parent's clean-up
        try:
            os.close(r)
            mine.close()
            _write_on_grid(w, theirs, period_ms / 1e3, tokens + 5)
        finally:
            os._exit(0)
    os.close(w)
    theirs.close()
    os.set_blocking(r, False)
    mine.setblocking(False)
    try:
        return RELAYS[relay](r, mine, tokens)
    finally:
        os.close(r)
        mine.close()
        os.waitpid(pid, 0)


def main() -> int:
    relay, period_ms, tokens = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    if relay not in RELAYS:
        raise SystemExit(f"relay: one of {', '.join(RELAYS)}")
    us = measure(relay, period_ms, tokens)
    print(json.dumps({"relay": relay, "period_ms": period_ms, "cpu_us_per_token": us}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
