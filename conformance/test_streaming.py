"""streaming: the §7 SSE sequence — framing, identity, one role chunk, one finish chunk, usage, [DONE]."""

from __future__ import annotations

from collections import Counter

import pytest

from conformance._support import (
    check_stream,
    chat_body,
    diff,
    expected_multiset,
    stream_chat,
)

pytestmark = pytest.mark.streaming

MAX = 16


def _one(client, cfg, **params):
    return stream_chat(client, chat_body(cfg, max_tokens=MAX, temperature=0, **params))


@pytest.mark.spec("§7")
def test_stream_framing(client, cfg):
    """text/event-stream; only `data:` events (and comments); ends with exactly one data: [DONE]."""
    st = _one(client, cfg)
    assert st.status == 200, f"HTTP {st.status}: {st.body[:300]!r}"
    ctype = st.headers.get("content-type", "")
    assert ctype.startswith("text/event-stream"), f"Content-Type {ctype!r}"
    assert not st.bad_lines, f"non-data lines: {st.bad_lines[:3]!r}"
    assert st.done and st.events.count("[DONE]") == 1, f"no single terminal [DONE]: {st.events[-2:]!r}"
    assert not st.after_done, f"bytes after [DONE]: {st.after_done[:3]!r}"
    assert "event:" not in st.raw_text and "\nid:" not in st.raw_text, "event:/id: lines in the stream"


@pytest.mark.spec("§7")
def test_stream_chunk_identity(client, cfg):
    """Every chunk is chat.completion.chunk with one chatcmpl- id, one created, the served model."""
    # Long enough (about 1-2 s on a small CPU model) to cross a second boundary.
    st = stream_chat(client, chat_body(cfg, "Count from 1 to 200, separated by commas.", temperature=0,
                                       max_tokens=200 if cfg.scripted else 150))
    check_stream(st, cfg)


@pytest.mark.spec("§7.1")
def test_stream_exactly_one_role_chunk(client, cfg):
    """Exactly one chunk carries delta.role, the first, with delta {"role": "assistant", "content": ""}."""
    st = _one(client, cfg)
    check_stream(st, cfg, identity=False)
    first = st.chunks[0]["choices"][0]
    assert first.get("finish_reason") is None, f"role chunk has finish_reason {first.get('finish_reason')!r}"
    assert first["delta"] == {"role": "assistant", "content": ""}, f"role chunk delta {first['delta']!r}"


@pytest.mark.spec("§7.3")
def test_stream_exactly_one_finish_chunk(client, cfg):
    """Exactly one chunk has a finish_reason; its delta is empty; no choice chunk follows it."""
    check_stream(_one(client, cfg), cfg, identity=False)


@pytest.mark.spec("§7.4")
def test_stream_no_usage_without_include_usage(client, cfg):
    """Without stream_options.include_usage no chunk carries a non-null usage."""
    st = _one(client, cfg)
    check_stream(st, cfg, include_usage=False, identity=False)


@pytest.mark.spec("§7.4")
def test_stream_usage_chunk(client, cfg):
    """include_usage: one final chunk with choices [] and usage; every other chunk has "usage": null."""
    n = len(cfg.script) if cfg.scripted else 1
    for _ in range(n):
        st = _one(client, cfg, stream_options={"include_usage": True})
        check_stream(st, cfg, include_usage=True, identity=False)
        u = st.usage_chunks[0]["usage"]
        assert u["completion_tokens"] <= MAX, f"completion_tokens {u['completion_tokens']} > max_tokens {MAX}"
        if cfg.scripted and st.finish_reasons[0] == "stop":
            assert u["completion_tokens"] == len(st.content.encode()), (
                f"completion_tokens {u['completion_tokens']} != {len(st.content.encode())} bytes streamed"
            )


@pytest.mark.spec("§7.4")
def test_stream_include_usage_false(client, cfg):
    """stream_options.include_usage false behaves as absent (no usage chunk)."""
    st = _one(client, cfg, stream_options={"include_usage": False})
    check_stream(st, cfg, include_usage=False, identity=False)


@pytest.mark.spec("§5.1")
def test_stream_max_tokens(client, cfg):
    """max_tokens caps a streamed completion (usage and finish_reason length)."""
    cap = 12 if cfg.scripted else 5
    st = stream_chat(
        client,
        chat_body(cfg, "Count from 1 to 200, separated by commas.", temperature=0, max_tokens=cap,
                  stream_options={"include_usage": True}),
    )
    check_stream(st, cfg, include_usage=True, identity=False, usage_nulls=False)
    assert st.usage_chunks[0]["usage"]["completion_tokens"] <= cap, "max_tokens ignored when streaming"
    assert st.finish_reasons == ["length"], f"finish_reason {st.finish_reasons!r}"


@pytest.mark.spec("§7")
def test_stream_content_exact(client, scripted):
    """Scripted: the streamed text of one script cycle is exactly the script (reassembled)."""
    cfg = scripted
    got = Counter()
    for _ in cfg.script:
        st = stream_chat(client, chat_body(cfg, max_tokens=200))
        check_stream(st, cfg, identity=False)
        got[(st.content, st.finish_reasons[0])] += 1
    want = expected_multiset(cfg.script, max_tokens=200)
    assert got == want, diff(got, want)


@pytest.mark.spec("§7")
def test_stream_openai_sdk(sdk, cfg):
    """The openai SDK consumes a stream with include_usage: content, one finish_reason, usage."""
    stream = sdk.chat.completions.create(
        model=cfg.model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finishes, usage = [], [], None
    with stream:
        for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if ch.delta.content:
                    text.append(ch.delta.content)
                if ch.finish_reason is not None:
                    finishes.append(ch.finish_reason)
    assert len(finishes) == 1, f"finish reasons {finishes!r}"
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
