"""The model registry (trioserve/registry.py): where models come from, their ids, the
name resolution order, per-model settings, and the startup errors."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import trio

from trioserve.cli import build_parser
from trioserve.config import EMBEDDED_MODEL_ID, Settings
from trioserve.registry import ModelSpec, RegistryError, build_registry, parse_aliases
from trioserve.worker.launch import argv_for, worker_argv


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def from_flags(*flags: str) -> Settings:
    return Settings().with_overrides(build_parser().parse_args(["serve", *flags]))


def test_no_configuration_is_the_single_embedded_model():
    registry = build_registry(Settings())
    assert registry.ids == (EMBEDDED_MODEL_ID,)
    spec = registry.default
    assert (spec.engine, spec.path, spec.pinned, spec.preload) == ("llama", "", True, True)
    # Its settings are the server's, with its id.
    assert spec.settings(Settings()).model_id == EMBEDDED_MODEL_ID


def test_a_single_model_path_keeps_its_id_rules(tmp_path):
    model = touch(tmp_path / "Model-Q4.gguf")
    assert build_registry(Settings(model_path=str(model))).ids == ("Model-Q4",)
    assert build_registry(Settings(model_path=str(model), model_id="mine")).ids == ("mine",)
    assert build_registry(Settings(engine="fake")).ids == ("fake",)


def test_lone_model_answers_claude_names_on_messages_only():
    registry = build_registry(Settings(engine="fake"))
    assert registry.resolve("claude-haiku-4-5", "messages").id == "fake"
    assert registry.resolve("claude-haiku-4-5", "chat") is None
    assert registry.resolve("gpt-5", "messages") is None
    assert registry.resolve(None, "messages") is None
    off = build_registry(Settings(engine="fake", client_model_names=False))
    assert off.resolve("claude-haiku-4-5", "messages") is None


def test_the_models_dir_example_of_docs_models_md_uses_the_ids_the_folder_produces(tmp_path):
    """docs/models.md shows a folder's listing and a command whose aliases name its models: the
    command must start with those files (an alias naming no served id is a startup error)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    block = doc.split("```console\n$ ls ~/models\n", 1)[1].split("```", 1)[0]
    listing, command = block.split("\n$ ", 1)
    for name in listing.split():
        touch(tmp_path / "models" / name)
    argv = shlex.split(command.replace("\\\n", " ").replace("~/models", str(tmp_path / "models")))
    assert argv[:2] == ["trioserve", "serve"]
    registry = build_registry(from_flags(*argv[2:]))
    assert registry.ids == ("Qwen3-4B-Q4_K_M", "SmolLM2-135M-Instruct.Q4_1")
    assert registry.resolve("claude-haiku-4-5", "messages").id == "SmolLM2-135M-Instruct.Q4_1"
    assert registry.resolve("gpt-5-codex", "responses").id == "Qwen3-4B-Q4_K_M"
    # The embedded model's file under --model-path has the same id (only ".gguf" goes).
    embedded = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert build_registry(Settings(model_path=str(embedded))).ids == ("SmolLM2-135M-Instruct.Q4_1",)


def test_models_dir_takes_every_gguf_and_model_folders(tmp_path):
    touch(tmp_path / "b-small.gguf")
    touch(tmp_path / "a-big.gguf")
    touch(tmp_path / "mmproj-a.gguf")  # a projector is no model
    touch(tmp_path / "split" / "Big-00001-of-00002.gguf")
    touch(tmp_path / "split" / "Big-00002-of-00002.gguf")
    touch(tmp_path / "Top-00001-of-00002.gguf")
    touch(tmp_path / "Top-00002-of-00002.gguf")
    touch(tmp_path / "et" / "model.pte")
    (tmp_path / "et" / "tokenizer.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    registry = build_registry(Settings(models_dir=str(tmp_path)))
    assert registry.ids == ("Top", "a-big", "b-small", "et", "split")
    assert registry.get("split").path.endswith("Big-00001-of-00002.gguf")
    assert registry.get("Top").path.endswith("Top-00001-of-00002.gguf")
    et = registry.get("et")
    assert (et.engine, et.tokenizer_path) == ("executorch", str(tmp_path / "et" / "tokenizer.json"))


def test_repeated_model_path_flags_serve_one_model_each(tmp_path):
    a, b = touch(tmp_path / "one.gguf"), touch(tmp_path / "two.gguf")
    settings = from_flags("--model-path", str(a), "--model-path", str(b),
                          "--model-alias", "claude-*haiku*=two", "--model-alias", "*=one")
    registry = build_registry(settings)
    assert registry.ids == ("one", "two")
    assert registry.resolve("claude-haiku-4-5", "messages").id == "two"
    assert registry.resolve("claude-sonnet-4-5", "messages").id == "one"  # the catch-all
    assert registry.resolve("two", "chat").id == "two"  # exact ids before any pattern
    # The variable takes several paths too.
    assert build_registry(Settings(model_path=f"{a},{b}")).ids == ("one", "two")


CONFIG = """
[[models]]
id = "small"
path = "small.gguf"
aliases = ["claude-*haiku*", "gpt-4o-mini"]
context = 4096
slots = 2
pinned = true
preload = true

[[models]]
id = "big"
path = "weights/big.gguf"
profile = "chatml"
workers = 2
[models.settings]
speculative = "auto"
no_think = true

[[models]]
id = "scripted"
engine = "fake"
[models.settings]
fake_script = "script.json"

[aliases]
"claude-*" = "big"
"*" = "small"
"""


def test_toml_config_gives_each_model_its_settings_and_aliases(tmp_path):
    touch(tmp_path / "small.gguf")
    touch(tmp_path / "weights" / "big.gguf")
    config = tmp_path / "models.toml"
    config.write_text(CONFIG)
    server = Settings(models_config=str(config), worker_bin="/w", threads=1)
    registry = build_registry(server)
    assert registry.ids == ("small", "big", "scripted")
    small, big = registry.get("small"), registry.get("big")
    assert small.path == str(tmp_path / "small.gguf")  # relative to the file
    assert (small.context, small.slots, small.pinned, small.preload) == (4096, 2, True, True)
    assert (big.pinned, big.preload) == (False, False)
    big_settings = big.settings(server)
    assert (big_settings.profile, big_settings.workers, big_settings.speculative,
            big_settings.no_think, big_settings.model_id) == ("chatml", 2, "auto", True, "big")
    assert registry.get("scripted").settings(server).fake_script == str(tmp_path / "script.json")
    # Resolution: ids, then the models' aliases in model order, then the [aliases] table.
    assert registry.resolve("claude-haiku-4-5", "messages").id == "small"
    assert registry.resolve("claude-opus-4-1", "messages").id == "big"
    assert registry.resolve("gpt-4o-mini", "chat").id == "small"
    assert registry.resolve("anything", "chat").id == "small"
    # Each model's worker gets its own file, context and slots.
    argv = worker_argv(small, server)
    assert argv[argv.index("--model") + 1] == small.path
    assert argv[argv.index("--ctx") + 1] == "4096"
    assert argv[argv.index("--capacity") + 1] == "2"
    assert worker_argv(big, server)[worker_argv(big, server).index("--speculative") + 1] == "auto"


def test_flag_aliases_come_before_the_files(tmp_path):
    touch(tmp_path / "small.gguf")
    touch(tmp_path / "weights" / "big.gguf")
    config = tmp_path / "models.toml"
    config.write_text(CONFIG.replace('[[models]]\nid = "scripted"\nengine = "fake"\n'
                                     '[models.settings]\nfake_script = "script.json"\n', ""))
    registry = build_registry(Settings(models_config=str(config), model_alias="claude-*haiku*=big"))
    assert registry.resolve("claude-haiku-4-5", "messages").id == "big"


@pytest.mark.parametrize("text, message", [
    ("[[models]]\nid = 'x'\npath = 'missing.gguf'\n", "is not a file"),
    ("[[models]\nid = 'x'", "not valid TOML"),
    ("[[models]]\npath = 'a.gguf'\n", "'id' is required"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\ncolour = 'red'\n", "unknown key 'colour'"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\ncontext = 'big'\n", "'context' must be a int"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\nengine = 'vllm'\n", "engine must be one of"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\n[models.settings]\nport = 1\n",
     "'port' is not a per-model setting"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\nslots = -1\n", "model 'x'"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\n[[models]]\nid = 'x'\npath = 'a.gguf'\n",
     "two models have the id 'x'"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\n[aliases]\n'gpt-*' = 'y'\n",
     "names the model 'y', which is not served (served: x)"),
    ("[[models]]\nid = 'x'\npath = 'a.gguf'\n[[models]]\nid = 'y'\nengine = 'fake'\n"
     "[aliases]\n'x' = 'y'\n", "is the id of a served model"),
    ("models_dir = '.'\n", "unknown top-level key(s) models_dir"),
    ("[[models]]\nid = 'x'\n", "'path' is required for the llama engine"),
    ("[[models]]\nid = 'x'\npath = 'hf:org/repo:Q4_K_M'\n", "no model pulls configured"),
])
def test_config_errors_name_the_model_and_the_problem(tmp_path, text, message):
    touch(tmp_path / "a.gguf")
    config = tmp_path / "models.toml"
    config.write_text(text)
    with pytest.raises(RegistryError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_registry(Settings(models_config=str(config)))


def test_source_errors(tmp_path):
    model = touch(tmp_path / "m.gguf")
    with pytest.raises(RegistryError, match="not a directory"):
        build_registry(Settings(models_dir=str(tmp_path / "nowhere")))
    with pytest.raises(RegistryError, match="cannot read it"):
        build_registry(Settings(models_config=str(tmp_path / "nowhere.toml")))
    with pytest.raises(RegistryError, match="two models have the id 'm'"):
        build_registry(Settings(model_path=f"{model},{model}"))
    with pytest.raises(RegistryError, match="--model-id names the one --model-path model"):
        build_registry(Settings(model_path=f"{model},{touch(tmp_path / 'n.gguf')}", model_id="x"))
    with pytest.raises(RegistryError, match="not a file"):
        build_registry(Settings(model_path=f"{model},{tmp_path / 'gone.gguf'}"))
    with pytest.raises(RegistryError, match="is not PATTERN=ID"):
        parse_aliases("claude-*")


def test_hub_paths_go_through_the_resolver(tmp_path):
    local = touch(tmp_path / "pulled.gguf")
    seen = []

    def resolve(path: str) -> str:
        seen.append(path)
        return str(local)

    registry = build_registry(Settings(model_path="hf:org/Repo-GGUF:Q4_K_M,"
                                                  + str(touch(tmp_path / "other.gguf"))),
                              resolve_path=resolve)
    assert seen == ["hf:org/Repo-GGUF:Q4_K_M"]
    assert registry.ids == ("Repo-GGUF-Q4_K_M", "other")
    assert registry.get("Repo-GGUF-Q4_K_M").path == str(local)

    alone = build_registry(Settings(model_path="hf:org/Repo-GGUF:Q4_K_M"), resolve_path=resolve)
    assert (alone.ids, alone.default.path, alone.default.pinned) == (("Repo-GGUF-Q4_K_M",), str(local), True)

    def refuse(path: str) -> str:
        raise OSError("no such quant in org/Repo-GGUF")

    with pytest.raises(RegistryError, match="no such quant"):
        build_registry(Settings(model_path="hf:org/Repo-GGUF:Q9,hf:org/Other:Q4"),
                       resolve_path=refuse)


def test_a_models_kv_cache_type_reaches_its_worker_and_is_checked():
    server = Settings(engine="fake", worker_bin="/w")
    spec = ModelSpec(id="m", engine="fake", kv_cache_type="q8_0", source="test")
    argv = argv_for(spec.settings(server))
    assert argv[argv.index("--kv-cache-type") + 1] == "q8_0"
    with pytest.raises(RegistryError, match="model 'm'.*kv_cache_type"):
        ModelSpec(id="m", engine="fake", kv_cache_type="q5_1", source="test").settings(server)


def test_serve_refuses_a_bad_model_configuration_with_exit_status_2(tmp_path, capsys):
    from trioserve.cli import main

    config = tmp_path / "models.toml"
    config.write_text("[[models]]\nid = 'x'\npath = 'gone.gguf'\n")
    assert main(["serve", "--models-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trioserve: model 'x' (--models-config ") and "is not a file" in err


def test_serve_resolves_the_registrys_hub_models_before_the_event_loop_starts(tmp_path, monkeypatch):
    """A hub model may be downloaded while it is resolved: that must never run inside trio's
    loop, where it would stall every other task (and signals) for the whole download."""
    from trioserve import cli

    local = touch(tmp_path / "pulled.gguf")
    resolved_in_loop = []

    def resolve(path: str) -> str:
        resolved_in_loop.append(trio.lowlevel.in_trio_run())
        return str(local)

    served = []

    async def serve_forever(quart_app) -> int:
        served.append(quart_app.services.registry.ids)
        return 0

    monkeypatch.setattr(cli, "hub_path", resolve)
    monkeypatch.setattr(cli, "serve_forever", serve_forever)
    other = touch(tmp_path / "other.gguf")
    assert cli.main(["serve", "--model-path", f"hf:org/Repo-GGUF:Q4_K_M,{other}", "--port", "0"]) == 0
    assert resolved_in_loop == [False]
    assert served == [("Repo-GGUF-Q4_K_M", "other")]


def test_a_second_interrupt_while_draining_stops_without_a_traceback(tmp_path, monkeypatch, capsys):
    from trioserve import cli

    async def serve_forever(quart_app) -> int:
        async with trio.open_nursery():
            raise KeyboardInterrupt  # what trio raises for a SIGINT that no receiver takes

    monkeypatch.setattr(cli, "serve_forever", serve_forever)
    assert cli.main(["serve", "--model-path", str(touch(tmp_path / "m.gguf")), "--port", "0"]) == 130
    assert "interrupted while draining" in capsys.readouterr().err
