"""core/model_setup.py and http/model_preview.py: which chat template and profile serve a
model, from a ready worker or from its file's header alone; the templates trioserve ships for
the families its profiles know (model/family_templates.py)."""

from __future__ import annotations

import pytest

from trioserve.config import Settings
from trioserve.core.model_setup import choose_template, missing_template, set_up
from trioserve.errors import FatalStartupError
from trioserve.http.model_preview import PreviewCache, model_identity, preview_model
from trioserve.model.family_templates import FAMILY_TEMPLATES, family_template
from trioserve.model.profiles import detect_profile, resolve_profile
from trioserve.worker.protocol import Ready

from tests.unit.worker.test_model_cost import LLAMA, write_gguf

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]


def ready(chat_template: str | None = None) -> Ready:
    """A ready record of a Gemma 3 GGUF (without a template unless one is given)."""
    return Ready(protocol=2, engine="llama", model_name="m", n_ctx=512, n_vocab=300, capacity=1,
                 max_line_bytes=1 << 20, max_batch_tokens=512, capabilities={},
                 special_tokens={"bos": "<bos>", "eos": "<eos>"}, chat_template=chat_template,
                 raw={}, architecture="gemma3")


@pytest.mark.parametrize("name", sorted(FAMILY_TEMPLATES))
def test_every_shipped_template_renders_and_is_detected_as_its_family(name):
    source = family_template(name)
    assert source is not None
    template = choose_template(Settings(chat_template=name), model_template=None, bos="<s>",
                               eos="</s>", architecture=None)
    text = template.render([m for m in CONVERSATION], add_generation_prompt=True)
    for m in CONVERSATION:  # every message's text reaches the prompt
        assert m["content"] in text
    assert detect_profile(template.source, None)[0].name == FAMILY_TEMPLATES[name]
    assert resolve_profile(template, architecture=None).name == FAMILY_TEMPLATES[name]


def test_a_file_of_that_name_wins_over_a_shipped_template(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3").write_text("{{ 'own file' }}")
    template = choose_template(Settings(chat_template="gemma3"), model_template=None, bos="",
                               eos="", architecture=None)
    assert template.render([{"role": "user", "content": "x"}]) == "own file"


def test_no_template_names_the_shipped_one_of_the_architectures_family():
    reason = missing_template(Settings(), has_model_template=False, architecture="gemma3")
    assert reason is not None and "--chat-template gemma3" in reason
    other = missing_template(Settings(), has_model_template=False, architecture="unknownarch")
    assert other is not None and "no chat template" in other and "the template trioserve ships" not in other
    assert missing_template(Settings(chatml_fallback=True), has_model_template=False,
                            architecture="gemma3") is None
    assert missing_template(Settings(), has_model_template=True, architecture="gemma3") is None


def test_set_up_refuses_a_model_without_a_template_naming_the_fix():
    with pytest.raises(FatalStartupError, match="--chat-template gemma3"):
        set_up(Settings(), ready())
    chosen = set_up(Settings(chat_template="gemma3"), ready())
    assert chosen.profile.name == "gemma3" and chosen.template.bos_token == "<bos>"


def test_a_template_file_that_cannot_be_read_is_a_startup_error(tmp_path):
    with pytest.raises(FatalStartupError, match="cannot load the chat template"):
        set_up(Settings(chat_template=str(tmp_path / "missing.jinja")), ready())


def test_preview_gives_context_capabilities_or_the_reason_it_cannot_start(tmp_path):
    with_template = write_gguf(tmp_path / "chat.gguf", {
        **LLAMA, "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                            "{{ m['content'] }}<|im_end|>\n{% endfor %}"})
    preview = preview_model(Settings(engine="llama", model_path=str(with_template)))
    assert preview is not None and preview.problem is None
    assert preview.context_length == LLAMA["llama.context_length"]
    assert preview.capabilities is not None and preview.capabilities["profile"] == "chatml"
    capped = preview_model(Settings(engine="llama", model_path=str(with_template), max_context=256))
    assert capped is not None and capped.context_length == 256
    bare = write_gguf(tmp_path / "bare.gguf", {**LLAMA, "general.architecture": "gemma3",
                                               "gemma3.context_length": 2048})
    refused = preview_model(Settings(engine="llama", model_path=str(bare)))
    assert refused is not None and refused.capabilities is None
    assert refused.problem is not None and "--chat-template gemma3" in refused.problem
    assert refused.context_length == 2048
    assert preview_model(Settings(engine="fake")) is None  # no file, no header


def test_preview_cache_reads_again_when_the_file_changes(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", LLAMA)
    settings = Settings(engine="llama", model_path=str(path))
    cache = PreviewCache()
    first = cache.get("m", settings)
    assert cache.get("m", settings) is first
    before = model_identity(settings)
    write_gguf(path, {**LLAMA, "llama.context_length": 4096}, tensor_bytes=2000)
    assert model_identity(settings) != before
    again = cache.get("m", settings)
    assert again is not None and again.context_length == 4096


def test_without_a_header_only_a_configured_template_is_checked(tmp_path):
    missing = preview_model(Settings(engine="fake", chat_template=str(tmp_path / "none.jinja")))
    assert missing is not None and "cannot load the chat template" in (missing.problem or "")
    assert preview_model(Settings(engine="fake", chat_template="gemma3")) is None
