"""KV cache types (spec/worker-protocol.md §3, §10, §11): the llama worker on the real embedded
model (SmolLM2-135M) starts with a q8_0 and a q4_0 cache, reports the type and the smaller
memory llama.cpp allocated, and answers; a quantized cache without flash attention is refused
at startup; the fake worker scales its reported bytes alike.

The q8_0 / q4_0 answers are not compared with f16's text: a quantized cache changes the
attention scores slightly, so greedy text may differ after a few tokens. What is checked is that
each answers a short greedy prompt with words, not garbage or an error.
"""

from __future__ import annotations

import subprocess

import pytest

from testkit.worker_process import Worker

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
# Flags that keep each start short: no extra-buffer probe process, a small context.
FAST = ["--threads", "2", "--ctx", "1024", "--capacity", "2", "--cpu-extra-buffers", "off"]
# ggml block sizes: 32 elements in 64 (f16), 34 (q8_0) or 18 (q4_0) bytes.
BLOCK = {"f16": 64, "q8_0": 34, "q4_0": 18}


def _start(bin_dir, model, kv_type: str) -> tuple[dict, str, str]:
    """The ready record, a greedy answer and stderr of a worker with ``kv_type``."""
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), *FAST,
                "--kv-cache-type", kv_type])
    try:
        ready = w.wait_ready(120)
        texts, done = w.generate(1, prompt=CHAT, max_new_tokens=12)
        assert done["type"] == "done", done
        return ready, "".join(texts), w.stderr_text()
    finally:
        assert w.close() == 0


@pytest.mark.slow
def test_quantized_caches_start_smaller_and_answer(bin_dir, model):
    runs = {kv: _start(bin_dir, model, kv) for kv in ("f16", "q8_0", "q4_0")}
    f16_bytes = runs["f16"][0]["kv_cache_bytes"]
    assert f16_bytes > 0
    assert runs["f16"][0]["recurrent_state_bytes"] == 0  # an attention model has none (spec §3)
    for kv, (ready, text, stderr) in runs.items():
        assert ready["kv_cache_type"] == kv
        assert ready["n_ctx"] == 1024 and ready["capacity"] == 2
        # What llama.cpp allocated (its log, MiB to 2 decimals): the block sizes' ratio.
        assert ready["kv_cache_bytes"] == pytest.approx(f16_bytes * BLOCK[kv] / 64, rel=0.01)
        assert any(c.isalpha() for c in text), (kv, text)
        if kv != "f16":
            assert f"KV cache {kv}: " in stderr and "less than at f16" in stderr, stderr
    assert runs["q4_0"][0]["kv_cache_bytes"] < runs["q8_0"][0]["kv_cache_bytes"] < f16_bytes
    assert "Paris" in runs["f16"][1]


@pytest.mark.slow
def test_a_quantized_cache_without_flash_attention_is_refused_at_startup(bin_dir, model):
    out = subprocess.run([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), *FAST,
                          "--kv-cache-type", "q8_0", "--flash-attn", "off"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert "--kv-cache-type q8_0 quantizes the V cache" in out.stderr
    assert "--flash-attn is off" in out.stderr


def test_an_unknown_kv_cache_type_is_a_usage_error(bin_dir, model):
    out = subprocess.run([str(bin_dir / "trioserve-llama-worker"), "--model", str(model),
                          "--kv-cache-type", "q5_1"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--kv-cache-type must be f16, q8_0 or q4_0" in out.stderr


def test_the_fake_worker_scales_its_kv_bytes_by_the_type(fake):
    f16 = fake("--ctx", "1024", "--capacity", "2").ready
    q8 = fake("--ctx", "1024", "--capacity", "2", "--kv-cache-type", "q8_0").ready
    q4 = fake("--ctx", "1024", "--capacity", "2", "--kv-cache-type", "q4_0").ready
    assert (f16["kv_cache_type"], q8["kv_cache_type"], q4["kv_cache_type"]) == ("f16", "q8_0", "q4_0")
    assert f16["kv_cache_bytes"] == 1024 * 2 * 4
    assert q8["kv_cache_bytes"] == f16["kv_cache_bytes"] * 34 // 64
    assert q4["kv_cache_bytes"] == f16["kv_cache_bytes"] * 18 // 64
