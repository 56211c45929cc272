"""model_cost.py: a model's memory estimate before its first load, from a GGUF's header."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest

from testkit.worker_process import NotInstalled, model_path
from trioserve.config import Settings
from trioserve.worker.model_cost import (
    AUTO_FLASH_ATTN_OFF_MAX_BYTES,
    AUTO_FLASH_ATTN_OFF_MIN_MODEL_BYTES,
    attention_matrix_bytes,
    estimate_model_cost,
    estimate_settings_cost,
    flash_attention_off,
    model_weights_bytes,
    read_gguf_info,
    read_gguf_shape,
)


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _value(value: Any) -> bytes:
    if isinstance(value, str):
        return struct.pack("<I", 8) + _string(value)
    if isinstance(value, int):
        return struct.pack("<I", 4) + struct.pack("<I", value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
    if isinstance(value, list):  # f32 scores
        return struct.pack("<IIQ", 9, 6, len(value)) + b"".join(struct.pack("<f", v) for v in value)
    raise TypeError(value)


def write_gguf(path: Path, meta: dict[str, Any], tensor_bytes: int = 1000) -> Path:
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta))
    body += b"".join(_string(k) + _value(v) for k, v in meta.items())
    path.write_bytes(body + b"\0" * tensor_bytes)
    return path


LLAMA = {"general.architecture": "llama", "general.name": "tiny",
         "tokenizer.ggml.tokens": ["<s>", "</s>", "hello"], "tokenizer.ggml.scores": [0.0, 0.5, 1.0],
         "llama.block_count": 4, "llama.context_length": 1024, "llama.embedding_length": 256,
         "llama.attention.head_count": 8, "llama.attention.head_count_kv": 2}


def test_shape_is_read_from_the_metadata_skipping_the_vocabulary(tmp_path):
    shape = read_gguf_shape(write_gguf(tmp_path / "m.gguf", LLAMA))
    assert (shape.n_layer, shape.n_ctx_train) == (4, 1024)
    # 2 kv heads x (256 / 8) head size, for keys and for values
    assert (shape.n_embd_k_per_layer, shape.n_embd_v_per_layer) == (64, 64)
    assert shape.kv_bytes(100) == 4 * (64 + 64) * 100 * 2


def test_explicit_key_and_value_lengths_win(tmp_path):
    meta = {**LLAMA, "llama.attention.key_length": 128, "llama.attention.value_length": 96}
    shape = read_gguf_shape(write_gguf(tmp_path / "m.gguf", meta))
    assert (shape.n_embd_k_per_layer, shape.n_embd_v_per_layer) == (256, 192)


def test_estimate_is_weights_plus_kv_per_slot_and_worker(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", LLAMA)
    weights = path.stat().st_size
    per_slot = 4 * 128 * 512 * 2
    estimate = estimate_model_cost(path, n_ctx=512, slots=3, workers=2)
    assert estimate.at_least == weights == model_weights_bytes(path)
    assert estimate.expected == weights + 2 * 3 * per_slot
    q8 = estimate_model_cost(path, n_ctx=512, slots=3, workers=2, kv_cache_type="q8_0")
    assert q8.expected == weights + 2 * 3 * (per_slot // 2 * 34 // 32)  # 34 bytes per 32 values
    # n_ctx 0: the training context, capped by the worker's KV budget
    capped = estimate_model_cost(path, n_ctx=0, slots=1, workers=1, kv_budget_bytes=1000)
    assert capped.expected == weights + 1000


def test_without_flash_attention_each_worker_counts_its_attention_matrix(tmp_path):
    """llama.cpp reserves a 512-token micro-batch's attention against one slot's cells, every
    query head, f32, and every deep prompt chunk writes it (the llama worker's ready record
    ``attention_matrix_bytes``; dense 1.5B at 20,480 cells: 640 MiB)."""
    path = write_gguf(tmp_path / "m.gguf", LLAMA)
    on = estimate_model_cost(path, n_ctx=512, slots=3, workers=2)
    assert estimate_model_cost(path, n_ctx=512, slots=3, workers=2, flash_attn="on") == on
    off = estimate_model_cost(path, n_ctx=512, slots=3, workers=2, flash_attn="off")
    assert off.expected - on.expected == 2 * 4 * 8 * 512 * 512
    # The training context (1,024 cells, 1 KiB of KV a cell) capped at half by the worker's KV
    # budget: the matrix of the 512 cells the cap leaves.
    capped = estimate_model_cost(path, n_ctx=0, slots=1, workers=1, kv_budget_bytes=512 * 1024,
                                 flash_attn="off")
    assert capped.expected == path.stat().st_size + 512 * 1024 + 4 * 8 * 512 * 512


def _big(path: Path) -> Path:
    """``path`` grown (sparse: no disk used) to a 1.5B-class file size, 900 MiB: the header,
    all the estimate reads, is unchanged."""
    os.truncate(path, 900 << 20)
    return path


def test_auto_runs_without_flash_attention_for_a_big_model_while_the_matrix_fits_a_gib(tmp_path):
    """``auto`` on a CPU worker (resolve_flash_attn in the worker): off for a model file of
    512 MiB or more, so the matrix is counted, up to 1 GiB of it (8 query heads: 65,536 cells
    a slot); past that on, and nothing is counted. A smaller file keeps it on."""
    path = _big(write_gguf(tmp_path / "m.gguf", {**LLAMA, "llama.context_length": 1 << 20}))
    shape, size = read_gguf_shape(path), model_weights_bytes(path)
    assert attention_matrix_bytes(shape, 65_536) == AUTO_FLASH_ATTN_OFF_MAX_BYTES
    assert flash_attention_off("auto", shape, 65_536, size)
    assert not flash_attention_off("auto", shape, 65_537, size)
    assert flash_attention_off("auto", shape, 512, AUTO_FLASH_ATTN_OFF_MIN_MODEL_BYTES)
    assert not flash_attention_off("auto", shape, 512, AUTO_FLASH_ATTN_OFF_MIN_MODEL_BYTES - 1)
    assert flash_attention_off("off", shape, 1 << 20, 1) and not flash_attention_off("on", shape, 512, size)
    # A model with sliding-window layers keeps it, whatever its size (a hybrid: the next test).
    window = read_gguf_shape(write_gguf(tmp_path / "w.gguf", {**LLAMA, "llama.attention.sliding_window": 512}))
    assert window.sliding_window == 512 and not window.full_attention_only
    assert not flash_attention_off("auto", window, 512, size) and flash_attention_off("off", window, 512, size)
    at_cap = estimate_model_cost(path, n_ctx=65_536, slots=1, workers=1, flash_attn="auto")
    assert at_cap == estimate_model_cost(path, n_ctx=65_536, slots=1, workers=1, flash_attn="off")
    past = estimate_model_cost(path, n_ctx=65_792, slots=1, workers=1, flash_attn="auto")
    assert past == estimate_model_cost(path, n_ctx=65_792, slots=1, workers=1, flash_attn="on")


def test_the_settings_count_the_attention_matrix_as_the_llama_worker_does(tmp_path):
    """estimate_settings_cost: the matrix with flash attention off (the default, auto, for a
    model file of 512 MiB or more at this small context) and every layer on the CPU; with a
    smaller file, layers on a GPU, a quantized cache or --speculative auto (flash attention on)
    the worker reports none."""
    small = str(write_gguf(tmp_path / "small.gguf", LLAMA))
    big = str(_big(write_gguf(tmp_path / "big.gguf", LLAMA)))

    def cost(path: str = big, **settings: Any) -> int:
        return estimate_settings_cost(Settings(engine="llama", model_path=path, max_context=512, slots=1,
                                               **settings)).expected

    matrix = 4 * 8 * 512 * 512
    assert cost() - cost(flash_attn="on") == matrix
    assert cost(flash_attn="off") == cost()
    assert cost(small) == cost(small, flash_attn="on") == cost(small, flash_attn="off") - matrix
    assert cost(gpu_layers=4) == cost(flash_attn="off", gpu_layers=4) == cost(flash_attn="on")
    assert cost(kv_cache_type="q8_0") < cost(flash_attn="on")  # a smaller cache, and no matrix
    assert cost(speculative="auto") == cost(flash_attn="on")  # auto is on for speculation
    assert cost(speculative="auto", flash_attn="off") == cost()


QWEN35 = {"general.architecture": "qwen35moe", "qwen35moe.block_count": 8, "qwen35moe.context_length": 4096,
          "qwen35moe.embedding_length": 256, "qwen35moe.attention.head_count": 4,
          "qwen35moe.attention.head_count_kv": 2, "qwen35moe.attention.key_length": 64,
          "qwen35moe.attention.value_length": 64, "qwen35moe.full_attention_interval": 4,
          "qwen35moe.ssm.conv_kernel": 4, "qwen35moe.ssm.state_size": 16, "qwen35moe.ssm.group_count": 2,
          "qwen35moe.ssm.inner_size": 128}


def test_a_hybrid_counts_kv_in_its_attention_layers_and_its_recurrent_state(tmp_path):
    """Qwen3.5: one layer in `full_attention_interval` has a KV cache; the others hold a fixed
    f32 state per sequence, whatever the context (counting KV in all 8 layers overstated
    the synthetic 3B MoE's cache fourfold)."""
    path = write_gguf(tmp_path / "m.gguf", QWEN35)
    shape = read_gguf_shape(path)
    assert shape.n_kv_layer == 2
    assert shape.kv_bytes(100) == 2 * (128 + 128) * 100 * 2
    conv, ssm = 3 * (128 + 2 * 2 * 16), 16 * 128
    assert shape.recurrent_bytes == 4 * 6 * (conv + ssm)
    estimate = estimate_model_cost(path, n_ctx=100, slots=3, workers=1)
    assert estimate.expected == path.stat().st_size + 3 * (shape.kv_bytes(100) + shape.recurrent_bytes)
    # Flash attention auto stays on for a hybrid of any size: no attention matrix.
    assert not shape.full_attention_only
    big = _big(path)
    auto = estimate_model_cost(big, n_ctx=100, slots=3, workers=1, flash_attn="auto")
    assert auto == estimate_model_cost(big, n_ctx=100, slots=3, workers=1, flash_attn="on")


def test_a_file_without_readable_metadata_is_estimated_at_its_size(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf at all")
    assert estimate_model_cost(path, n_ctx=512, slots=1, workers=1).expected == 17
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_shape(path)
    truncated = write_gguf(tmp_path / "t.gguf", LLAMA, tensor_bytes=0)
    truncated.write_bytes(truncated.read_bytes()[:60])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_shape(truncated)
    with pytest.raises(OSError):
        estimate_model_cost(tmp_path / "missing.gguf", n_ctx=0, slots=1, workers=1)


def test_a_folder_counts_all_its_files(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"x" * 5)
    assert model_weights_bytes(tmp_path) == 15


def test_the_embedded_models_shape():
    try:
        path = model_path()
    except NotInstalled as exc:
        pytest.skip(str(exc))
    shape = read_gguf_shape(path)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, trained on 8192 tokens
    assert (shape.n_layer, shape.n_ctx_train, shape.n_embd_k_per_layer) == (30, 8192, 192)


def test_info_reads_architecture_context_and_template_from_the_header(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    info = read_gguf_info(write_gguf(tmp_path / "m.gguf", {
        **LLAMA, "tokenizer.chat_template": template}))
    assert (info.architecture, info.context_length, info.chat_template) == ("llama", 1024, template)
    bare = read_gguf_info(write_gguf(tmp_path / "bare.gguf", LLAMA))
    assert bare.chat_template is None and bare.context_length == 1024


def test_info_of_a_file_that_is_no_gguf_or_is_cut_short_is_a_value_error(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError):
        read_gguf_info(tmp_path / "x.gguf")
    whole = write_gguf(tmp_path / "m.gguf", {**LLAMA, "tokenizer.chat_template": "x" * 100},
                       tensor_bytes=0).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:-40])  # inside the template string
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_info(tmp_path / "cut.gguf")
