"""The llama worker remembers kernel probes that passed (``--probe-memory DIR``, issue #51,
spec/worker-protocol.md §10): a second start on the same machine, binaries, model and settings
skips the probe process; anything that changes the key, a fault-injection test, or an unusable
directory makes the probe run; a worker never fails to start because of the memory.

Real model (the embedded SmolLM2), so slow. Skipped where this CPU's llama.cpp offers no extra
buffer types (no probe runs at all) or where the real probe fails here (nothing to remember).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tests.worker_process.test_kernel_path import start
from testkit.worker_process import Worker


def ready_path(bin_dir: Path, model: Path, memory: Path, *flags: str) -> tuple[dict, str]:
    """Starts the worker with ``--probe-memory memory``; its ready record's kernel_path and stderr."""
    w: Worker = start(bin_dir, model, "--probe-memory", str(memory), *flags)
    try:
        return w.ready["kernel_path"], w.stderr_text()
    finally:
        assert w.close() == 0


def skip_without_a_passing_probe(kp: dict) -> None:
    if not kp["extra_buffer_types"]:
        pytest.skip("this llama.cpp build offers no CPU extra buffer types: no probe to remember")
    if kp["probe"] != "passed":
        pytest.skip(f"this CPU's real probe fails ({kp['probe']}): only passes are remembered")


def remembered_files(memory: Path) -> list[Path]:
    return sorted(p for p in memory.iterdir() if p.suffix == ".pass")


@pytest.mark.slow
def test_a_passed_probe_is_remembered_and_skipped_until_the_model_changes(bin_dir, model, tmp_path):
    own_model = tmp_path / "model.gguf"  # a copy: its mtime is ours to change
    shutil.copy2(model, own_model)
    memory = tmp_path / "cache" / "kernel-probes"  # missing parents are created too

    first, _ = ready_path(bin_dir, own_model, memory)
    skip_without_a_passing_probe(first)
    assert first["probe_remembered"] is False and first["probe_ms"] > 0
    assert [p["remembered"] for p in first["probes"]] == [False]
    # the probe ran the full warm-up on these very kernels: this process checks one token
    assert first["warmup"] == "one token (the probe ran the kernels)"
    files = remembered_files(memory)
    assert len(files) == 1
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(memory.stat().st_mode) == 0o700

    second, stderr = ready_path(bin_dir, own_model, memory)
    assert second["probe"] == "passed" and second["probe_remembered"] is True
    assert second["probe_ms"] == 0 and second["probes"][0]["remembered"] is True
    assert second["extra_buffers_enabled"] is True and second["fallback"] is False
    assert second["extra_buffer_types_kept"] == first["extra_buffer_types_kept"]
    assert "probe passed (remembered)" in stderr
    assert second["warmup"] == "one token (the probe ran the kernels)"
    assert remembered_files(memory) == files

    st = own_model.stat()
    os.utime(own_model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    third, _ = ready_path(bin_dir, own_model, memory)
    assert third["probe"] == "passed" and third["probe_remembered"] is False and third["probe_ms"] > 0
    assert len(remembered_files(memory)) == 2  # the new key's pass is remembered beside the old


@pytest.mark.slow
def test_a_remembered_pass_is_not_consulted_by_a_fault_injection(bin_dir, model, tmp_path):
    memory = tmp_path / "probes"
    first, _ = ready_path(bin_dir, model, memory)
    skip_without_a_passing_probe(first)
    assert len(remembered_files(memory)) == 1

    faulty, _ = ready_path(bin_dir, model, memory, "--test-probe-fault", "sigill")
    assert faulty["probe"] == "died by illegal instruction (SIGILL)" and faulty["probe_remembered"] is False
    assert faulty["fallback"] is True and faulty["extra_buffers_enabled"] is False
    assert len(remembered_files(memory)) == 1  # the failure is not remembered either


@pytest.mark.slow
@pytest.mark.parametrize("where", ["a file", "under a file", "garbage"])
def test_an_unusable_memory_runs_the_probe_and_starts(bin_dir, model, tmp_path, where):
    """Any error means "not remembered": the probe runs and the worker starts. A path under a
    regular file cannot be written even by root (where a chmod would not stop the writes)."""
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory\n")
    if where == "a file":
        memory = blocker
    elif where == "under a file":
        memory = blocker / "kernel-probes"
    else:  # a remembered file with foreign contents: the key is right, the file is not ours
        memory = tmp_path / "probes"
        first, _ = ready_path(bin_dir, model, memory)
        skip_without_a_passing_probe(first)
        for f in remembered_files(memory):
            f.write_bytes(b"\x00garbage")
    kp, stderr = ready_path(bin_dir, model, memory)
    skip_without_a_passing_probe(kp)
    assert kp["probe_remembered"] is False and kp["probe_ms"] > 0
    assert kp["extra_buffers_enabled"] is True and "kernel path verified" in stderr
    assert blocker.read_text() == "not a directory\n"


@pytest.mark.slow
def test_the_memory_keeps_the_newest_256_files(bin_dir, model, tmp_path):
    memory = tmp_path / "probes"
    memory.mkdir()
    old = [memory / f"{i:016x}.pass" for i in range(300)]
    for i, f in enumerate(old):  # other keys' passes, older than any new one
        f.write_text("passed\n")
        os.utime(f, ns=(i * 1_000_000_000, i * 1_000_000_000))
    other = memory / "notes.txt"  # not a remembered pass: never removed
    other.write_text("mine\n")
    kp, _ = ready_path(bin_dir, model, memory)
    skip_without_a_passing_probe(kp)
    assert kp["probe_remembered"] is False  # none of the planted keys is this probe's
    kept = remembered_files(memory)
    assert len(kept) == 256
    assert set(old[-255:]) < set(kept)  # the newest planted ones and this probe's own pass
    assert other.read_text() == "mine\n"
