"""Control-plane tokenization for workers that take token ids only (the ExecuTorch engine).

The ExecuTorch worker runs a ``.pte`` program and has no tokenizer of its own (the executorch
wheel ships none in C++, and a byte-level BPE pre-tokenizer needs Unicode tables a hand-written
one would get subtly wrong). So the control plane tokenizes with the Hugging Face
``tokenizers`` library, the implementation that defines what a ``tokenizer.json`` means, and
sends ``{"ids": [...]}`` segments; the worker decodes the ids it samples with the same file's
vocabulary (cpp/hf_vocab.h), so text, stop strings and token counts stay the worker's, as
with every other engine.

The rules match the worker protocol's text segments (spec/worker-protocol.md §4): no BOS/EOS is
added; each segment is tokenized on its own; ``special=True`` (template text) parses
special-token text such as ``<|im_start|>`` into its control token, ``special=False`` (user
content) keeps it plain text; ``{"ids"}`` segments pass through verbatim.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenizers import Tokenizer

from trioserve.worker.protocol import Generate, IdsSegment, Request, Segment, TextSegment, Tokenize


class PromptEncoder:
    """Rewrites the prompt of generate and tokenize requests as token ids.

    Not thread-safe (it flips the tokenizer's special-token mode around a call); the control
    plane calls it from its single Trio thread.
    """

    def __init__(self, tokenizer_path: str | Path) -> None:
        """Loads ``tokenizer.json``.

        Raises:
            ValueError: the file is missing or not a tokenizer the library reads.
        """
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise ValueError(f"cannot load tokenizer {tokenizer_path}: {exc}") from None

    def encode(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text`` without BOS/EOS; special-token text parsed only when
        ``special``."""
        if not text:
            return []
        self._tokenizer.encode_special_tokens = not special
        try:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self._tokenizer.encode_special_tokens = False

    def segments_to_ids(self, segments: tuple[Segment, ...]) -> tuple[Segment, ...]:
        """One ``IdsSegment`` with the ids of every segment, in order."""
        ids: list[int] = []
        for seg in segments:
            if isinstance(seg, TextSegment):
                ids.extend(self.encode(seg.text, special=seg.special))
            else:
                ids.extend(seg.ids)
        return (IdsSegment(tuple(ids)),)

    def __call__(self, request: Request) -> Request:
        """``request`` with its prompt as ids (other requests unchanged)."""
        if isinstance(request, Generate):
            p = request.params
            segments = p.prompt_segments if p.prompt_segments is not None else (TextSegment(p.prompt),)
            return Generate(dataclasses.replace(p, prompt="", prompt_segments=self.segments_to_ids(segments)))
        if isinstance(request, Tokenize):
            segments = (request.prompt_segments if request.prompt_segments is not None
                        else (TextSegment(request.text or ""),))
            return Tokenize(prompt_segments=self.segments_to_ids(segments), count_only=request.count_only)
        return request
