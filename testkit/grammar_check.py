"""Test-only: check GBNF grammars with llama.cpp's own grammar engine (via llama-cpp-python).

The control plane never loads libllama (see ``trioserve.core.constraints``), and neither does the
test process: the checker runs in a child process (``testkit.native_child``), so a crash there
fails the tests that use it, naming the signal, instead of the test run. It loads only the
model's vocabulary (no weights) and answers two questions the way the llama worker will: does
llama.cpp parse the grammar, and does the grammar accept a given text (token by token, as
sampling would, ending where an end-of-generation token is allowed).
"""

from __future__ import annotations

from pathlib import Path

from trioserve.machine import embedded_model_path

from testkit.native_child import NativeChild, NativeChildError


class GrammarChecker:
    """llama.cpp grammar parsing and matching over one model's vocabulary, in a child process."""

    def __init__(self, model_path: str | Path | None = None) -> None:
        self._child = NativeChild(model_path or embedded_model_path())
        self.eos: int = self._child.call("load_vocab", model=self._child.model)

    def close(self) -> None:
        self._child.close()

    def parses(self, grammar: str) -> bool:
        """Whether llama.cpp's grammar parser accepts ``grammar`` (root rule ``root``)."""
        return bool(self._child.call("grammar_parses", grammar=grammar))

    def tokenize(self, text: str, parse_special: bool = False) -> list[int]:
        return list(self._child.call("tokenize", text=text, parse_special=parse_special))

    def matches(self, grammar: str, text: str) -> bool:
        """Whether the grammar lets a model emit exactly ``text`` and then stop. ValueError when
        llama.cpp does not parse the grammar."""
        try:
            return bool(self._child.call("grammar_matches", grammar=grammar, text=text))
        except NativeChildError as exc:
            if str(exc).startswith("ValueError:"):
                raise ValueError(str(exc).removeprefix("ValueError: ")) from None
            raise
