"""Checkpoint marks (trioserve/core/checkpoint_hints.py): the end of the system prompt and
tools, and the start of the answer's turn, found from the rendered template and placed on the
prompt's segments so token-id replay in between does not move them."""

from __future__ import annotations

from pathlib import Path

from trioserve.core.checkpoint_hints import CheckpointMarks, find_marks, mark_segments
from trioserve.model.chat_template import ChatTemplate
from trioserve.worker.protocol import IdsSegment, TextSegment

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "templates"
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Reads a file",
                                           "parameters": {"type": "object", "properties": {}}}}]
CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."},
                {"role": "assistant", "content": "a.py"}, {"role": "user", "content": "And the tests?"}]


def _marks(template: ChatTemplate, messages, tools=TOOLS, **kwargs):
    prompt = template.render(messages, tools=tools, template_kwargs=kwargs)

    def render(msgs, gen):
        return template.render(msgs, tools=tools, add_generation_prompt=gen, template_kwargs=kwargs)

    return prompt, find_marks(render, messages, prompt)


def test_a_thinking_template_is_marked_at_the_system_end_and_before_the_answers_turn():
    template = ChatTemplate.from_string((TEMPLATES / "qwen_xml.jinja").read_text(), "", "<|im_end|>")
    prompt, marks = _marks(template, CONVERSATION)
    head = prompt[:marks.from_start]
    assert head.startswith("<|im_start|>system\nYou are terse.") and "read" in head  # tools live there
    # Never after whitespace: the next prompt's tokenizer may merge it with what follows.
    assert head.endswith("<|im_end|>") and prompt[marks.from_start:].startswith("\n<|im_start|>user\nList")
    # The generation prompt opens the thinking block: the mark is right before it (before the
    # header's newline), where the next turn's prompt (which renders this answer without
    # reasoning) leaves this one.
    turn = prompt[len(prompt) - marks.from_end:]
    assert turn.startswith("\n<think>") and prompt[:len(prompt) - marks.from_end].endswith("<|im_start|>assistant")
    next_turn = template.render(CONVERSATION + [{"role": "assistant", "content": "tests/"}], tools=TOOLS,
                                add_generation_prompt=False)
    assert next_turn.startswith(prompt[:len(prompt) - marks.from_end])


def test_no_system_message_no_system_mark_and_a_failing_render_no_mark():
    template = ChatTemplate.from_string((TEMPLATES / "qwen_xml.jinja").read_text(), "", "<|im_end|>")
    _, marks = _marks(template, CONVERSATION[1:])
    assert marks.from_start is None and marks.from_end is not None

    def broken(msgs, gen):
        raise ValueError("no")

    assert find_marks(broken, CONVERSATION, "whatever") == CheckpointMarks()


def test_segments_are_split_at_the_marks_and_ids_segments_do_not_move_them():
    segments = (TextSegment("<s>SYSTEM|"), TextSegment("user text", special=False), IdsSegment((1, 2, 3)),
                TextSegment("|TURN"), TextSegment("prefix"))
    # Rendered prompt: "SYSTEM|user text<replayed text>|TURN"; the profile added "<s>" (shift 3)
    # and an answer prefix follows (tail 6). The turn mark (5 characters from the end: before
    # "|TURN") comes after the replayed ids, so the ids segment carries it.
    out = mark_segments(segments, CheckpointMarks(from_start=7, from_end=5), shift=3, tail=6)
    assert out == (TextSegment("<s>SYSTEM|", checkpoint=True), TextSegment("user text", special=False),
                   IdsSegment((1, 2, 3), checkpoint=True), TextSegment("|TURN"), TextSegment("prefix"))
    # A system mark at the ids' position goes before them.
    out = mark_segments(segments, CheckpointMarks(from_start=16), shift=3)
    assert [s.checkpoint for s in out] == [False, True, False, False, False]
    # Inside a text segment: split there, the flag on the first part, ``special`` kept.
    out = mark_segments((TextSegment("abcdef", special=False),), CheckpointMarks(from_start=2))
    assert out == (TextSegment("ab", special=False, checkpoint=True), TextSegment("cdef", special=False))
    # A mark on the far side of an ids segment (its text is gone) or at an end is dropped.
    assert mark_segments(segments, CheckpointMarks(from_start=30, from_end=40), shift=3, tail=6) == segments
    assert mark_segments((TextSegment("abc"),), CheckpointMarks(from_start=3, from_end=3)) == (TextSegment("abc"),)
