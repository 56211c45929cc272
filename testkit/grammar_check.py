"""Test-only: check GBNF grammars with llama.cpp's own grammar engine (via llama-cpp-python).

Tests may load libllama; the control plane never does (see ``trioserve.core.constraints``). This
loads only the embedded model's vocabulary (no weights) and answers two questions the way the
llama worker will: does llama.cpp parse the grammar, and does the grammar accept a given text
(token by token, as sampling would, ending where an end-of-generation token is allowed).
"""

from __future__ import annotations

import ctypes
import math
from functools import cached_property
from pathlib import Path

import llama_cpp

from trioserve.machine import embedded_model_path


class GrammarChecker:
    """llama.cpp grammar parsing and matching over one model's vocabulary."""

    def __init__(self, model_path: str | Path | None = None) -> None:
        path = str(model_path or embedded_model_path())
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_silence, ctypes.c_void_p())
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self._model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self._model:
            raise RuntimeError(f"cannot load the vocabulary of {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)

    def close(self) -> None:
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    @cached_property
    def eos(self) -> int:
        return llama_cpp.llama_vocab_eos(self._vocab)

    def parses(self, grammar: str) -> bool:
        """Whether llama.cpp's grammar parser accepts ``grammar`` (root rule ``root``)."""
        sampler = llama_cpp.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not sampler:
            return False
        llama_cpp.llama_sampler_free(sampler)
        return True

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, len(buf), False, False)
        if n < 0:
            raise RuntimeError("tokenize buffer too small")
        return list(buf[:n])

    def matches(self, grammar: str, text: str) -> bool:
        """Whether the grammar lets a model emit exactly ``text`` and then stop."""
        sampler = llama_cpp.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not sampler:
            raise ValueError("llama.cpp does not parse this grammar")
        try:
            for token in self.tokenize(text):
                if not self._allowed(sampler, token):
                    return False
                llama_cpp.llama_sampler_accept(sampler, token)
            return self._allowed(sampler, self.eos)
        finally:
            llama_cpp.llama_sampler_free(sampler)

    @staticmethod
    def _allowed(sampler, token: int) -> bool:
        data = (llama_cpp.llama_token_data * 1)(llama_cpp.llama_token_data(token, 0.0, 0.0))
        array = llama_cpp.llama_token_data_array(data, 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        return not math.isinf(data[0].logit)


@llama_cpp.llama_log_callback
def _silence(level, text, user_data):  # llama.cpp logs every grammar parse error to stderr
    pass
