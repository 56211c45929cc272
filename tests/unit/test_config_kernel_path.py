"""the cpu_extra_buffers setting, exit statuses in words, the kernel-path log line."""

import signal

import pytest

from trioserve.cli import build_parser
from trioserve.config import Settings
from trioserve.worker.exit_status import describe_exit, signal_in_words
from trioserve.worker.supervisor import describe_kernel_path, describe_kv_cache
from trioserve.worker.launch import argv_for


def test_cpu_extra_buffers_reaches_the_llama_worker_from_env_and_flag():
    def argv(settings: Settings) -> list[str]:
        return argv_for(settings.model_copy(update={"worker_bin": "/w", "model_path": "/m.gguf"}))

    assert "--cpu-extra-buffers" not in argv(Settings())  # auto is the worker's own default
    off = argv(Settings.from_env({"TRIOSERVE_CPU_EXTRA_BUFFERS": "off"}))
    assert off[off.index("--cpu-extra-buffers") + 1] == "off"
    on = argv(Settings().with_overrides(build_parser().parse_args(["serve", "--cpu-extra-buffers", "on"])))
    assert on[on.index("--cpu-extra-buffers") + 1] == "on"
    fake = argv_for(Settings(engine="fake", worker_bin="/f", cpu_extra_buffers="off"))
    assert "--cpu-extra-buffers" not in fake


@pytest.mark.parametrize("value", ["yes", "", "AMX"])
def test_a_bad_cpu_extra_buffers_names_the_variable(value):
    with pytest.raises(ValueError, match="TRIOSERVE_CPU_EXTRA_BUFFERS"):
        Settings.from_env({"TRIOSERVE_CPU_EXTRA_BUFFERS": value})


def test_exit_statuses_in_words():
    assert signal_in_words(signal.SIGILL) == "illegal instruction (SIGILL)"
    assert signal_in_words(signal.SIGSEGV) == "segmentation fault (SIGSEGV)"
    assert signal_in_words(signal.SIGUSR1).endswith("(SIGUSR1)")
    assert describe_exit(-signal.SIGILL) == "died by illegal instruction (SIGILL)"
    assert describe_exit(1) == "exited with exit status 1"
    assert describe_exit(None) == "is still running"


def test_kernel_path_log_words():
    assert describe_kernel_path(None) == ""
    text = describe_kernel_path({"cpu_extra_buffers": "auto", "extra_buffers_enabled": False,
                                 "probe": "died by illegal instruction (SIGILL)", "fallback": True,
                                 "warmup_ms": 120})
    assert text == ("; CPU extra buffer types off (setting auto, probe died by illegal instruction "
                    "(SIGILL), fell back to plain buffers; warm-up 120 ms)")


def test_kernel_path_log_words_name_a_run_time_selected_cpu_variant():
    text = describe_kernel_path({"cpu_backend": "runtime-selected", "cpu_variant": "haswell",
                                 "cpu_extra_buffers": "off", "extra_buffers_enabled": False,
                                 "probe": "not run", "fallback": False, "warmup_ms": 80})
    assert text == ("; CPU kernels haswell (selected at run time); CPU extra buffer types off "
                    "(setting off, probe not run; warm-up 80 ms)")
    switched = describe_kernel_path({
        "cpu_backend": "runtime-selected", "cpu_variant": "zen4", "cpu_variant_switched_from": "sapphirerapids",
        "cpu_extra_buffers": "auto", "extra_buffers_enabled": True, "probe": "died by illegal instruction (SIGILL)",
        "fallback": True, "extra_buffer_types_kept": ["CPU_REPACK"],
        "extra_buffer_types_dropped": {"AMX": "its probe (variant sapphirerapids) died by illegal instruction (SIGILL)"},
        "warmup_ms": 90})
    assert switched == ("; CPU kernels zen4 (chosen after a failed probe of sapphirerapids); CPU extra buffer types on "
                        "(setting auto, probe died by illegal instruction (SIGILL), kept CPU_REPACK, AMX dropped: its "
                        "probe (variant sapphirerapids) died by illegal instruction (SIGILL); warm-up 90 ms)")
    linked = describe_kernel_path({"cpu_backend": "linked", "cpu_extra_buffers": "off",
                                   "extra_buffers_enabled": False, "probe": "not run", "warmup_ms": 80})
    assert "CPU kernels" not in linked


def test_swa_settings_reach_the_workers_only_when_set():
    def argv(settings: Settings) -> list[str]:
        return argv_for(settings.model_copy(update={"worker_bin": "/w", "model_path": "/m.gguf"}))

    plain = argv(Settings())
    assert "--swa-cache" not in plain and "--swa-checkpoints" not in plain  # the workers' defaults
    small = argv(Settings.from_env({"TRIOSERVE_SWA_CACHE": "checkpoints", "TRIOSERVE_SWA_CHECKPOINTS": "8"}))
    assert small[small.index("--swa-cache") + 1] == "checkpoints"
    assert small[small.index("--swa-checkpoints") + 1] == "8"
    full = argv(Settings().with_overrides(build_parser().parse_args(["serve", "--swa-cache", "full"])))
    assert full[full.index("--swa-cache") + 1] == "full"
    fake = argv_for(Settings(engine="fake", worker_bin="/f", swa_checkpoints=0))
    assert fake[fake.index("--swa-checkpoints") + 1] == "0"
    with pytest.raises(ValueError, match="TRIOSERVE_SWA_CACHE"):
        Settings.from_env({"TRIOSERVE_SWA_CACHE": "small"})


def test_the_startup_log_reports_kv_memory_and_the_window_cache():
    assert describe_kv_cache({}) == ""
    assert describe_kv_cache({"kv_cache_bytes": 90 << 20, "n_swa": 0, "swa_cache": None}) == "; KV cache ~90 MiB"
    small = describe_kv_cache({"kv_cache_bytes": 1 << 30, "n_swa": 1024, "swa_cache": "checkpoints",
                               "checkpoints_per_slot": 4})
    assert small == "; KV cache ~1024 MiB; sliding window 1024 tokens, small window cache with 4 checkpoints per slot"
    assert describe_kv_cache({"n_swa": 512, "swa_cache": "full"}) == "; sliding window 512 tokens, full-size window cache"
