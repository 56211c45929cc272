"""core: models listing, non-streamed shape, usage, max tokens, stop, seed, UTF-8 (§2, §6, §8, §9).

Scripted servers get exact checks over one full cycle of the script (``len(script)`` consecutive
requests produce every script string exactly once, whatever order the tests run in); real models
get shape and invariant checks.
"""

from __future__ import annotations

from collections import Counter

import pytest

from conformance._support import (
    check_completion,
    check_stream,
    check_usage,
    chat_body,
    diff,
    expected_multiset,
    json_of,
    post_chat,
    stream_chat,
)

pytestmark = pytest.mark.core

COUNT_PROMPT = "Count from 1 to 200, separated by commas. Output only the numbers."
MULTIBYTE = "héllo wörld — 日本語 🎉"


def _results(client, cfg, n, **params):
    """n non-streamed completions: a Counter of (content, finish_reason) and the parsed bodies."""
    out, bodies = Counter(), []
    for _ in range(n):
        r = post_chat(client, chat_body(cfg, **params))
        data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        ch = check_completion(data, cfg)
        out[(ch["message"]["content"], ch["finish_reason"])] += 1
        bodies.append(data)
    return out, bodies


@pytest.mark.spec("§2")
def test_models_listing(client, cfg):
    """GET /v1/models lists the served model, once, with the §2 shape (one entry per served
    model, §2.1)."""
    r = client.get("/models")
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}"
    assert data.get("object") == "list", f"object = {data.get('object')!r}"
    entries = data.get("data")
    assert isinstance(entries, list) and entries, f"expected model entries, got {entries!r}"
    ids = [e.get("id") for e in entries]
    assert ids.count(cfg.model) == 1, f"the served model {cfg.model!r} is listed {ids.count(cfg.model)} times in {ids!r}"
    assert len(set(ids)) == len(ids), f"an id is listed twice: {ids!r}"
    m = entries[ids.index(cfg.model)]
    assert m.get("object") == "model", f"object = {m.get('object')!r}"
    assert isinstance(m.get("created"), int), f"created = {m.get('created')!r}"
    assert isinstance(m.get("owned_by"), str), f"owned_by = {m.get('owned_by')!r}"


@pytest.mark.spec("§2")
def test_models_listing_openai_sdk(sdk, cfg):
    """The official openai SDK lists the served model."""
    ids = [m.id for m in sdk.models.list()]
    assert cfg.model in ids, f"{cfg.model!r} not in {ids!r}"


@pytest.mark.spec("§6")
def test_nonstream_shape(client, cfg):
    """A non-streamed completion has the §6 shape (id, object, model, one choice, finish_reason, usage)."""
    n = len(cfg.script) if cfg.scripted else 1
    got, _ = _results(client, cfg, n, max_tokens=16, temperature=0)
    if cfg.scripted:
        want = expected_multiset(cfg.script, max_tokens=16)
        assert got == want, diff(got, want)


@pytest.mark.spec("§6")
def test_nonstream_openai_sdk(sdk, cfg):
    """The openai SDK parses a non-streamed completion."""
    resp = sdk.chat.completions.create(
        model=cfg.model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.spec("§8")
def test_usage_nonstream(client, cfg):
    """usage counts are integers, total = prompt + completion; scripted: completion_tokens = bytes emitted."""
    n = len(cfg.script) if cfg.scripted else 1
    _, bodies = _results(client, cfg, n, max_tokens=200 if cfg.scripted else 16, temperature=0)
    for data in bodies:
        u = check_usage(data["usage"], max_tokens=200 if cfg.scripted else 16)
        if cfg.scripted:
            content = data["choices"][0]["message"]["content"]
            assert u["completion_tokens"] == len(content.encode()), (
                f"completion_tokens {u['completion_tokens']} != {len(content.encode())} bytes of {content!r}"
            )


@pytest.mark.spec("§5.1")
@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_honoured(client, cfg, param):
    """max_tokens / max_completion_tokens cap the completion and give finish_reason length."""
    cap = 12 if cfg.scripted else 5
    if cfg.scripted:
        got, bodies = _results(client, cfg, len(cfg.script), **{param: cap})
        want = expected_multiset(cfg.script, max_tokens=cap)
        assert got == want, diff(got, want)
        for data in bodies:
            assert data["usage"]["completion_tokens"] == cap, f"completion_tokens {data['usage']['completion_tokens']} != {cap}"
        return
    r = post_chat(client, chat_body(cfg, COUNT_PROMPT, temperature=0, **{param: cap}))
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    ch = check_completion(data, cfg)
    u = data["usage"]
    assert u["completion_tokens"] <= cap, f"{param}={cap} ignored: completion_tokens = {u['completion_tokens']}"
    assert ch["finish_reason"] == "length", f"finish_reason {ch['finish_reason']!r} at {param}={cap} on a long answer"


@pytest.mark.spec("§5.1")
@pytest.mark.parametrize("mt,mct", [(24, 4), (4, 24)])
def test_max_tokens_both_smaller_wins(client, cfg, mt, mct):
    """With max_tokens and max_completion_tokens both given, the smaller one caps the completion."""
    r = post_chat(client, chat_body(cfg, COUNT_PROMPT, temperature=0, max_tokens=mt, max_completion_tokens=mct))
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    ch = check_completion(data, cfg)
    assert data["usage"]["completion_tokens"] <= 4, f"completion_tokens {data['usage']['completion_tokens']} > min(max_tokens={mt}, max_completion_tokens={mct})"
    assert ch["finish_reason"] == "length", f"finish_reason = {ch['finish_reason']!r}"


@pytest.mark.spec("§9.1")
def test_max_tokens_beyond_context_is_clamped(client, cfg):
    """max_tokens far beyond the context is clamped, not rejected (stream opens with HTTP 200)."""
    body = chat_body(cfg, "Say hello.", max_tokens=1_000_000, stream=True)
    with client.stream("POST", "/chat/completions", json=body) as r:
        head = r.read() if r.status_code != 200 else b""
        assert r.status_code == 200, f"HTTP {r.status_code}: {head[:300]!r}"
        for line in r.iter_lines():  # one event is enough; closing the stream cancels it
            if line.startswith("data:"):
                break


def _stop_check(client, cfg, stops, stream):
    if cfg.scripted:
        got = Counter()
        for _ in cfg.script:
            if stream:
                st = stream_chat(client, chat_body(cfg, stop=stops))
                check_stream(st, cfg, identity=False, usage_nulls=False)
                got[(st.content, st.finish_reasons[0])] += 1
            else:
                got += _results(client, cfg, 1, stop=stops)[0]
        want = expected_multiset(cfg.script, stop=stops)
        assert got == want, diff(got, want)
        return
    body = chat_body(cfg, "Count from 1 to 30, separated by commas and spaces: 1, 2, 3, ...", temperature=0, max_tokens=80, stop=stops)
    if stream:
        st = stream_chat(client, body)
        check_stream(st, cfg, identity=False, usage_nulls=False)
        content, finish = st.content, st.finish_reasons[0]
        for c in st.chunks:
            for ch in c.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                assert not any(s in piece for s in stops), f"stop string inside a chunk: {piece!r}"
    else:
        r = post_chat(client, body)
        data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        ch = check_completion(data, cfg)
        content, finish = ch["message"]["content"], ch["finish_reason"]
    for s in stops:
        assert s not in content, f"stop string {s!r} emitted: {content!r}"
    assert finish == "stop", f"finish_reason {finish!r}: the model counts past {stops!r}, so generation must end there ({content!r})"


@pytest.mark.spec("§9.2")
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_stop_single_token(client, cfg, stream):
    """A stop string ends generation and is never emitted (finish_reason stop)."""
    _stop_check(client, cfg, ["STOP"] if cfg.scripted else ["7"], stream)


@pytest.mark.spec("§9.2")
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_stop_multi_token(client, cfg, stream):
    """A stop string spanning several tokens/chunks (and a multibyte one) is never emitted."""
    _stop_check(client, cfg, ["日本", "fox jumps", "Paris\"}}"] if cfg.scripted else ["4, 5", "11,"], stream)


@pytest.mark.spec("§9.3")
def test_seed_reproducible_at_temperature(client, real):
    """Same seed, temperature 1.0 (with top_p/top_k): the same output twice."""
    cfg = real
    body = chat_body(cfg, "Write a short poem about the sea.", temperature=1.0, top_p=0.95, top_k=40, seed=1234, max_tokens=24)
    outs = []
    for _ in range(2):
        r = post_chat(client, body)
        data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        outs.append(check_completion(data, cfg)["message"]["content"])
    assert outs[0] == outs[1], f"seed not honoured: {outs[0]!r} != {outs[1]!r}"


@pytest.mark.spec("§9.3")
def test_seed_changes_sampling(client, real):
    """Different seeds at temperature 1.0 are not all identical (the seed actually reaches the sampler)."""
    cfg = real
    outs = set()
    for seed in (1, 2, 3, 4):
        r = post_chat(client, chat_body(cfg, "Write a short poem about the sea.", temperature=1.0, seed=seed, max_tokens=16))
        data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        outs.add(check_completion(data, cfg)["message"]["content"])
    assert len(outs) > 1, f"4 seeds at temperature 1.0 gave one output: {outs!r}"


@pytest.mark.spec("§7")
@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_multibyte_integrity(client, cfg, stream):
    """Multibyte UTF-8 (accents, CJK, emoji) arrives intact: no split characters, no U+FFFD (§9.4)."""
    n = len(cfg.script) if cfg.scripted else 1
    got = Counter()
    for _ in range(n):
        body = chat_body(cfg, f"Repeat exactly: {MULTIBYTE}", temperature=0, max_tokens=200 if cfg.scripted else 32)
        if stream:
            st = stream_chat(client, body)
            check_stream(st, cfg, identity=False, usage_nulls=False)
            pieces = [(ch.get("delta") or {}).get("content") or "" for c in st.chunks for ch in (c.get("choices") or [])]
            pieces = [p for p in pieces if p]
            for i, piece in enumerate(pieces):
                allowed_tail = i == len(pieces) - 1 and st.finish_reasons[0] == "length"
                assert "\ufffd" not in (piece[:-1] if allowed_tail else piece), f"U+FFFD in chunk {i}: {piece!r}"
                assert not any(0xD800 <= ord(x) <= 0xDFFF for x in piece), f"lone surrogate in {piece!r}"
            got[(st.content, st.finish_reasons[0])] += 1
        else:
            r = post_chat(client, body)
            data = json_of(r)
            assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
            ch = check_completion(data, cfg)
            got[(ch["message"]["content"], ch["finish_reason"])] += 1
    for content, finish in got:  # §9.4: only a character cut by the length limit may end as U+FFFD
        assert "\ufffd" not in (content[:-1] if finish == "length" else content), f"U+FFFD in output: {content!r}"
    if cfg.scripted:
        want = expected_multiset(cfg.script, max_tokens=200)
        assert got == want, diff(got, want)


@pytest.mark.spec("§5.5")
def test_roles_and_text_parts(client, cfg):
    """system, developer, user (text parts), assistant and a second user turn are accepted."""
    body = {
        "model": cfg.model,
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again?"},
        ],
    }
    r = post_chat(client, body)
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    check_completion(data, cfg)
