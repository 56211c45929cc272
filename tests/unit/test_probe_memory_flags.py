"""Where a llama worker remembers its passed kernel probes (``--probe-memory``, issue #51,
spec/worker-protocol.md §10): only with ``cpu_extra_buffers=auto``, the directory from
``TRIOSERVE_KERNEL_PROBE_MEMORY`` / ``XDG_CACHE_HOME`` / ``HOME``; and the log line says so."""

from __future__ import annotations

import pytest

from trioserve.config import Settings
from trioserve.worker.launch import argv_for
from trioserve.worker.supervisor import describe_kernel_path

ENV_NAMES = ("TRIOSERVE_KERNEL_PROBE_MEMORY", "XDG_CACHE_HOME", "HOME")


def llama_argv(monkeypatch: pytest.MonkeyPatch, mode: str = "auto", **env: str) -> list[str]:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return argv_for(Settings(worker_bin="/w", model_path="/m.gguf", cpu_extra_buffers=mode))


def memory_dir(argv: list[str]) -> str | None:
    return argv[argv.index("--probe-memory") + 1] if "--probe-memory" in argv else None


def test_auto_remembers_under_xdg_cache_home_or_home(monkeypatch, tmp_path):
    xdg = llama_argv(monkeypatch, XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    assert memory_dir(xdg) == str(tmp_path / "xdg" / "trioserve" / "kernel-probes")
    home = llama_argv(monkeypatch, HOME=str(tmp_path / "home"))
    assert memory_dir(home) == str(tmp_path / "home" / ".cache" / "trioserve" / "kernel-probes")
    relative_xdg = llama_argv(monkeypatch, XDG_CACHE_HOME="cache", HOME=str(tmp_path / "home"))
    assert memory_dir(relative_xdg) == memory_dir(home)  # a relative XDG_CACHE_HOME is ignored (XDG spec)


def test_the_variable_names_the_directory_or_turns_it_off(monkeypatch, tmp_path):
    chosen = llama_argv(monkeypatch, TRIOSERVE_KERNEL_PROBE_MEMORY=str(tmp_path / "probes"),
                        XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert memory_dir(chosen) == str(tmp_path / "probes")
    off = llama_argv(monkeypatch, TRIOSERVE_KERNEL_PROBE_MEMORY="off", HOME=str(tmp_path))
    assert "--probe-memory" not in off


@pytest.mark.parametrize("mode", ["on", "off"])
def test_no_memory_where_no_probe_runs(monkeypatch, tmp_path, mode):
    argv = llama_argv(monkeypatch, mode, HOME=str(tmp_path))
    assert "--probe-memory" not in argv
    assert argv[argv.index("--cpu-extra-buffers") + 1] == mode


def test_other_engines_get_no_memory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert "--probe-memory" not in argv_for(Settings(engine="fake", worker_bin="/f"))


def test_the_log_line_says_a_probe_was_remembered():
    kp = {"cpu_extra_buffers": "auto", "extra_buffers_enabled": True, "probe": "passed",
          "extra_buffer_types_kept": ["CPU_REPACK"], "fallback": False, "warmup_ms": 50}
    assert "probe passed (remembered), kept CPU_REPACK;" in describe_kernel_path({**kp, "probe_remembered": True})
    assert "probe passed, kept CPU_REPACK;" in describe_kernel_path({**kp, "probe_remembered": False})
