"""No test runs a native model runtime inside the test process (issue: a SIGILL in llama.cpp's
AMX kernels once killed the whole test run on an AMX machine).

Model code runs in the workers (driven as processes) or, where a test needs llama.cpp itself,
in ``testkit.native_child``'s child process: a crash there is one failed test that names the
signal, and every other test still runs.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from testkit import REPO
from trioserve.machine import embedded_model_path

from testkit.native_child import NativeChild, NativeChildDied, NativeChildError, how_it_ended

# Ways Python code brings a native model runtime into its own process.
IN_PROCESS = re.compile(r"^\s*(import llama_cpp|from llama_cpp\b|import executorch|from executorch\b|import torch"
                        r"|from torch\b)|ctypes\.CDLL\(\s*[\"']lib(llama|ggml)", re.M)


def test_no_test_module_loads_a_native_model_runtime_in_process():
    """Only the child side of testkit/native_child.py may import llama_cpp (inside a function
    that runs in the child)."""
    offenders = []
    for root in ("tests", "testkit", "bench", "conformance"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "testkit" / "native_child.py":
                continue
            for m in IN_PROCESS.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert offenders == []


def test_the_scan_finds_a_planted_import(tmp_path: Path):
    runtime, loader = "llama_cpp", "ctypes.CDLL"  # split, so this file does not plant them itself
    planted = f"import json\n\nimport {runtime}\nlib = {loader}('libggml.so.0')\n"
    assert [m.group(0).strip() for m in IN_PROCESS.finditer(planted)] == [f"import {runtime}", f"{loader}('libggml"]


@pytest.mark.parametrize("sig, words", [("SIGILL", "died by illegal instruction (SIGILL)"),
                                        ("SIGSEGV", "died by segmentation fault (SIGSEGV)")])
def test_a_crashing_child_fails_only_the_call_and_names_the_signal(sig, words):
    child = NativeChild("unused.gguf", timeout=60)
    try:
        with pytest.raises(NativeChildDied, match=re.escape(words)) as info:
            child.call("crash", signal=sig)
        assert "'crash'" in str(info.value)
        assert child.proc.returncode == -getattr(signal, sig)
    finally:
        child.close()


def test_how_it_ended_words():
    assert how_it_ended(-4) == "died by illegal instruction (SIGILL)"
    assert how_it_ended(3) == "exited with status 3"


def test_the_child_answers_after_a_refused_op():
    model = str(embedded_model_path())
    child = NativeChild(model, timeout=60)
    try:
        with pytest.raises(NativeChildError, match="cannot load the vocabulary"):
            child.call("load_vocab", model="/nonexistent.gguf")
        assert isinstance(child.call("load_vocab", model=model), int)  # still serving
        assert child.call("tokenize", text="Hello") and child.call("grammar_parses", grammar='root ::= "a"') is True
    finally:
        child.close()
