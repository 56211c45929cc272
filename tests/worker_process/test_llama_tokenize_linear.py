"""The llama worker's special-token tokenization is linear and exact.

llama.cpp's special-token partitioning copies the rest of the text at every special token
it finds: a prompt of many template-level special tokens (thousands of empty chat messages)
cost the square of their number. The worker tokenizes long special-parsed text in pieces
cut where a special token starts; these tests check that the ids are exactly those of one
llama.cpp call (llama-cpp-python, the same libllama, in a child process), and that a prompt that cannot fit is
refused before it is tokenized. Marked slow (real model), like the other llama worker tests.
"""

from __future__ import annotations

import itertools
import random

import pytest

from testkit.native_child import NativeChild
from testkit.worker_process import Worker

pytestmark = pytest.mark.slow

CTX = 4096


@pytest.fixture(scope="module")
def llama(bin_dir, model):
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", "2",
                "--ctx", str(CTX), "--capacity", "2"])
    w.wait_ready(120)
    w.ids = itertools.count(1)
    yield w
    assert w.close() == 0


@pytest.fixture(scope="module")
def reference(model):
    """One llama_tokenize call over the whole text (llama-cpp-python, vocabulary only, in a child
    process: testkit.native_child)."""
    child = NativeChild(model)
    child.call("load_vocab", model=str(model))
    yield lambda text: child.call("tokenize", text=text, parse_special=True)
    child.close()


def tokenize(w, text: str) -> list[int]:
    rec = w.request({"op": "tokenize", "id": next(w.ids), "prompt_segments": [{"text": text}]})
    assert rec["type"] == "tokens", rec
    return rec["ids"]


WORDS = ["hello", " world", "\n", "  ", "<", "|", ">", "<|im", "_start|>", "im_end", "\t", "é", "你好",
         "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<filename>", "<gh_stars>", " <|im_end|>"]


def chat_like(rng: random.Random, messages: int) -> str:
    """ChatML turns with odd contents: empty, whitespace at the edges, control-token text
    and fragments of it, adjacent special tokens."""
    parts = []
    for _ in range(messages):
        content = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
        role = rng.choice(["user", "assistant", "system", ""])
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>" + rng.choice(["\n", "", " ", "\n\n"]))
    return "".join(parts) + "<|im_start|>assistant\n"


@pytest.mark.parametrize("seed", range(6))
def test_pieces_give_the_same_ids_as_one_call(llama, reference, seed):
    rng = random.Random(seed)
    text = chat_like(rng, rng.choice([300, 800, 2000]))
    assert len(text.encode()) > 3 * 4096  # several pieces
    assert tokenize(llama, text) == reference(text)


def test_text_with_no_special_token_to_cut_at(llama, reference):
    text = "plain words and <angle brackets> " * 600 + "<|im_end|>"
    assert tokenize(llama, text) == reference(text)


def test_many_empty_messages_tokenize(llama):
    """20,000 empty messages: tokenized (linearly) and counted, not hung."""
    text = "<|im_start|>user\n<|im_end|>\n" * 20_000
    ids = tokenize(llama, text)
    assert len(ids) == 20_000 * 5  # <|im_start|> user \n <|im_end|> \n


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(llama):
    text = "<|im_start|>user\n<|im_end|>\n" * 110_000  # 3 MB
    _, err = llama.generate(next(llama.ids), prompt_segments=[{"text": text}], max_new_tokens=4)
    assert err["type"] == "error" and err["code"] == "context_length_exceeded", err
    assert err["lower_bound"] is True and CTX <= err["prompt_tokens"] <= 110_000 * 5
    # The worker is fine and serves the next request.
    texts, done = llama.generate(next(llama.ids), prompt="<|im_start|>user\nHi<|im_end|>\n", max_new_tokens=2)
    assert done["type"] == "done"


def test_a_prompt_that_might_fit_is_counted_exactly(llama):
    text = "hello " * 5000  # 30 KB: the bound (bytes / longest token) is below the context
    _, err = llama.generate(next(llama.ids), prompt=text)
    assert err["code"] == "context_length_exceeded" and "lower_bound" not in err
    assert err["prompt_tokens"] >= CTX

