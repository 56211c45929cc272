import random

import pytest

from trioserve.model.reasoning import ReasoningSplitter, split_reasoning


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


# --- per-profile markers -------------------------------------------------------------------

GEMMA4 = ("<|channel>thought", "<channel|>")
MAGISTRAL = ("[THINK]", "[/THINK]")


@pytest.mark.parametrize("markers,text,expected", [
    (GEMMA4, "<|channel>thought\nPlan it.<channel|>Answer.", ("Plan it.", "Answer.")),
    (GEMMA4, "<think>x</think>y", ("", "<think>x</think>y")),  # another family's tags are text
    (GEMMA4, "Answer mentioning <|channel>thought", ("", "Answer mentioning <|channel>thought")),
    (GEMMA4, "<|channel>thought\n<channel|>Answer.", ("", "Answer.")),  # empty block
    (MAGISTRAL, "[THINK]hmm[/THINK]\n\nDone", ("hmm", "Done")),
    (None, "<think>x</think>y", ("", "<think>x</think>y")),  # a model that does not think
])
def test_profile_markers(markers, text, expected):
    assert split_reasoning(text, markers=markers) == expected


def test_whitespace_after_the_opening_marker_is_not_reasoning():
    assert split_reasoning("<think>\n\nstep\n</think>\n\nA") == ("step\n", "A")
    assert split_reasoning("more</think>A", prompt="<|im_start|>assistant\n<think>\n") == ("more", "A")


def test_prompt_that_opens_a_gemma4_block():
    assert split_reasoning("\nthinking<channel|>Hi", prompt="<|turn>model\n<|channel>thought",
                           markers=GEMMA4) == ("thinking", "Hi")


@pytest.mark.parametrize("text", [
    "<|channel>thought\nstep one\nstep two<channel|>Final <channel|> answer",
    "<|channel>thought\n<channel|>Just content",
    "Plain answer",
    "<|channel>thought unterminated <chann",
])
def test_streaming_matches_whole_for_gemma4_markers(text):
    whole = split_reasoning(text, markers=GEMMA4)
    for size in range(1, 6):
        splitter = ReasoningSplitter(markers=GEMMA4)
        reasoning, content = "", ""
        for i in range(0, len(text), size):
            r, c = splitter.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert (reasoning + r, content + c) == whole
