"""Bytes before the first token (spec §7): a streamed request with a long prefill gets its
status, headers and first event at admission, then keep-alive comments until the first token,
on Chat Completions, Responses and Messages; a request still refused is a plain 400 before
any byte.

Over a raw socket, asserting the order of what arrived, not wall time: the body read in
arrival order must hold the first event, then keep-alives, then the model's text. Before
the early start, no byte could precede the first token, so no keep-alive could come first.
"""

from __future__ import annotations

import json
import re

import pytest

from ..conftest import live_server
from ..rawhttp import build_request, exchange

pytestmark = pytest.mark.usefixtures("no_leaks")

# One token per byte on the fake: a 6,000-character prompt at 0.5 ms per token is a ~3 s
# prefill; keep-alives every 0.1 s of silence.
PROMPT = "w " * 3000
FLAGS = "--prefill-ms-per-token 0.5"
KEEPALIVE = b": keep-alive"
# The event that carries the answer's first byte. The fake plays "Answer." byte by byte, so on
# a busy machine the later bytes may come in later events: look for the first byte's delta.
FIRST_TEXT = re.compile(rb'"(?:content|delta|text)":"A')

CASES = [
    ("/v1/chat/completions", {"model": "fake", "stream": True,
                              "messages": [{"role": "user", "content": PROMPT}]},
     b'"role":"assistant"'),
    ("/v1/responses", {"model": "fake", "stream": True, "input": PROMPT}, b"response.created"),
    ("/v1/messages", {"model": "fake", "stream": True, "max_tokens": 20,
                      "messages": [{"role": "user", "content": PROMPT}]}, b"message_start"),
]


def _post(path: str, body: dict) -> bytes:
    return build_request("POST", path, body=json.dumps(body).encode(),
                         headers=[("Host", "127.0.0.1"), ("Content-Type", "application/json"),
                                  ("Connection", "close")])


@pytest.mark.parametrize("path, body, first", CASES, ids=[c[0] for c in CASES])
async def test_a_long_prefill_streams_its_start_then_keep_alives(tmp_path, path, body, first):
    async with live_server(tmp_path, script=["Answer."], sse_keepalive=0.1, max_context=16384,
                           worker_args=FLAGS) as srv:
        resp = await exchange(srv.port, _post(path, body), timeout=60)
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in resp.body.split(b"\n\n") if b.strip()]
    text_at = next((i for i, b in enumerate(blocks) if FIRST_TEXT.search(b)), None)
    assert text_at is not None, blocks[-6:]
    assert first in blocks[0], blocks[:3]
    alive = [i for i, b in enumerate(blocks) if b == KEEPALIVE]
    # Keep-alives came after the first event and before the first token: the stream started
    # at admission. (~30 are due during the prefill; a few suffice to show the interval.)
    before_text = [i for i in alive if i < text_at]
    assert len(before_text) >= 3, blocks[:8]


@pytest.mark.parametrize("path, body, first", CASES, ids=[c[0] for c in CASES])
async def test_a_prompt_that_cannot_fit_is_still_a_plain_400(tmp_path, path, body, first):
    async with live_server(tmp_path, script=["Answer."], sse_keepalive=0.1, max_context=4096,
                           worker_args=FLAGS) as srv:
        resp = await exchange(srv.port, _post(path, body), timeout=60)
    assert resp.status == 400 and resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert "context" in json.dumps(error), error
