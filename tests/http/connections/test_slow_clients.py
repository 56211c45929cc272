"""A client that reads slower than the model generates gets the same stream in fewer chunks.

While a response's bytes wait for the client's socket, the text the worker sends meanwhile
is joined: the next chunk carries all of it (spec/README.md §7, "Slow clients"). The
concatenated content, the finish reason and the usage equal a fast client's, for every
API's stream; multi-byte characters split across tokens stay whole.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.http.conftest import live_server, parse_sse

# Every character costs 1-4 fake tokens (one per UTF-8 byte).
TEXT = "héllo wörld, ünïcode 🎉 and plain words; " * 40
TOKENS = len(TEXT.encode())


def _dechunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body."""
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


async def _stream(port: int, path: str, body: dict[str, Any], *, slow: bool) -> bytes:
    """POST ``body`` and read the whole SSE body. ``slow``: a 4 KiB receive buffer, nothing
    read for a while, then small reads with pauses, so the server's writes back up."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    payload = json.dumps(body).encode()
    async with stream:
        await stream.send_all(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                              + payload)
        if slow:
            await trio.sleep(0.3)
        raw = b""
        with trio.fail_after(60):
            while data := await stream.receive_some(1024 if slow else 65536):
                raw += data
                if slow:
                    await trio.sleep(0.01)
    head, _, body_bytes = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return _dechunk(body_bytes)


def _chat_text(event: dict[str, Any]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ())


def _completion_text(event: dict[str, Any]) -> str:
    return "".join(c.get("text") or "" for c in event.get("choices") or ())


@pytest.mark.parametrize("path,body,text_of", [
    ("/v1/chat/completions",
     {"model": "fake", "messages": [{"role": "user", "content": "go"}], "stream": True,
      "stream_options": {"include_usage": True}}, _chat_text),
    ("/v1/completions",
     {"model": "fake", "prompt": "go", "stream": True, "max_tokens": 4000,
      "stream_options": {"include_usage": True}}, _completion_text),
], ids=["chat", "completions"])
async def test_slow_client_gets_coalesced_chunks_with_the_fast_clients_text(tmp_path: Path, path, body, text_of):
    async with live_server(tmp_path, script=[TEXT], worker_args="--token-delay-ms 0.25",
                           max_context=TOKENS + 512) as srv:
        fast = parse_sse(await _stream(srv.port, path, body, slow=False))
        slow = parse_sse(await _stream(srv.port, path, body, slow=True))
    for events in (fast, slow):
        assert events[-1] == "[DONE]"
        assert "".join(text_of(e) for e in events[:-1]) == TEXT
    content_events = [e for e in slow[:-1] if text_of(e)]
    assert len(content_events) < TOKENS  # joined: fewer chunks than tokens
    assert _ending(slow) == _ending(fast) == ("stop", TOKENS)


def _ending(events: list[Any]) -> tuple[str, int]:
    """The finish reason and the completion tokens of the usage chunk (the prompt's cached
    tokens differ between two runs of one prompt: the second reuses the first's cache)."""
    reasons = [c["finish_reason"] for e in events[:-1] for c in e.get("choices") or ()
               if c.get("finish_reason")]
    usages = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert len(reasons) == 1 and len(usages) == 1
    return reasons[0], usages[0]["completion_tokens"]


async def test_stream_interval_sends_fewer_events_with_the_same_text(tmp_path: Path):
    """``stream_interval_ms``: the worker writes token records together at most every 50 ms
    (spec/worker-protocol.md §4.1), so a fast client gets a few tokens per event; the text,
    the finish reason and the usage are those of one event per token."""
    text = "coalesced words, " * 24
    tokens = len(text.encode())
    body = {"model": "fake", "messages": [{"role": "user", "content": "go"}], "stream": True,
            "stream_options": {"include_usage": True}}
    runs = {}
    for interval in (0, 50):
        async with live_server(tmp_path, script=[text], worker_args="--token-delay-ms 2",
                               stream_interval_ms=str(interval), max_context=tokens + 512) as srv:
            runs[interval] = parse_sse(await _stream(srv.port, "/v1/chat/completions", body, slow=False))
    for events in runs.values():
        assert events[-1] == "[DONE]"
        assert "".join(_chat_text(e) for e in events[:-1]) == text
        assert _ending(events) == ("stop", tokens)
    per_token = [e for e in runs[0][:-1] if _chat_text(e)]
    coalesced = [e for e in runs[50][:-1] if _chat_text(e)]
    # ~0.8 s of tokens in 50 ms groups: ~17 events, against ~one per token without.
    assert len(coalesced) < len(per_token) / 4, (len(coalesced), len(per_token))
