"""Fault injection of trioserve-fake-worker: each mode gives its documented behaviour."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest


def test_exit_after_tokens_crashes_with_77(fake, script_file):
    w = fake("--script", script_file(["abcdefgh"]), "--exit-after-tokens", "3")
    w.send({"op": "generate", "id": 1, "prompt": "x"})
    texts = []
    while (line := w.read_line(10)) is not None:
        rec = json.loads(line)
        assert rec["type"] == "token"
        texts.append(rec["text"])
    assert "".join(texts) == "abc"
    assert w.proc.wait(10) == 77


def test_exit_after_tokens_counts_over_process_life(fake, script_file):
    w = fake("--script", script_file(["ab"]), "--exit-after-tokens", "3")
    texts, done = w.generate(1, prompt="x")
    assert "".join(texts) == "ab" and done["type"] == "done"
    w.send({"op": "generate", "id": 2, "prompt": "x"})
    assert w.record()["text"] == "a"
    assert w.read_line(10) is None
    assert w.proc.wait(10) == 77


def _hang(fake, script_file, *extra):
    w = fake("--script", script_file(["abcdefgh"]), "--hang-after-tokens", "2", *extra)
    w.send({"op": "generate", "id": 1, "prompt": "x"})
    assert w.record()["text"] == "a"
    assert w.record()["text"] == "b"
    deadline = time.monotonic() + 10
    while "hanging" not in w.stderr_text():  # the worker logs when it enters the hang
        assert time.monotonic() < deadline, w.stderr_text()
        time.sleep(0.01)
    w.cancel(1)  # ignored while hung
    with pytest.raises(TimeoutError):
        w.read_line(0.5)
    # stdin EOF and cancel-pipe EOF do not end a hung worker either.
    w.proc.stdin.close()
    with pytest.raises(subprocess.TimeoutExpired):
        w.proc.wait(0.5)
    return w


def test_hang_after_tokens_needs_sigterm(fake, script_file):
    w = _hang(fake, script_file)
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(10) == -signal.SIGTERM


def test_hang_with_ignore_sigterm_needs_sigkill(fake, script_file):
    w = _hang(fake, script_file, "--ignore-sigterm")
    w.proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        w.proc.wait(0.5)
    w.proc.send_signal(signal.SIGKILL)
    assert w.proc.wait(10) == -signal.SIGKILL


def test_ignore_sigterm_while_idle(fake):
    w = fake("--ignore-sigterm")
    w.proc.send_signal(signal.SIGTERM)
    assert w.request({"op": "ping", "id": 1})["type"] == "pong"


def test_garbage_line_once(fake, script_file):
    w = fake("--script", script_file(["ok"]), "--garbage-line")
    w.send({"op": "generate", "id": 1, "prompt": "x"})
    line = w.read_line()
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)
    texts, done = w.collect(1)
    assert "".join(texts) == "ok" and done["type"] == "done"
    texts, done = w.generate(2, prompt="x")  # only once
    assert "".join(texts) == "ok"


def test_slow_start(fake):
    t0 = time.monotonic()
    w = fake("--slow-start-ms", "300", ready=False)
    with pytest.raises(TimeoutError):
        w.read_line(0.05)
    assert w.wait_ready(10)["type"] == "ready"
    assert time.monotonic() - t0 >= 0.25


def test_no_cancel_ignores_frames(fake, script_file):
    w = fake("--no-cancel", "--script", script_file(["abcdef"]), "--token-delay-ms", "20")
    assert w.ready["capabilities"]["supports_cancel"] is False
    w.send({"op": "generate", "id": 1, "prompt": "x"})
    w.cancel(1)  # the worker never reads the pipe
    texts, done = w.collect(1)
    assert "".join(texts) == "abcdef" and done["cancelled"] is False


def test_help_and_bad_flags(bin_dir):
    out = subprocess.run([str(bin_dir / "trioserve-fake-worker"), "--help"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0
    for flag in ("--exit-after-tokens", "--hang-after-tokens", "--garbage-line", "--slow-start-ms", "--no-cancel",
                 "--token-delay-ms", "--prefill-ms-per-token", "--ignore-sigterm", "--script", "--chat-template",
                 "--batch-tokens", "--capacity", "--prefill-chunk"):
        assert flag in out.stdout
    bad = subprocess.run([str(bin_dir / "trioserve-fake-worker"), "--bogus"], capture_output=True, text=True,
                         timeout=10, stdin=subprocess.DEVNULL)
    assert bad.returncode != 0 and bad.stdout == ""
