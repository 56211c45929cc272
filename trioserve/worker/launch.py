"""How one model's worker processes are started: their command line and environment
(spec/worker-protocol.md §1 for the flags), from the model's :class:`ModelSpec` and the
server's settings.

:func:`worker_argv` / :func:`worker_env` take a spec and the server settings (the model's own
values win, ``ModelSpec.settings``); :func:`argv_for` / :func:`env_for` take settings that
already are one model's (the single-model server's, tests, benches).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from trioserve.config import SPIN_INHERIT, Settings
from trioserve.machine import installed_worker, physical_memory_bytes
from trioserve.registry import ModelSpec

__all__ = ["argv_for", "env_for", "probe_memory_flags", "worker_argv", "worker_env"]



def worker_argv(spec: ModelSpec, server: Settings) -> list[str]:
    """The command line of every worker of ``spec``'s pool.

    Raises:
        SettingsError: see ``Settings.check_engine``; RegistryError: a per-model value is
            out of bounds.
    """
    return argv_for(spec.settings(server))


def worker_env(spec: ModelSpec, server: Settings, index: int = 0,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What worker ``index`` of ``spec``'s pool gets on top of the server's environment."""
    return env_for(spec.settings(server), index, base)


def argv_for(settings: Settings) -> list[str]:
    """The worker command line one model's settings describe (the same for every worker of a
    pool; what differs per worker is in :func:`env_for`).

    Raises:
        SettingsError: see ``Settings.check_engine``.
    """
    settings.check_engine()
    binary = settings.worker_bin or str(installed_worker(settings.engine))
    argv = [binary, "--ctx", str(settings.max_context)]
    if settings.engine == "llama":
        argv += _llama_flags(settings)
    elif settings.engine == "executorch":
        # Slots are instances of the program's forward method on one load (the worker caps
        # them to what fits memory); spill and prefix sharing as for llama.cpp.
        argv += ["--model", settings.model_path, "--tokenizer", settings.tokenizer_path,
                 "--threads", str(settings.worker_threads()),
                 "--heartbeat-ms", str(settings.heartbeat_ms())]
        if settings.slots > 0:
            argv += ["--capacity", str(settings.slots)]
        if settings.spill_budget_bytes != 1 << 30:
            argv += ["--spill-budget-bytes", str(settings.spill_budget_bytes)]
        return argv + _stream_interval_flags(settings) + _state_flags(settings) + shlex.split(settings.worker_args)
    elif settings.fake_script:
        argv += ["--script", settings.fake_script]
    argv += ["--heartbeat-ms", str(settings.heartbeat_ms())]
    argv += _stream_interval_flags(settings)
    if settings.slots > 0:
        argv += ["--capacity", str(settings.slots)]
    if settings.spill_budget_bytes != 1 << 30:  # the worker's own default otherwise
        argv += ["--spill-budget-bytes", str(settings.spill_budget_bytes)]
    if settings.kv_cache_type != "f16":  # llama and fake; the workers' own default otherwise
        argv += ["--kv-cache-type", settings.kv_cache_type]
    if settings.swa_cache != "auto":  # the workers' own defaults otherwise
        argv += ["--swa-cache", settings.swa_cache]
    if settings.swa_checkpoints != 4:
        argv += ["--swa-checkpoints", str(settings.swa_checkpoints)]
    return argv + _state_flags(settings) + shlex.split(settings.worker_args)


def _state_flags(settings: Settings) -> list[str]:
    """The persistent state store (spec/worker-protocol.md §6.4): every worker of every model
    shares the directory (a state file names its model by fingerprint); none when it is off."""
    if not settings.state_dir:
        return []
    return ["--state-dir", os.path.abspath(os.path.expanduser(settings.state_dir)),
            "--state-dir-bytes", str(settings.state_dir_bytes)]


def _stream_interval_flags(settings: Settings) -> list[str]:
    """Every worker takes ``--stream-interval-ms`` (spec §4.1); none when it is 0, their default."""
    interval = settings.stream_interval()
    return ["--stream-interval-ms", f"{interval:g}"] if interval > 0 else []


def _llama_flags(settings: Settings) -> list[str]:
    argv = ["--model", settings.resolved_model_path(),
            "--threads", str(settings.worker_threads())]
    if settings.workers > 1 and settings.max_context == 0:
        # Each worker sizes its KV cache from a quarter of physical memory by default:
        # N workers share that quarter instead of taking N quarters.
        argv += ["--kv-budget-bytes", str(max(1, physical_memory_bytes() // 4 // settings.workers))]
    if settings.gpu_layers:
        argv += ["--gpu-layers", str(settings.gpu_layers)]
    argv += ["--speculative", settings.speculative]
    if settings.cpu_extra_buffers != "auto":  # the worker's own default otherwise
        argv += ["--cpu-extra-buffers", settings.cpu_extra_buffers]
    else:  # only auto runs a probe: remember the ones that passed (issue #51)
        argv += probe_memory_flags()
    if settings.max_step_ms > 0:  # the worker's own default is fixed pieces
        argv += ["--max-step-ms", f"{settings.max_step_ms:g}"]
    if settings.deterministic:
        argv += ["--deterministic"]
    if settings.flash_attn != "auto":  # the worker's own default otherwise
        argv += ["--flash-attn", settings.flash_attn]
    return argv


def probe_memory_flags(env: Mapping[str, str] | None = None) -> list[str]:
    """``--probe-memory DIR`` for a llama worker with ``--cpu-extra-buffers auto``: where kernel
    probes that passed are remembered, so a restart on the same machine, binaries and model skips
    the ~1 s probe (spec/worker-protocol.md §10). ``$TRIOSERVE_KERNEL_PROBE_MEMORY`` (``off`` =
    none), else ``$XDG_CACHE_HOME/trioserve/kernel-probes``, else
    ``~/.cache/trioserve/kernel-probes``. No flag when no directory can be named (no HOME): the
    probe then simply runs. An environment variable, not a setting: it is a per-machine cache
    location, like XDG_CACHE_HOME itself.
    """
    env = os.environ if env is None else env
    explicit = env.get("TRIOSERVE_KERNEL_PROBE_MEMORY", "").strip()
    if explicit == "off":
        return []
    if explicit:
        return ["--probe-memory", os.path.abspath(os.path.expanduser(explicit))]
    cache = env.get("XDG_CACHE_HOME", "").strip()
    if not os.path.isabs(cache):  # the XDG spec: a relative value is ignored
        home = env.get("HOME", "").strip() or os.path.expanduser("~")
        if not os.path.isabs(home):
            return []
        cache = os.path.join(home, ".cache")
    return ["--probe-memory", os.path.join(cache, "trioserve", "kernel-probes")]


def env_for(settings: Settings, index: int = 0, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to set in worker ``index``'s environment on top of the server's own
    (``base``, default ``os.environ``).

    Several workers offloading to a GPU get one device each: ``CUDA_VISIBLE_DEVICES``
    names the ``index``-th device of the server's own ``CUDA_VISIBLE_DEVICES`` (all
    devices, counted from 0, when unset), cycling when there are more workers than
    devices. One worker inherits the server's devices unchanged.

    The llama.cpp library trioserve links is built with OpenMP (libgomp): between graph
    operations every model thread waits at a barrier, busy-spinning ``GOMP_SPINCOUNT``
    times before it sleeps. Spinning pays off only while every model thread has a core
    to itself; see the ``spin_count`` setting and docs/benchmarks.md (CPU contention) for
    the measured choice. No ``GOMP_SPINCOUNT`` for ``spin_count=inherit``.
    """
    env: dict[str, str] = {}
    if settings.spin_count != SPIN_INHERIT:
        env["GOMP_SPINCOUNT"] = settings.spin_count
    if settings.workers > 1 and settings.gpu_layers:
        base = os.environ if base is None else base
        visible = [d.strip() for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[index % len(visible)] if visible else str(index)
    return env
