"""A child process spawned from the Trio thread itself (or from the thread that is about to
run ``trio.run``: worker/early_start.py), with Trio streams for its pipes.

Why not ``trio.lowlevel.open_process``: it forks from a worker thread of Trio's thread
cache, and Linux ties ``PR_SET_PDEATHSIG`` to the *thread* that forked. Trio retires idle
cache threads after about ten seconds, so a worker that asks to die with its parent
(ours do, so a SIGKILLed server never leaves an orphan holding the model) would be
killed ten seconds after it started. Forking from the thread running ``trio.run`` keeps
the parent-death signal tied to the server's lifetime. ``subprocess.Popen`` uses vfork
here, so the event loop is blocked for about a millisecond per spawn.

Waiting uses a pidfd (Linux ≥ 5.3), so no thread or SIGCHLD handler is involved.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import trio


class ChildProcess:
    """The running child: ``pid``, ``stdin``/``stdout``/``stderr`` Trio streams,
    ``returncode`` (None while running), ``wait()`` and ``send_signal()``."""

    def __init__(self, popen: subprocess.Popen[bytes], pidfd: int, stdin: trio.lowlevel.FdStream,
                 stdout: trio.lowlevel.FdStream, stderr: trio.lowlevel.FdStream) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._pidfd = pidfd

    @classmethod
    def adopt(cls, child: StartedChild) -> ChildProcess:
        """Take over ``child`` (started earlier, maybe before the event loop ran): its fds
        become Trio streams owned by the returned object."""
        return cls(child.popen, child.pidfd, trio.lowlevel.FdStream(child.stdin_w),
                   trio.lowlevel.FdStream(child.stdout_r), trio.lowlevel.FdStream(child.stderr_r))

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        """Wait for the child to exit and reap it; returns its exit status (−N for signal N)."""
        if self._popen.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
            self._popen.wait()
        # Popen.send_signal may already have reaped the child through poll(); either way
        # the pidfd is done with once the exit status is known.
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        return self._popen.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child unless it has already been reaped (so a recycled pid is safe)."""
        self._popen.send_signal(sig)


@dataclass(frozen=True)
class StartedChild:
    """A child just started, before any Trio stream wraps its pipes: the parent's ends as raw
    fds, so that an owner outside the event loop can still close them (``kill``)."""

    popen: subprocess.Popen[bytes]
    pidfd: int
    stdin_w: int
    stdout_r: int
    stderr_r: int

    def kill(self) -> None:
        """SIGKILL the child, reap it (bounded: a child stuck in the kernel is left to its
        parent-death signal) and close every fd. Synchronous: for use outside the event loop."""
        self.popen.kill()
        try:
            self.popen.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            pass
        for fd in (self.pidfd, self.stdin_w, self.stdout_r, self.stderr_r):
            os.close(fd)


def start_child(argv: list[str], *, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> StartedChild:
    """Start ``argv`` with three new pipes, in its own session (group signals such as a
    terminal's Ctrl-C must not reach it behind the supervisor's back). Synchronous and free of
    the event loop, so it also runs before ``trio.run`` (from the thread that will run it: the
    parent-death signal is tied to that thread, see the module docstring).

    Raises OSError (or SubprocessError) when the OS refuses — no fds left, fork failing, no
    such executable — with every fd it made closed and no child left."""
    fds: list[int] = []
    try:
        in_r, in_w = os.pipe()
        fds += [in_r, in_w]
        out_r, out_w = os.pipe()
        fds += [out_r, out_w]
        err_r, err_w = os.pipe()
        fds += [err_r, err_w]
        popen = subprocess.Popen(argv, stdin=in_r, stdout=out_w, stderr=err_w, env=env,
                                 pass_fds=pass_fds, start_new_session=True)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    try:
        # pidfd_open can fail (EMFILE under fd exhaustion) after the child started: kill
        # and reap it here, or nobody could (the caller never gets a StartedChild).
        pidfd = os.pidfd_open(popen.pid)
    except BaseException:
        popen.kill()
        popen.wait()
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    return StartedChild(popen, pidfd, in_w, out_r, err_r)
