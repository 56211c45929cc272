"""The synthetic model generator (testkit/synthetic_models.py) without llama.cpp: same seed, same
bytes; the metadata and tensors each family's loader reads; the tokenizer's family tokens; and
the shapes ``--params`` picks. tests/worker_process/test_synthetic_models.py loads the files for real."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import gguf
import pytest

from testkit import TEST_DATA
from testkit.gguf_meta import read_metadata
from testkit.synthetic_models import (ARCHS, CONTROL, FORMATS, LAYER_GROUP, USER_DEFINED, base_vocab, count_params,
                                      file_name,
                                      family_vocab, main, make, scaled_shape, tiny_shape)


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_identical_bytes_and_another_seed_other_weights(arch, tmp_path):
    a = make(arch, tmp_path / "a", seed=7)
    b = make(arch, tmp_path / "b", seed=7)
    c = make(arch, tmp_path / "c", seed=8)
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    assert a.stat().st_size == c.stat().st_size and a.read_bytes() != c.read_bytes()
    assert not [p for p in (tmp_path / "a").iterdir() if p != a]  # no temporary file left behind
    assert a.stat().st_size < 12 * 2**20  # the tiny default: a few MB, mostly the embedding


def _meta(path: Path, arch: str, *keys: str) -> dict:
    return read_metadata(path, {"general.architecture", "tokenizer.chat_template", "tokenizer.ggml.tokens",
                                "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
                                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                "synthetic.params", *(f"{arch}.{k}" for k in keys)})


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_names_the_family_its_template_and_its_tokens(arch, tmp_path):
    m = _meta(make(arch, tmp_path), arch, "block_count", "full_attention_interval", "attention.sliding_window")
    fmt = FORMATS[arch]
    assert m["general.architecture"] == arch
    assert m["tokenizer.chat_template"] == (TEST_DATA / "templates" / f"{fmt.template}.jinja").read_text()
    tokens, types = m["tokenizer.ggml.tokens"], m["tokenizer.ggml.token_type"]
    base = base_vocab().tokens
    assert tokens[: len(base)] == list(base)  # SmolLM2's ids unchanged, the family's appended
    for text in fmt.control:
        assert tokens.count(text) == 1 and types[tokens.index(text)] == CONTROL, text
    for text in fmt.user_defined:
        assert tokens.count(text) == 1 and types[tokens.index(text)] == USER_DEFINED, text
    assert tokens[m["tokenizer.ggml.eos_token_id"]] == fmt.eos
    assert tokens[m["tokenizer.ggml.eot_token_id"]] == fmt.eot
    assert tokens[m["tokenizer.ggml.bos_token_id"]] == fmt.bos
    assert m[f"{arch}.block_count"] == tiny_shape(arch).n_layer
    assert m["synthetic.params"] == count_params(arch, tiny_shape(arch), len(tokens))
    if arch.startswith("qwen35"):
        assert m[f"{arch}.full_attention_interval"] == 4  # 3 Gated DeltaNet layers : 1 attention
    if arch.startswith("gemma"):
        assert m[f"{arch}.attention.sliding_window"] == 128


def test_hybrid_tensor_layout(tmp_path):
    """qwen35moe: Gated DeltaNet tensors on layers 0-2, gated attention on layer 3, experts
    everywhere; matrices F16, vectors and the conv kernel F32; sizes add up to the count."""
    path = make("qwen35moe", tmp_path)
    reader = gguf.GGUFReader(path)
    t = {x.name: x for x in reader.tensors}
    s, n_vocab = tiny_shape("qwen35moe"), len(family_vocab(FORMATS["qwen35moe"], base_vocab()).tokens)
    for i in range(3):
        assert f"blk.{i}.ssm_a" in t and f"blk.{i}.attn_qkv.weight" in t and f"blk.{i}.attn_q.weight" not in t
    assert "blk.3.ssm_a" not in t
    assert list(t["blk.3.attn_q.weight"].shape) == [s.n_embd, 2 * s.n_head * s.head_dim]  # query + gate
    assert list(t["blk.0.ffn_gate_exps.weight"].shape) == [s.n_embd, s.n_ff_exp, s.n_expert]
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert t["blk.0.ssm_conv1d.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert t["blk.0.ssm_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert (t["blk.0.ssm_a"].data < 0).all()  # -exp(A_log): a decay
    assert sum(int(x.n_elements) for x in reader.tensors) == count_params("qwen35moe", s, n_vocab)
    assert "output.weight" not in t  # tied to the embedding


@pytest.mark.parametrize("arch", ARCHS)
def test_params_scale_width_depth_and_experts(arch):
    n_vocab = len(family_vocab(FORMATS[arch], base_vocab()).tokens)
    previous = None
    for target in (20_000_000, 500_000_000, 1_000_000_000, 4_000_000_000):
        s = scaled_shape(arch, target)
        n = count_params(arch, s, n_vocab)
        # a many-expert model's layer group is ~0.4B parameters: its count overshoots by up to one
        assert target <= n <= (1.4 if s.n_expert >= 64 else 1.25) * target, (target, n, s)
        assert s.n_layer % LAYER_GROUP[arch] == 0 and 4 <= s.n_layer <= 48
        assert s.n_head % s.n_head_kv == 0 and s.n_embd % 64 == 0
        if previous is not None:
            assert s.n_embd >= previous.n_embd and (s.n_embd, s.n_layer) != (previous.n_embd, previous.n_layer)
            assert s.n_expert >= previous.n_expert
        if arch.startswith("qwen35"):
            assert s.ssm_v_heads % s.ssm_k_heads == 0  # llama.cpp repeats k heads over v heads
        previous = s
    if arch == "qwen35moe":
        assert scaled_shape(arch, 4_000_000_000).n_expert > scaled_shape(arch, 20_000_000).n_expert


def test_cli_prints_the_path(tmp_path, capsys):
    assert main(["make", "--arch", "gemma3", "--out", str(tmp_path), "--seed", "3", "--dtype", "f32"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path and path.is_file()
    assert path.name == "synthetic-gemma3-tiny-seed3-f32.gguf"
    # F32 matrices: twice the F16 file's weight bytes (the embedding dominates)
    emb = tiny_shape("gemma3").n_embd * len(family_vocab(FORMATS["gemma3"], base_vocab()).tokens)
    assert math.isclose(path.stat().st_size - make("gemma3", tmp_path, seed=3).stat().st_size, 2 * emb,
                        rel_tol=0.2)


def test_cli_rejects_a_bad_count(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["make", "--arch", "qwen3", "--out", str(tmp_path), "--params", "lots"])
    assert "not a parameter count" in capsys.readouterr().err


def test_the_3b_moe_is_active_on_about_half_a_billion_parameters_and_says_its_experts():
    """Issue #51's MoE: ~3B in all, ~0.5B active a token (8 of 128 experts), like Qwen3.5's
    MoE; the file name carries the expert ladder so a cached file of another never passes."""
    s = scaled_shape("qwen35moe", 3_000_000_000)
    n_vocab = len(family_vocab(FORMATS["qwen35moe"], base_vocab()).tokens)
    active = count_params("qwen35moe", replace(s, n_expert=s.n_expert_used), n_vocab)
    assert 3.0e9 <= count_params("qwen35moe", s, n_vocab) <= 3.5e9 and 0.35e9 <= active <= 0.6e9
    assert file_name("qwen35moe", 0, 3_000_000_000, "f16") == "synthetic-qwen35moe-3B-8of128-seed0-f16.gguf"
    assert file_name("qwen3", 0, 3_000_000_000, "f16") == "synthetic-qwen3-3B-seed0-f16.gguf"
