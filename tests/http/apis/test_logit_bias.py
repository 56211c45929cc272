"""``logit_bias`` through HTTP with the official OpenAI SDK (spec/README.md §5): on the embedded
model (llama engine) a bias changes greedy output on Chat Completions and legacy Completions,
banning the end-of-turn tokens runs an answer to ``max_tokens``; every malformed bias is a 400
on ``logit_bias`` and the same server then serves the next request; on the fake engine, which
cannot apply a bias, it is a 400 ``unsupported_parameter`` naming the engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai import OpenAI

from trioserve.config import EMBEDDED_MODEL_ID

from ..conftest import chat_body, live_server

pytestmark = [pytest.mark.usefixtures("no_leaks")]

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
N_VOCAB = 49152  # the embedded SmolLM2's vocabulary
EOS, ENDOFTEXT = 2, 0  # <|im_end|> and <|endoftext|>


def _llama_worker() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""  # "": installed


def _first_id(url: str, text: str) -> int:
    resp = httpx.post(url + "/tokenize", json={"content": text}, timeout=60)
    resp.raise_for_status()
    return resp.json()["tokens"][0]


def _chat(client: OpenAI, content: str = MESSAGES[0]["content"], max_tokens: int = 8, **kw: Any):
    return client.chat.completions.create(model=EMBEDDED_MODEL_ID, temperature=0, max_tokens=max_tokens,
                                          messages=[{"role": "user", "content": content}], **kw)


BAD: list[Any] = [
    {"abc": 1},
    {"1": 101},
    {"1": -101},
    {"1": "5"},
    {str(i): 1 for i in range(301)},
    {str(N_VOCAB): 1},
    {"1": {"2": 3}},
]
# A lone surrogate key, as the JSON escape a client writes (the SDK cannot encode it).
SURROGATE = b'"logit_bias": {"\\ud800": 1}'



@pytest.mark.slow
async def test_llama_applies_bias_and_refuses_bad_ones(tmp_path):
    async with live_server(tmp_path, engine="llama", worker_bin=_llama_worker(), threads=2,
                           max_context=2048) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120, max_retries=0)

        def run() -> dict[str, Any]:
            out: dict[str, Any] = {"plain": _chat(client)}
            first = _first_id(srv.url, out["plain"].choices[0].message.content)
            out["banned"] = _chat(client, logit_bias={str(first): -100})
            q = "What is 2+2? Answer with one word."  # a short answer: it ends well before 32 tokens
            out["short"] = _chat(client, q, max_tokens=32)
            out["long"] = _chat(client, q, max_tokens=32, logit_bias={str(EOS): -100, str(ENDOFTEXT): -100})
            out["legacy_plain"] = client.completions.create(model=EMBEDDED_MODEL_ID, prompt="The capital of France is",
                                                            max_tokens=4, temperature=0)
            legacy_first = _first_id(srv.url, out["legacy_plain"].choices[0].text)
            out["legacy_banned"] = client.completions.create(
                model=EMBEDDED_MODEL_ID, prompt="The capital of France is", max_tokens=4, temperature=0,
                logit_bias={str(legacy_first): -100})
            out["errors"] = []
            for bias in BAD:
                for create in (lambda b: _chat(client, logit_bias=b),
                               lambda b: client.completions.create(model=EMBEDDED_MODEL_ID, prompt="x",
                                                                   max_tokens=2, logit_bias=b)):
                    try:
                        create(bias)
                        out["errors"].append(None)
                    except openai.BadRequestError as exc:
                        out["errors"].append(exc.body)
                    # The same server serves the next request.
                    out.setdefault("after", []).append(_chat(client, max_tokens=2).choices[0].finish_reason)
            for path, head in (("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '),
                               ("/v1/completions", b'{"model": "m", "prompt": "x", ')):
                resp = httpx.post(srv.url + path, content=head + SURROGATE + b"}", timeout=60,
                                  headers={"content-type": "application/json"})
                out["errors"].append(resp.json()["error"] if resp.status_code == 400 else resp.text)
                out.setdefault("after", []).append(_chat(client, max_tokens=2).choices[0].finish_reason)
            return out

        try:
            out = await trio.to_thread.run_sync(run)
        finally:
            client.close()  # its connection pool's sockets (no_leaks)

    assert out["banned"].choices[0].message.content != out["plain"].choices[0].message.content
    assert out["short"].choices[0].finish_reason == "stop" and out["short"].usage.completion_tokens < 32
    assert out["long"].choices[0].finish_reason == "length" and out["long"].usage.completion_tokens == 32
    assert out["legacy_banned"].choices[0].text != out["legacy_plain"].choices[0].text
    assert len(out["errors"]) == 2 * len(BAD) + 2
    for err in out["errors"]:
        assert err is not None and err["param"] == "logit_bias", err
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value", err
    assert all(reason in ("stop", "length") for reason in out["after"])


async def test_fake_engine_refuses_bias_naming_it(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(logit_bias={"1": -100}))
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert (err["code"], err["param"]) == ("unsupported_parameter", "logit_bias")
        assert "(fake)" in err["message"]
        resp = await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "logit_bias": {"1": 5}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias"
        # Shape errors come first, whatever the engine; an empty bias is no bias.
        resp = await client.post("/v1/chat/completions", json=chat_body(logit_bias={"1": 500}))
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_value"
        resp = await client.post("/v1/chat/completions", json=chat_body(logit_bias={}))
        assert resp.status_code == 200, resp.text
