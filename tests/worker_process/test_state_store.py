"""The persistent state store (spec/worker-protocol.md §6.4) on the fake worker: states written
after a turn are found again by content by a restarted (or killed and restarted) worker, and
every fault — a corrupt, truncated, foreign-model or older-format file, a symlink, a read-only,
vanished or full directory — is served cold with the worker still answering.

The fake engine's state is its token ids and ``--echo-digest`` echoes a digest of the slot's
whole state, so an output equal to a cold worker's proves the loaded state was exactly the
prompt's prefix."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.executorch_assets import PROGRAMS, TOKENIZER, executorch_worker, expected
from testkit.worker_process import Worker

from .session_turns import cold_echo
from trioserve.cli import main

SYS = "You are a coding agent. Read the files, then answer with a patch and nothing else. " * 6
TURN1 = SYS + "user: fix the failing test in parser.py"
TURN2 = TURN1 + " -> done. user: now add a test for the empty input case"


def _store_flags(state_dir: Path, *more: str) -> tuple[str, ...]:
    return ("--echo-digest", "--state-dir", str(state_dir), *more)


def _files(state_dir: Path) -> list[Path]:
    return sorted(state_dir.glob("*.tss"))


def _wait_files(state_dir: Path, n: int = 1, timeout: float = 10.0) -> list[Path]:
    """The store's files once at least ``n`` exist (the writer thread writes after the turn)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = _files(state_dir)
        if len(files) >= n:
            return files
        time.sleep(0.02)
    raise AssertionError(f"no state file in {state_dir} within {timeout} s: {os.listdir(state_dir)}")


def _cold(fake, prompt: str) -> str:
    w = fake("--echo-digest")
    texts, done = w.generate(1, prompt=prompt)
    assert done["prefill_plan"] == "new", done
    w.close()
    return "".join(texts)


def _seed(fake, state_dir: Path, *flags: str, session: str | None = "agent") -> None:
    """One worker runs TURN1 (named ``session``, or anonymous) and exits; its state is stored."""
    w = fake(*_store_flags(state_dir, *flags))
    fields = {"session_id": session} if session else {}
    _, done = w.generate(1, prompt=TURN1, **fields)
    assert done["type"] == "done", done
    assert w.close() == 0
    assert _files(state_dir), "the drain at stdin EOF writes the state"


def _assert_cold_and_alive(w: Worker, rid: int = 1) -> None:
    texts, done = w.generate(rid, prompt=TURN2, session_id="agent")
    assert done["type"] == "done" and done.get("copy_source") != "disk", done
    assert done["reused_prompt_tokens"] == 0
    assert w.request({"op": "ping", "id": rid + 1})["type"] == "pong"


def test_ready_record_reports_the_store(fake, tmp_path):
    d = tmp_path / "states"
    w = fake(*_store_flags(d, "--state-dir-bytes", "123456"))
    store = w.ready["state_store"]
    assert store["dir"] == str(d) and store["bound_bytes"] == 123456 and store["files"] == 0
    assert store["format_version"] == 1
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert fake("--echo-digest").ready["state_store"] is None  # off by default


def test_restarted_worker_starts_a_returning_session_from_disk(fake, tmp_path):
    d = tmp_path / "states"
    w = fake(*_store_flags(d))
    _, d1 = w.generate(1, prompt=TURN1, session_id="agent")
    (f,) = _wait_files(d)  # written after the turn, while the worker idles
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert d1["state_store"]["files"] in (0, 1)
    assert w.close() == 0
    w2 = fake(*_store_flags(d))
    assert w2.ready["state_store"]["files"] == 1
    texts, d2 = w2.generate(1, prompt=TURN2, session_id="agent")
    assert d2["prefill_plan"] == "copied" and d2["copy_source"] == "disk", d2
    assert d2["reused_prompt_tokens"] == len(TURN1) >= 0.5 * len(TURN2)
    assert d2["state_store"]["hits"] == 1
    assert "".join(texts) == _cold(fake, TURN2)
    # An anonymous request with the same system prompt starts from the stored prefix too.
    other = SYS + "user: something else entirely"
    texts, d3 = w2.generate(3, prompt=other)
    assert d3["prefill_plan"] == "copied" and d3["reused_prompt_tokens"] >= len(SYS)
    assert "".join(texts) == _cold(fake, other)


def test_sigkilled_worker_loses_at_most_the_turn_in_flight(fake, tmp_path):
    d = tmp_path / "states"
    w = fake(*_store_flags(d))
    w.generate(1, prompt=TURN1, session_id="agent")
    _wait_files(d)
    w.kill()  # no drain: only what the writer finished is there
    w2 = fake(*_store_flags(d))
    texts, done = w2.generate(1, prompt=TURN2, session_id="agent")
    assert done["copy_source"] == "disk" and done["reused_prompt_tokens"] == len(TURN1)
    assert "".join(texts) == _cold(fake, TURN2)


def test_a_recurrent_models_states_are_stored_where_its_prompts_diverge(fake, tmp_path):
    """A recurrent (hybrid) state is usable only where a prompt extends all of it, and a thinking
    template's next turn diverges before the end of the stored turn (the reasoning is dropped).
    So the prefix states at the checkpoint positions (the system prompt's end, marked by the
    control plane, and the prompt's end) are stored too: after a restart the next turn starts
    from the previous prompt and another session from the system prompt."""
    d = tmp_path / "states"
    recurrent = ("--recurrent", *_store_flags(d))
    prompt1 = "user: list the files\nassistant:"
    w = fake(*recurrent)
    _, d1 = w.generate(1, prompt_segments=[{"text": SYS, "checkpoint": True}, {"text": prompt1}], session_id="agent")
    assert d1["type"] == "done", d1
    _wait_files(d, 3)  # the two prefixes (written at once) and the turn (written while idle)
    assert w.close() == 0
    w2 = fake(*recurrent)
    turn2 = SYS + prompt1 + "[answer without its reasoning]\nuser: and the tests?\nassistant:"
    texts, d2 = w2.generate(1, prompt=turn2, session_id="agent")
    assert d2["copy_source"] == "disk" and d2["reused_prompt_tokens"] == len(SYS + prompt1), d2
    assert "".join(texts) == cold_echo(fake, ("--echo-digest", "--recurrent"), turn2)
    other = SYS + "user: something else entirely"
    texts, d3 = w2.generate(3, prompt=other)
    assert d3["copy_source"] == "disk" and d3["reused_prompt_tokens"] == len(SYS), d3
    assert "".join(texts) == cold_echo(fake, ("--echo-digest", "--recurrent"), other)


def test_a_sessions_next_turn_replaces_its_file_and_close_removes_it(fake, tmp_path):
    d = tmp_path / "states"
    w = fake(*_store_flags(d))
    w.generate(1, prompt=TURN1, session_id="agent")
    (first,) = _wait_files(d)
    w.generate(2, prompt=TURN2, session_id="agent")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (first.exists() or not _files(d)):
        time.sleep(0.02)
    assert not first.exists() and len(_files(d)) == 1  # one file per session: the newest state
    ack = w.request({"op": "session_close", "id": 3, "session_id": "agent"})
    assert ack["found"] is True
    assert _files(d) == []
    # Closed means gone: a restarted worker starts that session cold.
    w.close()
    w2 = fake(*_store_flags(d))
    _assert_cold_and_alive(w2)
    # A session only on disk (another worker's) is found and removed by close too.
    w2.close()  # stores w2's "agent" state at drain
    before = _files(d)
    _seed(fake, d, session="other")
    w3 = fake(*_store_flags(d))
    assert w3.request({"op": "session_close", "id": 1, "session_id": "other"})["found"] is True
    assert _files(d) == before
    assert w3.request({"op": "session_close", "id": 2, "session_id": "other"})["found"] is False


def test_two_workers_sharing_a_directory_find_each_others_states(fake, tmp_path):
    d = tmp_path / "shared"
    a = fake(*_store_flags(d))
    b = fake(*_store_flags(d))  # started before a wrote anything
    a.generate(1, prompt=TURN1, session_id="agent")
    _wait_files(d)
    a.kill()
    texts, done = b.generate(1, prompt=TURN2, session_id="agent")
    assert done["copy_source"] == "disk" and done["reused_prompt_tokens"] == len(TURN1)
    assert "".join(texts) == _cold(fake, TURN2)


def _rewrite(f: Path, edit) -> None:
    data = bytearray(f.read_bytes())
    f.write_bytes(bytes(edit(data)))


def _flip_last(data: bytearray) -> bytearray:
    data[-1] ^= 0xFF
    return data


def _version_2(data: bytearray) -> bytearray:
    data[8:12] = struct.pack("<I", 2)
    return data


@pytest.mark.parametrize("fault", ["corrupt body", "truncated", "older format", "garbage", "empty"])
def test_a_damaged_file_is_skipped_and_the_request_served_cold(fake, tmp_path, fault):
    d = tmp_path / "states"
    _seed(fake, d)
    (f,) = _files(d)
    if fault == "corrupt body":
        _rewrite(f, _flip_last)
    elif fault == "truncated":
        _rewrite(f, lambda b: b[: len(b) - 7])
    elif fault == "older format":
        _rewrite(f, _version_2)
    elif fault == "garbage":
        f.write_bytes(os.urandom(4096))
    else:
        f.write_bytes(b"")
    w = fake(*_store_flags(d))
    _assert_cold_and_alive(w)
    if fault == "corrupt body":  # only the body is bad: found at load, then removed
        assert not f.exists()
        assert "body checksum mismatch" in w.stderr_text()
    else:
        assert w.ready["state_store"]["files"] == 0 and w.ready["state_store"]["skipped_files"] == 1


def test_another_models_states_are_never_loaded(fake, tmp_path):
    d = tmp_path / "states"
    _seed(fake, d, "--ctx", "2048")
    w = fake(*_store_flags(d, "--ctx", "4096"))  # another "model": another fingerprint
    assert w.ready["state_store"]["files"] == 0
    _assert_cold_and_alive(w)
    assert len(_wait_files(d, 2)) == 2  # its file is left for its own model; this one wrote its own


def test_a_symlink_in_the_directory_is_never_followed(fake, tmp_path):
    d = tmp_path / "states"
    _seed(fake, d)
    (f,) = _files(d)
    outside = tmp_path / "elsewhere.tss"
    f.rename(outside)
    f.symlink_to(outside)
    w = fake(*_store_flags(d))
    assert w.ready["state_store"]["files"] == 0
    _assert_cold_and_alive(w)
    assert outside.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_is_read_but_never_written(fake, tmp_path):
    d = tmp_path / "states"
    _seed(fake, d)
    d.chmod(0o500)
    try:
        w = fake(*_store_flags(d))
        _, done = w.generate(1, prompt=TURN2, session_id="agent")
        assert done["copy_source"] == "disk"  # reading works
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the next turn's write fails: counted, logged
            _, done = w.generate(int(time.monotonic() * 1000), prompt=TURN2 + "!", session_id="agent")
            if done["state_store"]["write_failures"] > 0:
                break
            time.sleep(0.05)
        assert done["state_store"]["write_failures"] > 0
        assert w.request({"op": "ping", "id": 10**12})["type"] == "pong"
    finally:
        d.chmod(0o700)


def test_a_vanished_directory_is_served_cold(fake, tmp_path):
    d = tmp_path / "states"
    w = fake(*_store_flags(d))
    for f in _files(d):
        f.unlink()
    d.rmdir()
    _assert_cold_and_alive(w)
    _, done = w.generate(3, prompt=TURN2 + " again", session_id="agent")
    assert done["type"] == "done"
    assert _wait_files(d)  # the next write made the directory again


def test_a_full_disk_fails_the_write_not_the_worker(bin_dir, tmp_path):
    # A file size limit (RLIMIT_FSIZE, here 8 KiB) fails the write like a full disk (EFBIG
    # instead of ENOSPC): the worker ignores SIGXFSZ, removes the temp file and serves on.
    d = tmp_path / "states"
    argv = ["prlimit", "--fsize=8192", str(bin_dir / "trioserve-fake-worker"), *_store_flags(d)]
    w = Worker(argv)
    try:
        w.wait_ready()
        big = SYS * 8  # ~4k tokens: 16 KiB of fake state
        done = {}
        for rid in range(1, 40):
            _, done = w.generate(rid, prompt=big + str(rid), session_id="agent")
            if done["state_store"]["write_failures"] > 0:
                break
            time.sleep(0.05)
        assert done["state_store"]["write_failures"] > 0
        # No temp file left: the writer may still be failing a second queued state when the
        # first failure is reported, so wait (bounded) for it to clean up too.
        deadline = time.monotonic() + 10
        while any(d.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _files(d) == [] and [p for p in d.iterdir()] == []
        assert w.request({"op": "ping", "id": 1000})["type"] == "pong"
    finally:
        w.kill()
        w.close()


def test_the_store_is_bounded_in_bytes_least_recently_used_first(fake, tmp_path):
    d = tmp_path / "states"
    # A fake state file is ~8 bytes a token (ids in the header, 4-byte "cells"): ~4.3 KB here.
    w = fake(*_store_flags(d, "--state-dir-bytes", "10000", "--capacity", "6"))  # room for two files
    prompts = [f"session {i}: " + SYS for i in range(4)]
    for i, p in enumerate(prompts):
        w.generate(i + 1, prompt=p, session_id=f"s{i}")
        _wait_files(d, min(i + 1, 2))
        time.sleep(0.05)
    w.close()
    total = sum(f.stat().st_size for f in _files(d))
    assert 0 < total <= 10000 and len(_files(d)) == 2
    w2 = fake(*_store_flags(d))
    _, newest = w2.generate(1, prompt=prompts[3] + " more", session_id="s3")
    _, oldest = w2.generate(2, prompt=prompts[0] + " more", session_id="s0")
    assert newest["copy_source"] == "disk"
    assert oldest.get("copy_source") != "disk"


def test_state_command_lists_and_purges_the_store(fake, tmp_path, monkeypatch):
    monkeypatch.delenv("TRIOSERVE_STATE_DIR", raising=False)

    d = tmp_path / "states"
    _seed(fake, d, session="agent")
    _seed(fake, d, session="other")
    (d / "junk.tss").write_bytes(b"not a state")
    files = _files(d)
    listing = subprocess_run(["list", "--state-dir", str(d)])
    assert "\tagent\t" in listing and "\tother\t" in listing and "not a state file" in listing
    assert f"{len(files)} files" in listing
    assert main(["state", "purge", "--state-dir", str(d), "--session", "agent"]) == 0
    sessions = [line.split("\t")[3] for line in subprocess_run(["list", "--state-dir", str(d)]).splitlines()[1:-1]]
    assert sorted(sessions) == ["-", "other"]
    assert main(["state", "purge", "--state-dir", str(d)]) == 0
    assert list(d.iterdir()) == []
    assert main(["state", "list"]) == 2  # no directory named


def subprocess_run(args: list[str]) -> str:
    out = subprocess.run([sys.executable, "-m", "trioserve.cli", "state", *args], capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout


@pytest.mark.parametrize("kind", [("--recurrent",), ("--swa", "64", "--swa-cache", "checkpoints")])
def test_states_that_cannot_be_cut_back_are_used_whole(fake, tmp_path, script_file, kind):
    # A recurrent (hybrid) or small-window state is stored like any other; a stored one is
    # taken only when all of it is a prefix of the prompt: a session's next turn, which
    # carries the reply (the script's, ended by EOS: every reply token is resident).
    d = tmp_path / "states"
    flags = ("--script", script_file([" ok, patched."]), *kind)
    _seed(fake, d, *flags)
    w = fake(*_store_flags(d, *flags))
    resumed = TURN1 + " ok, patched. user: and the tests?"
    _, done = w.generate(1, prompt=resumed, session_id="agent")
    assert done["copy_source"] == "disk", done
    assert done["reused_prompt_tokens"] == len(TURN1 + " ok, patched."), done
    # A prompt that diverges inside the stored state cannot use it.
    _, diverged = w.generate(2, prompt=SYS + "user: something else", session_id="new")
    assert diverged.get("copy_source") != "disk" and diverged["reused_prompt_tokens"] == 0


def test_two_writers_of_the_same_state_leave_one_whole_file(fake, tmp_path):
    # Two workers on one directory store the same session's same state at once: the renames
    # replace each other atomically; what is left is one whole, loadable file.
    d = tmp_path / "states"
    a, b = fake(*_store_flags(d)), fake(*_store_flags(d))
    for w in (a, b):
        w.send({"op": "generate", "id": 1, "prompt": TURN1, "session_id": "agent"})
    for w in (a, b):
        _, done = w.collect(1)
        assert done["type"] == "done"
    assert a.close() == 0 and b.close() == 0
    assert len(_files(d)) == 1 and not [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    c = fake(*_store_flags(d))
    texts, done = c.generate(1, prompt=TURN2, session_id="agent")
    assert done["copy_source"] == "disk" and done["reused_prompt_tokens"] == len(TURN1)
    assert "".join(texts) == _cold(fake, TURN2)


@pytest.mark.parametrize("program", ["tiny", "tiny_sdpa"])
def test_executorch_states_are_stored_and_found_again(tmp_path, program):
    # The ExecuTorch worker's KV save/restore through the store: a session's state written by
    # one worker starts the next worker's turn, with the greedy ids of a worker that kept it.
    prompt = expected()["cases"][0]["prompt_ids"]

    def start(*flags: str) -> Worker:
        w = Worker([str(executorch_worker()), "--model", str(PROGRAMS[program]), "--tokenizer", str(TOKENIZER),
                    "--threads", "1", *flags])
        w.wait_ready(60)
        return w

    def turn(w: Worker, rid: int, ids: list[int], n: int) -> dict:
        _, done = w.generate(rid, prompt_segments=[{"ids": ids}], max_new_tokens=n, session_id="s")
        assert done["type"] == "done", done
        return done

    d = tmp_path / "states"
    ref = start()
    d1 = turn(ref, 1, prompt, 6)
    turn2 = prompt + d1["generated_token_ids"] + [5, 6, 7]
    want = turn(ref, 2, turn2, 6)["generated_token_ids"]
    ref.close()
    w = start("--state-dir", str(d))
    assert w.ready["state_store"] is not None
    assert turn(w, 1, prompt, 6)["generated_token_ids"] == d1["generated_token_ids"]
    assert w.close() == 0 and _files(d)
    w = start("--state-dir", str(d))
    done = turn(w, 1, turn2, 6)
    assert done["copy_source"] == "disk" and done["reused_prompt_tokens"] >= len(prompt), done
    assert done["generated_token_ids"] == want
    w.close()
