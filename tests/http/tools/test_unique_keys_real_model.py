"""``json_object`` answers of the real embedded model (SmolLM2-135M through llama.cpp) never
repeat a key within one object (spec §5.6).

The prompt asks for the kind of object the issue caught repeating a key (a cat with a name and
an age); sampled at temperature 1.0 over many seeds so the small model wanders. Each answer is
read with a duplicate-detecting ``object_pairs_hook`` when complete, and with an independent
key scanner (testkit/json_keys.py) in every case: an unfinished object must not repeat a key
either. How often the same requests repeat a key without the worker's key stage is measured by
bench/unique_keys_bench.py, not asserted here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio
from openai import OpenAI

from trioserve.config import EMBEDDED_MODEL_ID

from testkit.json_keys import repeated_key, unique_pairs

from ..conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

PROMPT = ("Describe a cat as a JSON object with the keys name, age, color and toys. "
          "Repeat the name key at the end.")
SEEDS = range(16)


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
                    response_format={"type": "json_object"}, max_tokens=80, temperature=1.0,
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
