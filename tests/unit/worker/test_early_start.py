"""Workers started at launch, before the HTTP stack is imported (worker/early_start.py): which
servers start them, that a supervisor's first spawn takes the very process, and that nobody's
leftovers survive (real fake-engine workers)."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import textwrap
import time

import trio

from trioserve.config import Settings
from trioserve.registry import RegistryError, build_registry
from trioserve.worker.early_start import EarlyStarts
from trioserve.worker.launch import worker_argv, worker_env

from tests.http.connections.test_cancellation import process_gone


def full_env(spec, settings, index):
    return {**os.environ, **worker_env(spec, settings, index)}


def test_a_lone_model_starts_each_of_its_workers_and_close_kills_what_nobody_took():
    settings = Settings(engine="fake", workers=2)
    registry = build_registry(settings)
    with EarlyStarts.start(registry, settings) as early:
        pids = early.pids
        assert len(pids) == 2 and all(not process_gone(pid) for pid in pids)
        spec = registry.specs[0]
        taken = early.take(spec.id, 1, worker_argv(spec, settings), full_env(spec, settings, 1))
        assert taken is not None and early.pids == [pids[0]]
    assert process_gone(pids[0])  # killed and reaped at the end of the block
    assert not process_gone(taken.pid)  # the taker's now
    taken.kill()
    assert process_gone(taken.pid)


def test_several_models_or_a_model_over_the_budget_start_nothing(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text("[[models]]\nid = 'a'\nengine = 'fake'\n\n[[models]]\nid = 'b'\nengine = 'fake'\n")
    several = Settings(models_config=str(config))
    with EarlyStarts.start(build_registry(several), several) as early:
        assert early.pids == []
    # Over the budget the server refuses to start (worker/lifecycle.py): nothing may load first.
    tiny = Settings(engine="fake", memory_budget_bytes=1)
    with EarlyStarts.start(build_registry(tiny), tiny) as early:
        assert early.pids == []


def test_a_process_started_for_another_command_line_is_killed_not_adopted():
    settings = Settings(engine="fake")
    registry = build_registry(settings)
    spec = registry.specs[0]
    with EarlyStarts.start(registry, settings) as early:
        [pid] = early.pids
        argv = worker_argv(spec, settings) + ["--slots", "3"]
        assert early.take(spec.id, 0, argv, full_env(spec, settings, 0)) is None
        assert process_gone(pid)
        assert early.take(spec.id, 0, worker_argv(spec, settings), full_env(spec, settings, 0)) is None


async def test_the_first_spawn_takes_the_started_process_and_a_restart_spawns_afresh():
    settings = Settings(engine="fake")
    registry = build_registry(settings)
    spec = registry.specs[0]
    argv, env = worker_argv(spec, settings), full_env(spec, settings, 0)
    with EarlyStarts.start(registry, settings) as early:
        [pid] = early.pids
        spawn = early.spawn_for(spec.id, 0)
        async with trio.open_nursery() as nursery:
            first = await spawn(argv, nursery=nursery, env=env, ready_timeout=30)
            assert first.process.pid == pid and first.ready.capacity >= 1
            assert early.pids == []
            second = await spawn(argv, nursery=nursery, env=env, ready_timeout=30)
            assert second.process.pid != pid
            for client in (first, second):
                await client.stop(exit_wait=2.0, term_wait=2.0)
    assert process_gone(pid)


def test_a_startup_error_after_the_early_start_kills_the_started_worker(monkeypatch, capsys):
    """The app is built after the early start; a model it refuses (exit status 2) takes the
    early worker with it."""
    from trioserve import cli
    from trioserve.http import application

    started: list[int] = []
    real_start = EarlyStarts.start

    def start(registry, settings):
        early = real_start(registry, settings)
        started.extend(early.pids)
        return early

    def refuse(*args, **kwargs):
        assert len(started) == 1 and not process_gone(started[0])  # loading while the app is built
        raise RegistryError("model 'fake': refused for the test")

    monkeypatch.setattr(EarlyStarts, "start", staticmethod(start))
    monkeypatch.setattr(application, "create_quart_app", refuse)
    assert cli.main(["serve", "--engine", "fake", "--port", "0"]) == 2
    assert "refused for the test" in capsys.readouterr().err
    assert process_gone(started[0])


SERVE_AND_REPORT = textwrap.dedent("""
    import sys
    from trioserve.worker import early_start

    real_start = early_start.EarlyStarts.start

    def start(registry, settings):
        http_stack = sorted(m for m in ("quart", "quart_trio", "hypercorn", "werkzeug") if m in sys.modules)
        early = real_start(registry, settings)
        print("early", early.pids, "http stack imported:", http_stack, flush=True)
        return early

    early_start.EarlyStarts.start = staticmethod(start)
    from trioserve.cli import main
    sys.exit(main(["serve", "--engine", "fake", "--port", "0"]))
""")


def read_until(stream, marker: str, deadline_s: float) -> str:
    """What ``stream`` (a pipe) gave until a line with ``marker`` (bounded)."""
    output = ""
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        end = time.monotonic() + deadline_s
        while marker not in output:
            left = end - time.monotonic()
            assert left > 0 and selector.select(left), f"no {marker!r} within {deadline_s} s:\n{output}"
            data = os.read(stream.fileno(), 65536).decode()
            assert data, f"the server exited before {marker!r}:\n{output}"
            output += data
    return output


def test_serve_starts_the_worker_before_the_http_stack_and_serves_with_that_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    server = subprocess.Popen([sys.executable, "-c", SERVE_AND_REPORT], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env)
    try:
        output = read_until(server.stdout, " ready (", 60)
    finally:
        server.terminate()
        rest, _ = server.communicate(timeout=30)
    lines = output.splitlines()
    early = next(line for line in lines if line.startswith("early"))
    assert "http stack imported: []" in early, output
    pid = int(early.split("[", 1)[1].split("]", 1)[0])
    assert f"taking the process started at launch (pid {pid})" in output
    assert f"worker {pid} ready (" in output
    assert server.returncode == 0, rest.decode()
