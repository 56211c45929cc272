"""Supervisor: owns the worker process — spawn, serve, kill, reap, restart.

The supervisor runs in the app nursery for the life of the server. Each worker
*incarnation* gets its own nursery holding the worker's stderr forwarder and the
runtime's tasks, so when an incarnation ends nothing of it outlives the nursery.

Health: ``state`` is ``loading`` while a worker starts and while a restart is pending
(failure seen, worker being stopped, backoff running), ``ready`` while one serves, and
``unavailable`` when no worker will come (crash loop, restarts disabled, fatal startup
error, shutdown). ``public_reason`` is the short, stable phrase ``/health`` may show
("starting", "restarting", "crash loop", ...); ``reason`` is the detailed internal one
(exception text, paths), meant for the log and tests, never for clients.

Restart policy: a worker that dies, hangs or breaks the protocol is killed (SIGTERM,
bounded wait, SIGKILL, bounded wait, reap) and restarted after an exponential backoff,
which starts over once a worker served ``healthy_after`` seconds or no failure happened
for ``crash_window`` seconds. ``max_crashes`` failures inside ``crash_window`` seconds is
a crash loop: the supervisor stops restarting, stays ``unavailable`` and sets ``fatal`` so
that a top-level server can exit non-zero and let its orchestrator act. Every failure to
start (the OS refusing fds or a fork, a missing executable, a worker that exits before
ready) is a worker failure under the same policy, never a crash of the supervisor.

Crashes name their signal: a worker that dies by a signal is reported as, e.g., "worker died
by illegal instruction (SIGILL)" in the log and ``reason``, and ``crash`` holds the signal in
words for ``/health``. Two exceptions to restarting, because a restart cannot help:

- a worker that dies by a signal before it finished a single generation, on
  ``first_step_crash_limit`` starts in a row (a CPU kernel that crashes on the first real
  step, before or after ``ready``), is a *startup failure* with that reason;
- a worker that exits with status 3 during startup refuses to run on this CPU (its
  llama.cpp build was compiled for instructions the CPU lacks; cpp/cpu_check.h).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import trio

from trioserve.worker.exit_status import EXIT_INCOMPATIBLE_CPU, describe_exit, signal_in_words
from trioserve.worker.runtime import SessionRuntime
from trioserve.worker.client import ReadyInfo, WorkerClient
from trioserve.worker.protocol import WorkerError, WorkerExited, WorkerHung
from trioserve.errors import FatalStartupError

log = logging.getLogger("trioserve.worker.supervisor")


@dataclass
class RestartPolicy:
    restart: bool = True
    backoff_initial: float = 0.5
    backoff_max: float = 15.0
    max_crashes: int = 5
    crash_window: float = 60.0
    healthy_after: float = 60.0  # a worker that served this long resets the backoff
    # Starts in a row whose worker died by a signal before finishing a generation: a startup
    # failure (a kernel that crashes on every first step), not a restart loop.
    first_step_crash_limit: int = 2


class RestartTracker:
    """The restart policy as pure state: failures in, restart delays out (no clock)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.backoff = policy.backoff_initial
        self.crash_times: list[float] = []

    def failure(self, *, at: float, served_for: float | None) -> float | None:
        """Record a worker failure at time ``at`` (seconds, any monotonic clock) of a
        worker that served ``served_for`` seconds (None: it never became ready).

        Returns the delay before the next start, or None for a crash loop (``max_crashes``
        failures within ``crash_window``). The delay doubles per failure up to
        ``backoff_max`` and starts over from ``backoff_initial`` when this worker served at
        least ``healthy_after`` s or the previous failure is ``crash_window`` s old.
        """
        p = self.policy
        healthy = served_for is not None and served_for >= p.healthy_after
        quiet = bool(self.crash_times) and at - self.crash_times[-1] >= p.crash_window
        if healthy or quiet:
            self.backoff = p.backoff_initial
        self.crash_times = [t for t in self.crash_times if at - t < p.crash_window] + [at]
        if len(self.crash_times) >= p.max_crashes:
            return None
        delay = self.backoff
        self.backoff = min(self.backoff * 2, p.backoff_max)
        return delay


SpawnWorker = Callable[..., Awaitable[WorkerClient]]


class Supervisor:
    """Keeps one worker serving ``runtime``.

    ``on_ready`` is called with each incarnation's ReadyInfo before it serves; raising
    FatalStartupError from it stops the supervisor for good.
    """

    def __init__(
        self,
        argv: list[str],
        runtime: SessionRuntime,
        *,
        on_ready: Callable[[ReadyInfo], None] = lambda info: None,
        on_give_up: Callable[[], None] = lambda: None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 300.0,
        stop_timeout: float = 2.0,
        kill_timeout: float = 2.0,
        policy: RestartPolicy | None = None,
        spawn: SpawnWorker = WorkerClient.spawn,
    ) -> None:
        self.argv = argv
        self.runtime = runtime
        self.on_ready = on_ready
        # Called in the same step as ``fatal`` is set, so an owner (the worker pool) can
        # never be seen ``unavailable`` yet not fatal.
        self.on_give_up = on_give_up
        self.env = env
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.kill_timeout = kill_timeout
        self.policy = policy or RestartPolicy()
        self.spawn = spawn  # WorkerClient.spawn; tests pass a fake with its signature
        self.state = "loading"
        self.reason = "worker is starting"
        self.public_reason = "starting"
        self.fatal = trio.Event()
        self.worker_pid: int | None = None
        self.restarts = 0
        self.last_restart_ms: float | None = None  # failure detected → ready again
        self.last_stop: str | None = None  # how the last worker ended: exited/sigterm/sigkill
        # The signal (in words) that killed the last worker on its own, None when it did not
        # die by a signal; cleared when a worker is ready. /health shows it.
        self.crash: str | None = None
        # The ready worker's kernel_path (llama: extra buffer types, probe, warm-up; spec §3).
        self.kernel_path: dict[str, Any] | None = None
        self._unserved_signal_deaths = 0  # see RestartPolicy.first_step_crash_limit
        self._tracker = RestartTracker(self.policy)
        self._failed_at: float | None = None  # trio clock of the last failure
        self._cancel_scope = trio.CancelScope()
        self._stopped = trio.Event()

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise until ``stop()`` or a fatal failure. Reports started at once: the
        first worker loads in the background while ``/health`` says ``loading``."""
        task_status.started()
        try:
            with self._cancel_scope:
                while True:
                    delay = await self._run_incarnation()
                    if delay is None:  # given up: state, reasons and fatal already set
                        return
                    log.warning("restarting the worker in %.2f s (%s)", delay, self.reason)
                    await trio.sleep(delay)
                    self.restarts += 1
        finally:
            if not self.fatal.is_set():
                self._set("unavailable", "server is shutting down", "shutting down")
            self._stopped.set()

    async def stop(self) -> None:
        """Stop supervising: fail pending work, stop the worker (bounded), wait for it."""
        self._set("unavailable", "server is shutting down", "shutting down")
        self._cancel_scope.cancel()
        await self._stopped.wait()

    async def _run_incarnation(self) -> float | None:
        """Run one worker from spawn to exit. Returns the delay before the next start, or
        None when the supervisor gives up (fatal startup error, crash loop, no restarts)."""
        self._set("loading", "worker is starting", "restarting" if self._failed_at is not None else "starting")
        self.runtime.set_unavailable("worker is loading")
        client: WorkerClient | None = None
        ready_at: float | None = None
        hung = False
        async with trio.open_nursery() as nursery:
            try:
                client = await self.spawn(
                    self.argv, nursery=nursery, env=self.env, ready_timeout=self.ready_timeout)
                self.worker_pid = client.process.pid
                self.on_ready(client.ready)
                ready_at = trio.current_time()
                kernel_path = client.ready.raw.get("kernel_path")
                self.kernel_path = kernel_path if isinstance(kernel_path, dict) else None
                self.crash = None
                self._set("ready", "", "")
                if self._failed_at is not None:
                    self.last_restart_ms = (ready_at - self._failed_at) * 1000
                spec = client.ready.raw.get("speculative")
                # A setting asked for and not in effect is a warning, never a quiet info line.
                level = logging.WARNING if isinstance(spec, dict) and spec.get("off_reason") else logging.INFO
                log.log(level, "worker %d ready (%s)%s%s%s%s", client.process.pid, client.ready.model_name,
                        describe_kv_cache(client.ready.raw), describe_kernel_path(self.kernel_path),
                        describe_speculation(client.ready.raw), describe_stream_interval(client.ready.raw))
                await self.runtime.serve(client)
            except FatalStartupError as exc:
                self._give_up(str(exc), "startup failed")
                return None
            except WorkerError as exc:
                hung = isinstance(exc, WorkerHung)
                served = getattr(client, "generations_done", 0) > 0  # test doubles may lack it
                return self._after_failure(exc, ready_at, served=served)
            except Exception as exc:
                # A bug on our side: report it through /health and the exit status rather
                # than let it escape into the app nursery (which would only disable the
                # lifespan and leave the server answering with no worker behind it).
                log.exception("supervisor failed")
                self._give_up(f"internal error: {exc!r}", "internal error")
                return None
            finally:
                if client is not None:
                    with trio.CancelScope(shield=True):
                        await self._stop_worker(client, hung=hung)
        raise AssertionError("runtime.serve returned without an error")  # pragma: no cover

    def _after_failure(self, exc: WorkerError, ready_at: float | None, *,
                       served: bool = False) -> float | None:
        """Decide, at once, what a failure means for /health: ``loading`` while a restart
        is pending, ``unavailable`` when none will come. ``served``: the worker finished at
        least one generation."""
        now = trio.current_time()
        self._failed_at = now
        log.error("worker failed: %s", exc)
        self.runtime.set_unavailable(str(exc))
        code = exc.returncode if isinstance(exc, WorkerExited) else None
        self.crash = signal_in_words(-code) if code is not None and code < 0 else None
        if isinstance(exc, WorkerExited) and exc.during_startup and code == EXIT_INCOMPATIBLE_CPU:
            self._give_up(f"startup failed: {exc}: this CPU lacks instructions the worker's "
                          "llama.cpp build needs (the worker's log line says which, and how to "
                          "rebuild)", "startup failed")
            return None
        if self.crash is not None and not served:
            self._unserved_signal_deaths += 1
        else:
            self._unserved_signal_deaths = 0
        if self._unserved_signal_deaths >= self.policy.first_step_crash_limit:
            self._give_up(f"startup failed: the worker {describe_exit(code)} before finishing a "
                          f"generation, {self._unserved_signal_deaths} starts in a row", "startup failed")
            return None
        if not self.policy.restart:
            self._give_up(f"{exc}; restarts are disabled", "restarts disabled")
            return None
        delay = self._tracker.failure(at=now, served_for=None if ready_at is None else now - ready_at)
        if delay is None:
            self._give_up(f"crash loop: {len(self._tracker.crash_times)} worker failures in "
                          f"{self.policy.crash_window:g} s; last: {exc}", "crash loop")
            return None
        self._set("loading", f"restarting in {delay:g} s after: {exc}", "restarting")
        return delay

    async def _stop_worker(self, client: WorkerClient, *, hung: bool) -> None:
        if hung:
            how = await client.stop(exit_wait=0, term_wait=self.kill_timeout)
        else:
            how = await client.stop(exit_wait=self.stop_timeout, term_wait=self.kill_timeout)
        code = client.process.returncode
        log.info("worker %d stopped (%s, %s)", client.process.pid, how, describe_exit(code))
        self.last_stop = how
        if how == "exited" and code is not None and code < 0 and self.crash is None:
            # It died by a signal on its own, but the failure seen first was another symptom
            # (e.g. its stdin broke before its stdout's EOF was read): still name the signal.
            self.crash = signal_in_words(-code)

    # -- state -----------------------------------------------------------------------

    def _give_up(self, reason: str, public_reason: str) -> None:
        log.error("giving up on the worker: %s", reason)
        self._set("unavailable", reason, public_reason)
        self.runtime.set_unavailable(reason)
        self.fatal.set()
        self.on_give_up()

    def _set(self, state: str, reason: str, public_reason: str) -> None:
        self.state = state
        self.reason = reason
        self.public_reason = public_reason


def describe_kernel_path(kernel_path: Mapping[str, Any] | None) -> str:
    """The startup log's words for a llama worker's kernel_path ("" when it has none)."""
    if not kernel_path:
        return ""
    enabled = "on" if kernel_path.get("extra_buffers_enabled") else "off"
    # A build with run-time-selected CPU kernels names the variant it loaded (e.g. "zen4").
    variant = kernel_path.get("cpu_variant")
    how = "forced by --cpu-variant / TRIOSERVE_CPU_VARIANT" if kernel_path.get("cpu_variant_forced") \
        else "selected at run time"
    if kernel_path.get("cpu_variant_switched_from"):
        how = f"chosen after a failed probe of {kernel_path['cpu_variant_switched_from']}"
    text = f"; CPU kernels {variant} ({how})" if variant else ""
    text += (f"; CPU extra buffer types {enabled} (setting {kernel_path.get('cpu_extra_buffers')}, "
            f"probe {kernel_path.get('probe')}")
    if kernel_path.get("probe_remembered"):  # a pass read from --probe-memory: no probe process ran
        text += " (remembered)"
    kept = kernel_path.get("extra_buffer_types_kept") or []
    if kept:
        text += f", kept {', '.join(kept)}"
    if kernel_path.get("fallback"):  # which were dropped and why (a failed probe: an AMX fault, say)
        for name, why in (kernel_path.get("extra_buffer_types_dropped") or {}).items():
            text += f", {name} dropped: {why}"
        if not kept:
            text += ", fell back to plain buffers"
    return text + f"; warm-up {kernel_path.get('warmup_ms')} ms)"


# Bytes of a block of 32 KV cache elements per --kv-cache-type (ggml's block sizes; spec §10).
KV_BLOCK_BYTES = {"f16": 64, "q8_0": 34, "q4_0": 18}


def describe_kv_cache(ready: Mapping[str, Any]) -> str:
    """The startup log's words for a worker's KV memory and, for a sliding-window or a hybrid /
    recurrent model, how its state is kept (spec §3, §6.3); "" when the ready record reports
    neither."""
    text = ""
    kv = ready.get("kv_cache_bytes")
    kv_type = ready.get("kv_cache_type", "f16")
    if isinstance(kv, int) and kv > 0 and kv_type in KV_BLOCK_BYTES and kv_type != "f16":
        f16 = kv * KV_BLOCK_BYTES["f16"] // KV_BLOCK_BYTES[kv_type]
        text += (f"; KV cache ~{kv / (1 << 20):.0f} MiB as {kv_type}, "
                 f"{(f16 - kv) / (1 << 20):.0f} MiB less than at f16")
    elif isinstance(kv, int) and kv > 0:
        text += f"; KV cache ~{kv / (1 << 20):.0f} MiB"
    n_swa, mode = ready.get("n_swa"), ready.get("swa_cache")
    if isinstance(n_swa, int) and n_swa > 0 and mode == "full":
        text += f"; sliding window {n_swa} tokens, full-size window cache"
    elif isinstance(n_swa, int) and n_swa > 0 and mode == "checkpoints":
        text += (f"; sliding window {n_swa} tokens, small window cache with "
                 f"{ready.get('checkpoints_per_slot')} checkpoints per slot")
    if ready.get("checkpoint_kind") in ("recurrent", "recurrent+window"):
        # A hybrid/recurrent state cannot be cut back: turns resume from these (spec §6.3).
        text += f"; recurrent state, {ready.get('checkpoints_per_slot')} checkpoints per slot"
    return text


def describe_stream_interval(ready: Mapping[str, Any]) -> str:
    """The startup log's words for token coalescing (spec §3, §4.1): "" when every token is
    written at once (or the ready record does not say)."""
    ms = ready.get("stream_interval_ms")
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or ms <= 0:
        return ""
    return f"; token records written together every {ms:g} ms (a generation's first at once)"


def describe_speculation(ready: Mapping[str, Any]) -> str:
    """The startup log's words for the worker's self-speculative decoding (spec §3, §4.6):
    its mode, the global draft index's bound and the measured step cost; "" when the ready
    record does not say (an older worker)."""
    spec = ready.get("speculative")
    if not isinstance(spec, dict):
        return ""
    if spec.get("mode") != "auto":
        reason = spec.get("off_reason")
        if isinstance(reason, str) and reason:  # asked for, but the worker cannot keep it exact
            return f"; speculative decoding off, although asked for: {reason}"
        return "; speculative decoding off"
    text = f"; speculative decoding auto (drafts up to {spec.get('draft_max')} tokens"
    tokens, size = spec.get("global_index_tokens"), spec.get("global_index_bytes")
    if isinstance(tokens, int) and tokens > 0 and isinstance(size, int):
        text += f", global index {tokens} tokens / {size / (1 << 20):.1f} MiB"
    cost = spec.get("step_cost_ms")
    if isinstance(cost, list) and cost:
        text += ", step ms by tokens " + " ".join(
            f"{n}:{ms:.1f}" for n, ms in cost if isinstance(n, int) and isinstance(ms, (int, float)))
    return text + ")"


PUBLIC_REASONS = ("loading", "restarting", "unavailable")


def public_reason(supervisor: Any) -> str:
    """The short reason /health may show: ``loading``, ``restarting`` or ``unavailable``.

    Uses the supervisor's own ``public_reason`` when it has one; otherwise derives it
    from the state, never from the detailed ``reason`` text (that may quote worker
    output, file paths or pids).
    """
    reason = getattr(supervisor, "public_reason", None)
    if isinstance(reason, str) and reason in PUBLIC_REASONS:
        return reason
    if supervisor.state == "loading":
        restarting = supervisor.restarts > 0 or supervisor.reason.startswith("restarting")
        return "restarting" if restarting else "loading"
    return "unavailable"


__all__ = ["PUBLIC_REASONS", "FatalStartupError", "RestartPolicy", "RestartTracker", "Supervisor",
           "WorkerHung", "describe_kernel_path", "public_reason"]
