"""trioserve and llama-server under benchmark: as child processes on loopback ports (so the
client's own cost is not charged to the server), or trioserve in this process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from bench.lib import REPO
from testkit import free_port
from testkit.kernel_path import kernel_path, llama_server_args
from trioserve.config import Settings
from trioserve.worker.model_cost import flash_attention_off, model_weights_bytes, read_gguf_shape
from trioserve.testing import InProcessServer, serve_in_process


# trioserve's setting (trioserve.config: TRIOSERVE_ + the field name), read by both servers here.
FLASH_ATTN_ENV = "TRIOSERVE_FLASH_ATTN"


class ServerProcess:
    """A server child process on a loopback port: trioserve (``python -m trioserve.cli``) or
    llama-server. ``pid`` is the process that serves HTTP (the control plane)."""

    def __init__(self, argv: list[str], port: int, name: str, log_path: Path,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.port, self.name = port, name
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env, cwd=cwd)
        self.pid = self.proc.pid
        self.health: dict[str, Any] = {}

    @classmethod
    def trioserve(cls, tmp: Path, env: dict[str, str] | None = None, trace: Path | None = None,
                  **settings: Any) -> ServerProcess:
        """``trace``: run it under bench/lib/token_trace.py, which writes each generation's
        token timestamps to that file when the server exits."""
        port = free_port()
        main = ["bench.lib.token_trace", str(trace)] if trace is not None else ["trioserve.cli"]
        argv = [sys.executable, "-m", *main, "serve", "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
        for key, value in settings.items():
            argv += ["--" + key.replace("_", "-"), str(value)]
        # From the repository root, so `python -m trioserve.cli` runs this checkout's trioserve.
        return cls(argv, port, "trioserve", tmp / f"trioserve-{port}.log", env=env, cwd=REPO)

    @classmethod
    def llama_server(cls, tmp: Path, binary: str, model: Path, threads: int, ctx: int, slots: int = 1,
                     extra: list[str] | None = None, env: dict[str, str] | None = None) -> ServerProcess:
        """llama-server on ``model``: ``ctx`` is its whole context (llama-server splits it over
        ``slots``); ``extra`` arguments appended (``--spec-type ...``); ``env`` replaces the
        environment (the worker's OpenMP settings, for a like-with-like comparison). Its extra
        buffer types follow the worker's choice on this machine (testkit.kernel_path)."""
        port = free_port()
        kernels = llama_server_args(kernel_path(str(model), threads))
        # The attention kernels trioserve's worker runs: the setting given to trioserve through
        # the environment (bench.sizes --flash-attn), with auto resolved as the worker resolves
        # it for this model and per-slot context (llama-server's own auto is on for a CPU).
        fa = os.environ.get(FLASH_ATTN_ENV) or "auto"
        if fa == "auto":
            shape, cells = read_gguf_shape(model), ctx // max(1, slots)
            fa = "off" if flash_attention_off("auto", shape, cells, model_weights_bytes(model)) else "on"
        kernels += ["-fa", fa]
        argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                "-tb", str(threads), "-c", str(ctx), "-np", str(slots), "--jinja", *kernels, *(extra or [])]
        return cls(argv, port, "llama-server", tmp / f"llama-server-{port}.log", env=env)

    async def wait_ready(self, timeout: float = 300.0) -> None:
        with trio.fail_after(timeout):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
                try:
                    status, body = await http_get(self.port, "/health")
                    if status == 200:
                        self.health = json.loads(body) if body.startswith(b"{") else {}
                        return
                except OSError:
                    pass
                await trio.sleep(0.05)

    @property
    def worker_pid(self) -> int | None:
        """The model worker: the server's child process (/health does not reveal pids)."""
        children: list[int] = []
        for task in Path(f"/proc/{self.pid}/task").glob("*"):
            try:
                children += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                continue
        return children[0] if len(children) == 1 else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        data = b""
        with trio.fail_after(5):
            while chunk := await stream.receive_some(65536):
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                if sep and b"content-length" in head.lower():
                    n = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))
                    if len(body) >= n:
                        break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@asynccontextmanager
async def running_server(**settings: Any) -> AsyncIterator[InProcessServer]:
    """trioserve in this process on a loopback port, with ``settings`` over the defaults."""
    values = dict(host="127.0.0.1", port=0, log_level="warning")
    values.update(settings)
    async with serve_in_process(Settings(**values)) as server:
        yield server
