"""WorkerClient: the raw transport to one C++ worker process.

This layer knows the wire format of ``spec/worker-protocol.md`` — JSONL over the child's
stdin/stdout, the ready handshake and the out-of-band cancel pipe — and nothing about
OpenAI, queues or sessions.

Ownership: a WorkerClient owns one child process, its three pipes and the write end of
its cancel pipe. ``WorkerClient.spawn`` returns only after the ready record arrived (or
raises, with the child reaped). ``stop`` always reaps the child and closes every fd,
even when called from a cancelled scope.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import struct
from dataclasses import dataclass
from typing import Any

import trio

from .child_process import ChildProcess

log = logging.getLogger("trioserve.worker")

PROTOCOL_VERSION = 1
CANCEL_FD_ENV = "TRIOSERVE_CANCEL_FD"
# The worker bounds its input lines at 1 MiB; the parent bounds what it reads generously
# above that, because a ready record carries a chat template and a done record can carry
# a whole context window of generated ids.
MAX_RECORD_BYTES = 8 * 1024 * 1024


class WorkerError(Exception):
    """The worker process failed as a whole (died, hung, or broke the protocol).

    Distinct from a per-request error record, which the worker survives.
    """


class WorkerExited(WorkerError):
    """The worker closed stdout: it exited or is exiting."""


class ProtocolViolation(WorkerError):
    """The worker wrote something that is not a protocol record."""


@dataclass(frozen=True)
class ReadyInfo:
    """What the worker's ready record says about the served model."""

    raw: dict[str, Any]

    @property
    def supports_cancel(self) -> bool:
        return self.raw.get("capabilities", {}).get("supports_cancel") is True

    @property
    def n_ctx(self) -> int:
        return int(self.raw.get("n_ctx") or 0)

    @property
    def capacity(self) -> int:
        return int(self.raw.get("capacity") or 1)

    @property
    def chat_template(self) -> str | None:
        return self.raw.get("chat_template") or None

    @property
    def special_tokens(self) -> dict[str, Any]:
        return self.raw.get("special_tokens") or {}

    @property
    def model_name(self) -> str:
        return (self.raw.get("model") or {}).get("name") or "model"


class _LineReader:
    """Reads newline-terminated records from a stream with a hard bound on line length.

    The bound overshoots by at most one ``receive_some`` chunk before failing, so a
    runaway child can never make the parent buffer without limit.
    """

    def __init__(self, stream: trio.abc.ReceiveStream, max_line: int) -> None:
        self._stream = stream
        self._max_line = max_line
        self._buf = bytearray()
        self._scan_from = 0

    async def readline(self) -> bytes | None:
        """Return the next line without its newline, or None at EOF.

        Bytes after the last newline at EOF are returned as a final (unterminated) line.
        """
        while True:
            nl = self._buf.find(b"\n", self._scan_from)
            if nl >= 0:
                line = bytes(self._buf[:nl])
                del self._buf[: nl + 1]
                self._scan_from = 0
                return line
            self._scan_from = len(self._buf)
            if len(self._buf) > self._max_line:
                raise ProtocolViolation(f"worker wrote a line longer than {self._max_line} bytes")
            data = await self._stream.receive_some(65536)
            if not data:
                if self._buf:
                    line = bytes(self._buf)
                    self._buf.clear()
                    return line
                return None
            self._buf += data


class WorkerClient:
    """One running worker process and its pipes.

    Not safe for concurrent ``send``/``receive`` from several tasks: exactly one task (the
    runtime's dispatcher) drives the protocol. ``cancel`` is synchronous and may be called
    from any task, including from ``finally`` blocks of cancelled handlers.
    """

    def __init__(self, process: ChildProcess, cancel_w: int | None, ready: ReadyInfo) -> None:
        self.process = process
        self.ready = ready
        self._cancel_w = cancel_w if ready.supports_cancel else None
        if cancel_w is not None and self._cancel_w is None:
            os.close(cancel_w)  # worker did not accept cancel: don't keep a dead pipe
        self._reader = _LineReader(process.stdout, MAX_RECORD_BYTES)
        self._next_id = 1
        self._closed = False

    # -- spawning -------------------------------------------------------------------

    @classmethod
    async def spawn(
        cls,
        argv: list[str],
        *,
        nursery: trio.Nursery,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
    ) -> WorkerClient:
        """Start the worker and wait (bounded) for its ready record.

        A task copying the worker's stderr to the log is started in ``nursery`` at once
        (model loading can log more than a pipe buffer holds); it ends when the worker
        closes stderr. Raises WorkerError when the worker exits, writes garbage or stays
        silent past ``ready_timeout``; the child is reaped before the error propagates.
        """
        cancel_r, cancel_w = os.pipe()
        os.set_blocking(cancel_w, False)
        child_env = dict(os.environ if env is None else env)
        child_env[CANCEL_FD_ENV] = str(cancel_r)
        try:
            process = ChildProcess.spawn(argv, env=child_env, pass_fds=(cancel_r,))
        except OSError as exc:
            os.close(cancel_w)
            raise WorkerError(f"cannot start worker {argv[0]!r}: {exc}") from exc
        except BaseException:
            os.close(cancel_w)
            raise
        finally:
            os.close(cancel_r)
        nursery.start_soon(_copy_stderr_to_log, process.stderr, process.pid)
        client = None
        try:
            reader = _LineReader(process.stdout, MAX_RECORD_BYTES)
            with trio.move_on_after(ready_timeout) as scope:
                line = await reader.readline()
            if scope.cancelled_caught:
                raise WorkerError(f"worker sent no ready record within {ready_timeout:g} s")
            if line is None:
                await process.wait()
                raise WorkerExited(f"worker exited during startup (exit status {process.returncode})")
            record = _decode(line)
            if record.get("type") != "ready":
                raise ProtocolViolation(f"worker's first record is not 'ready': {line[:200]!r}")
            if record.get("protocol") != PROTOCOL_VERSION:
                raise ProtocolViolation(
                    f"worker speaks protocol {record.get('protocol')!r}; this server speaks {PROTOCOL_VERSION}"
                )
            client = cls(process, cancel_w, ReadyInfo(record))
            client._reader = reader  # keep whatever the reader already buffered
            return client
        finally:
            if client is None:
                await WorkerClient(process, cancel_w, ReadyInfo({})).stop(exit_wait=1.0, term_wait=2.0)

    # -- protocol -------------------------------------------------------------------

    def next_request_id(self) -> int:
        """Allocate the next request id (strictly increasing for this process)."""
        rid = self._next_id
        self._next_id += 1
        return rid

    async def send(self, request: dict[str, Any]) -> None:
        """Write one request line. Raises WorkerExited if the worker's stdin is gone."""
        data = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        try:
            await self.process.stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise WorkerExited("worker's stdin is closed") from exc

    async def receive(self) -> dict[str, Any]:
        """Read the next record. Raises WorkerExited at EOF, ProtocolViolation on garbage."""
        try:
            line = await self._reader.readline()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise WorkerExited("worker's stdout is closed") from exc
        if line is None:
            raise WorkerExited("worker closed its stdout")
        return _decode(line)

    def cancel(self, request_id: int) -> bool:
        """Ask the worker to stop request ``request_id``; never blocks, never raises.

        Returns False when the frame could not be delivered (no cancel support, pipe full
        or broken); the caller's grace-period deadline then covers it.
        """
        if self._cancel_w is None:
            return False
        try:
            written = os.write(self._cancel_w, struct.pack("<Q", request_id))
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
        with trio.CancelScope(shield=True):
            if self._cancel_w is not None:
                _close_quietly(self._cancel_w)
                self._cancel_w = None
            process = self.process
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


def _decode(line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolViolation(f"worker wrote a line that is not JSON: {line[:200]!r}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise ProtocolViolation(f"worker wrote a record without a type: {line[:200]!r}")
    return record


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError as exc:  # pragma: no cover - only EBADF on a double close
        if exc.errno != errno.EBADF:
            raise
