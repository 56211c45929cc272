"""Export the tiny random Llama the ExecuTorch tests serve, and record its reference outputs.

What it writes (into ``--out``, default ``tests/data/executorch``), all committed so CI needs
no torch:

- ``tokenizer.json``: a byte-level BPE tokenizer trained here on a fixed built-in text
  (``VOCAB_SIZE`` entries: 256 bytes, merges, and the ChatML specials ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``), and ``tokenizer_config.json`` with a ChatML chat template
  and ``<|im_end|>`` as EOS. A small vocabulary keeps the program under 1 MB.
- ``tiny.pte``: a 2-layer, dim-64 Llama with seeded random weights, exported by ExecuTorch's own
  ``export_llama`` (KV cache, XNNPACK, fp32, the issue's command line), with the EOS/BOS ids as
  program metadata.
- ``tiny_sdpa.pte``: the same weights exported with ``--use_sdpa_with_kv_cache`` (the program
  calls ``llama::update_cache`` and ``llama::custom_sdpa``, which trioserve's worker implements).
- ``expected.json``: for a few prompts, the greedy ids that ExecuTorch's Python runtime
  (``executorch.runtime``) produces for ``tiny.pte`` (whole-prompt prefill, then one token per
  call, argmax); the C++ worker must reproduce them exactly with either program. (The wheel's
  Python runtime cannot run ``tiny_sdpa.pte``: it has no kernels for the llama:: operators.)

Needs torch + executorch (the export-time packages), which trioserve itself does not: run it
from a separate environment, e.g.::

    python3.11 -m venv /work/et-venv
    /work/et-venv/bin/pip install torch==2.13.0   # the CPU wheel; no CUDA
    /work/et-venv/bin/pip install executorch==1.5.1
    /work/et-venv/bin/python scripts/executorch/export_tiny_pte.py

About 45 s on a 2-core machine. The output is deterministic for the same package versions
(seeded weights, a fixed corpus), except for the .pte's exact bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB_SIZE = 384
SEED = 20261201
MAX_SEQ_LEN = 64        # the largest prefill chunk one forward call takes
MAX_CONTEXT_LEN = 256   # the KV cache: the served context window
PARAMS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32,
          "norm_eps": 1e-5, "rope_theta": 10000.0, "use_scaled_rope": False}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Prompts whose greedy continuations expected.json records (the tests send the same ids).
REFERENCE_PROMPTS = [
    "<|im_start|>user\nHello there, how are you today?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nCount: one two three<|im_end|>\n<|im_start|>assistant\n",
]
REFERENCE_TOKENS = 32


def corpus() -> list[str]:
    """A fixed text to train the merges on: varied English, digits, punctuation, and a
    little non-ASCII so multi-byte characters occur as byte sequences and merges."""
    words = ("the quick brown fox jumps over the lazy dog while a small model serves tokens to "
             "many clients across the network hello there how are you today we count one two "
             "three four five six seven eight nine ten and stream every piece as it comes "
             "café naïve résumé 你好 世界 🌍").split()
    lines = []
    for i in range(400):
        picked = [words[(i * 7 + k * 13) % len(words)] for k in range(8 + i % 5)]
        lines.append(" ".join(picked) + (". " if i % 3 else "? ") + str(i))
    return lines


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATE, "model_max_length": MAX_CONTEXT_LEN}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Tokenizer.from_file(str(out / "tokenizer.json"))


def write_checkpoint(work: Path, vocab_size: int) -> tuple[Path, Path]:
    import torch
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    params = dict(PARAMS, vocab_size=vocab_size)
    torch.manual_seed(SEED)
    model = construct_transformer(ModelArgs(max_seq_len=MAX_SEQ_LEN, max_context_len=MAX_CONTEXT_LEN, **params))
    # Only the weights: the KV caches and masks are rebuilt by the exporter.
    state = {k: v for k, v in model.state_dict().items() if "kv_cache" not in k and "mask" not in k}
    ckpt, params_path = work / "ckpt.pth", work / "params.json"
    torch.save(state, ckpt)
    params_path.write_text(json.dumps(params))
    return ckpt, params_path


def export(work: Path, ckpt: Path, params: Path, out: Path, eos_id: int, name: str, custom_sdpa: bool) -> Path:
    """export_llama with the issue's flags; ``custom_sdpa`` adds ``--use_sdpa_with_kv_cache``
    (the program then calls llama::update_cache / llama::custom_sdpa)."""
    metadata = json.dumps({"get_bos_id": -1, "get_eos_ids": [eos_id]})
    cmd = [sys.executable, "-m", "executorch.examples.models.llama.export_llama",
           "--model", "llama3", "-p", str(params), "-c", str(ckpt), "-kv", "-X", "--xnnpack-extended-ops",
           "-d", "fp32", "--max_seq_length", str(MAX_SEQ_LEN), "--max_context_length", str(MAX_CONTEXT_LEN),
           "--metadata", metadata, "--output_name", str(out / name)]
    if custom_sdpa:
        cmd.append("--use_sdpa_with_kv_cache")
    subprocess.run(cmd, check=True, cwd=work)
    return out / name


def reference_ids(pte: Path, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy continuation by ExecuTorch's Python runtime: the whole prompt in one forward
    call, then one token per call, argmax of the last logits each time."""
    import torch
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(pte))
    forward = program.load_method("forward")
    logits = forward.execute([torch.tensor([prompt_ids], dtype=torch.long),
                              torch.tensor([0], dtype=torch.long)])[0]
    pos = len(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        nxt = int(torch.argmax(logits.reshape(-1, logits.shape[-1])[-1]))
        out.append(nxt)
        logits = forward.execute([torch.tensor([[nxt]], dtype=torch.long), torch.tensor([pos], dtype=torch.long)])[0]
        pos += 1
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "data" / "executorch")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    tok = build_tokenizer(args.out)
    eos_id = tok.token_to_id("<|im_end|>")
    # The same weights twice: plain attention (aten ops only) and the exporter's fused
    # attention (--use_sdpa_with_kv_cache: llama::update_cache / llama::custom_sdpa, which
    # trioserve's worker implements). The reference ids come from the plain program: the
    # executorch 1.5.1 wheel's Python runtime has no kernels for the llama:: operators (it fails
    # with "Missing operator: llama::custom_sdpa.out"), so the fused program must reproduce the
    # plain program's reference: the same function, computed by another attention kernel.
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt, params = write_checkpoint(work, tok.get_vocab_size())
        pte = export(work, ckpt, params, args.out, eos_id, "tiny.pte", custom_sdpa=False)
        sdpa = export(work, ckpt, params, args.out, eos_id, "tiny_sdpa.pte", custom_sdpa=True)
    cases = []
    for prompt in REFERENCE_PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=False).ids
        assert len(ids) <= MAX_SEQ_LEN, "a reference prompt must fit one forward call"
        cases.append({"prompt": prompt, "prompt_ids": ids, "greedy_ids": reference_ids(pte, ids, REFERENCE_TOKENS)})
    expected = {"generator": "ExecuTorch Python runtime (executorch.runtime), greedy argmax",
                "program": pte.name, "also_for": sdpa.name,
                "executorch": _version("executorch"), "torch": _version("torch"),
                "max_seq_len": MAX_SEQ_LEN, "max_context_len": MAX_CONTEXT_LEN, "vocab_size": tok.get_vocab_size(),
                "eos_id": eos_id, "cases": cases}
    (args.out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    for p in (pte, sdpa):
        print(f"wrote {p} ({os.path.getsize(p)} bytes)")
    print(f"done in {time.monotonic() - t0:.1f} s")
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
