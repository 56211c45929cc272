"""trioserve beside llama-server at the sizes users run (issue #51): synthetic dense and MoE
models of 0.5–4B-class, quantized as users run them, made and cached outside the repository
(testkit/quantize.py: the F16 model of testkit/synthetic_models.py, then llama.h's quantizer).

    python -m bench.sizes --llama-server PATH [--models qwen3:1.5b:Q4_K_M,qwen35moe:3b:Q4_K_M]
                          [--section decode,streams,prefill,memory] [--threads 2] [--rounds 3]
                          [--prefill-sizes 4k,16k] [--cache DIR] [--flash-attn auto|on|off]

Per model, the sections of ``bench.peers_bench`` on that model (same threads, slots, context
and kernel path on both servers; llama-server with its defaults otherwise, flash attention
``auto`` as trioserve's worker, or both as ``--flash-attn`` says): ``decode`` (one stream), ``streams`` (4 and 8, aggregate),
``prefill`` (4k and 16k prompts, alone and beside a decoding stream, with that stream's longest
gap), ``memory``: start-up time of each server and the resident memory of trioserve's worker
and of llama-server after the same requests; ``ttft``: time to first token, p50 and p99, of
four clients each sending one request after another (distinct ~300-token prompts) to 4 slots;
``stepcost``: what one decode step of 1, 2, 3, 4 and 8 tokens in one slot costs on this model
(the worker's start-up calibration, ``--measure-step-cost``): a verify step of k draft tokens
against one plain step, the figure that decides whether self-speculation can pay here.

Random weights: speed only. Never asserts on time; the last line printed is one JSON object.
Measure alone: nothing else running on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.lib.client import stream_chat
from bench.lib.machine import LLAMA_SERVER_ENV, machine, rss_mb
from bench.lib.servers import FLASH_ATTN_ENV, ServerProcess
from bench.lib.stats import percentile
from bench.lib.workers import engine_env, worker_bin
from bench.peers_bench import decode_section, model_id, prefill_section, streams_section, table
from testkit.gguf_meta import read_metadata
from testkit.quantize import DEFAULT_CACHE, quantized
from testkit.worker_process import Worker

SIZES = {"0.5b": 500_000_000, "1.5b": 1_500_000_000, "3b": 3_000_000_000, "4b": 4_000_000_000}
DEFAULT_MODELS = "qwen3:0.5b:Q4_K_M,qwen3:1.5b:Q4_K_M,qwen35moe:3b:Q4_K_M,qwen3:4b:Q4_K_M"


def parse_models(spec: str) -> list[tuple[str, int, str]]:
    """``arch:size:type`` items, comma-separated (size: one of SIZES or a parameter count)."""
    out = []
    for item in filter(None, spec.split(",")):
        arch, size, qtype = item.split(":")
        out.append((arch, SIZES.get(size.lower()) or int(size), qtype))
    return out


async def memory_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[dict[str, Any]]]:
    """Start-up time and resident memory of each server (one at a time) after the same four
    concurrent requests. trioserve starts twice: the first start on this machine, binaries and
    model runs the kernel probe, a restart finds it remembered (spec/worker-protocol.md §10)."""
    ctx, rows = 4096, []
    body = {"temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": "Tell me about the sea. " * 40}],
            **args.extra_body}
    memory = tmp / "kernel-probes"  # empty: the first start probes
    for name in ("trioserve", "trioserve (restart)", "llama-server"):
        t0 = time.monotonic()
        trio_side = name.startswith("trioserve")
        srv = (ServerProcess.trioserve(tmp, env={**os.environ, "TRIOSERVE_KERNEL_PROBE_MEMORY": str(memory)},
                                       engine="llama", model_path=model, threads=args.threads, max_context=ctx,
                                       slots=4, worker_bin=worker_bin(), speculative="off") if trio_side
               else ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, 4 * ctx, 4, env=engine_env()))
        try:
            await srv.wait_ready(timeout=1800)
            ready_s = time.monotonic() - t0
            mid = (await model_id(srv)) if trio_side else "x"
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(stream_chat, srv.port, {**body, "model": mid})
            pid = srv.worker_pid if trio_side else srv.pid
            rows.append({"server": name, "ready s": round(ready_s, 1), "RSS MB": round(rss_mb(pid), 0)})
        finally:
            srv.stop()
    md = (f"Start-up (process start to /health ready; trioserve's restart finds its kernel probe remembered) and "
          f"resident memory (trioserve: its worker) after 4 concurrent requests, 4 slots of {ctx} tokens each:\n\n" + table(rows, ["server", "ready s", "RSS MB"]))
    return md, rows


async def ttft_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[dict[str, Any]]]:
    """TTFT p50/p99 of 4 closed-loop clients (each sends its next request when its last ends),
    ``args.ttft_requests`` a client of ``args.ttft_tokens`` tokens each, every prompt distinct
    (nothing cached), 4 slots."""
    ctx, clients, per_client, rows = 2048, 4, args.ttft_requests, []
    for name in ("trioserve", "llama-server"):
        srv = (ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads, max_context=ctx,
                                       slots=clients, worker_bin=worker_bin(), speculative="off") if name == "trioserve"
               else ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, clients * ctx, clients,
                                               env=engine_env()))
        ttfts: list[float] = []
        try:
            await srv.wait_ready(timeout=1800)
            mid = (await model_id(srv)) if name == "trioserve" else "x"

            async def client(c: int) -> None:
                for k in range(per_client):
                    text = f"Request {c}-{k}. " + "Summarize the state of the harbour and its ships today. " * 30
                    body = {"model": mid, "temperature": 0, "max_tokens": args.ttft_tokens,
                            "messages": [{"role": "user", "content": text}], **args.extra_body}
                    if name == "llama-server":
                        body["cache_prompt"] = False
                    r = await stream_chat(srv.port, body)
                    ttfts.append((r["t_first"] - r["t_sent"]) * 1000)

            async with trio.open_nursery() as nursery:
                for c in range(clients):
                    nursery.start_soon(client, c)
        finally:
            srv.stop()
        rows.append({"server": name, "requests": len(ttfts), "TTFT p50 ms": round(percentile(ttfts, 50)),
                     "TTFT p99 ms": round(percentile(ttfts, 99)), "max ms": round(max(ttfts))})
        print(rows[-1], flush=True)
    md = (f"TTFT of {clients} closed-loop clients ({per_client} requests each, distinct ~330-token prompts, "
          f"{args.ttft_tokens} tokens each), {clients} slots:\n\n" + table(rows, ["server", "requests", "TTFT p50 ms",
                                                                          "TTFT p99 ms", "max ms"]))
    return md, rows


async def stepcost_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[dict[str, Any]]]:
    """The worker's own step-cost calibration (one slot, a 64-token context, best of 3 after a
    warm-up step per size): ms of a decode step of n tokens, and that against one plain step.
    ``--speculative auto`` too, so its start-up exactness verdict is reported beside the table
    (``--measure-step-cost`` measures whatever that verdict is)."""
    w = Worker([str(worker_bin()), "--model", str(model), "--threads", str(args.threads), "--ctx", "4096",
                "--capacity", "1", "--speculative", "auto", "--measure-step-cost"], env=engine_env())
    try:
        w.wait_ready(1800)
        spec = w.ready["speculative"]
    finally:
        w.close()
    points = spec["step_cost_ms"]
    one = points[0][1] if points else float("nan")
    rows = [{"tokens in the step": n, "ms": round(ms, 1), "vs one plain step": round(ms / one, 2)} for n, ms in points]
    md = ("One decode step of n tokens in one slot (a verify step of n - 1 draft tokens), the worker's start-up "
          "calibration:\n\n" + table(rows, ["tokens in the step", "ms", "vs one plain step"]))
    if spec.get("off_reason"):
        md += f"\n\n`--speculative auto` stays off here: {spec['off_reason']}"
    else:
        md += f"\n\n`--speculative auto` is on here (mode {spec['mode']})."
    return md, rows


SECTIONS = {"decode": decode_section, "streams": streams_section, "prefill": prefill_section,
            "memory": memory_section, "ttft": ttft_section, "stepcost": stepcost_section}


# The texts llama.cpp takes for end-of-generation tokens besides the GGUF's eos/eot ids
# (llama-vocab.cpp), of the synthetic families' vocabularies.
END_TEXTS = ("<|endoftext|>", "<|im_end|>", "<eos>", "<end_of_turn>", "<turn|>")


def end_of_turn_bias(model: Path) -> dict[str, int]:
    """A ``logit_bias`` that bans every token ending a generation in ``model``: random weights
    end an answer after a token or two on some models (the hybrid MoE), which makes a tok/s
    no rate. Both servers get the same bias, so both sample the same way."""
    keys = {"tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id"}
    meta = read_metadata(model, keys)
    ids = {meta[k] for k in keys - {"tokenizer.ggml.tokens"} if k in meta}
    ids |= {i for i, text in enumerate(meta["tokenizer.ggml.tokens"]) if text in END_TEXTS}
    return {str(i): -100 for i in sorted(ids)}


def worker_failures(tmp: Path) -> list[str]:
    """The lines of trioserve's logs in ``tmp`` that report a worker failing, restarted or
    given up on (trioserve/worker/supervisor.py): a slow step at a large size must never be
    taken for a hung worker."""
    marks = ("worker failed", "restarting the worker", "giving up on the worker")
    return [line.strip() for log in sorted(tmp.glob("trioserve-*.log"))
            for line in log.read_text(errors="replace").splitlines() if any(m in line for m in marks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=os.environ.get(LLAMA_SERVER_ENV))
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--section", default="decode,streams,prefill,memory")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill-sizes", default="4k,16k")
    ap.add_argument("--prefill-rounds", type=int, default=1)
    ap.add_argument("--ttft-requests", type=int, default=4, help="ttft: requests per client")
    ap.add_argument("--ttft-tokens", type=int, default=32, help="ttft: tokens per answer")
    ap.add_argument("--stream-rounds", type=int, default=1)
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default=None,
                    help="both servers' flash attention (default: trioserve's own, auto, and llama-server's)")
    ap.add_argument("--ban-end-of-turn", action=argparse.BooleanOptionalAction, default=True,
                    help="send a logit_bias banning the model's end-of-generation tokens to both servers "
                         "(every request: answers run to max_tokens on random weights)")
    args = ap.parse_args()
    if args.flash_attn:  # read by trioserve's settings and by ServerProcess.llama_server
        os.environ[FLASH_ATTN_ENV] = args.flash_attn
    if not args.llama_server:
        sys.exit(f"llama-server is needed: --llama-server or ${LLAMA_SERVER_ENV}")
    # What bench.peers_bench's sections read besides the above.
    args.gemma, args.stream_interval_ms, args.train_ctx = False, 0, 32768
    result: dict[str, Any] = {"bench": "sizes", "machine": machine(), "load_start": os.getloadavg()}
    for arch, params, qtype in parse_models(args.models):
        t0 = time.monotonic()
        model = quantized(arch, params, qtype, Path(args.cache))
        made_s = time.monotonic() - t0
        key = f"{arch}-{params // 10**8 / 10:g}B-{qtype}"
        print(f"## {key}: {model.name}, {model.stat().st_size / 2**30:.2f} GiB (ready in {made_s:.0f} s)", flush=True)
        result[key] = {}
        args.extra_body = {"logit_bias": end_of_turn_bias(model)} if args.ban_end_of_turn else {}
        with tempfile.TemporaryDirectory() as d:
            for s in args.section.split(","):
                md, rows = trio.run(SECTIONS[s], args, Path(d), model)
                print(f"#### {s} ({key}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f})\n\n{md}\n", flush=True)
                result[key][s] = rows
            result[key]["worker_failures"] = worker_failures(Path(d))
            print(f"trioserve's worker failures during {key}'s sections: {result[key]['worker_failures'] or 'none'}\n")
    m = machine()
    print(f"Generated by `python -m bench.sizes --models {args.models}` on {datetime.date.today()}: "
          f"{m['cores']} cores, {m['cpu']}.")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
