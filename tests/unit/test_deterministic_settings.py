"""The deterministic setting reaches the llama worker as --deterministic; other engines refuse
it; the startup log names a forced CPU variant (spec/worker-protocol.md §4.5, §10)."""

import pytest

from trioserve.cli import build_parser
from trioserve.config import Settings, SettingsError
from trioserve.worker.supervisor import describe_kernel_path
from trioserve.worker.launch import argv_for


def _argv(settings: Settings) -> list[str]:
    return argv_for(settings.model_copy(update={"worker_bin": "/w", "model_path": "/m.gguf"}))


def test_deterministic_reaches_the_llama_worker_from_env_and_flag():
    assert "--deterministic" not in _argv(Settings())
    assert "--deterministic" in _argv(Settings.from_env({"TRIOSERVE_DETERMINISTIC": "on"}))
    flag = Settings().with_overrides(build_parser().parse_args(["serve", "--deterministic", "true"]))
    assert "--deterministic" in _argv(flag)
    with pytest.raises(ValueError, match="TRIOSERVE_DETERMINISTIC"):
        Settings.from_env({"TRIOSERVE_DETERMINISTIC": "sometimes"})


@pytest.mark.parametrize("engine", ["fake", "executorch"])
def test_deterministic_with_another_engine_is_a_settings_error(engine):
    s = Settings(engine=engine, worker_bin="/w", model_path="/m.pte", tokenizer_path="/t.json",
                 deterministic=True)
    with pytest.raises(SettingsError, match="--deterministic applies to the llama engine"):
        argv_for(s)


def test_kernel_path_log_words_name_a_forced_cpu_variant():
    text = describe_kernel_path({"cpu_backend": "runtime-selected", "cpu_variant": "haswell",
                                 "cpu_variant_forced": True, "cpu_extra_buffers": "off",
                                 "extra_buffers_enabled": False, "probe": "not run", "warmup_ms": 80})
    assert text.startswith("; CPU kernels haswell (forced by --cpu-variant / TRIOSERVE_CPU_VARIANT);")
