"""KV cache memory and decode speed at ``--kv-cache-type`` f16 / q8_0 / q4_0, on the embedded
model (SmolLM2-135M), one llama worker per type.

    python -m bench.kv_cache_bench [--runs 2] [--tokens 64] [--ctx 4096] [--threads 2]

* ``kv_mib_per_slot``: the ready record's ``kv_cache_bytes`` (what llama.cpp allocated) ÷ slots.
* ``decode_tok_s``: one greedy stream of ``--tokens`` tokens: tokens after the first ÷ (first
  token → done), the prompt a short question.
* ``decode_tok_s_deep``: the same after a ~1,500-token prompt, where attention reads more
  cells (a quantized cache is dequantized on the fly by flash attention).

The workers run side by side, measured in turn run by run so drift hits all; ratios are the
type ÷ f16, paired per run, median. Writes its table to docs/benchmarks/kv-cache-types.md (its own section)
with the machine, load and date. Never asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

from bench.lib import REPO
from bench.lib.machine import machine
from bench.lib.markdown import replace_section
from bench.lib.workers import Worker, find_model, worker_bin

TYPES = ("f16", "q8_0", "q4_0")
CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
SHORT = CHAT.format(q="Tell me a long story about a robot who learns to paint.")
DEEP = CHAT.format(q="Summarize, then tell a story: " + "the quick brown fox jumps over the lazy dog. " * 140)
BEGIN, END = "<!-- kv-cache-types:begin -->", "<!-- kv-cache-types:end -->"


def decode_rate(w: Worker, prompt: str, tokens: int) -> float:
    """Greedy tokens per second after the first token (the prompt's prefill excluded)."""
    rid = next(w.ids)
    w.send({"op": "generate", "id": rid, "prompt": prompt, "max_new_tokens": tokens,
            "temperature": 0})
    first, count = None, 0
    while True:
        r = w.record()
        if r["type"] == "token":
            count += 1
            first = first or time.monotonic()
        elif r["type"] in ("done", "error"):
            assert r["type"] == "done", r
            end = time.monotonic()
            return (r["completion_tokens"] - 1) / max(end - (first or end), 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks/kv-cache-types.md")
    args = ap.parse_args()
    binary, model = worker_bin(), find_model()
    base = [str(binary), "--model", str(model), "--threads", str(args.threads), "--ctx", str(args.ctx),
            "--capacity", str(args.capacity), "--cpu-extra-buffers", "off"]
    workers = {t: Worker(base + ["--kv-cache-type", t]) for t in TYPES}
    figures: dict[str, dict[str, list[float]]] = {t: {"short": [], "deep": []} for t in TYPES}
    load_start = os.getloadavg()[0]
    try:
        for _ in range(args.runs):
            for t, w in workers.items():
                figures[t]["short"].append(decode_rate(w, SHORT, args.tokens))
                figures[t]["deep"].append(decode_rate(w, DEEP, args.tokens))
        kv = {t: w.ready["kv_cache_bytes"] for t, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    load = (load_start + os.getloadavg()[0]) / 2
    lines = ["| kv_cache_type | KV MiB per slot | vs f16 | decode tok/s (short) | ratio | "
             "decode tok/s (after ~1,500 tokens) | ratio |", "|---|---|---|---|---|---|---|"]
    for t in TYPES:
        ratio = {k: statistics.median(a / b for a, b in zip(figures[t][k], figures["f16"][k]))
                 for k in ("short", "deep")}
        lines.append(f"| {t} | {kv[t] / args.capacity / (1 << 20):.1f} | {kv[t] / kv['f16']:.3f} | "
                     f"{statistics.median(figures[t]['short']):.1f} | {ratio['short']:.2f} | "
                     f"{statistics.median(figures[t]['deep']):.1f} | {ratio['deep']:.2f} |")
    info = machine()
    head = (f"KV cache types on SmolLM2-135M-Instruct Q4_1: `--ctx {args.ctx}`, {args.capacity} slots, "
            f"{args.threads} threads, `--cpu-extra-buffers off`, {args.tokens} greedy tokens, "
            f"{args.runs} runs interleaved; {info['cpu']} ({info['cores']} cores), load average "
            f"{load:.1f}, {datetime.date.today().isoformat()} (`python -m bench.kv_cache_bench`).")
    block = "\n".join([BEGIN, "", "### KV cache types", "", head, "", *lines, "", END])
    print(block)
    if not args.no_write:
        replace_section(REPO / "docs" / "benchmarks" / "kv-cache-types.md", BEGIN, END, block)


if __name__ == "__main__":
    main()
