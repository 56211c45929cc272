"""Prompts more than one section sends, so their figures compare like with like."""

from __future__ import annotations

import random

# A chat message with a run number in it, so no run reuses a cached prefix of another.
STORY = "Tell me a very long and detailed story about a robot who learns to paint (story {k})."

# A prompt already in SmolLM2's chat template, for benchmarks that speak to a worker directly.
PROMPT = "<|im_start|>user\nTell me a long story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


def source_file(rng: random.Random, lines: int) -> str:
    """A Python file of ``lines`` lines in the style agents edit: small functions whose names,
    arguments and constants vary with ``rng`` (the edit and tool re-emit workloads)."""
    out: list[str] = []
    i = 0
    while len(out) < lines:
        name = rng.choice(["parse", "render", "load", "store", "merge", "split", "check"]) + f"_{i}"
        arg = rng.choice(["path", "items", "config", "text"])
        out += [f"def {name}({arg}):", f"    \"\"\"{name.split('_')[0].title()} the {arg}.\"\"\"",
                f"    result = helper_{i % 7}({arg}, limit={rng.randint(1, 64)})",
                "    if not result:", "        return None", f"    return result + {i}", ""]
        i += 1
    return "\n".join(out[:lines])
