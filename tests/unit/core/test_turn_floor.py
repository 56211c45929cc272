"""The early bound (trioserve/core/turn_floor.py): counting turns in a raw body without
decoding each message, and measuring how many tokens a turn adds under a template."""

from __future__ import annotations

import json
import re

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.core.turn_floor import (
    CHAT_TURNS,
    MIN_TURNS,
    RESPONSES_TURNS,
    RESPONSES_TEMPLATE_FIELDS,
    Survey,
    count_turns,
    floor_from_counts,
    measure_turn_floor,
    survey,
)
from trioserve import limits

MODEL = "m"


def body(messages, **extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": messages, **extra}).encode()


def reference(raw: bytes) -> int:
    """The turns as the ordinary parse sees them."""
    return sum(1 for m in json.loads(raw)["messages"]
               if isinstance(m, dict) and m.get("role") in ("user", "assistant"))


def count(raw: bytes) -> int | None:
    return trio.run(lambda: count_turns(raw, served_model=MODEL))


EMPTY = {"role": "user", "content": ""}


@pytest.mark.parametrize("messages", [
    [EMPTY] * 20_000,
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 500,
    [{"content": "reversed keys", "role": "assistant"}] * 300,
    # content that looks like turns, escapes, non-ASCII, a role key's text in content
    [{"role": "user", "content": 'x\\"role": {"role":"user","content":""}, \u00e9\u4e2d \n\t'}] * 200,
    [{"role": "user", "content": "role"}, {"role": "assistant", "content": 'a"role":'}] * 100,
    # other shapes between the plain turns: counted from the parsed rest
    [{"role": "system", "content": "s"}]
    + [EMPTY, {"role": "assistant", "content": "b", "name": "n"},
       {"role": "tool", "content": "t", "tool_call_id": "1"}] * 100
    + [EMPTY] * 5000,
])
def test_counts_the_turns_of_the_top_level_list_exactly(messages):
    raw = body(messages)
    assert count(raw) == reference(raw)


def test_text_part_lists_are_matched_as_turns_without_a_parse():
    """Content given as text parts is one turn in every API: the run patterns take it, so a
    body of such turns is counted by the regular expression, not by parsing each message."""
    turn = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}
    text = json.dumps([turn] * 100)[1:-1]
    assert CHAT_TURNS.runs[0].fullmatch(text)
    assert count(body([turn] * 100)) == 100
    # A part of another type (an image) is not plain text: left to the parse, still counted.
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert not CHAT_TURNS.runs[1].fullmatch(json.dumps(image))
    assert count(body([turn, image] * 100)) == 200


def test_any_json_formatting_of_the_turns_is_counted():
    raw = json.dumps({"model": MODEL, "messages": [EMPTY] * 500}, indent=3).encode()
    assert count(raw) == 500
    raw = json.dumps({"messages": [EMPTY] * 500, "model": MODEL}, separators=(",", ":")).encode()
    assert count(raw) == 500


@pytest.mark.parametrize("raw", [
    body([EMPTY] * 500, model="other"),  # model_not_found comes first
    body([EMPTY] * 500, chat_template_kwargs={"x": 1}),  # may change what the template renders
    body([EMPTY] * 500, reasoning_effort="low"),
    body([EMPTY] * 500)[:-2],  # not JSON: the ordinary path names the error
    body([EMPTY] * 500).replace(b'"m"', b'"\xff"'),  # not UTF-8
    body([EMPTY] * (MIN_TURNS - 1)),  # too few to be worth it
])
def test_gives_no_count_where_the_bound_does_not_apply(raw):
    assert count(raw) is None


def test_turns_elsewhere_are_never_counted():
    assert count(body([EMPTY], metadata={"x": [EMPTY] * 500})) in (None, 1)
    dup = (b'{"model": "m", "messages": [' + b",".join([b'{"role":"user","content":""}'] * 500)
           + b'], "messages": []}')
    assert count(dup) in (None, 0)
    assert count(body([{"role": "user", "content": json.dumps([EMPTY] * 500)}])) in (None, 1)


_texts = st.lists(st.sampled_from(['a', '"', '\\', '{', '}', ',', ':', '"role":', ' ', '\n',
                                   '\u00e9', '\u2028']), max_size=6).map("".join)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]),
                           "content": _texts}),
    st.fixed_dictionaries({"content": _texts, "role": st.sampled_from(["user", "assistant"])}),
    st.fixed_dictionaries({"role": st.just("user"), "content": _texts, "name": _texts}),
    st.fixed_dictionaries({"role": st.just("user"),
                           "content": st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": _texts}), max_size=2)}),
)
_block = st.tuples(_message, st.integers(1, 40)).map(lambda t: [t[0]] * t[1])


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(_block, min_size=1, max_size=12), indent=st.sampled_from([None, 1]),
       nested=st.booleans())
def test_the_count_is_exact_or_absent_for_any_mix(blocks, indent, nested):
    messages = [m for block in blocks for m in block]
    extra = {"metadata": {"copy": messages}} if nested else {}
    raw = json.dumps({"model": MODEL, "messages": messages, **extra}, indent=indent).encode()
    found = count(raw)
    assert found is None or found == reference(raw)


def responses_reference(raw: bytes) -> int:
    """User messages of a Responses ``input`` list as its parser sees them."""
    return sum(1 for m in json.loads(raw)["input"] if isinstance(m, dict) and m.get("role") == "user"
               and m.get("type", "message") == "message")


def count_input(raw: bytes) -> int | None:
    return trio.run(lambda: count_turns(raw, served_model=MODEL, shape=RESPONSES_TURNS,
                                        template_fields=("reasoning",)))


_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                           "content": _texts}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "assistant"]),
                           "content": _texts}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                           "content": st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text", "text"]),
                                "text": _texts}), min_size=1, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c"),
                           "output": _texts}),
)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(st.tuples(_item, st.integers(1, 40)).map(lambda t: [t[0]] * t[1]),
                       min_size=1, max_size=12))
def test_responses_input_counts_its_user_messages_exactly_or_not_at_all(blocks):
    items = [m for block in blocks for m in block]
    raw = json.dumps({"model": MODEL, "input": items}).encode()
    found = count_input(raw)
    assert found is None or found == responses_reference(raw)


def test_responses_assistant_items_are_never_counted():
    """Consecutive assistant items are joined into one turn by /v1/responses."""
    items = [{"role": "assistant", "content": ""}] * 1000 + [{"role": "user", "content": ""}] * 100
    assert count_input(json.dumps({"model": MODEL, "input": items}).encode()) == 100
    assert count_input(json.dumps({"model": MODEL, "input": items,
                                   "reasoning": {"effort": "low"}}).encode()) is None


# -- the floor --------------------------------------------------------------------------------


def test_floor_is_the_least_increment_per_turn():
    counts = {("user", ""): {1: 10, 2: 15, 3: 20, 4: 25, 8: 45},
              ("alternating", ""): {1: 10, 2: 16, 3: 21, 4: 27, 8: 49}}
    assert floor_from_counts(counts) == 5


@pytest.mark.parametrize("series", [
    {1: 10, 2: 15, 3: 15, 4: 20, 8: 40},  # one turn added nothing: dropped or merged
    {1: 10, 2: 15, 3: 20, 4: 25, 8: 25},  # a window of the last four turns
    {1: 10},  # nothing to compare
])
def test_a_template_that_can_drop_turns_has_no_floor(series):
    assert floor_from_counts({("user", ""): series}) == 0


def test_no_series_no_floor():
    assert floor_from_counts({}) == 0


SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def fake_tokens(text: str) -> int:
    """A tokenizer for the tests: each special token, and each run of other non-space text."""
    return len(SPECIAL.findall(text)) + len(SPECIAL.sub(" ", text).split())


def chatml(conversation, *, keep_last: int | None = None, skip_empty: bool = False,
           refuse_consecutive: bool = False):
    if refuse_consecutive and any(a[0] == b[0] for a, b in zip(conversation, conversation[1:])):
        return None
    shown = conversation[-keep_last:] if keep_last else conversation
    parts = []
    for role, text in shown:
        if skip_empty and not text:
            continue
        # the template text around each turn (the content is a segment of its own)
        parts += [f"<|im_start|>{role}\n", "<|im_end|>\n"]
    return parts + ["<|im_start|>assistant\n"]


async def measured(render) -> int:
    calls: list[str] = []

    async def count_tokens(text: str) -> int:
        calls.append(text)
        await trio.sleep(0)
        return fake_tokens(text)

    floor = await measure_turn_floor(render, count_tokens)
    assert len(calls) == len(set(calls))  # each distinct segment tokenized once
    return floor


async def test_measures_a_chatml_turn():
    assert await measured(chatml) == 3  # <|im_start|>, the role, <|im_end|>


async def test_a_windowing_template_has_no_floor():
    assert await measured(lambda c: chatml(c, keep_last=4)) == 0


async def test_a_template_that_skips_empty_turns_has_no_floor():
    assert await measured(lambda c: chatml(c, skip_empty=True)) == 0


async def test_conversations_the_template_refuses_are_left_out():
    assert await measured(lambda c: chatml(c, refuse_consecutive=True)) == 3


async def test_a_template_that_refuses_everything_has_no_floor():
    assert await measured(lambda c: None) == 0


def test_an_api_names_its_own_template_fields():
    raw = body([EMPTY] * 500, thinking={"type": "enabled", "budget_tokens": 1024})
    assert count(raw) == 500  # not a Chat Completions field
    assert trio.run(lambda: count_turns(raw, served_model=MODEL,
                                        template_fields=("thinking", "output_config"))) is None


def surveyed(raw: bytes, **kwargs) -> Survey | None:
    return trio.run(lambda: survey(raw, served_model=MODEL, **kwargs))


@pytest.mark.parametrize("messages, extra, items, turns", [
    # every element counts as an item, whatever its role or shape
    ([{"role": "system", "content": ""}] * 3000 + [EMPTY], {}, 3001, 1),
    ([EMPTY] * 500 + [{"role": "tool", "content": "t", "tool_call_id": "1"}] * 20 + [7, "x"], {}, 522, 500),
    # template fields: no turns for the bound, the items all the same
    ([EMPTY] * 500, {"chat_template_kwargs": {"x": 1}}, 500, None),
    ([EMPTY] * 500, {"reasoning_effort": "low"}, 500, None),
    # an empty chat_template_kwargs holds no template variable: the bound applies
    ([EMPTY] * 500, {"chat_template_kwargs": {}}, 500, 500),
    ([EMPTY] * 500, {"chat_template_kwargs": None}, 500, 500),
])
def test_the_survey_counts_every_item(messages, extra, items, turns):
    found = surveyed(body(messages, **extra))
    assert found is not None and (found.items, found.turns) == (items, turns)


def test_the_survey_counts_messages_system_blocks_and_sees_small_role_free_bodies():
    blocks = [{"type": "text", "text": ""}] * (limits.MAX_CONVERSATION_ITEMS + 1)
    raw = body([{"role": "user", "content": "hi"}], system=blocks)
    found = surveyed(raw, template_fields=("thinking",))
    assert found is not None and (found.items, found.turns) == (len(blocks) + 1, None)
    # no role key at all: 10,001 numbers in the list still count
    raw = body([0] * (limits.MAX_CONVERSATION_ITEMS + 1))
    assert surveyed(raw) == Survey(limits.MAX_CONVERSATION_ITEMS + 1, None, 1)
    assert surveyed(body([0] * 100)) is None  # too small to be over the bound: not parsed


def test_responses_reasoning_without_effort_keeps_the_bound():
    items = [{"role": "user", "content": ""}] * 300
    for reasoning, turns in (({}, 300), ({"summary": "auto"}, 300), ({"effort": "low"}, None)):
        raw = json.dumps({"model": MODEL, "input": items, "reasoning": reasoning}).encode()
        found = surveyed(raw, shape=RESPONSES_TURNS, template_fields=RESPONSES_TEMPLATE_FIELDS)
        assert found is not None and (found.items, found.turns) == (300, turns)


def reference_objects(raw: bytes) -> int:
    count, stack = 0, [json.loads(raw)]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            count += 1
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return count


@pytest.mark.parametrize("raw", [
    body([{"role": "user", "content": [{"type": "text", "text": ""}] * 5000}]),
    body([{"role": "user", "content": [{"type": "text", "text": 'a"type": {'}] * 3}] * 2000,
         tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}] * 50),
    body([EMPTY] * 3000 + [{"role": "assistant", "content": "x", "name": "n"}] * 100),
    body([{"content": [{"type": "text", "text": "x"}], "role": "user"}] * 3000),
])
def test_the_survey_counts_objects_exactly_for_compact_bodies(raw):
    """json.dumps writes '"type": ' with a space: the count in runs is then a lower bound;
    written compactly (as clients do) it is exact."""
    compact = json.dumps(json.loads(raw), separators=(",", ":")).encode()
    found = surveyed(compact)
    assert found is not None and found.objects == reference_objects(compact)
    spaced = surveyed(raw)
    assert spaced is not None and spaced.objects <= reference_objects(raw)
