import random

import pytest

from trioserve.reasoning import ReasoningSplitter, split_reasoning


@pytest.mark.parametrize("text,prompt,expected", [
    ("<think>plan it</think>\nThe answer.", "", ("plan it", "The answer.")),
    ("  <think>a</think>b", "", ("a", "b")),
    ("No thinking here <think>x</think>", "", ("", "No thinking here <think>x</think>")),
    ("plan</think>\n\nDone", "<|im_start|>assistant\n<think>\n", ("plan", "Done")),
    ("<think>never closed", "", ("never closed", "")),
    ("", "", ("", "")),
    ("<thin", "", ("", "<thin")),
    ("<", "", ("", "<")),
    ("Hello", "", ("", "Hello")),
])
def test_split(text, prompt, expected):
    assert split_reasoning(text, prompt=prompt) == expected


@pytest.mark.parametrize("text", [
    "<think>step one\nstep two</think>\nFinal answer with </think> inside",
    "\n<think></think>Just content",
    "Plain answer mentioning <think> tags",
    "<think>unterminated thoughts </thi",
])
def test_streaming_matches_whole_for_any_split(text):
    whole = split_reasoning(text)
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(5, len(text))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        splitter = ReasoningSplitter()
        reasoning, content = "", ""
        for piece in pieces:
            r, c = splitter.feed(piece)
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert (reasoning + r, content + c) == whole
