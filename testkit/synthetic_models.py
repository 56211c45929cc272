"""Synthetic GGUF models for tests and benchmarks: random weights in the tensor layout of a model
family the bundled llama.cpp runs, a real tokenizer, and the family's chat format.

``make(arch, out_dir, seed=..., params=...)`` writes one file, deterministically from the seed
(the same arguments give a byte-identical file), in well under a second for the default tiny
shapes; ``python -m testkit.synthetic_models make --arch ARCH --out DIR`` does the same and
prints the path. Weights are random, so what such a model says is noise: tests on it check
mechanics (loading, memory kinds, scheduling, determinism), never answer quality.

The tokenizer is SmolLM2's byte-level BPE (49,152 tokens), copied from the embedded model's
GGUF (``testkit.worker_process.model_path``), with the family's chat-format tokens appended
where SmolLM2 lacks them, as control tokens or, where the family marks them so, user-defined
ones. The chat template is trioserve's test template for the format (tests/data/templates,
written from each format's public description; not the vendor's file). The tensor shapes and
metadata keys are what the bundled llama.cpp's loader reads (its ``src/models/<arch>.cpp``);
llama.cpp refuses a file with a missing, extra or misshapen tensor, so loading one is the check.
Nothing is downloaded. Not part of trioserve; docs/models.md, "Synthetic models".
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

ARCHS = ("qwen3", "qwen35", "qwen35moe", "gemma3", "gemma4")

# token_type values of a GGUF vocabulary (gguf.TokenType; llama.cpp's LLAMA_TOKEN_TYPE_*)
CONTROL, USER_DEFINED = 3, 4


# --- tokenizer -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChatFormat:
    """The chat-format side of a family: its template file and the tokens that file writes."""

    template: str  # stem under tests/data/templates
    control: tuple[str, ...]  # parsed as one token only where special tokens are parsed
    user_defined: tuple[str, ...] = ()  # always one token (the family's added non-special tokens)
    bos: str | None = None
    eos: str = ""
    eot: str = ""  # end of turn; llama.cpp guesses it by text otherwise, and SmolLM2's <|im_end|> would win
    pad: str | None = None
    add_bos: bool = False


# Qwen3 and Qwen3.5 GGUFs mark <|im_start|>/<|im_end|> control and <think>, <tool_call>, ...
# user-defined (tokenizer.json "special": false), so those are one token in any text.
_QWEN_USER = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHATML_QWEN3 = ChatFormat("qwen3", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), _QWEN_USER,
                          bos="<|endoftext|>", eos="<|im_end|>", eot="<|im_end|>", pad="<|endoftext|>")
CHATML_QWEN35 = replace(CHATML_QWEN3, template="qwen_xml")
GEMMA3_FORMAT = ChatFormat("gemma3", ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                           bos="<bos>", eos="<eos>", eot="<end_of_turn>", pad="<pad>", add_bos=True)
GEMMA4_FORMAT = ChatFormat(
    "gemma4",
    ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>",
     "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'),
    bos="<bos>", eos="<eos>", eot="<turn|>", pad="<pad>", add_bos=True)
# Qwen3.5 gets the Qwen3.5-style test template (XML tool calls, thinking on by default).
FORMATS = {"qwen3": CHATML_QWEN3, "qwen35": CHATML_QWEN35, "qwen35moe": CHATML_QWEN35,
           "gemma3": GEMMA3_FORMAT, "gemma4": GEMMA4_FORMAT}


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    model: str
    pre: str


@functools.lru_cache(maxsize=1)
def base_vocab() -> Vocab:
    """SmolLM2's tokenizer, read from the embedded model's GGUF once a process. Read with
    testkit.gguf_meta (0.1 s) rather than gguf.GGUFReader, which maps every tensor (2 s)."""
    from testkit.gguf_meta import read_metadata
    from testkit.worker_process import model_path

    keys = {f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges", "model", "pre")}
    m = read_metadata(model_path(), keys)
    missing = keys - m.keys()
    if missing:
        raise ValueError(f"{model_path()} lacks {sorted(missing)}")
    return Vocab(tokens=tuple(m["tokenizer.ggml.tokens"]), token_types=tuple(m["tokenizer.ggml.token_type"]),
                 merges=tuple(m["tokenizer.ggml.merges"]), model=m["tokenizer.ggml.model"],
                 pre=m["tokenizer.ggml.pre"])


def family_vocab(fmt: ChatFormat, base: Vocab) -> Vocab:
    """``base`` with the format's tokens appended where missing and typed as the family types
    them (a token SmolLM2 already has keeps its id and gets the family's type)."""
    tokens, types = list(base.tokens), list(base.token_types)
    index = {t: i for i, t in enumerate(tokens)}
    for text, kind in [(t, CONTROL) for t in fmt.control] + [(t, USER_DEFINED) for t in fmt.user_defined]:
        if text in index:
            types[index[text]] = kind
        else:
            index[text] = len(tokens)
            tokens.append(text)
            types.append(kind)
    return replace(base, tokens=tuple(tokens), token_types=tuple(types))


# --- shapes ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """A model's size. The defaults are the tiny test model (a few MB, mostly the embedding)."""

    n_embd: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_ff: int = 128
    # MoE (qwen35moe)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    # Gated DeltaNet (qwen35, qwen35moe): state_size is the head size of both k and v
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_state: int = 0
    # sliding window (gemma3, gemma4); gemma4's window layers have their own head size
    n_swa: int = 0
    head_dim_swa: int = 0
    n_ctx_train: int = 4096


# Layers come in groups: qwen35's linear-attention layers repeat with every 4th layer full
# attention (full_attention_interval, the real models' 3:1); gemma3 has 5 window layers to one
# global (llama.cpp's default sliding_window_pattern 6), and gemma4, whose pattern is an
# explicit per-layer array, gets the same.
LAYER_GROUP = {"qwen3": 1, "qwen35": 4, "qwen35moe": 4, "gemma3": 6, "gemma4": 6}


def tiny_shape(arch: str) -> Shape:
    if arch == "qwen3":
        return Shape()
    if arch in ("qwen35", "qwen35moe"):
        base = Shape(n_layer=4, head_dim=64, ssm_k_heads=2, ssm_v_heads=4, ssm_state=32)
        if arch == "qwen35moe":
            return replace(base, n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64)
        return base
    if arch == "gemma3":
        return Shape(n_layer=6, n_head=4, n_head_kv=1, head_dim=64, n_swa=128)
    if arch == "gemma4":
        return Shape(n_layer=6, n_head=4, n_head_kv=2, head_dim=64, head_dim_swa=32, n_swa=128)
    raise ValueError(f"unknown arch {arch!r}; one of {', '.join(ARCHS)}")


def scaled_shape(arch: str, params: int) -> Shape:
    """The smallest shape of the family with at least ``params`` parameters (embedding and all
    experts included): the width steps up a ladder, each width with real-model-like heads,
    FFN, expert and Gated DeltaNet sizes; the depth is what the count needs, in whole layer
    groups, at least 4 layers and at most a cap that grows with the width (8 up to width 128,
    width/16, 48 from 768), so a bigger target widens the model once it is that deep."""
    n_vocab = len(family_vocab(FORMATS[arch], base_vocab()).tokens)
    group = LAYER_GROUP[arch]
    for d in (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120):
        head = 32 if d <= 64 else 64 if d <= 512 else 128
        n_head = max(2, d // head)
        n_kv = n_head // 4 if n_head % 4 == 0 and n_head >= 8 else max(1, n_head // 2)
        s = replace(tiny_shape(arch), n_embd=d, n_head=n_head, n_head_kv=n_kv, head_dim=head, n_ff=3 * d,
                    n_layer=group, n_ctx_train=32768)
        if arch in ("qwen35", "qwen35moe"):
            s = replace(s, ssm_state=head, ssm_k_heads=max(2, d // 128), ssm_v_heads=2 * max(2, d // 128))
        if arch == "qwen35moe":
            # From width 1024 on, many narrow experts as Qwen3.5's MoE has (8 of 128 routed, a
            # quarter-width expert FFN), so a ~3B model is active on ~0.5B parameters a token.
            n_exp, used, ff_exp = (8, 2, d // 2) if d < 512 else (16, 4, d // 2) if d < 1024 else (128, 8, d // 4)
            s = replace(s, n_expert=n_exp, n_expert_used=used, n_ff_exp=max(32, ff_exp), n_ff_shexp=max(32, ff_exp))
        if arch == "gemma3":
            s = replace(s, n_swa=512)
        if arch == "gemma4":
            s = replace(s, head_dim=2 * head, head_dim_swa=head, n_swa=512)
        fixed = count_params(arch, replace(s, n_layer=0), n_vocab)
        per_group = count_params(arch, s, n_vocab) - fixed
        least = math.ceil(4 / group)  # at least 4 layers, whole groups
        groups = max(least, math.ceil((params - fixed) / per_group))
        if groups * group <= min(48, max(8, d // 16)) or d == 5120:
            return replace(s, n_layer=groups * group)
    raise AssertionError("unreachable")


def count_params(arch: str, shape: Shape, n_vocab: int) -> int:
    return sum(math.prod(dims) for _, dims, _ in tensor_specs(arch, shape, n_vocab))


# --- tensors ---------------------------------------------------------------------------------

# How a tensor is filled: "w" a weight matrix ~ N(0, 1/fan_in), "one" a norm weight, "emb" the
# token embedding, "ssm_a" Gated DeltaNet's -exp(A_log), "dt" its dt bias, "conv" its kernel.
Spec = tuple[str, tuple[int, ...], str]  # name, llama.cpp dims (ne0 first), init


def tensor_specs(arch: str, s: Shape, n_vocab: int) -> list[Spec]:
    """The tensors llama.cpp's loader creates for ``arch`` (src/models/<arch>.cpp), in its
    dims order (``{ne0, ne1, ...}``: input features first). The output head is tied to the
    embedding (the loader duplicates token_embd when output.weight is absent)."""
    out: list[Spec] = [("token_embd.weight", (s.n_embd, n_vocab), "emb"),
                       ("output_norm.weight", (s.n_embd,), "one")]
    if arch == "gemma4":
        out.append(("rope_freqs.weight", (s.head_dim // 2,), "one"))  # proportional rope, shared
    for i in range(s.n_layer):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (s.n_embd,), "one"))
        if arch in ("qwen35", "qwen35moe"):
            out.append((b + "post_attention_norm.weight", (s.n_embd,), "one"))
            if (i + 1) % LAYER_GROUP[arch] == 0:
                out += _attention(b, s, s.head_dim, gated_q=True)
            else:
                out += _gated_delta_net(b, s)
            out += _moe(b, s) if arch == "qwen35moe" else _ffn(b, s)
        elif arch == "qwen3":
            out += _attention(b, s, s.head_dim)
            out.append((b + "ffn_norm.weight", (s.n_embd,), "one"))
            out += _ffn(b, s)
        else:  # gemma3, gemma4
            swa = _is_swa(i)
            head = s.head_dim_swa if (arch == "gemma4" and swa) else s.head_dim
            out += _attention(b, s, head)
            out.append((b + "post_attention_norm.weight", (s.n_embd,), "one"))
            out.append((b + "ffn_norm.weight", (s.n_embd,), "one"))
            out += _ffn(b, s)
            out.append((b + "post_ffw_norm.weight", (s.n_embd,), "one"))
    return out


def _is_swa(i: int) -> bool:
    return (i + 1) % LAYER_GROUP["gemma3"] != 0


def _attention(b: str, s: Shape, head: int, gated_q: bool = False) -> list[Spec]:
    q = head * s.n_head
    return [(b + "attn_q.weight", (s.n_embd, 2 * q if gated_q else q), "w"),  # qwen35: query + gate
            (b + "attn_k.weight", (s.n_embd, head * s.n_head_kv), "w"),
            (b + "attn_v.weight", (s.n_embd, head * s.n_head_kv), "w"),
            (b + "attn_output.weight", (q, s.n_embd), "w"),
            (b + "attn_q_norm.weight", (head,), "one"),
            (b + "attn_k_norm.weight", (head,), "one")]


def _gated_delta_net(b: str, s: Shape) -> list[Spec]:
    key_dim, value_dim = s.ssm_state * s.ssm_k_heads, s.ssm_state * s.ssm_v_heads
    return [(b + "attn_qkv.weight", (s.n_embd, 2 * key_dim + value_dim), "w"),
            (b + "attn_gate.weight", (s.n_embd, value_dim), "w"),
            (b + "ssm_conv1d.weight", (4, 2 * key_dim + value_dim), "conv"),
            (b + "ssm_dt.bias", (s.ssm_v_heads,), "dt"),
            (b + "ssm_a", (s.ssm_v_heads,), "ssm_a"),
            (b + "ssm_beta.weight", (s.n_embd, s.ssm_v_heads), "w"),
            (b + "ssm_alpha.weight", (s.n_embd, s.ssm_v_heads), "w"),
            (b + "ssm_norm.weight", (s.ssm_state,), "one"),
            (b + "ssm_out.weight", (value_dim, s.n_embd), "w")]


def _ffn(b: str, s: Shape) -> list[Spec]:
    return [(b + "ffn_gate.weight", (s.n_embd, s.n_ff), "w"),
            (b + "ffn_up.weight", (s.n_embd, s.n_ff), "w"),
            (b + "ffn_down.weight", (s.n_ff, s.n_embd), "w")]


def _moe(b: str, s: Shape) -> list[Spec]:
    e = s.n_expert
    return [(b + "ffn_gate_inp.weight", (s.n_embd, e), "w"),
            (b + "ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, e), "w"),
            (b + "ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, e), "w"),
            (b + "ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, e), "w"),
            (b + "ffn_gate_inp_shexp.weight", (s.n_embd,), "w"),
            (b + "ffn_gate_shexp.weight", (s.n_embd, s.n_ff_shexp), "w"),
            (b + "ffn_up_shexp.weight", (s.n_embd, s.n_ff_shexp), "w"),
            (b + "ffn_down_shexp.weight", (s.n_ff_shexp, s.n_embd), "w")]


def _stays_f32(name: str, dims: tuple[int, ...]) -> bool:
    # As llama.cpp's converter: vectors, the conv kernel (ggml_ssm_conv reads F32) and the
    # routers stay F32 in an F16 file.
    return len(dims) == 1 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight"))


def _values(seed: int, name: str, dims: tuple[int, ...], init: str) -> np.ndarray:
    """The tensor's values (float32, numpy order = reversed dims), from its own stream: a
    tensor's values depend only on the seed and its name, not on what else the file holds."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    shape = tuple(reversed(dims))
    if init == "one":
        return np.ones(shape, np.float32)
    if init == "ssm_a":  # -exp(A_log), A_log = log U(1, 16) as the reference initializes it
        return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
    if init == "dt":  # softplus^-1 of dt ~ U(0.001, 0.1)
        dt = rng.uniform(0.001, 0.1, shape)
        return np.log(np.expm1(dt)).astype(np.float32)
    fan_in = dims[0]
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(1.0 / math.sqrt(fan_in))
    return x


# --- metadata --------------------------------------------------------------------------------

def _arch_metadata(w, arch: str, s: Shape) -> None:
    a = arch
    w.add_uint32(f"{a}.context_length", s.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 1_000_000.0)
    if a == "qwen3":
        w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    if a in ("qwen35", "qwen35moe"):
        # Partial interleaved M-RoPE as Qwen3.5: a quarter of the head rotates, its pairs split
        # 11:11:10 over the (text-only: equal) position sections.
        n_rot = s.head_dim // 4
        w.add_uint32(f"{a}.rope.dimension_count", n_rot)
        half = n_rot // 2
        sec = [round(half * 11 / 32), round(half * 11 / 32)]
        w.add_array(f"{a}.rope.dimension_sections", [*sec, half - sum(sec), 0])
        w.add_uint32(f"{a}.full_attention_interval", LAYER_GROUP[a])
        w.add_uint32(f"{a}.ssm.conv_kernel", 4)
        w.add_uint32(f"{a}.ssm.state_size", s.ssm_state)
        w.add_uint32(f"{a}.ssm.group_count", s.ssm_k_heads)
        w.add_uint32(f"{a}.ssm.time_step_rank", s.ssm_v_heads)
        w.add_uint32(f"{a}.ssm.inner_size", s.ssm_state * s.ssm_v_heads)
    if a == "qwen35moe":
        w.add_uint32(f"{a}.expert_count", s.n_expert)
        w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
        w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.n_ff_shexp)
    if a in ("gemma3", "gemma4"):
        w.add_uint32(f"{a}.attention.sliding_window", s.n_swa)
        w.add_float32(f"{a}.rope.freq_base_swa", 10_000.0)
    if a == "gemma4":
        w.add_array(f"{a}.attention.sliding_window_pattern", [_is_swa(i) for i in range(s.n_layer)])
        w.add_uint32(f"{a}.attention.key_length_swa", s.head_dim_swa)
        w.add_uint32(f"{a}.attention.value_length_swa", s.head_dim_swa)
        w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
        w.add_uint32(f"{a}.rope.dimension_count_swa", s.head_dim_swa)
        w.add_uint32(f"{a}.embedding_length_per_layer_input", 0)  # no per-layer embeddings (as 31B)
        w.add_float32(f"{a}.final_logit_softcapping", 30.0)


def _tokenizer_metadata(w, fmt: ChatFormat, vocab: Vocab, template: str) -> None:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    w.add_string("tokenizer.ggml.model", vocab.model)
    w.add_string("tokenizer.ggml.pre", vocab.pre)
    w.add_array("tokenizer.ggml.tokens", list(vocab.tokens))
    w.add_array("tokenizer.ggml.token_type", list(vocab.token_types))
    w.add_array("tokenizer.ggml.merges", list(vocab.merges))
    if fmt.bos is not None:
        w.add_uint32("tokenizer.ggml.bos_token_id", ids[fmt.bos])
    w.add_uint32("tokenizer.ggml.eos_token_id", ids[fmt.eos])
    w.add_uint32("tokenizer.ggml.eot_token_id", ids[fmt.eot])
    if fmt.pad is not None:
        w.add_uint32("tokenizer.ggml.padding_token_id", ids[fmt.pad])
    w.add_bool("tokenizer.ggml.add_bos_token", fmt.add_bos)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.add_string("tokenizer.chat_template", template)


# --- writing ---------------------------------------------------------------------------------

DTYPES = {"f16": np.float16, "f32": np.float32}


def size_label(params: int | None) -> str:
    if params is None:
        return "tiny"
    return f"{params / 1e9:g}B" if params >= 1e9 else f"{params / 1e6:g}M"


def file_name(arch: str, seed: int, params: int | None, dtype: str) -> str:
    """The file's name says arch, size, seed and dtype; a scaled MoE's also its experts
    (routed of all), so a cached file made with another expert ladder is never taken for it."""
    experts = ""
    if params is not None and (s := scaled_shape(arch, params)).n_expert:
        experts = f"-{s.n_expert_used}of{s.n_expert}"
    return f"synthetic-{arch}-{size_label(params)}{experts}-seed{seed}-{dtype}.gguf"


def make(arch: str, out_dir: str | os.PathLike[str], *, seed: int = 0, params: int | None = None,
         dtype: str = "f16") -> Path:
    """Writes the synthetic ``arch`` model into ``out_dir`` and returns its path.

    Args:
        arch: one of :data:`ARCHS`.
        out_dir: created if missing. The file name says arch, size, seed and dtype
            (:func:`file_name`); an existing file of that name is replaced.
        seed: the weights' seed; the same arguments give a byte-identical file.
        params: the least total parameter count (:func:`scaled_shape`); None: the tiny shape.
        dtype: ``"f16"`` or ``"f32"`` for the matrices (vectors are always F32).

    The file is written under a temporary name and renamed, so a reader never sees half of
    one. Tensors are generated one at a time while writing: memory stays at the largest
    tensor, whatever the model's size.
    """
    import gguf

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    fmt = FORMATS[arch]
    vocab = family_vocab(fmt, base_vocab())
    shape = tiny_shape(arch) if params is None else scaled_shape(arch, params)
    specs = tensor_specs(arch, shape, len(vocab.tokens))
    template = (_template_dir() / f"{fmt.template}.jinja").read_text(encoding="utf-8")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / file_name(arch, seed, params, dtype)
    tmp = out / f".{path.name}.{os.getpid()}.tmp"
    try:
        w = gguf.GGUFWriter(tmp, arch)
        w.add_name(f"Synthetic {arch} {size_label(params)} seed {seed}")
        w.add_type("model")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        # provenance (llama.cpp ignores keys it does not know)
        w.add_uint64("synthetic.seed", seed)
        w.add_uint64("synthetic.params", count_params(arch, shape, len(vocab.tokens)))
        _arch_metadata(w, arch, shape)
        _tokenizer_metadata(w, fmt, vocab, template)
        for name, dims, _ in specs:
            np_dtype = np.float32 if _stays_f32(name, dims) else DTYPES[dtype]
            nbytes = math.prod(dims) * np.dtype(np_dtype).itemsize
            w.add_tensor_info(name, tuple(reversed(dims)), np.dtype(np_dtype), nbytes)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, dims, init in specs:
            np_dtype = np.float32 if _stays_f32(name, dims) else DTYPES[dtype]
            w.write_tensor_data(_values(seed, name, dims, init).astype(np_dtype, copy=False))
        w.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _template_dir() -> Path:
    from testkit import TEST_DATA

    return TEST_DATA / "templates"


def family_tokens(arch: str) -> tuple[str, ...]:
    """The chat-format token texts of ``arch`` that its tokenizer makes single tokens."""
    fmt = FORMATS[arch]
    return fmt.control + fmt.user_defined


def _iter_archs(values: Sequence[str]) -> Iterator[str]:
    for v in values:
        yield from (ARCHS if v == "all" else (v,))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.synthetic_models",
                                     description="Random-weight GGUF models of the families llama.cpp runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write one model; prints its path")
    mk.add_argument("--arch", required=True, choices=[*ARCHS, "all"], action="append",
                    help="model family (repeatable; 'all' for every one)")
    mk.add_argument("--out", required=True, help="output folder (created if missing)")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--params", type=_count, default=None,
                    help="least total parameter count, e.g. 500M, 4B (default: a tiny model of a few MB)")
    mk.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    args = parser.parse_args(argv)
    for arch in _iter_archs(args.arch):
        print(make(arch, args.out, seed=args.seed, params=args.params, dtype=args.dtype), flush=True)
    return 0


def _count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:].upper())
    try:
        return int(float(text[:-1]) * scale) if scale else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 500M, 4B, 120000)") from None


if __name__ == "__main__":
    sys.exit(main())
