"""Benchmark clients of a running server: the raw-socket streaming chat client whose own cost per
event is a few byte searches, a raw-socket request opener, and an httpx SSE reader."""

from __future__ import annotations

import json
import re
import time
from typing import Any, AsyncIterator, Callable

import trio


_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d+)')


def _has_content(data: bytes) -> bool:
    """Does any complete ``data:`` line in ``data`` carry a non-empty delta of content or of
    reasoning (a thinking model's first tokens are reasoning: its first token all the same)?"""
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            obj = json.loads(line[6:])
        except ValueError:
            continue
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                return True
    return False


async def stream_chat(port: int, body: dict[str, Any],
                      on_first: Callable[[], Any] | None = None) -> dict[str, Any]:
    """One streamed chat completion on a raw socket. Timing: request sent, first content
    byte, ``[DONE]``. Tokens come from the final usage chunk. The client only looks inside
    events until the first content; after that it counts events and scans for [DONE], so
    its own cost per event is a few C-level byte searches. ``on_first`` runs when the first
    content arrives; what it returns is ``first_mark`` in the result (e.g. the server's CPU
    time then)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    payload = json.dumps(body).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        t_sent = time.perf_counter()
        await stream.send_all(request)
        t_first = None
        first_mark: Any = None
        head = b""        # everything until the first content (parsed)
        tail = b""        # the last bytes seen (usage + [DONE] live there)
        events = 0
        nbytes = 0
        while True:
            data = await stream.receive_some(1 << 18)
            if not data:
                raise RuntimeError(f"connection closed before [DONE]: {(head + tail)[-400:]!r}")
            nbytes += len(data)
            events += data.count(b"\ndata: ") + data.startswith(b"data: ")
            if t_first is None:
                head += data
                if _has_content(head):
                    t_first = time.perf_counter()
                    first_mark = on_first() if on_first is not None else None
                tail = head[-8192:]
            else:
                tail = (tail + data)[-8192:]
            if b"data: [DONE]" in tail:
                t_done = time.perf_counter()
                break
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {head[:400]!r}")
    completions = _COMPLETION.findall(tail)
    prompts = _PROMPT.findall(tail)
    return {"t_sent": t_sent, "t_first": t_first or t_done, "t_done": t_done,
            "completion_tokens": int(completions[-1]) if completions else 0,
            "prompt_tokens": int(prompts[-1]) if prompts else 0,
            "events": events, "bytes": nbytes, "first_mark": first_mark}


async def open_stream(port: int, body: dict[str, Any]) -> trio.SocketStream:
    """Send a chat completion request on a raw socket (no client library in the timing)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    payload = json.dumps(body).encode()
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return stream


async def sse_events(client: Any, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST a streamed chat completion with an httpx client and yield each parsed SSE event
    (``[DONE]`` excluded). A non-200 answer raises RuntimeError with the start of its body."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])
