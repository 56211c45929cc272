"""Quantized synthetic models (testkit/quantize.py, issue #51): llama.h's quantizer turns the
F16 synthetic model into the type users run, the file says that type in its header, the llama
worker loads it and generates, and a second request for the same model is served from the
cache without making it again."""

from __future__ import annotations

import pytest

from testkit.quantize import quantized

# general.file_type (llama.h's llama_ftype) and the tensor type most matrices get
FILE_TYPES = {"Q8_0": (7, "Q8_0"), "Q4_K_M": (15, "Q4_K")}


@pytest.mark.parametrize("qtype", sorted(FILE_TYPES))
def test_a_quantized_model_loads_generates_and_is_cached(tmp_path, spawn, qtype):
    import gguf

    path = quantized("qwen3", 8_000_000, qtype, tmp_path)
    reader = gguf.GGUFReader(path)
    file_type = reader.fields["general.file_type"]
    ftype, matrices = FILE_TYPES[qtype]
    assert int(file_type.parts[file_type.data[0]][0]) == ftype
    assert matrices in {t.tensor_type.name for t in reader.tensors}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the F16 source is gone

    w = spawn("trioserve-llama-worker", "--model", str(path), "--threads", "2", "--ctx", "512", "--capacity", "1")
    texts, done = w.generate(1, prompt="hello there", max_new_tokens=4, temperature=0)
    assert done["type"] == "done" and done["completion_tokens"] == 4, done

    stamp = path.stat().st_mtime_ns
    assert quantized("qwen3", 8_000_000, qtype, tmp_path) == path
    assert path.stat().st_mtime_ns == stamp
