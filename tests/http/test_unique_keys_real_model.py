"""``json_object`` answers of the real embedded model (SmolLM2-135M through llama.cpp) never
repeat a key within one object (spec §5.6, issue 19).

The prompt asks for the kind of object the issue caught repeating a key (a cat with a name and
an age); sampled at temperature 1.0 over many seeds so the small model wanders. Each answer is
read with a duplicate-detecting ``object_pairs_hook`` when complete, and with an independent
key scanner when the budget cut it (an unfinished object must not repeat a key either). How
often the same requests repeat a key without the worker's key stage is measured by
bench/unique_keys_bench.py, not asserted here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from openai import OpenAI

from trioserve.config import EMBEDDED_MODEL_ID

from .conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

PROMPT = ("Describe a cat as a JSON object with the keys name, age, color and toys. "
          "Repeat the name key at the end.")
SEEDS = range(16)


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {keys}"
    return dict(pairs)


def repeated_key(text: str) -> str | None:
    """The first key that repeats in its object in (possibly unfinished) JSON text, or None.
    A scanner separate from the worker's: a stack of objects with their keys; strings after
    ``{`` or ``,`` in an object are keys, decoded by json."""
    stack: list[tuple[set[str] | None, list[bool]]] = []  # (keys or None for an array, [expect_key])
    i = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= len(text):
                return None  # an unfinished string at the end
            if stack and stack[-1][0] is not None and stack[-1][1][0]:
                stack[-1][1][0] = False
                key = json.loads(text[i:j + 1])
                if key in stack[-1][0]:
                    return key
                stack[-1][0].add(key)
            i = j + 1
            continue
        if c in "{[":
            stack.append((set() if c == "{" else None, [c == "{"]))
        elif c in "}]" and stack:
            stack.pop()
        elif c == "," and stack and stack[-1][0] is not None:
            stack[-1][1][0] = True
        i += 1
    return None


def test_the_scanner_finds_repeats():
    assert repeated_key('{"a": 1, "b": {"a": 2}, "a"') == "a"
    assert repeated_key('{"a": "a", "b": ["a", {"a": 1}], "c": "x\\"a') is None
    assert repeated_key('{"\\u0061": 1, "a": 2}') == "a"


def _llama_worker() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""


async def test_json_object_answers_never_repeat_a_key(tmp_path):
    async with live_server(tmp_path, engine="llama", worker_bin=_llama_worker(), threads=2,
                           max_context=2048) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0)

        def run():
            with client:
                return [client.chat.completions.create(
                    model=EMBEDDED_MODEL_ID, messages=[{"role": "user", "content": PROMPT}],
                    response_format={"type": "json_object"}, max_tokens=96, temperature=1.0,
                    seed=seed) for seed in SEEDS]

        results = await trio.to_thread.run_sync(run)
    complete = 0
    for seed, result in zip(SEEDS, results):
        out = result.choices[0]
        text = out.message.content or ""
        assert text.lstrip().startswith("{"), (seed, text)
        assert repeated_key(text) is None, (seed, text)
        if out.finish_reason == "stop":
            complete += 1
            assert isinstance(json.loads(text, object_pairs_hook=unique_pairs), dict), (seed, text)
        else:
            assert out.finish_reason == "length", (seed, out)
    assert complete >= len(SEEDS) // 2, f"only {complete} complete answers"
