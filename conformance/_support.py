"""Shared helpers: configuration from the environment, bounded HTTP calls, SSE parsing, and the
checks every area uses (error envelope, stream sequence, scripted expectations).

Every request made through these helpers is bounded by a timeout; streams are also bounded by an
overall deadline.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
DEFAULT_SCRIPT = HERE / "script.json"
FINISH_REASONS = {"stop", "length", "tool_calls"}


def _root_of(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


@dataclass
class Config:
    base_url: str
    root_url: str
    model: str | None
    api_key: str
    scripted: bool
    script: list[str]
    timeout: float

    @classmethod
    def from_env(cls) -> "Config":
        base = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1").rstrip("/")
        scripted = os.environ.get("CONFORMANCE_SCRIPTED", "") not in ("", "0", "false", "no")
        script_path = Path(os.environ.get("CONFORMANCE_SCRIPT", str(DEFAULT_SCRIPT)))
        script = json.loads(script_path.read_text(encoding="utf-8")) if scripted else []
        return cls(
            base_url=base,
            root_url=_root_of(base),
            model=os.environ.get("OPENAI_MODEL") or None,
            api_key=os.environ.get("OPENAI_API_KEY", "conformance"),
            scripted=scripted,
            script=script,
            timeout=float(os.environ.get("CONFORMANCE_TIMEOUT", "60")),
        )


def http_client(cfg: Config, timeout: float | None = None) -> httpx.Client:
    t = cfg.timeout if timeout is None else timeout
    return httpx.Client(
        base_url=cfg.base_url,
        timeout=httpx.Timeout(t, connect=5.0),
        headers={"Authorization": f"Bearer {cfg.api_key}"},
        # A fresh connection per request: a server closing an idle keep-alive connection must
        # not show up as a failure of whatever point happens to reuse it.
        limits=httpx.Limits(max_keepalive_connections=0),
    )


# ---------------------------------------------------------------------------------------------
# Requests


def chat_body(cfg: Config, content: str = "Say hello.", **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "messages": [{"role": "user", "content": content}]}
    body.update(params)
    return body


def post_chat(client: httpx.Client, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return client.post("/chat/completions", content=body, headers={"Content-Type": "application/json"}, **kw)
    return client.post("/chat/completions", json=body, **kw)


@dataclass
class Stream:
    """A read SSE response (or the non-200 response that replaced it)."""

    status: int
    headers: httpx.Headers
    events: list[Any] = field(default_factory=list)  # parsed JSON objects, and "[DONE]"
    bad_lines: list[str] = field(default_factory=list)  # lines that are not data:/comment/blank
    after_done: list[str] = field(default_factory=list)  # anything after data: [DONE]
    body: bytes = b""  # the body of a non-200 response
    raw_text: str = ""

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict)]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def content(self) -> str:
        out = []
        for c in self.chunks:
            for ch in c.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if isinstance(piece, str):
                    out.append(piece)
        return "".join(out)

    @property
    def finish_reasons(self) -> list[str]:
        return [
            ch["finish_reason"]
            for c in self.chunks
            for ch in (c.get("choices") or [])
            if ch.get("finish_reason") is not None
        ]

    @property
    def usage_chunks(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks if c.get("usage") is not None]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks if "error" in c]


def stream_chat(client: httpx.Client, body: dict[str, Any], max_seconds: float = 120.0) -> Stream:
    """POST a streaming request and read it to the end (bounded by ``max_seconds`` overall)."""
    body = dict(body, stream=True)
    deadline = time.monotonic() + max_seconds
    with client.stream("POST", "/chat/completions", json=body) as r:
        st = Stream(status=r.status_code, headers=r.headers)
        if r.status_code != 200:
            st.body = r.read()
            return st
        raw: list[str] = []
        for line in r.iter_lines():
            raw.append(line)
            if time.monotonic() > deadline:
                raise AssertionError(f"stream still open after {max_seconds:.0f}s")
            if st.done:
                if line.strip():
                    st.after_done.append(line)
                continue
            if line == "" or line.startswith(":"):
                continue
            if not line.startswith("data:"):
                st.bad_lines.append(line)
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                st.events.append("[DONE]")
                continue
            try:
                st.events.append(json.loads(payload))
            except ValueError:
                st.bad_lines.append(line)
        st.raw_text = "\n".join(raw)
    return st


# ---------------------------------------------------------------------------------------------
# Checks


def json_of(r: httpx.Response) -> Any:
    ctype = r.headers.get("content-type", "")
    assert "application/json" in ctype, f"HTTP {r.status_code}: Content-Type is {ctype!r}, not JSON: {r.text[:200]!r}"
    try:
        return r.json()
    except ValueError as e:  # pragma: no cover - reported as a failure
        raise AssertionError(f"HTTP {r.status_code}: body is not JSON: {r.text[:200]!r}") from e


def check_error(
    r: httpx.Response | Stream,
    status: int,
    code: str | None,
    param: Any = ...,
    *,
    param_prefix: str | None = None,
) -> dict[str, Any]:
    """Assert an error response: status, §3 envelope (all four keys), type, code and param."""
    if isinstance(r, Stream):
        assert r.status == status, f"expected HTTP {status} {code}, got HTTP {r.status} (stream started: {r.chunks[:1]!r})"
        ctype = r.headers.get("content-type", "")
        assert "application/json" in ctype, f"HTTP {status}: Content-Type is {ctype!r}, not JSON"
        data = r.json()
        text = r.body.decode("utf-8", "replace")
    else:
        assert r.status_code == status, f"expected HTTP {status} {code}, got HTTP {r.status_code}: {r.text[:300]!r}"
        data = json_of(r)
        text = r.text
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), f"no error envelope: {text[:300]!r}"
    err = data["error"]
    missing = {"message", "type", "param", "code"} - set(err)
    assert not missing, f"error envelope lacks {sorted(missing)}: {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"empty error message: {err!r}"
    want_type = "server_error" if status >= 500 else "invalid_request_error"
    assert err["type"] == want_type, f"error.type {err['type']!r}, expected {want_type!r}: {err!r}"
    assert err["code"] == code, f"error.code {err['code']!r}, expected {code!r}: {err!r}"
    if param is not ...:
        assert err["param"] == param, f"error.param {err['param']!r}, expected {param!r}: {err!r}"
    if param_prefix is not None:
        assert isinstance(err["param"], str) and err["param"].startswith(param_prefix), (
            f"error.param {err['param']!r}, expected a path under {param_prefix!r}: {err!r}"
        )
    return err


def check_usage(usage: Any, max_tokens: int | None = None) -> dict[str, int]:
    assert isinstance(usage, dict), f"usage is {usage!r}"
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        v = usage.get(k)
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"usage.{k} = {v!r}"
    assert usage["prompt_tokens"] > 0, f"usage.prompt_tokens = {usage['prompt_tokens']}"
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"total != sum: {usage!r}"
    for det in ("prompt_tokens_details", "completion_tokens_details"):
        d = usage.get(det)
        if d is not None:
            assert isinstance(d, dict) and all(isinstance(v, int) for v in d.values()), f"usage.{det} = {d!r}"
    if max_tokens is not None:
        assert usage["completion_tokens"] <= max_tokens, f"completion_tokens {usage['completion_tokens']} > max {max_tokens}"
    return usage


def check_completion(data: Any, cfg: Config) -> dict[str, Any]:
    """§6 shape of a non-streamed response; returns choices[0]."""
    assert isinstance(data, dict), f"response is {type(data).__name__}"
    assert data.get("object") == "chat.completion", f"object = {data.get('object')!r}"
    assert isinstance(data.get("id"), str) and data["id"].startswith("chatcmpl-"), f"id = {data.get('id')!r}"
    assert isinstance(data.get("created"), int), f"created = {data.get('created')!r}"
    assert data.get("model") == cfg.model, f"model = {data.get('model')!r}, expected {cfg.model!r}"
    choices = data.get("choices")
    assert isinstance(choices, list) and len(choices) == 1, f"choices = {choices!r}"
    ch = choices[0]
    assert ch.get("index") == 0, f"choices[0].index = {ch.get('index')!r}"
    msg = ch.get("message")
    assert isinstance(msg, dict) and msg.get("role") == "assistant", f"message = {msg!r}"
    if msg.get("tool_calls"):
        assert msg.get("content") is None or isinstance(msg["content"], str), f"content = {msg.get('content')!r}"
    else:
        assert isinstance(msg.get("content"), str), f"content = {msg.get('content')!r}"
    assert ch.get("finish_reason") in FINISH_REASONS, f"finish_reason = {ch.get('finish_reason')!r}"
    assert ch.get("logprobs") is None, f"logprobs = {ch.get('logprobs')!r}"
    if "reasoning_content" in msg and msg["reasoning_content"] is not None:
        assert isinstance(msg["reasoning_content"], str), f"reasoning_content = {msg['reasoning_content']!r}"
    check_usage(data.get("usage"))
    return ch


def check_stream(
    st: Stream, cfg: Config, *, include_usage: bool = False, identity: bool = True, usage_nulls: bool = True
) -> None:
    """The §7 sequence: framing, one role chunk, one finish chunk, usage chunk, [DONE].

    ``identity`` adds the chunk-identity details (one id, one created, the served model) and
    ``usage_nulls`` the `"usage": null` keys with include_usage — the streaming area checks those
    points; other areas turn them off so that they fail only for their own point.
    """
    assert st.status == 200, f"HTTP {st.status}: {st.body[:300]!r}"
    ctype = st.headers.get("content-type", "")
    assert ctype.startswith("text/event-stream"), f"Content-Type {ctype!r}"
    assert not st.bad_lines, f"lines that are not 'data:' events: {st.bad_lines[:3]!r}"
    assert not st.errors, f"error event in stream: {st.errors[0]!r}"
    assert st.done, f"stream did not end with data: [DONE] (last events {st.events[-2:]!r})"
    assert st.events.count("[DONE]") == 1 and not st.after_done, f"data after [DONE]: {st.after_done[:3]!r}"
    chunks = st.chunks
    assert chunks, "no chunks before [DONE]"
    for c in chunks:
        assert c.get("object") == "chat.completion.chunk", f"object = {c.get('object')!r}"
    if identity:
        check_identity(chunks, cfg)
    _check_sequence(st, chunks, include_usage=include_usage, usage_nulls=usage_nulls)


def check_identity(chunks: list[dict[str, Any]], cfg: Config) -> None:
    ids = {c.get("id") for c in chunks}
    assert len(ids) == 1, f"chunk ids differ: {sorted(map(str, ids))[:4]}"
    cid = next(iter(ids))
    assert isinstance(cid, str) and cid.startswith("chatcmpl-"), f"id = {cid!r}"
    for c in chunks:
        assert c.get("model") == cfg.model, f"chunk model = {c.get('model')!r}, expected {cfg.model!r}"
        assert isinstance(c.get("created"), int), f"created = {c.get('created')!r}"
    created = sorted({c.get("created") for c in chunks})
    assert len(created) == 1, f"chunk 'created' differs within one stream: {created[:4]}"


def _check_sequence(st: Stream, chunks: list[dict[str, Any]], *, include_usage: bool, usage_nulls: bool) -> None:
    # Role chunk: exactly one, first.
    roles = [i for i, c in enumerate(chunks) for ch in (c.get("choices") or []) if "role" in (ch.get("delta") or {})]
    assert len(roles) == 1, f"{len(roles)} chunks carry delta.role (expected exactly one)"
    first = chunks[0].get("choices") or [{}]
    assert roles[0] == 0 and first[0]["delta"]["role"] == "assistant", f"first chunk is not the role chunk: {chunks[0]!r}"
    # Finish chunk: exactly one, empty delta, last chunk with choices.
    fins = [i for i, c in enumerate(chunks) for ch in (c.get("choices") or []) if ch.get("finish_reason") is not None]
    assert len(fins) == 1, f"{len(fins)} chunks carry a finish_reason (expected exactly one)"
    fc = chunks[fins[0]]["choices"][0]
    assert fc["finish_reason"] in FINISH_REASONS, f"finish_reason = {fc['finish_reason']!r}"
    assert not fc.get("delta"), f"finish chunk delta is not empty: {fc.get('delta')!r}"
    with_choices = [i for i, c in enumerate(chunks) if c.get("choices")]
    assert with_choices[-1] == fins[0], "a chunk with choices follows the finish chunk"
    for c in chunks:
        for ch in c.get("choices") or []:
            assert ch.get("index") == 0, f"choice index {ch.get('index')!r}"
            piece = (ch.get("delta") or {}).get("content")
            assert piece is None or isinstance(piece, str), f"delta.content = {piece!r}"
    usage_chunks = st.usage_chunks
    if include_usage:
        assert len(usage_chunks) == 1, f"{len(usage_chunks)} usage chunks (expected exactly one)"
        uc = usage_chunks[0]
        assert uc is chunks[-1], "the usage chunk is not the last chunk before [DONE]"
        assert uc.get("choices") == [], f"usage chunk choices = {uc.get('choices')!r} (expected [])"
        check_usage(uc["usage"])
        for c in chunks[:-1] if usage_nulls else ():
            assert "usage" in c and c["usage"] is None, f"a non-usage chunk lacks \"usage\": null: {c!r}"
    else:
        assert not usage_chunks, f"usage chunk sent without stream_options.include_usage: {usage_chunks[0]!r}"


# ---------------------------------------------------------------------------------------------
# Scripted expectations (trioserve's fake engine: one token per UTF-8 byte, script cycles)


def expected_output(s: str, stop: list[str] | None = None, max_tokens: int | None = None) -> tuple[str, str]:
    """(content, finish_reason) the fake engine must produce for script string ``s``."""
    hits = [(s.find(x), x) for x in (stop or []) if x and x in s]
    if hits:
        i, x = min(hits)
        if max_tokens is None or len(s[: i + len(x)].encode()) <= max_tokens:
            return s[:i], "stop"
    b = s.encode()
    if max_tokens is not None and len(b) > max_tokens:
        # spec §9.4: a character cut by the length limit ends the text as one U+FFFD
        return b[:max_tokens].decode("utf-8", "replace"), "length"
    return s, "stop"


def expected_multiset(script: list[str], **kw: Any) -> Counter:
    return Counter(expected_output(s, **kw) for s in script)


def diff(got: Counter, want: Counter) -> str:
    extra = list((got - want).elements())[:3]
    missing = list((want - got).elements())[:3]
    return f"unexpected {extra!r}; missing {missing!r}"
