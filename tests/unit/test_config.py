import argparse
import logging

import pytest

from trioserve.cli import build_parser, main
from trioserve.config import EMBEDDED_MODEL_ID, Settings, SettingsError, _bool, _opt
from trioserve.worker.launch import argv_for


def test_env_values_are_typed_and_flags_win():
    settings = Settings.from_env({"TRIOSERVE_PORT": "9001", "TRIOSERVE_NO_THINK": "yes",
                                  "TRIOSERVE_CANCEL_GRACE": "0.5", "TRIOSERVE_ENGINE": "fake"})
    assert (settings.port, settings.no_think, settings.cancel_grace, settings.engine) == (9001, True, 0.5, "fake")
    args = build_parser().parse_args(["serve", "--port", "7", "--no-think", "false", "--chatml-fallback"])
    merged = settings.with_overrides(args)
    assert (merged.port, merged.no_think, merged.chatml_fallback, merged.engine) == (7, False, True, "fake")


@pytest.mark.parametrize("env", [{"TRIOSERVE_PORT": "eighty"}, {"TRIOSERVE_RESTART": "maybe"},
                                 {"TRIOSERVE_ENGINE": "vllm"}])
def test_bad_env_values_name_the_variable(env):
    with pytest.raises(ValueError, match=next(iter(env))):
        Settings.from_env(env)


def test_bad_env_value_exits_2_with_a_message(monkeypatch, capsys):
    monkeypatch.setenv("TRIOSERVE_QUEUE_DEPTH", "lots")
    assert main(["serve"]) == 2
    assert "TRIOSERVE_QUEUE_DEPTH" in capsys.readouterr().err


def test_worker_argv_and_model_id():
    llama = Settings(worker_bin="/w", model_path="/m/Model-Q4.gguf", threads=2, max_context=2048)
    assert argv_for(llama)[:5] == ["/w", "--ctx", "2048", "--model", "/m/Model-Q4.gguf"]
    assert "--capacity" not in argv_for(llama)  # the worker's default slots
    assert argv_for(Settings(worker_bin="/w", slots=8))[-2:] == ["--capacity", "8"]
    assert "--threads" in argv_for(llama)
    assert llama.resolved_model_id() == "Model-Q4"
    assert Settings(worker_bin="/w").resolved_model_id() == EMBEDDED_MODEL_ID
    fake = Settings(engine="fake", worker_bin="/f", fake_script="/s.json", worker_args="--token-delay-ms 5")
    # max_context 0 (default): the worker picks the model's training context within its budget.
    assert argv_for(fake) == ["/f", "--ctx", "0", "--script", "/s.json", "--heartbeat-ms", "500",
                                  "--token-delay-ms", "5"]
    assert fake.resolved_model_id() == "fake"


# --- bounds (limits.py, spec §15) -------------------------------------------------------------

OUT_OF_BOUNDS = [
    ("queue_depth", "-1"),
    ("cancel_grace", "0"),
    ("cancel_grace", "-2"),
    ("cancel_grace", "nan"),
    ("drain_timeout", "0"),
    ("drain_timeout", "-1"),
    ("ready_timeout", "0"),
    ("ready_timeout", "inf"),
    ("crash_window", "0"),
    ("max_crashes", "0"),
    ("port", "-1"),
    ("port", "65536"),
    ("max_context", "15"),
    ("max_body_bytes", "1023"),
    ("threads", "-1"),
    ("memory_budget_bytes", "-1"),
    ("model_idle_unload_s", "-1"),
    ("model_load_timeout", "0"),
]
OUT_OF_BOUNDS_IDS = [f"{name}={value}" for name, value in OUT_OF_BOUNDS]


@pytest.mark.parametrize("name, value", OUT_OF_BOUNDS, ids=OUT_OF_BOUNDS_IDS)
def test_out_of_bounds_env_values_are_startup_errors_naming_the_variable(name, value):
    variable = "TRIOSERVE_" + name.upper()
    with pytest.raises(SettingsError, match=f"^{variable}: ") as info:
        Settings.from_env({variable: value})
    assert value.lstrip("-") in str(info.value) or value == "nan"


@pytest.mark.parametrize("name, value", OUT_OF_BOUNDS, ids=OUT_OF_BOUNDS_IDS)
def test_out_of_bounds_flags_exit_2_naming_the_flag(name, value, capsys):
    flag = "--" + name.replace("_", "-")
    assert main(["serve", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"trioserve: {flag}: ") and "must be" in err


@pytest.mark.parametrize("name, value", [("port", "0"), ("port", "65535"), ("queue_depth", "0"),
                                         ("max_context", "16"), ("max_body_bytes", "1024"),
                                         ("cancel_grace", "0.001"), ("threads", "0")])
def test_values_on_the_bounds_are_accepted(name, value):
    settings = Settings.from_env({"TRIOSERVE_" + name.upper(): value})
    assert str(getattr(settings, name)) in (value, str(float(value)))


def test_flags_are_bounded_and_named_in_the_error():
    with pytest.raises(SettingsError, match="^--port: must be ≥ 0, got -5$"):
        Settings().with_overrides(build_parser().parse_args(["serve", "--port=-5"]))
    assert Settings().with_overrides(build_parser().parse_args(["serve", "--port", "1"])).port == 1


def test_memory_budget_defaults_to_three_quarters_of_physical_memory(monkeypatch):
    from trioserve import config

    monkeypatch.setattr(config, "physical_memory_bytes", lambda: 16 << 30)
    assert Settings().resolved_memory_budget() == 12 << 30
    assert Settings(memory_budget_bytes=1 << 30).resolved_memory_budget() == 1 << 30


def test_direct_construction_checks_bounds_too():
    with pytest.raises(ValueError):
        Settings(queue_depth=-1)


# --- pydantic-settings ------------------------------------------------------------------------


def test_settings_read_os_environ_like_from_env(monkeypatch):
    monkeypatch.setenv("TRIOSERVE_PORT", "9002")
    monkeypatch.setenv("TRIOSERVE_RESTART", "off")
    monkeypatch.setenv("TRIOSERVE_LOG_LEVEL", "debug")
    assert Settings() == Settings.from_env() == Settings.from_env(
        {"TRIOSERVE_PORT": "9002", "TRIOSERVE_RESTART": "off", "TRIOSERVE_LOG_LEVEL": "debug"})
    assert (Settings().port, Settings().restart) == (9002, False)
    # keyword arguments win over the environment
    assert Settings(port=7).port == 7


def test_unrelated_trioserve_variables_are_not_settings(monkeypatch):
    monkeypatch.setenv("TRIOSERVE_WORKER_DIR", "/somewhere")  # a test-suite variable
    assert Settings.from_env().port == 8000


def test_to_env_round_trips():
    settings = Settings(engine="fake", port=0, no_think=True, cancel_grace=0.25, worker_args="--x 1")
    assert Settings.from_env(settings.to_env()) == settings


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        assert "TRIOSERVE_" + name.upper() in out
        assert "--" + name.replace("_", "-") in out


def test_opt_declares_a_setting_with_env_flag_choices_and_bounds():
    """Fields other modules add are declared the same way and get everything."""

    class Extended(Settings):
        api_key: str = _opt("", "key clients must send")
        allow_no_auth: bool = _opt(False, "serve without a key", type=_bool)
        max_connections: int = _opt(256, "connections at once", type=int, ge=1)
        mode: str = _opt("a", "mode", choices=("a", "b"))

    s = Extended.from_env({"TRIOSERVE_API_KEY": "k", "TRIOSERVE_ALLOW_NO_AUTH": "yes",
                           "TRIOSERVE_MAX_CONNECTIONS": "9", "TRIOSERVE_MODE": "b"})
    assert (s.api_key, s.allow_no_auth, s.max_connections, s.mode) == ("k", True, 9, "b")
    with pytest.raises(SettingsError, match="TRIOSERVE_MAX_CONNECTIONS: must be ≥ 1"):
        Extended.from_env({"TRIOSERVE_MAX_CONNECTIONS": "0"})
    with pytest.raises(SettingsError, match="TRIOSERVE_MODE: must be one of a, b"):
        Extended.from_env({"TRIOSERVE_MODE": "c"})
    parser = argparse.ArgumentParser()
    Extended.add_arguments(parser)
    args = parser.parse_args(["--allow-no-auth", "--max-connections", "3"])
    assert Extended().with_overrides(args).max_connections == 3
    assert "TRIOSERVE_MAX_CONNECTIONS" in parser.format_help()


# --- the hypercorn entry point ----------------------------------------------------------------


async def test_hypercorn_entry_point_fails_its_startup_on_bad_settings(monkeypatch, caplog):
    """`hypercorn trioserve.app:app`: bad settings fail the lifespan startup with the message
    (hypercorn then stops the worker) instead of serving 500s without a lifespan."""
    from trioserve.app import _AppFromEnvironment

    monkeypatch.setenv("TRIOSERVE_QUEUE_DEPTH", "-1")
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "lifespan.startup"}

    async def send(message: dict) -> None:
        sent.append(message)

    with caplog.at_level(logging.ERROR, logger="trioserve"):
        await _AppFromEnvironment()({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
    assert sent == [{"type": "lifespan.startup.failed",
                     "message": "TRIOSERVE_QUEUE_DEPTH: must be ≥ 0, got -1"}]
    assert "TRIOSERVE_QUEUE_DEPTH" in caplog.text


def test_the_configuration_doc_lists_every_setting_as_declared():
    """docs/configuration.md's table is settings_table() (regenerate it with
    write_settings_table() after changing a setting)."""
    from trioserve.config import SETTINGS_DOC, SETTINGS_TABLE_END, SETTINGS_TABLE_START, settings_table

    text = SETTINGS_DOC.read_text(encoding="utf-8")
    table = text.split(SETTINGS_TABLE_START, 1)[1].split(SETTINGS_TABLE_END, 1)[0].strip()
    assert table == settings_table()
    for name in Settings.model_fields:
        assert f"`TRIOSERVE_{name.upper()}`" in table
