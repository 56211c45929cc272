"""The control-plane tokenization for the ExecuTorch engine (trioserve/worker/prompt_encoder.py) and
the engine's settings; uses the committed tiny tokenizer (tests/data/executorch)."""

from __future__ import annotations


import pytest
from tokenizers import Tokenizer
from trioserve.config import Settings, SettingsError
from trioserve.worker.prompt_encoder import PromptEncoder
from trioserve.worker.protocol import (Generate, GenerateParams, IdsSegment, Ping, TextSegment,
                                       Tokenize)
from testkit import TEST_DATA
from trioserve.worker.launch import argv_for

TOKENIZER = TEST_DATA / "executorch" / "tokenizer.json"


@pytest.fixture(scope="module")
def enc() -> PromptEncoder:
    return PromptEncoder(TOKENIZER)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


def test_special_segments_parse_control_tokens_and_user_text_does_not(enc, tok):
    im_start = tok.token_to_id("<|im_start|>")
    template = enc.encode("<|im_start|>user\n", special=True)
    assert template[0] == im_start
    user = enc.encode("<|im_start|>", special=False)
    assert im_start not in user and len(user) > 1
    assert tok.decode(user, skip_special_tokens=False) == "<|im_start|>"


def test_no_bos_eos_and_empty_text(enc):
    assert enc.encode("", special=True) == []
    ids = enc.encode("hello", special=True)
    assert ids and enc.encode("hello", special=False) == ids


def test_segments_are_tokenized_separately_and_ids_pass_verbatim(enc):
    parts = enc.segments_to_ids((TextSegment("hello"), TextSegment(" there", special=False),
                                 IdsSegment((7, 8))))
    assert parts == (IdsSegment(tuple(enc.encode("hello", special=True) + enc.encode(" there", special=False)
                                      + [7, 8])),)


def test_generate_and_tokenize_are_rewritten_others_unchanged(enc):
    g = enc(Generate(GenerateParams(prompt="hi there", max_new_tokens=3, stop=("x",))))
    assert isinstance(g, Generate) and g.params.prompt == "" and g.params.max_new_tokens == 3
    assert g.params.stop == ("x",)
    assert g.params.prompt_segments == (IdsSegment(tuple(enc.encode("hi there", special=True))),)
    t = enc(Tokenize(text="<|im_end|>"))
    assert t.prompt_segments == (IdsSegment(tuple(enc.encode("<|im_end|>", special=True))),)
    assert len(t.prompt_segments[0].ids) == 1
    assert enc(Ping()) == Ping()


def test_a_bad_tokenizer_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        PromptEncoder(bad)
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        PromptEncoder(tmp_path / "missing.json")


def test_executorch_settings_need_their_files_and_pass_slots():
    with pytest.raises(SettingsError, match="--model-path <model.pte> and --tokenizer-path"):
        Settings(engine="executorch", model_path="m.pte").check_engine()
    several = Settings(engine="executorch", model_path="m.pte", tokenizer_path="t.json", worker_bin="/bin/w",
                       slots=3, spill_budget_bytes=1000)
    argv = argv_for(several)
    assert argv[argv.index("--capacity") + 1] == "3"
    assert argv[argv.index("--spill-budget-bytes") + 1] == "1000"
    s = Settings(engine="executorch", model_path="/x/m.pte", tokenizer_path="/x/tokenizer.json",
                 worker_bin="/bin/w", threads=2, slots=1)
    s.check_engine()
    argv = argv_for(s)
    assert argv[:3] == ["/bin/w", "--ctx", "0"]  # max_context 0: the program's max_context_len
    assert argv[argv.index("--model") + 1] == "/x/m.pte"
    assert argv[argv.index("--tokenizer") + 1] == "/x/tokenizer.json"
    assert argv[argv.index("--threads") + 1] == "2"
    assert argv[argv.index("--capacity") + 1] == "1"  # --slots 1
    assert "--spill-budget-bytes" not in argv  # the worker's default
    assert s.resolved_model_id() == "m"


def test_cli_reports_a_missing_tokenizer_as_a_usage_error(capsys):
    from trioserve.cli import main

    assert main(["serve", "--engine", "executorch", "--model-path", "m.pte"]) == 2
    assert "--tokenizer-path" in capsys.readouterr().err
