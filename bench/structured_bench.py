"""Structured-output benchmark: what a grammar costs.

* ``compile_ms``: control-plane JSON Schema → GBNF for a 50-property schema (and a small one),
  cold (cache cleared) and cached (an identical request again). Pure Python, no model.
* ``decode_tok_s``: streamed decode rate on the real model, unconstrained vs under a grammar
  (a one-field schema with a long string, the 50-property schema, json_object). The rate is
  (completion tokens − 1) / (last content chunk − first content chunk), so prefill and the
  grammar's setup are excluded. Target: constrained ≥ 0.8 × unconstrained.
* ``ttft_ms``: request → first content chunk for the same prompt, unconstrained vs with the
  50-property schema (cold in the control plane; includes the worker parsing the grammar).

Needs a llama worker with grammar support (worker protocol v2 §6); without one only the
compile figures are measured. ``--worker-bin`` (repeatable) measures several worker builds in
the same run, one after the other (e.g. before/after a sampler change); the default is
``$TRIOSERVE_WORKER_DIR/trioserve-llama-worker`` when set, else the installed worker. Prints a
table per worker; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import httpx
import trio

from bench.lib.client import sse_events
from bench.lib.machine import machine
from bench.lib.servers import running_server
from trioserve.core import constraints as structured
from testkit.core_requests import constrained_request

TARGET_RATIO = 0.8
STORY_PROMPT = "Write a long story about a lighthouse keeper and a storm."
FIFTY_PROMPT = "Fill in this form about a fictional person as JSON."


def fifty_property_schema() -> dict[str, Any]:
    """50 bounded properties of every supported kind, all required (a big, realistic form)."""
    kinds = [
        {"type": "string", "maxLength": 24},
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue", "other"]},
        {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
        {"type": "string", "format": "date"},
        {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
        {"type": "number"},
        {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["x"], "additionalProperties": False},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


STORY_SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 1000}},
                "required": ["story"], "additionalProperties": False}


def schema_format(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def compile_ms(schema: dict[str, Any], runs: int) -> dict[str, float]:
    """Median cold and cached compile times of ``schema`` through the request path."""
    req = constrained_request(schema_format(schema, "bench"))
    cold, cached = [], []
    structured.constraint_for(req)  # load the converter once: not part of a request's cost
    for _ in range(runs):
        cache = structured.GrammarCache()
        t0 = time.perf_counter()
        constraint = structured.constraint_for(req, cache=cache)
        cold.append((time.perf_counter() - t0) * 1000)
        assert constraint is not None
        grammar = constraint.grammar
        cache.put(constraint)  # as the serving core does once the worker took it
        t0 = time.perf_counter()
        structured.constraint_for(req, cache=cache)
        cached.append((time.perf_counter() - t0) * 1000)
    return {"cold": statistics.median(cold), "cached": statistics.median(cached),
            "grammar_bytes": len(grammar.encode())}


async def timed_stream(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, float]:
    """Stream one completion; return ttft, decode rate and token count."""
    t0 = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    async for event in sse_events(client, body):
        if event.get("usage"):
            usage = event["usage"]
        if event.get("choices") and event["choices"][0]["delta"].get("content"):
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
    tokens = usage.get("completion_tokens", 0)
    rate = (tokens - 1) / (last - first) if first is not None and last and last > first and tokens > 1 else float("nan")
    return {"ttft_ms": ((first or t0) - t0) * 1000, "tok_s": rate, "tokens": tokens}


async def decode(args: argparse.Namespace, worker_bin: str) -> dict[str, Any]:
    fifty = fifty_property_schema()
    modes = {
        "free": ({}, STORY_PROMPT),
        "schema_story": ({"response_format": schema_format(STORY_SCHEMA, "story")}, STORY_PROMPT),
        "schema_50_props": ({"response_format": schema_format(fifty, "form")}, FIFTY_PROMPT),
        "json_object": ({"response_format": {"type": "json_object"}}, STORY_PROMPT + " Answer in JSON."),
    }
    out: dict[str, Any] = {"tok_s": {}, "tokens": {}, "ttft_ms": {}}
    async with running_server(engine="llama", worker_bin=worker_bin, threads=args.threads,
                              max_context=4096) as srv:
        serving = srv.quart_app.services.default.chat
        if not serving.core.grammar_supported:
            return {"skipped": "the llama worker does not report capabilities.grammar"}
        model = srv.settings.resolved_model_id()
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as client:
            def body(extra: dict[str, Any], prompt: str, **kw: Any) -> dict[str, Any]:
                return {"model": model, "stream": True, "stream_options": {"include_usage": True},
                        "temperature": 0.7, "max_tokens": args.tokens,
                        "messages": [{"role": "user", "content": prompt}], **extra, **kw}

            await timed_stream(client, body({}, STORY_PROMPT, max_tokens=8))  # warm up
            # Modes interleaved run by run, so a shared machine's changing load hits them alike.
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
            for i in range(args.runs):
                for name, (extra, prompt) in modes.items():
                    runs[name].append(await timed_stream(client, body(extra, prompt, seed=i)))
            for name, done in runs.items():
                rates = [r["tok_s"] for r in done if r["tok_s"] == r["tok_s"]]
                out["tok_s"][name] = statistics.median(rates) if rates else float("nan")
                out["tokens"][name] = statistics.median(r["tokens"] for r in done)
            # Grammar setup as a client sees it: cold compile + worker parse, vs no grammar.
            ttfts: dict[str, list[float]] = {"free": [], "schema_50_props": []}
            for i in range(args.runs):
                for name, extra in (("free", {}), ("schema_50_props", modes["schema_50_props"][0])):
                    serving.core.grammars.clear()
                    result = await timed_stream(client, body(extra, FIFTY_PROMPT, seed=i, max_tokens=4))
                    ttfts[name].append(result["ttft_ms"])
            out["ttft_ms"] = {name: statistics.median(values) for name, values in ttfts.items()}
    free = out["tok_s"]["free"]
    out["ratio"] = {k: v / free for k, v in out["tok_s"].items() if k != "free"}
    return out


def default_worker() -> str:
    """$TRIOSERVE_WORKER_DIR's llama worker when set (a fresh build), else "" (the installed one)."""
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return os.path.join(override, "trioserve-llama-worker") if override else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=160, help="max_tokens per decode run")
    parser.add_argument("--threads", type=int, default=2,
                        help="worker threads; 1 is steadier on a shared, oversubscribed machine")
    parser.add_argument("--compile-only", action="store_true", help="skip the real-model part")
    parser.add_argument("--worker-bin", action="append", default=[],
                        help="llama worker executable to measure (repeat to compare builds in one run)")
    args = parser.parse_args()

    compile_50 = compile_ms(fifty_property_schema(), max(args.runs, 20))
    compile_small = compile_ms(STORY_SCHEMA, max(args.runs, 20))
    print("| grammar compile (control plane) | cold ms | cached ms | grammar bytes |")
    print("|---|---|---|---|")
    for name, c in (("50-property schema", compile_50), ("1-property schema", compile_small)):
        print(f"| {name} | {c['cold']:.2f} | {c['cached']:.4f} | {c['grammar_bytes']} |")

    result: dict[str, Any] = {"bench": "structured", "machine": machine(),
                              "compile_ms": {"schema_50_props": compile_50, "schema_1_prop": compile_small}}
    if not args.compile_only:
        workers = args.worker_bin or [default_worker()]
        result["decode"] = {}
        for worker_bin in workers:
            dec = trio.run(decode, args, worker_bin)
            result["decode"][worker_bin or "installed"] = dec
            print(f"\nworker: {worker_bin or 'installed'}")
            if "skipped" in dec:
                print(f"decode: skipped ({dec['skipped']})")
                continue
            print("\n| mode | decode tok/s | × unconstrained | median tokens |")
            print("|---|---|---|---|")
            for name, rate in dec["tok_s"].items():
                ratio = 1.0 if name == "free" else dec["ratio"][name]
                print(f"| {name} | {rate:.1f} | {ratio:.2f} | {dec['tokens'][name]:.0f} |")
            print(f"\nTTFT, 50-property schema (cold compile + worker grammar parse): "
                  f"{dec['ttft_ms']['schema_50_props']:.0f} ms vs {dec['ttft_ms']['free']:.0f} ms unconstrained")
            worst = min(dec["ratio"].values())
            dec["meets_target"] = worst >= TARGET_RATIO
            print(f"worst ratio {worst:.2f} (target ≥ {TARGET_RATIO})")
        result["target_ratio"] = TARGET_RATIO
    print(json.dumps(result))


if __name__ == "__main__":
    main()
