"""WorkerClient: moves bytes between the control plane and one C++ worker process.

The wire format lives in ``worker_protocol`` (a sans-IO codec); this layer only feeds the
worker's stdout into a ``RecordDecoder``, writes prepared request lines to its stdin and
cancel frames to its cancel pipe. It knows nothing about OpenAI, queues or sessions.

Ownership: a WorkerClient owns one child process, its three pipes and the write end of
its cancel pipe. ``WorkerClient.spawn`` returns only after the ready record arrived (or
raises WorkerError, with the child reaped and every fd closed). ``stop`` always reaps the
child and closes every fd, even when called from a cancelled scope.

Concurrency: ``send_request`` may be called from several tasks at once (a FIFO lock
serializes the lines, and ids are allocated under it, so ids increase in the order lines
are written); ``receive`` from one task at a time (the runtime's reader); ``cancel`` is
synchronous and may be called from anywhere, including ``finally`` blocks of cancelled
handlers.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable

import trio

from trioserve.worker.child_process import ChildProcess, StartedChild, start_child
from trioserve.worker.exit_status import describe_exit, signal_in_words
from trioserve.worker.protocol import (
    CLOSED,
    NEED_DATA,
    Done,
    PreparedRequest,
    ProtocolViolation,
    Ready,
    Record,
    RecordDecoder,
    WorkerError,
    WorkerExited,
    WorkerHung,
    encode_cancel,
)

log = logging.getLogger("trioserve.worker")

CANCEL_FD_ENV = "TRIOSERVE_CANCEL_FD"
# Request lines are written in pieces of one pipe buffer: each piece must be taken by the
# worker within the caller's progress timeout. A long line to a busy worker legitimately
# takes many of its steps (it reads stdin between steps); a worker that stops reading for
# a whole timeout is hung.
WRITE_CHUNK = 65536
READ_CHUNK = 65536
# How long a worker whose stdout reached EOF may take to exit before the error is raised
# without its exit status (a crashed worker is gone within milliseconds).
EXIT_REAP_WAIT = 1.0

# Kept for the modules that imported them from here before the codec existed.
ReadyInfo = Ready
__all__ = ["StartedWorker", "WorkerClient", "start_worker_process", "WorkerError", "WorkerExited",
           "WorkerHung", "ProtocolViolation", "ReadyInfo", "CANCEL_FD_ENV"]


@dataclass(frozen=True)
class StartedWorker:
    """A worker process started (``start_worker_process``) whose ready record nobody has read
    yet: the child and the write end of its cancel pipe, both owned by whoever holds this
    until ``WorkerClient.spawn`` takes it."""

    child: StartedChild
    cancel_w: int

    @property
    def pid(self) -> int:
        return self.child.popen.pid

    def kill(self) -> None:
        """Kill and reap the child and close every fd (synchronous: for an owner outside the
        event loop, such as a startup that failed before the loop ran)."""
        os.close(self.cancel_w)
        self.child.kill()


def start_worker_process(argv: list[str], env: dict[str, str] | None = None) -> StartedWorker:
    """Start a worker (``env``: its whole environment, the server's when None) with its cancel
    pipe, without waiting for it. Synchronous, so it also works before the event loop starts.

    Raises:
        WorkerError: the OS refused (no fds, fork failing, no such executable); no child is
            left and every fd made here is closed.
    """
    try:
        cancel_r, cancel_w = os.pipe()
    except OSError as exc:
        raise WorkerError(f"cannot create the cancel pipe: {exc}") from exc
    try:
        os.set_blocking(cancel_w, False)
        child_env = dict(os.environ if env is None else env)
        child_env[CANCEL_FD_ENV] = str(cancel_r)
        child = start_child(argv, env=child_env, pass_fds=(cancel_r,))
    except (OSError, subprocess.SubprocessError) as exc:
        os.close(cancel_w)
        raise WorkerError(f"cannot start worker {argv[0]!r}: {exc}") from exc
    except BaseException:
        os.close(cancel_w)
        raise
    finally:
        os.close(cancel_r)
    return StartedWorker(child, cancel_w)


class WorkerClient:
    """One running worker process and its pipes (see the module docstring for the rules)."""

    def __init__(self, process: ChildProcess, cancel_w: int | None, ready: Ready,
                 decoder: RecordDecoder) -> None:
        self.process = process
        self.ready = ready
        self._cancel_w = cancel_w if ready.supports_cancel else None
        if cancel_w is not None and self._cancel_w is None:
            os.close(cancel_w)  # worker did not accept cancel: don't keep a dead pipe
        self._decoder = decoder
        self._next_id = 1
        self._write_lock = trio.StrictFIFOLock()
        # Set when a line was only partly written (a timeout or cancellation interrupted
        # it): the worker would read the rest of the stream shifted, so nothing more may
        # be written.
        self._stdin_torn = False
        self.generations_done = 0  # done records received: this worker has served

    # -- spawning -------------------------------------------------------------------

    @classmethod
    async def spawn(
        cls,
        argv: list[str],
        *,
        nursery: trio.Nursery,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
        started: StartedWorker | None = None,
    ) -> WorkerClient:
        """Start the worker (or take ``started``, one that ``start_worker_process`` started
        for this ``argv`` and ``env`` earlier) and wait (bounded) for its ready record.

        A task copying the worker's stderr to the log is started in ``nursery`` at once
        (model loading can log more than a pipe buffer holds); it ends when the worker
        closes stderr. Every failure is a WorkerError — the OS refusing resources
        (``os.pipe`` or ``fork`` failing with EMFILE/ENOMEM/EAGAIN under exhaustion), a
        missing executable, a worker that exits, writes garbage, speaks another protocol
        version or stays silent past ``ready_timeout`` — so the supervisor retries rather
        than dies; the child is reaped and every fd closed before the error propagates.
        Cancellation: the child is stopped (bounded, shielded) and Cancelled propagates.
        """
        if started is None:
            started = start_worker_process(argv, env)
        process, cancel_w = ChildProcess.adopt(started.child), started.cancel_w
        nursery.start_soon(_copy_stderr_to_log, process.stderr, process.pid)
        decoder = RecordDecoder()
        client = None
        try:
            with trio.move_on_after(ready_timeout) as scope:
                record = await _receive(process, decoder)
            if scope.cancelled_caught:
                raise WorkerError(f"worker sent no ready record within {ready_timeout:g} s")
            if record is None:
                await process.wait()
                code = process.returncode
                how = (f"died by {signal_in_words(-code)} during startup" if code is not None and code < 0
                       else f"exited during startup (exit status {code})")
                raise WorkerExited(f"worker {how}", returncode=code, during_startup=True)
            assert isinstance(record, Ready), "the decoder admits only a ready record first"
            client = cls(process, cancel_w, record, decoder)
            return client
        finally:
            if client is None:
                await _stop_process(process, cancel_w, exit_wait=1.0, term_wait=2.0, kill_wait=10.0)

    # -- protocol -------------------------------------------------------------------

    @property
    def max_line_bytes(self) -> int:
        return self.ready.max_line_bytes

    async def send_request(self, request: PreparedRequest, *, progress_timeout: float,
                           register: Callable[[int], None] = lambda rid: None) -> int:
        """Write one request line with a fresh id and return the id.

        Under the write lock: allocate the next id, call ``register(id)`` (synchronous;
        so the caller can route the answer before it can possibly arrive), write the line.
        Each 64 KiB piece must be taken by the worker within ``progress_timeout`` seconds,
        else WorkerHung. Raises WorkerExited when stdin is gone. A write that did not
        complete (timeout, cancellation, broken pipe) leaves stdin unusable: later calls
        raise WorkerError.
        """
        async with self._write_lock:
            if self._stdin_torn:
                raise WorkerError("an earlier request line was only partly written")
            rid = self._next_id
            self._next_id += 1
            data = memoryview(request.line(rid))
            register(rid)
            stdin = self.process.stdin
            self._stdin_torn = True
            try:
                for start in range(0, len(data), WRITE_CHUNK):
                    with trio.move_on_after(progress_timeout) as scope:
                        await stdin.send_all(data[start:start + WRITE_CHUNK])
                    if scope.cancelled_caught:
                        raise WorkerHung(f"worker did not read its stdin for {progress_timeout:g} s")
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise WorkerExited("worker's stdin is closed") from exc
            self._stdin_torn = False
            return rid

    async def receive(self) -> Record:
        """Read the next record. Raises WorkerExited at EOF, ProtocolViolation on garbage.

        At EOF the worker is given ``EXIT_REAP_WAIT`` seconds to exit, so that the error
        says how it ended ("worker died by segmentation fault (SIGSEGV)") rather than only
        that its stdout closed; a worker still running after that is left to ``stop``.
        """
        record = await _receive(self.process, self._decoder)
        if record is None:
            with trio.move_on_after(EXIT_REAP_WAIT):
                await self.process.wait()
            code = self.process.returncode
            if code is None:
                raise WorkerExited("worker closed its stdout")
            raise WorkerExited(f"worker {describe_exit(code)}", returncode=code)
        if isinstance(record, Done):
            self.generations_done += 1
        return record

    async def receive_batch(self) -> list[Record]:
        """Every complete record of the next read of stdout, in order (at least one): the
        reader wakes once per read, not once per record (a worker writes all of a step's
        records before it waits again). Records already buffered are returned without
        reading. Raises as :meth:`receive` (WorkerExited at EOF, ProtocolViolation on
        garbage); a violation after good records of the same read is raised by the next
        call, so the good records are delivered first."""
        while True:
            batch = self._decoder.next_records()
            if batch is CLOSED:
                return [await self.receive()]  # raises WorkerExited, with the exit status
            if batch is not NEED_DATA:
                break
            self._decoder.receive_data(await _read_once(self.process.stdout))
        assert isinstance(batch, list)
        self.generations_done += sum(1 for r in batch if type(r) is Done)
        return batch

    def cancel(self, request_id: int) -> bool:
        """Ask the worker to stop request ``request_id``; never blocks, never raises.

        Returns False when the frame could not be delivered (no cancel support, pipe full
        or broken); the caller's grace-period deadline then covers it.
        """
        if self._cancel_w is None:
            return False
        try:
            written = os.write(self._cancel_w, encode_cancel(request_id))
        except BlockingIOError:
            return False
        except OSError as exc:
            log.warning("cancel pipe failed (%s); falling back to the kill path", exc)
            _close_quietly(self._cancel_w)
            self._cancel_w = None
            return False
        return written == 8

    @property
    def supports_cancel(self) -> bool:
        return self._cancel_w is not None

    # -- stopping -------------------------------------------------------------------

    async def stop(self, *, exit_wait: float, term_wait: float, kill_wait: float = 10.0) -> str:
        """Stop the child and reap it; idempotent; shielded so it completes when cancelled.

        Each step is bounded: close stdin (the worker treats EOF as "exit now") and stdout
        (a child blocked writing into a full pipe would never see SIGTERM) and the cancel
        pipe; wait ``exit_wait`` s for an orderly exit (0: don't wait — the worker is hung);
        SIGTERM and wait ``term_wait`` s; SIGKILL and wait ``kill_wait`` s. stderr is left
        to its forwarder, which reads the last log lines and closes it at EOF.

        Returns how it ended: "exited", "sigterm", "sigkill", or "unreaped" when even
        SIGKILL did not end it in time (a process stuck in the kernel; logged).
        """
        cancel_w, self._cancel_w = self._cancel_w, None
        return await _stop_process(self.process, cancel_w, exit_wait=exit_wait,
                                   term_wait=term_wait, kill_wait=kill_wait)


async def _receive(process: ChildProcess, decoder: RecordDecoder) -> Record | None:
    """The next record from ``process``'s stdout, or None at EOF between records."""
    while True:
        record = decoder.next_record()
        if record is CLOSED:
            return None
        if record is not NEED_DATA:
            return record
        decoder.receive_data(await _read_once(process.stdout))


async def _read_once(stdout: trio.lowlevel.FdStream) -> bytes:
    """One read of the worker's stdout (``b""`` at EOF) with one trip through the scheduler.

    ``FdStream.receive_some`` checkpoints before it tries the read and then waits for the
    fd: two scheduler passes for every read, i.e. for every step's records. Waiting first
    is one, and still a checkpoint (the reader cannot starve other tasks however fast the
    worker writes). Cancellation: a cancelled wait raises Cancelled with nothing read.
    """
    fd = stdout.fileno()
    if fd < 0:
        raise WorkerExited("worker's stdout is closed")
    while True:
        try:
            await trio.lowlevel.wait_readable(fd)
            return os.read(fd, READ_CHUNK)
        except BlockingIOError:
            continue  # woken without data (another reader cannot exist; be safe)
        except (trio.ClosedResourceError, trio.BrokenResourceError, OSError) as exc:
            raise WorkerExited("worker's stdout is closed") from exc


async def _stop_process(process: ChildProcess, cancel_w: int | None, *, exit_wait: float,
                        term_wait: float, kill_wait: float) -> str:
    with trio.CancelScope(shield=True):
        if cancel_w is not None:
            _close_quietly(cancel_w)
        for stream in (process.stdin, process.stdout):
            try:
                await stream.aclose()
            except trio.BrokenResourceError:
                pass
        if process.returncode is None and exit_wait > 0:
            with trio.move_on_after(exit_wait):
                await process.wait()
        if process.returncode is not None:
            return "exited"
        _signal(process, signal.SIGTERM)
        with trio.move_on_after(term_wait):
            await process.wait()
        if process.returncode is not None:
            return "sigterm"
        _signal(process, signal.SIGKILL)
        with trio.move_on_after(kill_wait):
            await process.wait()
        if process.returncode is not None:
            return "sigkill"
        log.error("worker %d did not die within %g s of SIGKILL", process.pid, kill_wait)
        return "unreaped"
    raise AssertionError("unreachable: the shielded scope above is never cancelled")


async def _copy_stderr_to_log(stream: trio.abc.ReceiveStream, pid: int) -> None:
    """Forward the worker's stderr, line by line, to the ``trioserve.worker`` logger.

    Never stops reading before EOF (a full stderr pipe would block the worker); an
    overlong line is logged in pieces. Closes the stream at EOF.
    """
    pending = b""
    try:
        while data := await stream.receive_some(65536):
            pending += data
            *lines, pending = pending.split(b"\n")
            if len(pending) > 65536:
                lines.append(pending)
                pending = b""
            for line in lines:
                log.info("[worker %d] %s", pid, line.decode("utf-8", "replace"))
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
    if pending:
        log.info("[worker %d] %s", pid, pending.decode("utf-8", "replace"))


def _signal(process: ChildProcess, sig: int) -> None:
    try:
        process.send_signal(sig)
    except ProcessLookupError:
        pass


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:  # pragma: no cover - only EBADF on a double close
        if exc.errno != errno.EBADF:
            raise
