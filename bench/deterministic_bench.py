"""What ``--deterministic`` costs (spec/worker-protocol.md §4.5), on the embedded model.

    python bench/deterministic_bench.py [--runs 3] [--tokens 64] [--threads 2]

The same llama worker binary twice, default mode and ``--deterministic`` (each with
``--cpu-extra-buffers off``, so both run the same kernels; set ``TRIOSERVE_CPU_VARIANT`` to
measure another CPU variant), interleaved run by run so drift hits both:

* ``decode_tok_s_1``: one stream, greedy, ``--tokens`` tokens: first token record → done.
* ``agg_tok_s_4``: four streams sent together: completion tokens ÷ (first send → last done).
  Deterministic mode computes each slot on its own (no batching across streams).
* ``prefill_tok_s``: a ~1,000-token prompt alone, prompt tokens ÷ TTFT (the worker's
  ``ttft_ms``). Deterministic mode prefills it in 64-token micro-batches.
* ``turn2_reused`` / ``turn2_ttft_ms``: a session's second turn (its first prompt, reply and a
  new question): tokens reused and the turn's TTFT. Deterministic mode reuses only whole
  64-token pieces of the first prompt and prefills the reply again.
* ``equal_4``: of the four concurrent streams, how many equal their solo output (greedy): the
  property deterministic mode guarantees and the default does not.

Ratios are deterministic ÷ default, paired run by run, median. Prints a table, then one JSON
line. Never asserts on time; timings on a shared host are noisy (compare the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.worker_bench import Worker, find_bin_dir, find_model  # noqa: E402

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ["Tell me a long story about a robot who learns to paint.",
             "Explain how a bicycle works, step by step.",
             "Write a letter to a friend about your holiday by the sea.",
             "Describe a busy market in the morning."]
LONG = CHAT.format(q="Summarize: " + "the quick brown fox jumps over the lazy dog. " * 90)


def generate(w: Worker, **fields) -> tuple[dict, float, float]:
    """One generate; returns (done, t_first_token, t_done) on the monotonic clock."""
    rid = next(w.ids)
    w.send({"op": "generate", "id": rid, "temperature": 0, **fields})
    first = None
    while True:
        r = w.record()
        if r["type"] == "token" and first is None:
            first = time.monotonic()
        if r["type"] in ("done", "error"):
            assert r["type"] == "done", r
            return r, first or time.monotonic(), time.monotonic()


def together(w: Worker, prompts: list[str], tokens: int) -> tuple[list[dict], float]:
    ids = [next(w.ids) for _ in prompts]
    t0 = time.monotonic()
    w.proc.stdin.write(b"".join(json.dumps({"op": "generate", "id": i, "prompt": p, "max_new_tokens": tokens,
                                            "temperature": 0}).encode() + b"\n" for i, p in zip(ids, prompts)))
    w.proc.stdin.flush()
    done: dict[int, dict] = {}
    while len(done) < len(ids):
        r = w.record()
        if r["type"] in ("done", "error"):
            assert r["type"] == "done", r
            done[r["id"]] = r
    return [done[i] for i in ids], time.monotonic() - t0


def measure(w: Worker, tokens: int) -> dict[str, float]:
    out: dict[str, float] = {}
    # Clear every slot's prefix so each figure starts cold (one token of an unrelated prompt).
    d, t1, t2 = generate(w, prompt=CHAT.format(q=QUESTIONS[0]), max_new_tokens=tokens)
    out["decode_tok_s_1"] = (d["completion_tokens"] - 1) / max(t2 - t1, 1e-9)
    prompts = [CHAT.format(q=q) for q in QUESTIONS]
    solo = [generate(w, prompt=p, max_new_tokens=tokens)[0]["generated_token_ids"] for p in prompts]
    res, wall = together(w, prompts, tokens)
    out["agg_tok_s_4"] = sum(r["completion_tokens"] for r in res) / wall
    out["equal_4"] = sum(r["generated_token_ids"] == s for r, s in zip(res, solo))
    d, _, _ = generate(w, prompt=LONG, max_new_tokens=1)
    out["prefill_tok_s"] = d["prompt_tokens"] / (d["ttft_ms"] / 1000.0)
    sid = f"s{next(w.ids)}"
    d1, _, _ = generate(w, prompt=LONG, max_new_tokens=tokens, session_id=sid)
    turn2 = [{"text": LONG}, {"ids": d1["generated_token_ids"]},
             {"text": "<|im_end|>\n" + CHAT.format(q="Shorter, please.")}]
    d2, _, _ = generate(w, prompt_segments=turn2, max_new_tokens=1, session_id=sid)
    out["turn2_reused"] = d2["reused_prompt_tokens"]
    out["turn2_ttft_ms"] = d2["ttft_ms"]
    w.send({"op": "session_close", "id": next(w.ids), "session_id": sid})
    w.record()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bin_dir, model = find_bin_dir(), find_model()
    base = [str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", str(args.threads),
            "--ctx", "2048", "--capacity", "4", "--cpu-extra-buffers", "off"]
    workers = {"default": Worker(base), "deterministic": Worker(base + ["--deterministic"])}
    variant = workers["default"].ready["kernel_path"].get("cpu_variant", "linked")
    rows: dict[str, dict[str, list[float]]] = {m: {} for m in workers}
    ratios: dict[str, list[float]] = {}
    try:
        for _ in range(args.runs):
            got = {m: measure(w, args.tokens) for m, w in workers.items()}
            for m, figs in got.items():
                for k, v in figs.items():
                    rows[m].setdefault(k, []).append(v)
            for k in ("decode_tok_s_1", "agg_tok_s_4", "prefill_tok_s"):
                ratios.setdefault(k, []).append(got["deterministic"][k] / got["default"][k])
    finally:
        for w in workers.values():
            w.close()
    load = os.getloadavg()[0]
    print(f"\n--deterministic cost: CPU variant {variant}, {args.threads} threads, {args.runs} runs, "
          f"load average {load:.1f}\n")
    print("| figure | default | deterministic | deterministic / default |")
    print("|---|---|---|---|")
    summary: dict[str, object] = {"cpu_variant": variant, "threads": args.threads, "load": round(load, 1)}
    for k in rows["default"]:
        a, b = statistics.median(rows["default"][k]), statistics.median(rows["deterministic"][k])
        r = statistics.median(ratios[k]) if k in ratios else None
        print(f"| {k} | {a:.1f} | {b:.1f} | {'' if r is None else f'{r:.2f}'} |")
        summary[k] = {"default": round(a, 2), "deterministic": round(b, 2), **({"ratio": round(r, 3)} if r else {})}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
