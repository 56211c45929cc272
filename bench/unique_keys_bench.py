"""Unique-keys benchmark: how often the embedded model repeats a JSON key without the worker's
key stage, and what the stage costs (spec §5.6, worker protocol §4 ``unique_keys``).

* ``repeats``: the same ``json_object`` requests (SmolLM2-135M through trioserve-llama-worker,
  the control plane's json_object grammar, temperature 1.0, seeds 0..N-1) with the stage off
  and on; an answer counts when it repeats a key within one object (testkit/json_keys.py, also
  on answers the budget cut).
* ``decode_ms_per_token``: the worker's own decode time per token (done record
  ``decode_ms`` / (completion_tokens - 1)), off vs on: end to end, noisy on a shared machine.
* the C++ micro-benchmark ``bench_json_key_guard`` (built with the C++ tests), when found: the
  per-step cost of the stage alone on the model's vocabulary (common step, refusal).

Prints a table; the last line is one JSON object. Never asserts on timings.

    python -m bench.unique_keys_bench [--n 24] [--max-new-tokens 96] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

from bench.lib.workers import Worker, find_bin_dir, find_model
from testkit.core_requests import constrained_request
from testkit.json_keys import repeated_key
from trioserve.core import constraints as structured

PROMPT = ("<|im_start|>user\nDescribe a cat as a JSON object with the keys name, age, color and "
          "toys. Repeat the name key at the end.<|im_end|>\n<|im_start|>assistant\n")


def run_mode(w: Worker, grammar: str, seeds: range, max_new: int, unique: bool) -> dict:
    repeats, cut, per_token = 0, 0, []
    examples: list[str] = []
    for seed in seeds:
        rid = next(w.ids)
        fields = {"op": "generate", "id": rid, "prompt": PROMPT, "max_new_tokens": max_new,
                  "temperature": 1.0, "seed": seed, "grammar": grammar}
        if unique:
            fields["unique_keys"] = {}
        w.send(fields)
        text = ""
        while True:
            rec = w.record()
            if rec["type"] == "token":
                text += rec["text"]
                continue
            assert rec["type"] == "done", rec
            break
        if repeated_key(text) is not None:
            repeats += 1
            if len(examples) < 2:
                examples.append(text)
        cut += rec["finish_reason"] == "length"
        if rec["completion_tokens"] > 1:
            per_token.append(rec["decode_ms"] / (rec["completion_tokens"] - 1))
    return {"repeats": repeats, "cut": cut, "decode_ms_per_token": statistics.median(per_token),
            "examples": examples}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bin_dir, model = find_bin_dir(), find_model()
    req = constrained_request({"type": "json_object"})
    grammar = structured.constraint_for(req).grammar
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads",
                str(args.threads), "--ctx", "1024", "--capacity", "1"])
    try:
        seeds = range(args.n)
        off = run_mode(w, grammar, seeds, args.max_new_tokens, unique=False)
        on = run_mode(w, grammar, seeds, args.max_new_tokens, unique=True)
    finally:
        w.close()
    micro = None
    micro_bin = bin_dir / "bench_json_key_guard"
    if micro_bin.is_file():
        out = subprocess.run([str(micro_bin), str(model)], capture_output=True, text=True, timeout=600)
        print(out.stdout.rstrip())
        micro = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n{'stage':<6} {'answers':>8} {'repeat a key':>13} {'cut by budget':>14} {'decode ms/token':>16}")
    for name, r in (("off", off), ("on", on)):
        print(f"{name:<6} {args.n:>8} {r['repeats']:>13} {r['cut']:>14} {r['decode_ms_per_token']:>16.2f}")
    for text in off["examples"]:
        print("  off, e.g.:", json.dumps(text)[:160])
    print(json.dumps({"n": args.n, "max_new_tokens": args.max_new_tokens,
                      "off": {k: v for k, v in off.items() if k != "examples"},
                      "on": {k: v for k, v in on.items() if k != "examples"}, "micro": micro}))


if __name__ == "__main__":
    main()
