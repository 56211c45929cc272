"""End to end on the real model: decode tokens/s and TTFT through trioserve (embedded SmolLM2
through llama.cpp, greedy) versus the direct loop ``trioserve-llama-direct`` (same library, model,
threads, context, prompt text after templating, token count), paired run by run; optionally the
same streaming benchmark against llama.cpp's ``llama-server`` (the peer row). Memory: the
control plane's and the worker's RSS.

The ``e2e`` (and ``e2e1``) sections of ``python -m bench``. Never asserts on time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.lib.client import stream_chat
from bench.lib.machine import cpu_seconds, rss_mb
from bench.lib.prompts import STORY
from bench.lib.servers import ServerProcess, http_get
from bench.lib.stats import summary
from bench.lib.workers import model_template, run_direct
from trioserve.machine import embedded_model_path




async def end_to_end(tmp: Path, runs: int, tokens: int, threads: int, ctx: int,
                     llama_server: str | None) -> dict[str, Any]:
    model = embedded_model_path()
    template = model_template(model, threads, ctx)
    srv = ServerProcess.trioserve(tmp, engine="llama", threads=threads, max_context=ctx)
    peer = ServerProcess.llama_server(tmp, llama_server, model, threads, ctx) if llama_server else None
    rows: dict[str, list[float]] = {k: [] for k in (
        "ts_tok_s", "direct_tok_s", "peer_tok_s", "ratio", "peer_ratio", "ts_ttft", "direct_ttft", "peer_ttft",
        "ttft_overhead", "ts_vs_peer", "cp_us_per_token", "cp_setup_ms", "cp_us_per_token_after_first",
        "ts_cpu_ms", "peer_cpu_ms")}
    checks = {"same_prompt_tokens": True, "same_n": True, "peer_same_n": True}
    rss: dict[str, float] = {}
    try:
        await srv.wait_ready()
        if peer:
            await peer.wait_ready()
        rss["worker_rss_mb_idle"] = rss_mb(srv.worker_pid)
        rss["control_plane_rss_mb_idle_llama"] = rss_mb(srv.pid)
        base = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": tokens}
        # Warm-up both servers (first-request allocations).
        warm = {**base, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        srv_model = json.loads((await http_get(srv.port, "/v1/models"))[1])["data"][0]["id"]
        await stream_chat(srv.port, {**warm, "model": srv_model})
        if peer:
            await stream_chat(peer.port, warm)
        for k in range(runs):
            # A fresh prompt each run, so no side can reuse a cached prefix.
            messages = [{"role": "user", "content": STORY.format(k=k)}]
            prompt = template.render(messages, add_generation_prompt=True)
            c0, w0 = cpu_seconds(srv.pid), cpu_seconds(srv.worker_pid)
            r = await stream_chat(srv.port, {**base, "model": srv_model, "messages": messages},
                                  on_first=lambda: cpu_seconds(srv.pid))
            n = r["completion_tokens"]
            c1 = cpu_seconds(srv.pid)
            rows["cp_us_per_token"].append((c1 - c0) / n * 1e6)
            # Split at the first content byte: the request's setup (parse, validate, render,
            # submit, the first token's event) and the CPU per token after it.
            rows["cp_setup_ms"].append((r["first_mark"] - c0) * 1000)
            rows["cp_us_per_token_after_first"].append((c1 - r["first_mark"]) / max(1, n - 1) * 1e6)
            rows["ts_cpu_ms"].append((cpu_seconds(srv.pid) - c0 + cpu_seconds(srv.worker_pid) - w0) * 1000)
            d = run_direct(model, threads, ctx, prompt, n)
            checks["same_prompt_tokens"] &= d["prompt_tokens"] == r["prompt_tokens"]
            checks["same_n"] &= d["n"] == n
            ts_tok_s = (n - 1) / (r["t_done"] - r["t_first"])
            ts_ttft = (r["t_first"] - r["t_sent"]) * 1000
            rows["ts_tok_s"].append(ts_tok_s)
            rows["direct_tok_s"].append(d["decode_tok_s_after_first"])
            rows["ratio"].append(ts_tok_s / d["decode_tok_s_after_first"])
            rows["ts_ttft"].append(ts_ttft)
            rows["direct_ttft"].append(d["ttft_ms"])
            rows["ttft_overhead"].append(ts_ttft - d["ttft_ms"])
            if peer:
                # cache_prompt off: trioserve's anonymous requests never reuse a prefix (the
                # system prompt is common to all runs), so both prefill the whole prompt.
                c0 = cpu_seconds(peer.pid)
                p = await stream_chat(peer.port, {**base, "max_tokens": n, "messages": messages,
                                                  "cache_prompt": False})
                # llama-server decodes in its own process: its CPU is model + HTTP together.
                rows["peer_cpu_ms"].append((cpu_seconds(peer.pid) - c0) * 1000)
                checks["peer_same_n"] &= p["completion_tokens"] == n
                pn = p["completion_tokens"]
                peer_tok_s = (pn - 1) / (p["t_done"] - p["t_first"])
                rows["peer_tok_s"].append(peer_tok_s)
                rows["peer_ratio"].append(peer_tok_s / d["decode_tok_s_after_first"])
                rows["peer_ttft"].append((p["t_first"] - p["t_sent"]) * 1000)
                rows["ts_vs_peer"].append(ts_tok_s / peer_tok_s)
        rss["worker_rss_mb"] = rss_mb(srv.worker_pid)
        rss["control_plane_rss_mb_llama"] = rss_mb(srv.pid)
        if peer:
            rss["llama_server_rss_mb"] = rss_mb(peer.pid)
        out: dict[str, Any] = {
            "e2e_decode_ratio": summary(rows["ratio"]),
            "trioserve_decode_tok_s": summary(rows["ts_tok_s"]),
            "direct_decode_tok_s": summary(rows["direct_tok_s"]),
            "ttft_overhead_ms": summary(rows["ttft_overhead"]),
            "control_plane_cpu_us_per_token_llama": summary(rows["cp_us_per_token"]),
            "control_plane_setup_ms_llama": summary(rows["cp_setup_ms"]),
            "control_plane_cpu_us_per_token_after_first_llama": summary(rows["cp_us_per_token_after_first"]),
            "trioserve_cpu_ms_per_request": summary(rows["ts_cpu_ms"]),
            "trioserve_ttft_ms": summary(rows["ts_ttft"]),
            "direct_ttft_ms": summary(rows["direct_ttft"]),
            "e2e_tokens": tokens, "e2e_checks": checks, **rss,
        }
        out["ttft_overhead_ms_p50"] = out["ttft_overhead_ms"]["median"]
        if peer:
            out.update(vs_llama_server_decode_ratio=summary(rows["ts_vs_peer"]),
                       llama_server_decode_tok_s=summary(rows["peer_tok_s"]),
                       llama_server_vs_direct_ratio=summary(rows["peer_ratio"]),
                       llama_server_ttft_ms=summary(rows["peer_ttft"]),
                       llama_server_cpu_ms_per_request=summary(rows["peer_cpu_ms"]))
        return out
    finally:
        srv.stop()
        if peer:
            peer.stop()
