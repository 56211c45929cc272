"""Hub model references (trioserve/hub.py): parsing, and which file(s) a quantisation or file
name picks from a repo listing. Pulls themselves are in test_cli_pull.py."""

from __future__ import annotations

import pytest

from trioserve import hub
from trioserve.hub import HubError, ModelRef, parse_model_ref, select_files

LISTING = [
    "README.md", "config.json",
    "SmolLM2-135M-Instruct-Q4_K_M.gguf", "SmolLM2-135M-Instruct-Q4_K_S.gguf",
    "SmolLM2-135M-Instruct-Q8_0.gguf", "mmproj-SmolLM2-f16.gguf",
    "big/Model-Q6_K-00001-of-00002.gguf", "big/Model-Q6_K-00002-of-00002.gguf",
]


def test_a_reference_parses_with_or_without_its_prefix():
    assert parse_model_ref("hf:owner/repo:Q4_K_M") == ModelRef("owner/repo", "Q4_K_M")
    assert parse_model_ref("owner/repo") == ModelRef("owner/repo", "")
    assert parse_model_ref("hf:owner/repo:file.gguf") == ModelRef("owner/repo", "file.gguf")
    assert str(ModelRef("owner/repo", "Q8_0")) == "hf:owner/repo:Q8_0"


@pytest.mark.parametrize("bad", ["hf:", "hf:repo-without-owner", "hf:a/b/c", "hf:a/b:c:d",
                                 "hf:../x", "hf:a/b c"])
def test_a_malformed_reference_is_refused_with_the_expected_form(bad):
    with pytest.raises(HubError, match="expected hf:<owner>/<repo>"):
        parse_model_ref(bad)


def test_a_quantisation_picks_its_file_in_any_case():
    assert select_files(ModelRef("o/r", "q8_0"), LISTING) == ["SmolLM2-135M-Instruct-Q8_0.gguf"]
    assert select_files(ModelRef("o/r", "Q4_K_M"), LISTING) == ["SmolLM2-135M-Instruct-Q4_K_M.gguf"]


def test_a_split_gguf_brings_every_part_first_part_first():
    parts = ["big/Model-Q6_K-00001-of-00002.gguf", "big/Model-Q6_K-00002-of-00002.gguf"]
    assert select_files(ModelRef("o/r", "Q6_K"), LISTING) == parts
    assert select_files(ModelRef("o/r", "Model-Q6_K-00002-of-00002.gguf"), LISTING) == parts


def test_a_file_name_picks_that_file():
    assert select_files(ModelRef("o/r", "SmolLM2-135M-Instruct-Q4_K_S.gguf"), LISTING) == \
        ["SmolLM2-135M-Instruct-Q4_K_S.gguf"]


def test_an_ambiguous_quantisation_lists_the_gguf_files():
    with pytest.raises(HubError, match="matches several models") as caught:
        select_files(ModelRef("o/r", "Q4_K"), LISTING)
    assert "SmolLM2-135M-Instruct-Q4_K_S.gguf" in str(caught.value)
    assert "mmproj" not in str(caught.value)  # a vision projector is no model to pick


def test_a_missing_quantisation_or_file_lists_the_gguf_files():
    with pytest.raises(HubError, match="'IQ2_XS' matches no file.*Q8_0.gguf"):
        select_files(ModelRef("o/r", "IQ2_XS"), LISTING)
    with pytest.raises(HubError, match="no file 'nope.gguf'.*Q8_0.gguf"):
        select_files(ModelRef("o/r", "nope.gguf"), LISTING)


def test_no_quantisation_takes_the_only_model_else_q4_k_m_else_asks():
    assert select_files(ModelRef("o/r"), ["a-Q8_0.gguf", "README.md"]) == ["a-Q8_0.gguf"]
    assert select_files(ModelRef("o/r"), LISTING) == ["SmolLM2-135M-Instruct-Q4_K_M.gguf"]
    with pytest.raises(HubError, match="no quantisation given"):
        select_files(ModelRef("o/r"), ["a-Q8_0.gguf", "a-Q5_0.gguf"])


def test_a_repo_without_gguf_files_is_refused():
    with pytest.raises(HubError, match="no GGUF model files"):
        select_files(ModelRef("o/r", "Q4_0"), ["model.safetensors"])


def test_log_progress_writes_lines_not_a_redrawn_bar(caplog):
    caplog.set_level("INFO", logger="trioserve.hub")
    with hub.LogProgress(total=4 << 20, initial=1 << 20, desc="m.gguf") as bar:
        bar.update(3 << 20)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "pull m.gguf: 1.0 MiB of 4.0 MiB (25%) (resuming)"
    assert lines[-1] == "pull m.gguf: 4.0 MiB of 4.0 MiB (100%) done"
    assert not any("\r" in line for line in lines)


def test_a_terminal_gets_the_library_bar_and_a_log_gets_lines(monkeypatch):
    from huggingface_hub.utils.tqdm import tqdm as hub_tqdm

    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert hub._progress_class(None) is hub_tqdm
    monkeypatch.setattr("sys.stderr.isatty", lambda: False)
    assert hub._progress_class(None) is hub.LogProgress
    assert hub._progress_class(True) is hub_tqdm
