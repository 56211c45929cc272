"""Prompts more than one section sends, so their figures compare like with like."""

from __future__ import annotations

# A chat message with a run number in it, so no run reuses a cached prefix of another.
STORY = "Tell me a very long and detailed story about a robot who learns to paint (story {k})."

# A prompt already in SmolLM2's chat template, for benchmarks that speak to a worker directly.
PROMPT = "<|im_start|>user\nTell me a long story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"
