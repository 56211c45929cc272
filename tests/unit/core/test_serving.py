"""The API-neutral serving core: the output pipeline's events and endings, the event fold,
and ServingCore over a scripted runtime (tests/fakes/core.py; no processes)."""

from __future__ import annotations

import json

import pytest

from trioserve import errors
from trioserve.core.events import (
    Accumulator,
    Finished,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallStarted,
)
from trioserve.core.pipeline import OutputPipeline
from trioserve.core.request import (
    CoreRequest,
    ForcedTool,
    FunctionTool,
    JsonObjectOutput,
    JsonSchemaOutput,
    Message,
    ParamPaths,
    ToolCallPart,
    unmatched_tool_result,
)
from trioserve.core.sessions import SessionKey
from trioserve.model.tool_formats import HermesParser
from trioserve.worker.protocol import Done, decode_record

from tests.fakes.core import scripted_core

CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2_CUT = '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
TOOLS = (FunctionTool("get_weather", "weather", {"type": "object",
                                                 "properties": {"city": {"type": "string"}}}),)


def done(**fields) -> Done:
    record = {"type": "done", "id": 1, "finish_reason": "stop", "cancelled": False,
              "stop_string": None, "prompt_tokens": 10, "completion_tokens": 5, **fields}
    decoded = decode_record(json.dumps(record).encode())
    assert isinstance(decoded, Done)
    return decoded


def run(pipeline: OutputPipeline, pieces: list[str], end: Done | None) -> list:
    events = []
    for piece in pieces:
        events += pipeline.feed(piece)
    return events + pipeline.finish(end)


def hermes(*names: str) -> HermesParser:
    return HermesParser(dict.fromkeys(names or ("get_weather",)))


# --- the pipeline -------------------------------------------------------------------------------


def test_plain_text_is_text_deltas_and_a_stop_ending_with_usage():
    events = run(OutputPipeline(stops=()), ["Hel", "lo"], done(reused_prompt_tokens=4))
    assert events[:-1] == [TextDelta("Hel"), TextDelta("lo")]
    end = events[-1]
    assert isinstance(end, Finished) and end.reason == "stop"
    assert (end.usage.prompt_tokens, end.usage.completion_tokens, end.usage.cached_tokens) == (10, 5, 4)


def test_reasoning_block_is_reasoning_deltas_never_text():
    events = run(OutputPipeline(stops=(), reasoning_markers=("<think>", "</think>")),
                 ["<think>pla", "n</think>\n\nAnswer"], done())
    acc = Accumulator()
    acc.extend(events)
    assert (acc.result.reasoning, acc.result.text) == ("plan", "Answer")
    assert all(not isinstance(e, TextDelta) or "think" not in e.text for e in events)


def test_a_stop_string_across_pieces_cuts_and_is_named_when_it_is_the_requests():
    # A backstop: the worker never emits a stop string; what was sent stays sent.
    pipeline = OutputPipeline(stops=("END", "<|im_end|>"), request_stops=("END",))
    events = pipeline.feed("abc E")
    assert not pipeline.stop_hit
    events += pipeline.feed("ND tail")
    assert pipeline.stop_hit and pipeline.feed("more") == []
    events += pipeline.finish(None)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "abc E"
    assert events[-1].reason == "stop" and events[-1].stop_sequence == "END"
    whole = OutputPipeline(stops=("END", "<|im_end|>"), request_stops=("END",))
    events = whole.feed("abc <|im_end|> tail") + whole.finish(done(stop_string="<|im_end|>"))
    assert events[0] == TextDelta("abc ") and events[-1].stop_sequence is None


def test_a_tool_call_is_started_arguments_done_in_order():
    events = run(OutputPipeline(stops=(), tool_parser=hermes()), ["Sure. ", CALL_1], done())
    kinds = [type(e) for e in events]
    assert kinds == [TextDelta, ToolCallStarted, ToolCallArgumentsDelta, ToolCallDone, Finished]
    call = events[3]
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "get_weather", {"city": "Paris"})
    assert events[1].call_id == call.call_id and events[2].delta == call.arguments
    assert events[-1].reason == "tool_calls"


@pytest.mark.parametrize("split", [1, 7, 30])
def test_budget_inside_the_second_call_is_length_one_call_and_no_markup(split):
    text = CALL_1 + CALL_2_CUT
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    events = run(OutputPipeline(stops=(), tool_parser=hermes()), pieces,
                 done(finish_reason="length"))
    acc = Accumulator()
    acc.extend(events)
    result = acc.result
    assert result.finished.reason == "length"
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    assert result.text == ""  # the unfinished call is dropped, not content
    assert result.finished.dropped_text.startswith("<tool_call>")


def test_budget_after_complete_calls_is_still_length():
    events = run(OutputPipeline(stops=(), tool_parser=hermes()), [CALL_1, "\n"],
                 done(finish_reason="length"))
    assert events[-1].reason == "length" and events[-1].dropped_text == ""
    assert sum(isinstance(e, ToolCallDone) for e in events) == 1


def test_budget_inside_a_call_after_text_keeps_the_text_and_drops_a_partial_marker():
    events = run(OutputPipeline(stops=(), tool_parser=hermes()), ["Let me check. <tool_c"],
                 done(finish_reason="length"))
    acc = Accumulator()
    acc.extend(events)
    assert acc.result.text == "Let me check." and acc.result.finished.dropped_text == "<tool_c"


def test_budget_without_tools_keeps_every_character():
    text = "text that mentions <tool_call> and stops"
    events = run(OutputPipeline(stops=()), [text], done(finish_reason="length"))
    acc = Accumulator()
    acc.extend(events)
    assert acc.result.text == text and acc.result.finished.reason == "length"


def test_malformed_call_that_ended_normally_stays_content():
    text = "<tool_call>\nnot json\n</tool_call>"
    events = run(OutputPipeline(stops=(), tool_parser=hermes()), [text], done())
    acc = Accumulator()
    acc.extend(events)
    assert acc.result.text == text and acc.result.finished.reason == "stop"


def test_finish_twice_is_a_caller_bug():
    pipeline = OutputPipeline(stops=())
    pipeline.finish(done())
    with pytest.raises(RuntimeError):
        pipeline.finish(done())


# --- the request model ----------------------------------------------------------------------------


def test_template_messages_decode_object_arguments_and_keep_other_text():
    req = CoreRequest(messages=(
        Message("system", "be brief"),
        Message("assistant", "", reasoning="r", tool_calls=(
            ToolCallPart.from_text("c1", "f", '{"a": 1}'), ToolCallPart.from_text("c2", "g", "not json"))),
        Message("tool", "42", tool_call_id="c1"),
    ))
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert req.template_tools() is None
    with_tools = CoreRequest(messages=req.messages, tools=TOOLS, tool_choice="none")
    assert with_tools.template_tools() is None and with_tools.tool_dicts()[0]["function"]["name"] == "get_weather"


def test_a_tool_result_must_answer_an_earlier_call():
    call = Message("assistant", tool_calls=(ToolCallPart("c1", "f", {}),))
    ok = CoreRequest(messages=(Message("user", "x"), call, Message("tool", "r", tool_call_id="c1")))
    assert unmatched_tool_result(ok) is None
    early = CoreRequest(messages=(Message("tool", "r", tool_call_id="c1"), call))
    err = unmatched_tool_result(early)
    assert err is not None and (err.status, err.code, err.param) == (400, "invalid_value",
                                                                      "messages[0].tool_call_id")
    placed = CoreRequest(messages=(Message("tool", "r", tool_call_id="c9",
                                           tool_call_id_param="input[3].call_id"),),
                         params=ParamPaths(messages="input"))
    err = unmatched_tool_result(placed)
    assert err is not None and err.param == "input[3].call_id" and '"c9"' in err.message


def test_template_fields_read_in_the_apis_names():
    paths = ParamPaths(messages="input", reasoning_effort="thinking")
    assert paths.template_field("messages[2].content") == "input[2].content"
    assert paths.template_field("reasoning_effort") == "thinking"
    assert paths.template_field("tools[0]") == "tools[0]"
    assert paths.template_field("messagesX") == "messagesX"
    assert ParamPaths().tool_parameters_of(TOOLS[0], 3) == "tools[3].function.parameters"
    placed = FunctionTool("f", parameters_param="tools[1].tools[0].parameters")
    assert ParamPaths().tool_parameters_of(placed, 0) == "tools[1].tools[0].parameters"


# --- ServingCore over a scripted runtime -------------------------------------------------------------


async def test_core_renders_generates_and_folds_a_whole_answer():
    core, runtime = scripted_core(["Hi", " there"])
    turn = await core.start(CoreRequest(messages=(Message("user", "hello"),), max_tokens=9),
                            request_id="r1")
    result = await turn.collect()
    turn.close()
    assert (result.text, result.finished.reason) == ("Hi there", "stop")
    [gen] = runtime.generations
    assert gen.params.max_new_tokens == 9 and "hello" in gen.params.prompt
    assert gen.params.prompt.endswith("<|im_start|>assistant\n")


async def test_core_streams_batches_ending_with_finished_and_close_cancels():
    core, runtime = scripted_core(["a", "b", "c"])
    turn = await core.start(CoreRequest(messages=(Message("user", "x"),)), request_id="r")
    batches = turn.batches()
    first = await batches.__anext__()
    assert first == [TextDelta("a")]
    turn.close()  # the client left mid-stream
    await batches.aclose()
    assert runtime.generations[0].cancel_requested


async def test_core_length_inside_second_call_through_the_core():
    core, _ = scripted_core(([CALL_1, CALL_2_CUT], {"finish_reason": "length"}))
    turn = await core.start(CoreRequest(messages=(Message("user", "weather?"),), tools=TOOLS,
                                        max_tokens=100), request_id="r")
    result = await turn.collect()
    assert result.finished.reason == "length" and len(result.tool_calls) == 1
    assert "<tool_call>" not in result.text


async def test_core_refuses_a_forced_tool_without_grammar_support_before_generating():
    core, runtime = scripted_core(["x"])
    req = CoreRequest(messages=(Message("user", "x"),), tools=TOOLS,
                      tool_choice=ForcedTool("get_weather"))
    with pytest.raises(errors.APIError) as info:
        await core.start(req, request_id="r")
    assert info.value.code == "unsupported_parameter" and runtime.generations == []


async def test_core_reports_schema_errors_in_the_apis_names():
    core, _ = scripted_core(["x"], grammar=True)
    paths = ParamPaths(output_format="text.format", output_schema="text.format.schema",
                       forced_tool="tool_choice.name")
    schema = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}}
    req = CoreRequest(messages=(Message("user", "x"),), params=paths,
                      output_format=JsonSchemaOutput("s", schema))
    with pytest.raises(errors.APIError) as info:
        await core.start(req, request_id="r")
    assert info.value.param == "text.format.schema.properties.x.minimum"
    assert "'text.format.schema.properties.x.minimum'" in info.value.message
    forced = CoreRequest(messages=(Message("user", "x"),), params=paths, tools=TOOLS,
                         tool_choice=ForcedTool("nope"))
    with pytest.raises(errors.APIError) as info:
        await core.start(forced, request_id="r")
    assert info.value.param == "tool_choice.name" and "'tool_choice.name'" in info.value.message


async def test_core_remembers_a_sessions_turn_for_replay_only_when_it_was_exact():
    core, _ = scripted_core((["Hi"], {"generated_token_ids": [72, 105]}),
                            ([CALL_1, CALL_2_CUT], {"finish_reason": "length",
                                                    "generated_token_ids": [1, 2, 3]}))
    session = SessionKey("s", "prompt_cache_key")
    req = CoreRequest(messages=(Message("user", "x"),), session=session)
    turn = await core.start(req, request_id="r")
    await turn.collect()
    turn.close()
    plan = core.replay.plan("s", [*req.template_messages(), {"role": "assistant", "content": "Hi"}])
    assert [t.ids for _, t in plan] == [(72, 105)]
    # A turn whose unfinished call was dropped is not what the ids say: not remembered.
    req2 = CoreRequest(messages=(Message("user", "x"), Message("assistant", "Hi"),
                                 Message("user", "y")), tools=TOOLS, session=session)
    turn = await core.start(req2, request_id="r2")
    await turn.collect()
    turn.close()
    assert len(core.replay._sessions["s"]) == 1


@pytest.mark.parametrize("supported", [True, False])
async def test_core_asks_for_unique_keys_on_json_output_when_the_worker_can(supported):
    core, runtime = scripted_core(['{"a": 1}'], grammar=True)
    core.unique_keys_supported = supported
    req = CoreRequest(messages=(Message("user", "x"),), output_format=JsonObjectOutput())
    turn = await core.start(req, request_id="r")
    await turn.collect()
    params = runtime.generations[0].params
    assert params.grammar is not None
    assert params.unique_keys == ({} if supported else None)
