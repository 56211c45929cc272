"""legacy: /v1/completions, /tokenize, /detokenize and the context window in /v1/models (§19).

Shape and invariant checks only.
"""

from __future__ import annotations

import json

import pytest

from conformance._support import http_client, json_of

pytestmark = pytest.mark.legacy


@pytest.mark.spec("§19.1")
def test_text_completion_shape(cfg):
    """POST /v1/completions with a string prompt: a text_completion with usage"""
    with http_client(cfg) as c:
        r = c.post("/completions", json={"model": cfg.model, "prompt": "Once upon a time", "max_tokens": 8})
    data = json_of(r)
    assert r.status_code == 200, data
    assert data["object"] == "text_completion" and isinstance(data["choices"][0]["text"], str), data
    assert data["choices"][0]["finish_reason"] in ("stop", "length"), data
    assert 0 < data["usage"]["completion_tokens"] <= 8 and data["usage"]["prompt_tokens"] > 0, data


@pytest.mark.spec("§19.1")
def test_streamed_text_completion(cfg):
    """stream: text_completion chunks, one finish_reason, then data: [DONE]"""
    with http_client(cfg) as c:
        r = c.post("/completions", json={"model": cfg.model, "prompt": "Once upon a time", "max_tokens": 8,
                                         "stream": True})
    assert r.status_code == 200, r.text[:300]
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    assert blocks[-1] == "data: [DONE]", blocks[-3:]
    chunks = [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]
    assert all(ch["object"] == "text_completion" for ch in chunks), chunks[:2]
    finishes = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1]), finishes


@pytest.mark.spec("§19.1")
def test_token_id_prompt(cfg):
    """a prompt of token ids (from /tokenize) gives the same prompt_tokens count"""
    with http_client(cfg) as c:
        tokens = json_of(c.post(cfg.root_url + "/tokenize", json={"content": "Once upon a time"}))["tokens"]
        r = c.post("/completions", json={"model": cfg.model, "prompt": tokens, "max_tokens": 4})
    data = json_of(r)
    assert r.status_code == 200, data
    assert data["usage"]["prompt_tokens"] == len(tokens), (data["usage"], tokens)


@pytest.mark.spec("§19.1")
def test_suffix_is_honoured_or_refused(cfg):
    """suffix: fill-in-the-middle when the model has FIM tokens, else a 400 naming suffix"""
    with http_client(cfg) as c:
        r = c.post("/completions", json={"model": cfg.model, "prompt": "def add(a, b):\n    ",
                                         "suffix": "\n    return c\n", "max_tokens": 8})
    data = json_of(r)
    if r.status_code == 200:
        assert isinstance(data["choices"][0]["text"], str), data
    else:
        assert r.status_code == 400 and data["error"]["param"] == "suffix", data


@pytest.mark.spec("§19.2")
def test_tokenize_detokenize_round_trip(cfg):
    """/tokenize then /detokenize gives the text back; with_pieces gives one piece per id"""
    text = "Hello, wörld!"
    with http_client(cfg) as c:
        tokens = json_of(c.post(cfg.root_url + "/tokenize", json={"content": text}))["tokens"]
        back = json_of(c.post(cfg.root_url + "/detokenize", json={"tokens": tokens}))["content"]
        pieces = json_of(c.post(cfg.root_url + "/tokenize", json={"content": text, "with_pieces": True}))["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens), tokens
    assert back == text, back
    assert [p["id"] for p in pieces] == tokens, pieces


@pytest.mark.spec("§19.3")
def test_models_report_the_context_window(cfg):
    """/v1/models: context_length (and vLLM's max_model_len) for the served model"""
    with http_client(cfg) as c:
        data = json_of(c.get("/models"))
    entry = next(m for m in data["data"] if m["id"] == cfg.model)
    assert isinstance(entry.get("context_length"), int) and entry["context_length"] > 0, entry
    assert entry.get("max_model_len") == entry["context_length"], entry
