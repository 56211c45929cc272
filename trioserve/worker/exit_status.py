"""A worker's exit status in words, for the log, errors and ``/health``.

A worker that dies by a signal is most often a CPU kernel fault (an instruction this CPU
lacks, or a kernel bug such as llama.cpp's AMX crash), so the words name the signal the way
an operator would search for it: "illegal instruction (SIGILL)". The C++ probe
(cpp/kernel_probe.h, ``signal_in_words``) uses the same words.
"""

from __future__ import annotations

import signal

# Exit status of a llama worker that refuses to start because this CPU lacks instruction-set
# extensions its llama.cpp build was compiled for (cpp/cpu_check.h). Restarting cannot help.
EXIT_INCOMPATIBLE_CPU = 3

_SIGNAL_WORDS = {
    signal.SIGILL: "illegal instruction",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating-point exception",
    signal.SIGABRT: "aborted",
    signal.SIGKILL: "killed",
    signal.SIGTERM: "terminated",
}


def signal_in_words(signum: int) -> str:
    """``"illegal instruction (SIGILL)"``; for other signals the C library's description."""
    try:
        sig = signal.Signals(signum)
    except ValueError:
        return f"signal {signum}"
    words = _SIGNAL_WORDS.get(sig) or (signal.strsignal(sig) or "signal").lower()
    return f"{words} ({sig.name})"


def describe_exit(returncode: int | None) -> str:
    """``"died by illegal instruction (SIGILL)"``, ``"exited with exit status 1"``, or
    ``"is still running"``: a verb phrase, as in "worker died by ...".

    ``returncode`` as subprocess reports it: negative = killed by that signal.
    """
    if returncode is None:
        return "is still running"
    if returncode < 0:
        return f"died by {signal_in_words(-returncode)}"
    return f"exited with exit status {returncode}"


__all__ = ["EXIT_INCOMPATIBLE_CPU", "describe_exit", "signal_in_words"]
