"""The KV cache type and flash-attention settings: what reaches the worker, the combinations
refused before anything starts, and the startup log's words for the memory a quantized cache
saves (spec/worker-protocol.md §3, §10, §11)."""

import pytest

from trioserve.cli import build_parser, main
from trioserve.config import Settings, SettingsError
from trioserve.worker.launch import argv_for
from trioserve.machine import usable_cpus
from trioserve.worker.supervisor import describe_kv_cache, describe_stream_interval


def _argv(settings: Settings) -> list[str]:
    return argv_for(settings.model_copy(update={"worker_bin": "/w", "model_path": "/m.gguf"}))


def test_the_kv_cache_type_reaches_the_llama_and_fake_workers_from_env_and_flag():
    assert "--kv-cache-type" not in _argv(Settings())  # f16: the worker's own default
    env = _argv(Settings.from_env({"TRIOSERVE_KV_CACHE_TYPE": "q8_0"}))
    assert env[env.index("--kv-cache-type") + 1] == "q8_0"
    flag = Settings().with_overrides(build_parser().parse_args(["serve", "--kv-cache-type", "q4_0"]))
    assert _argv(flag)[_argv(flag).index("--kv-cache-type") + 1] == "q4_0"
    fake = argv_for(Settings(engine="fake", worker_bin="/f", kv_cache_type="q4_0"))
    assert fake[fake.index("--kv-cache-type") + 1] == "q4_0"
    with pytest.raises(ValueError, match="TRIOSERVE_KV_CACHE_TYPE.*f16, q8_0, q4_0"):
        Settings.from_env({"TRIOSERVE_KV_CACHE_TYPE": "q5_1"})


def test_flash_attention_reaches_the_llama_worker_only_when_not_auto():
    assert "--flash-attn" not in _argv(Settings())
    on = _argv(Settings(flash_attn="on"))
    assert on[on.index("--flash-attn") + 1] == "on"


def test_a_quantized_cache_without_flash_attention_is_refused_at_startup(capsys):
    with pytest.raises(SettingsError, match="--kv-cache-type q8_0 quantizes the V cache.*--flash-attn is off"):
        _argv(Settings(kv_cache_type="q8_0", flash_attn="off"))
    assert main(["serve", "--kv-cache-type", "q4_0", "--flash-attn", "off"]) == 2
    assert "only with flash attention" in capsys.readouterr().err
    _argv(Settings(kv_cache_type="f16", flash_attn="off"))  # f16 needs none


def test_the_executorch_engine_refuses_a_quantized_cache():
    s = Settings(engine="executorch", worker_bin="/w", model_path="/m.pte",
                 tokenizer_path="/t.json", kv_cache_type="q8_0")
    with pytest.raises(SettingsError, match="executorch engine's KV cache.*f16 only"):
        argv_for(s)


def test_the_startup_log_says_what_a_quantized_cache_saves_against_f16():
    assert describe_kv_cache({"kv_cache_bytes": 34 << 20, "kv_cache_type": "q8_0"}) == \
        "; KV cache ~34 MiB as q8_0, 30 MiB less than at f16"
    assert describe_kv_cache({"kv_cache_bytes": 18 << 20, "kv_cache_type": "q4_0"}) == \
        "; KV cache ~18 MiB as q4_0, 46 MiB less than at f16"
    assert describe_kv_cache({"kv_cache_bytes": 64 << 20, "kv_cache_type": "f16"}) == "; KV cache ~64 MiB"


def test_the_stream_interval_reaches_every_worker_only_when_set():
    cpus = usable_cpus()
    # auto: 50 ms for a llama.cpp worker on the CPU whose threads fill the usable CPUs, else 0.
    assert Settings().stream_interval_ms == "auto"
    filled = _argv(Settings(threads=cpus))
    assert filled[filled.index("--stream-interval-ms") + 1] == "50"
    if cpus > 1:
        assert "--stream-interval-ms" not in _argv(Settings(threads=1))  # a core left for the server
    assert "--stream-interval-ms" not in _argv(Settings(threads=cpus, gpu_layers=99))
    assert "--stream-interval-ms" not in _argv(Settings.from_env({"TRIOSERVE_STREAM_INTERVAL_MS": "0"}))
    llama = _argv(Settings.from_env({"TRIOSERVE_STREAM_INTERVAL_MS": "40", "TRIOSERVE_THREADS": "1"}))
    assert llama[llama.index("--stream-interval-ms") + 1] == "40"
    assert "--stream-interval-ms" not in argv_for(Settings(engine="fake", worker_bin="/f"))  # auto: 0
    fake = argv_for(Settings(engine="fake", worker_bin="/f", stream_interval_ms="12.5"))
    assert fake[fake.index("--stream-interval-ms") + 1] == "12.5"
    et = argv_for(Settings(engine="executorch", worker_bin="/e", model_path="/m.pte", tokenizer_path="/t.json",
                           stream_interval_ms="30"))
    assert et[et.index("--stream-interval-ms") + 1] == "30"
    for bad in ("-1", "1001", "soon", "nan"):
        with pytest.raises(ValueError, match="TRIOSERVE_STREAM_INTERVAL_MS"):
            Settings.from_env({"TRIOSERVE_STREAM_INTERVAL_MS": bad})


def test_the_startup_log_names_the_stream_interval():
    assert describe_stream_interval({}) == "" and describe_stream_interval({"stream_interval_ms": 0}) == ""
    assert describe_stream_interval({"stream_interval_ms": 50}) == (
        "; token records written together every 50 ms (a generation's first at once)")


def test_the_startup_log_names_recurrent_state_checkpoints():
    assert describe_kv_cache({"checkpoint_kind": "recurrent", "checkpoints_per_slot": 4}) == \
        "; recurrent state, 4 checkpoints per slot"
    assert describe_kv_cache({"checkpoint_kind": None, "checkpoints_per_slot": 0}) == ""
