import pytest

from trioserve.cli import build_parser, main
from trioserve.config import EMBEDDED_MODEL_ID, Settings


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
    assert llama.worker_argv()[:7] == ["/w", "--ctx", "2048", "--model", "/m/Model-Q4.gguf", "--capacity", "1"]
    assert "--threads" in llama.worker_argv()
    assert llama.resolved_model_id() == "Model-Q4"
    assert Settings(worker_bin="/w").resolved_model_id() == EMBEDDED_MODEL_ID
    fake = Settings(engine="fake", worker_bin="/f", fake_script="/s.json", worker_args="--token-delay-ms 5")
    assert fake.worker_argv() == ["/f", "--ctx", "4096", "--script", "/s.json", "--token-delay-ms", "5"]
    assert fake.resolved_model_id() == "fake"
