"""The Messages adapter over the serving core with a scripted runtime (no processes): the
reasoning budget (cut, answer prefix, summed usage), the core's ``answer_prefix`` and
``Turn.cut``, and count_tokens' rendering."""

from __future__ import annotations

import json

from trioserve.api.messages.adapter import ServingMessages
from trioserve.model.chat_template import ChatTemplate
from trioserve.core.events import Finished, TextDelta
from trioserve.core.request import CoreRequest, Message

from tests.fakes.core import scripted_core
from testkit import TEST_DATA

QWEN3 = ChatTemplate.from_string(
    (TEST_DATA / "templates" / "qwen3.jinja").read_text(),
    bos_token="", eos_token="<|im_end|>")


def body(**extra) -> bytes:
    return json.dumps({"model": "fake", "max_tokens": 3000,
                       "messages": [{"role": "user", "content": "Think."}], **extra}).encode()


async def test_answer_prefix_is_rendered_after_the_generation_prompt():
    core, runtime = scripted_core(["ok"])
    turn = await core.start(CoreRequest(messages=(Message("user", "x"),), answer_prefix="<think>\nr\n</think>\n\n"),
                            request_id="r")
    await turn.collect()
    turn.close()
    params = runtime.generations[0].params
    assert params.prompt.endswith("<|im_start|>assistant\n<think>\nr\n</think>\n\n")
    assert params.prompt_segments[-1].text == "<think>\nr\n</think>\n\n"


async def test_cut_cancels_and_ends_with_the_workers_usage():
    core, runtime = scripted_core(["a", "b", "c"])
    turn = await core.start(CoreRequest(messages=(Message("user", "x"),)), request_id="r")
    batches = turn.batches()
    assert await batches.__anext__() == [TextDelta("a")]
    await batches.aclose()
    assert turn.token_records == 1
    tail = await turn.cut()
    turn.close()
    assert isinstance(tail[-1], Finished) and runtime.generations[0].cancel_requested


async def test_reasoning_budget_cuts_and_a_second_generation_answers():
    thinking = ["<think>\n"] + ["r"] * 1500 + ["\n</think>\n\nlate"]
    core, runtime = scripted_core(thinking, ["final"], template=QWEN3)
    messages = ServingMessages(core)
    msg = (await messages.create(body(thinking={"type": "enabled", "budget_tokens": 1024}))).body
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"]
    # 1024 token records: the opening marker's and 1023 of reasoning.
    assert msg["content"][0]["thinking"] == "r" * 1023 and msg["content"][1]["text"] == "final"
    first, second = runtime.generations
    assert first.done.cancelled and not second.done.cancelled
    assert second.params.prompt.endswith("<think>\n" + "r" * 1023 + "\n</think>\n\n")
    assert second.params.max_new_tokens == 3000 - first.done.completion_tokens
    assert msg["usage"]["output_tokens"] == first.done.completion_tokens + len("final")


async def test_count_tokens_renders_the_prompt_and_asks_the_worker():
    class Tokenizing:
        def __init__(self, runtime):
            from trioserve.worker.tokenize_gate import TokenizeGate
            self.runtime, self.requests = runtime, []
            self.tokenize_gate = TokenizeGate()

        async def call(self, request):
            from trioserve.worker.protocol import Tokens
            self.requests.append(request)
            text = "".join(s.text for s in request.prompt_segments)
            return Tokens(id=1, ids=tuple(range(len(text))))

    core, runtime = scripted_core()
    core.runtime = Tokenizing(runtime)  # type: ignore[assignment]
    count = await ServingMessages(core).count_tokens(json.dumps(
        {"model": "fake", "system": "S", "messages": [{"role": "user", "content": "hi"}]}).encode())
    prompt = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert count == {"input_tokens": len(prompt)}
