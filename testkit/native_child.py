"""Native model runtimes for tests, in a child process: llama.cpp through llama-cpp-python never
runs inside the pytest process.

Why: a native runtime can die by a signal (llama.cpp's AMX kernels die by SIGILL on some Sapphire
Rapids VMs, llama.cpp issue #20824). In the test process that kills the whole test run; in a
child it fails the one test that used it, with the signal named (``NativeChildDied``).

``NativeChild`` starts ``python -m testkit.native_child`` and speaks one JSON object a line with
it: a request ``{"op": ..., **args}``, an answer ``{"ok": result}`` or ``{"error": text}``. Every
answer is awaited with a deadline. A full model load takes the kernel path the llama worker
chose for the model (testkit.kernel_path): the same CPU variant, and extra buffer types only
where the worker keeps them. Ops: vocabulary loads, tokenization and grammar checks (GrammarChecker),
a full model load and chat completions (tests/test_structured_llama_cpp.py), quantization
(testkit/quantize.py), and ``crash``
(tests/unit/test_native_child.py: a deliberate death).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testkit import REPO


class NativeChildDied(RuntimeError):
    """The child died (by a signal or an exit) while answering; the message names how."""


class NativeChildError(RuntimeError):
    """The child answered an op with an error (the runtime refused it)."""


def how_it_ended(returncode: int) -> str:
    """``-4`` -> "died by illegal instruction (SIGILL)", as the worker's probe says it."""
    if returncode < 0:
        sig = signal.Signals(-returncode)
        words = {signal.SIGILL: "illegal instruction", signal.SIGSEGV: "segmentation fault",
                 signal.SIGBUS: "bus error", signal.SIGFPE: "floating-point exception",
                 signal.SIGABRT: "aborted", signal.SIGKILL: "killed"}.get(sig, sig.name)
        return f"died by {words} ({sig.name})"
    return f"exited with status {returncode}"


class NativeChild:
    """A child process that runs llama-cpp-python for one test module (or one checker)."""

    def __init__(self, model: str | Path, *, timeout: float = 300.0) -> None:
        self.model = str(model)
        self.timeout = timeout
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # stderr to a file, not a pipe: nobody reads it while an op runs, and llama.cpp's log of
        # a long op (a quantization logs every tensor) would fill a pipe and block the child.
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "testkit.native_child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, env=env, cwd=str(REPO))

    def call(self, op: str, timeout: float | None = None, **args: Any) -> Any:
        """Sends one op and returns its result. Raises NativeChildDied (naming the signal) if the
        child dies first, NativeChildError if it answers with an error, TimeoutError past the
        deadline (the child is killed then)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the read below says how
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.proc.kill()
                self.proc.wait(10)
                raise TimeoutError(f"native child: no answer to {op!r} in time (killed)")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                break
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(30)
            raise NativeChildDied(f"the llama-cpp-python child {how_it_ended(code)} during {op!r}; "
                                  f"its stderr: {self.stderr_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise NativeChildError(answer["error"])
        return answer["ok"]

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(running)"
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-2000:].strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdout, self._stderr):
            if f is not None:
                f.close()


# ---- the child side -------------------------------------------------------------------------

class _Runtime:
    """What the child holds: one vocabulary and/or one full model, loaded on demand."""

    def __init__(self) -> None:
        import llama_cpp
        self.llama_cpp = llama_cpp
        # llama.cpp logs every grammar parse error to stderr: keep them out (and the callback alive)
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        self.vocab_model = None
        self.vocab = None
        self.llm = None

    # vocabulary only (no weights, no compute kernels)
    def load_vocab(self, model: str) -> int:
        lc = self.llama_cpp
        lc.llama_backend_init()
        lc.llama_log_set(self._quiet, ctypes.c_void_p())
        params = lc.llama_model_default_params()
        params.vocab_only = True
        self.vocab_model = lc.llama_model_load_from_file(model.encode(), params)
        if not self.vocab_model:
            raise RuntimeError(f"cannot load the vocabulary of {model}")
        self.vocab = lc.llama_model_get_vocab(self.vocab_model)
        return int(lc.llama_vocab_eos(self.vocab))

    def tokenize(self, text: str, parse_special: bool = False) -> list[int]:
        lc = self.llama_cpp
        data = text.encode("utf-8", "surrogatepass")
        buf = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, parse_special)
        if n < 0:
            raise RuntimeError("tokenize buffer too small")
        return list(buf[:n])

    def grammar_parses(self, grammar: str) -> bool:
        lc = self.llama_cpp
        sampler = lc.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            return False
        lc.llama_sampler_free(sampler)
        return True

    def grammar_matches(self, grammar: str, text: str) -> bool:
        lc = self.llama_cpp
        sampler = lc.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            raise ValueError("llama.cpp does not parse this grammar")
        try:
            for token in self.tokenize(text):
                if not self._allowed(sampler, token):
                    return False
                lc.llama_sampler_accept(sampler, token)
            return self._allowed(sampler, lc.llama_vocab_eos(self.vocab))
        finally:
            lc.llama_sampler_free(sampler)

    def _allowed(self, sampler: Any, token: int) -> bool:
        lc = self.llama_cpp
        data = (lc.llama_token_data * 1)(lc.llama_token_data(token, 0.0, 0.0))
        array = lc.llama_token_data_array(data, 1, -1, False)
        lc.llama_sampler_apply(sampler, ctypes.byref(array))
        return not math.isinf(data[0].logit)

    # a full model, on the worker's kernel path
    def quantize(self, src: str, dst: str, qtype: str) -> int:
        """llama.h's quantizer over every matrix of ``src``, with its default choices
        (testkit/quantize.py); its return code (0: written)."""
        lc = self.llama_cpp
        params = lc.llama_model_quantize_default_params()
        params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{qtype}")
        params.nthread = os.cpu_count() or 1
        return int(lc.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))

    def load_chat(self, model: str, variant: str, extra_buffers: bool, n_ctx: int, threads: int) -> str:
        lc = self.llama_cpp
        loaded = _load_cpu_backend(Path(lc.__file__).parent, variant)
        self.llm = lc.Llama(model, n_ctx=n_ctx, n_threads=threads, seed=0, verbose=False,
                            use_extra_bufts=extra_buffers)
        return loaded

    def chat(self, messages: list[dict[str, Any]], grammar: str, max_tokens: int,
             tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        assert self.llm is not None, "load_chat first"
        out = self.llm.create_chat_completion(messages=messages, tools=tools, temperature=0, max_tokens=max_tokens,
                                              grammar=self.llama_cpp.LlamaGrammar.from_string(grammar, verbose=False))
        choice = out["choices"][0]
        return {"finish_reason": choice["finish_reason"], "content": choice["message"]["content"]}


def _load_cpu_backend(package_dir: Path, variant: str) -> str:
    """A portable llama.cpp (GGML_BACKEND_DL) keeps its CPU kernels as libggml-cpu-<variant>.so
    modules, which llama-cpp-python never loads; load ``variant`` (the worker's choice), or ggml's
    pick when it is "". A build with a linked CPU backend has none: nothing to do. Returns the
    loaded module's file name, or "linked"."""
    lib_dir = package_dir / "lib"
    for d in (lib_dir, lib_dir.parent.parent / "bin"):
        modules = sorted(d.glob("libggml-cpu-*.so"))
        if not modules:
            continue
        # By soname: the libggml that libllama.so already loaded (the wheel holds copies, not
        # links, of libggml.so*; another copy would be another backend registry).
        ggml = ctypes.CDLL("libggml.so.0")
        if variant:
            load = ggml.ggml_backend_load
            load.argtypes, load.restype = [ctypes.c_char_p], ctypes.c_void_p
            path = d / f"libggml-cpu-{variant}.so"
            if not load(str(path).encode()):
                raise RuntimeError(f"cannot load {path}")
            return path.name
        load_all = ggml.ggml_backend_load_all_from_path
        load_all.argtypes, load_all.restype = [ctypes.c_char_p], None
        load_all(str(d).encode())
        return "ggml's pick"
    return "linked"


def _serve() -> int:
    """The child's loop: one op a line on stdin, one answer a line on stdout, until EOF."""
    rt = _Runtime()
    ops = {
        "load_vocab": lambda a: rt.load_vocab(a["model"]),
        "tokenize": lambda a: rt.tokenize(a["text"], a.get("parse_special", False)),
        "grammar_parses": lambda a: rt.grammar_parses(a["grammar"]),
        "grammar_matches": lambda a: rt.grammar_matches(a["grammar"], a["text"]),
        "load_chat": lambda a: rt.load_chat(a["model"], a["variant"], a["extra_buffers"], a["n_ctx"], a["threads"]),
        "chat": lambda a: rt.chat(a["messages"], a["grammar"], a["max_tokens"], a.get("tools")),
        "quantize": lambda a: rt.quantize(a["src"], a["dst"], a["type"]),
        # a deliberate death, as a broken kernel would die (tests/unit/test_native_child.py)
        "crash": lambda a: os.kill(os.getpid(), getattr(signal, a["signal"])),
    }
    out = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer: dict[str, Any] = {"ok": ops[request.pop("op")](request)}
        except Exception as exc:  # the answer carries it; the child goes on
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
