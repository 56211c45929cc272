"""Pure logic behind the agent-harness features: the canonical prefix of JSON arguments being
written, the pipeline's one-call limit and streamed arguments, role runs joined for a template
that needs alternation, and the model-name rule of ``/v1/messages``."""

from __future__ import annotations

import json
import random

import pytest

from trioserve.core.events import Finished, TextDelta, ToolCallArgumentsDelta, ToolCallDone, ToolCallStarted
from trioserve.core.model_names import ModelNames
from trioserve.core.pipeline import OutputPipeline
from trioserve.model.profiles import resolve_profile
from trioserve.model.tool_formats import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    QwenXmlParser,
    tool_schemas,
)
from trioserve.model.tool_formats.json_prefix import CanonicalPrefix
from trioserve.worker.protocol import Done

from testkit.templates import format_template

DOCUMENTS = [
    '{"a": 1, "b": [1, 2.50, -0, 1E2, true, null, []], "c": {"d": "x\\ny \\u00e9 \\ud83d\\ude00 \\/ \\"q\\""}}',
    "{}",
    '{ "k" : [ ] , "z":{ } }',
    '{"lone": "\\ud800 x", "tab": "a\\tb", "ctl": "\\u0001"}',
    '{"big": 12345678901234567890, "f": 0.1e-3, "neg": -12.5E+3}',
    json.dumps({"path": "a.txt", "content": "line \"é\"\n" * 200}, indent=2, ensure_ascii=False),
]


@pytest.mark.parametrize("raw", DOCUMENTS)
def test_canonical_prefix_grows_into_the_encoders_text_however_the_text_is_split(raw):
    want = json.dumps(json.loads(raw), ensure_ascii=False)
    rng = random.Random(raw)
    for _ in range(50):
        prefix, got, i = CanonicalPrefix(), "", 0
        while i < len(raw):
            k = rng.randint(1, 9)
            got += prefix.feed(raw[i:i + k])
            i += k
            assert want.startswith(got), (got, want)
        assert got == want and prefix.done and not prefix.failed


@pytest.mark.parametrize("raw", ['{"a": 1, "a": 2}', '{"a" 1}', '{"a": tru}', '{"a": 01}',
                                 '{"a": "x\ny"}', '{"a": 1,}', '"text"'])
def test_canonical_prefix_stops_at_what_the_decoder_would_refuse_or_reorder(raw):
    prefix = CanonicalPrefix()
    got = prefix.feed(raw) + prefix.feed(" ")
    assert prefix.failed
    assert got == "" or '{"a": 1, "a"' not in got  # a repeated key is never sent


TOOLS = tool_schemas([{"type": "function", "function": {"name": "f"}},
                      {"type": "function", "function": {"name": "g"}}])
TWO = ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
       '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\nmore text')


def _run(pipeline: OutputPipeline, text: str, step: int = 1) -> list:
    events: list = []
    for i in range(0, len(text), step):
        events += pipeline.feed(text[i:i + step])
        if pipeline.stop_hit:
            break
    done = Done(id=1, finish_reason="stop", cancelled=True, stop_string=None, prompt_tokens=1,
                completion_tokens=1, queue_ms=None, ttft_ms=None, raw={}) if pipeline.stop_hit else None
    return events + pipeline.finish(done)


@pytest.mark.parametrize("step", [1, 7, len(TWO)])
def test_single_call_ends_the_answer_after_the_first_complete_call(step):
    pipeline = OutputPipeline(stops=(), tool_parser=HermesParser(TOOLS), single_call=True)
    events = _run(pipeline, TWO, step)
    assert [e.name for e in events if isinstance(e, ToolCallDone)] == ["f"]
    assert not [e for e in events if isinstance(e, TextDelta)]
    assert pipeline.stop_hit and isinstance(events[-1], Finished) and events[-1].reason == "tool_calls"


def test_without_single_call_both_calls_and_the_text_come_through():
    events = _run(OutputPipeline(stops=(), tool_parser=HermesParser(TOOLS)), TWO, 5)
    assert [e.name for e in events if isinstance(e, ToolCallDone)] == ["f", "g"]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)).strip() == "more text"


CALLS = {
    HermesParser: '<tool_call>\n{"name": "f", "arguments": ARGS}\n</tool_call>',
    MistralParser: '[TOOL_CALLS][{"name": "f", "arguments": ARGS}]',
    Llama3JsonParser: '{"name": "f", "parameters": ARGS}',
}


@pytest.mark.parametrize("parser", list(CALLS), ids=lambda p: p.format_name)
def test_streamed_arguments_concatenate_to_the_final_arguments(parser):
    args = {"path": "a.txt", "content": 'say "hi"\n' * 30, "n": 1.5e3}
    text = CALLS[parser].replace("ARGS", json.dumps(args, indent=1))
    pipeline = OutputPipeline(stops=(), tool_parser=parser(TOOLS), stream_arguments=True)
    events = _run(pipeline, text, 3)
    [done] = [e for e in events if isinstance(e, ToolCallDone)]
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    pieces = [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)]
    assert [(s.index, s.call_id, s.name) for s in started] == [(0, done.call_id, "f")]
    assert "".join(pieces) == done.arguments == json.dumps(args, ensure_ascii=False)
    assert len(pieces) >= 10
    assert events.index(started[0]) < min(i for i, e in enumerate(events)
                                          if isinstance(e, ToolCallArgumentsDelta))


QWEN_TOOLS = tool_schemas([{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "number"},
                                     "content": {"type": "string"}}}}}])


@pytest.mark.parametrize("step", [1, 4, 13])
def test_qwen_xml_streams_string_values_and_matches_the_final_arguments(step):
    content = 'say "hi" </parameter> not the end\n\n' * 20 + "\n"
    text = ("<tool_call>\n<function=f>\n<parameter=path>\na.txt\n</parameter>\n"
            "<parameter=n>\n1.5e3\n</parameter>\n"
            f"<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call>")
    pipeline = OutputPipeline(stops=(), tool_parser=QwenXmlParser(QWEN_TOOLS), stream_arguments=True)
    events = _run(pipeline, text, step)
    [done] = [e for e in events if isinstance(e, ToolCallDone)]
    pieces = [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)]
    assert json.loads(done.arguments) == {"path": "a.txt", "n": 1500.0, "content": content}
    assert "".join(pieces) == done.arguments and len(pieces) >= 10


def test_a_call_not_streamed_arrives_in_one_piece():
    events = _run(OutputPipeline(stops=(), tool_parser=HermesParser(TOOLS)), CALLS[HermesParser]
                  .replace("ARGS", '{"x": 1}'), 2)
    assert [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)] == ['{"x": 1}']


# --- role runs -------------------------------------------------------------------------------

CODEX_LIKE = [{"role": "system", "content": "instructions"}, {"role": "system", "content": "more"},
              {"role": "user", "content": "environment"}, {"role": "user", "content": "task"},
              {"role": "assistant", "content": "ok"}, {"role": "system", "content": "style"},
              {"role": "user", "content": "next"}]


def test_gemma3_gets_role_runs_joined_and_renders():
    template = format_template("gemma3")
    serving = resolve_profile(template, architecture=None)
    messages, _ = serving.prepare_messages(CODEX_LIKE, None)
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "instructions\n\nmore"), ("user", "environment\n\ntask"), ("assistant", "ok"),
        ("user", "style\n\nnext")]
    text = template.render(messages)
    assert text.count("<start_of_turn>user") == 2
    assert CODEX_LIKE[2]["content"] == "environment"  # the request's dicts are not modified


@pytest.mark.parametrize("stem", ["qwen3", "llama3", "gemma4"])
def test_templates_that_render_role_runs_get_them_unchanged(stem):
    serving = resolve_profile(format_template(stem), architecture=None)
    messages, _ = serving.prepare_messages(CODEX_LIKE, None)
    assert messages == CODEX_LIKE


def test_a_template_that_only_needs_one_leading_system_message_keeps_user_runs():
    serving = resolve_profile(format_template("chatml_hermes"), architecture=None)
    messages, _ = serving.prepare_messages(CODEX_LIKE, None)
    assert [m["role"] for m in messages] == ["system", "user", "user", "assistant", "user", "user"]
    format_template("chatml_hermes").render(messages)  # renders


# --- model names ------------------------------------------------------------------------------


def test_claude_names_are_served_on_messages_only_and_only_when_allowed():
    allowed = ModelNames.single("m", client_names=True)
    assert ModelNames.single("m", client_names=False).serves("m", "chat")
    assert allowed.serves("claude-opus-4-8", "messages")
    assert not ModelNames.single("m", client_names=False).serves("claude-opus-4-8", "messages")
    assert not allowed.serves("claude-opus-4-8", "chat")
    assert not allowed.serves("gpt-5", "messages")
    assert not allowed.serves(None, "messages")


@pytest.mark.parametrize("step", [1, 3, 11])
def test_gemma4_streams_its_arguments_and_matches_the_final_arguments(step):
    from trioserve.model.tool_formats import Gemma4Parser
    content = 'say "hi" {not: a, bracket} ✓\n' * 20
    text = ('<|tool_call>call:f{path:<|"|>a.txt<|"|>,n:1.5e3,flag:true,'
            f'content:<|"|>{content}<|"|>}}<tool_call|>')
    pipeline = OutputPipeline(stops=(), tool_parser=Gemma4Parser(QWEN_TOOLS), stream_arguments=True)
    events = _run(pipeline, text, step)
    [done] = [e for e in events if isinstance(e, ToolCallDone)]
    pieces = [e.delta for e in events if isinstance(e, ToolCallArgumentsDelta)]
    assert json.loads(done.arguments) == {"path": "a.txt", "n": 1500.0, "flag": True, "content": content}
    assert "".join(pieces) == done.arguments and len(pieces) >= 10
