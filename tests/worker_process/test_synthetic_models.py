"""The synthetic models (testkit/synthetic_models.py) on the real llama worker: every family
loads, llama.cpp builds the memory the family has (a hybrid recurrent + KV memory for Qwen3.5,
a sliding-window cache for Gemma), the chat format's tokens are single tokens, and greedy
generation is repeatable. Random weights: what the models say is never checked.

What llama.cpp built is read from its own log (``--verbose``; the log lines of the pinned
llama-cpp-python 0.3.36) and, for the recurrent/hybrid kind, from the ready record: with
``--speculative auto`` the worker reports "this engine cannot verify drafts" exactly when
``llama_model_is_recurrent() || llama_model_is_hybrid()`` (cpp/engines/llama/llama_engine.h).
A family takes about a second here, so these are not marked slow.
"""

from __future__ import annotations

import itertools
import os
import re

import pytest

from testkit.synthetic_models import (ARCHS, CONTROL, FORMATS, USER_DEFINED, base_vocab, family_vocab, make,
                                      tiny_shape)
from testkit.templates import CONVERSATIONS, TOOL_CONVERSATION, WEATHER_TOOL
from trioserve.model.chat_template import ChatTemplate

FLAGS = ("--threads", "2", "--ctx", "512", "--capacity", "2")
CANNOT_VERIFY = "this engine cannot verify drafts"  # cpp/loop/speculation_glue.h

# The tiny shapes' layer kinds, as llama.cpp must see them: Qwen3.5's every 4th layer is full
# attention (full_attention_interval), Gemma's every 6th is global (5 window layers : 1).
RECURRENT = {"qwen35": {0, 1, 2}, "qwen35moe": {0, 1, 2}}
WINDOW = {"gemma3": {0, 1, 2, 3, 4}, "gemma4": {0, 1, 2, 3, 4}}
GEMMA3_CHAT = [{"role": "system", "content": "Answer briefly."}, *CONVERSATIONS["multi"]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    return {arch: make(arch, out) for arch in ARCHS}


def _log(w) -> str:
    """The worker's whole stderr so far; pread leaves the offset the worker writes at alone."""
    fd = w.stderr.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _layers(log: str, pattern: str) -> set[int]:
    return {int(m) for m in re.findall(pattern, log)}


def _prompt(arch: str, ready: dict) -> str:
    st = ready["special_tokens"]
    template = ChatTemplate.from_string(ready["chat_template"], st["bos"] or "", st["eos"] or "")
    if arch == "gemma3":  # its template renders no tools and insists on alternating roles
        return template.render(GEMMA3_CHAT)
    return template.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])


@pytest.mark.parametrize("arch", ARCHS)
def test_family_loads_with_its_memory_kind_and_generates_repeatably(arch, models, spawn):
    w = spawn("trioserve-llama-worker", "--model", str(models[arch]), *FLAGS, "--speculative", "auto", "--verbose")
    ids = itertools.count(1)
    ready, log = w.ready, _log(w)
    vocab = family_vocab(FORMATS[arch], base_vocab())
    n_layer = tiny_shape(arch).n_layer
    assert ready["model"]["architecture"] == arch and ready["model"]["name"].startswith("Synthetic")
    assert (ready["n_ctx"], ready["capacity"], ready["n_vocab"]) == (512, 2, len(vocab.tokens))
    assert ready["n_swa"] == (128 if arch in WINDOW else 0)

    # The memory llama.cpp built: recurrent state for the Gated DeltaNet layers and a KV cache
    # for the rest; a window flag on Gemma's local layers.
    recurrent = _layers(log, r"llama_memory_recurrent, layer +(\d+): dev")
    kv = _layers(log, r"llama_kv_cache: layer +(\d+): dev")
    window = _layers(log, r"load_tensors: layer +(\d+) assigned to device \S+, is_swa = 1")
    assert recurrent == RECURRENT.get(arch, set()), log[-3000:]
    assert kv == set(range(n_layer)) - recurrent
    assert window == WINDOW.get(arch, set())
    assert (ready["speculative"].get("off_reason") == CANNOT_VERIFY) == (arch in RECURRENT)

    # The chat format's tokens are single tokens: control ones only where special tokens are
    # parsed (the ready record lists them), user-defined ones in any text.
    control = set(ready["special_tokens"]["control"])
    for text, kind in zip(vocab.tokens, vocab.token_types):
        if text in FORMATS[arch].control + FORMATS[arch].user_defined:
            assert w.request({"op": "tokenize", "id": next(ids), "text": text})["ids"] == [vocab.tokens.index(text)]
            assert (text in control) == (kind == CONTROL), text
            assert kind in (CONTROL, USER_DEFINED)

    # The family's template renders a conversation whose format tokens each become one token.
    prompt = _prompt(arch, ready)
    prompt_ids = w.request({"op": "tokenize", "id": next(ids), "text": prompt})["ids"]
    used = [t for t in FORMATS[arch].control + FORMATS[arch].user_defined if t in prompt]
    assert len(used) >= 3, prompt
    for text in used:
        assert prompt_ids.count(vocab.tokens.index(text)) == prompt.count(text), text

    runs = []
    for _ in range(2):
        texts, done = w.generate(next(ids), prompt=prompt, max_new_tokens=12)
        assert done["type"] == "done" and done["prompt_tokens"] == len(prompt_ids), done
        assert done["completion_tokens"] == len(done["generated_token_ids"]) > 0
        runs.append(done["generated_token_ids"])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("arch", ARCHS)
def test_scaled_model_loads_and_generates(arch, tmp_path, spawn):
    """``params`` changes width, depth, heads (and experts, state sizes) together: a 20M-parameter
    model (width 256, 8-12 layers) of each family loads and decodes."""
    path = make(arch, tmp_path, params=20_000_000, seed=1)
    w = spawn("trioserve-llama-worker", "--model", str(path), *FLAGS)
    assert w.ready["model"]["architecture"] == arch
    texts, done = w.generate(1, prompt="Hello", max_new_tokens=4)
    assert done["type"] == "done" and len(done["generated_token_ids"]) == done["completion_tokens"] > 0, done
