"""A child process spawned from the Trio thread itself, with Trio streams for its pipes.

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
    def spawn(cls, argv: list[str], *, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> ChildProcess:
        """Start ``argv`` with three new pipes, in its own session (group signals such as a
        terminal's Ctrl-C must not reach it behind the supervisor's back).

        Raises OSError (or SubprocessError) when the OS refuses — no fds left, fork
        failing, no such executable — with every fd it made closed and no child left."""
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
            # and reap it here, or nobody could (the caller never gets a ChildProcess).
            pidfd = os.pidfd_open(popen.pid)
        except BaseException:
            popen.kill()
            popen.wait()
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        return cls(popen, pidfd, trio.lowlevel.FdStream(in_w), trio.lowlevel.FdStream(out_r),
                   trio.lowlevel.FdStream(err_r))

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
