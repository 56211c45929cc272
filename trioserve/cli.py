"""``trioserve serve``: run the server in this process on hypercorn's trio backend.

Unlike ``hypercorn trioserve.app:app`` (whose supervisor process exits 0 whatever
happened to its worker), this command exits non-zero when no model's workers can be
kept alive (crash loop, unusable model), so an orchestrator's restart policy can act.
SIGTERM and SIGINT drain: the listener closes, in-flight requests get ``--drain-timeout``
seconds to finish and are cancelled after it, then the worker is stopped and reaped.

It also applies what only the process that owns the sockets can: the guard settings are
checked before anything starts (e.g. a non-loopback ``--host`` without an API key is a
startup error, exit status 2), and at most ``--max-connections`` connections are served
at once (``trioserve.http.server``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from typing import TYPE_CHECKING

import trio

from trioserve import hub
from trioserve.config import Settings, SettingsError
from trioserve.registry import RegistryError, build_registry
from trioserve.worker.state_files import add_state_command, run_state_command

if TYPE_CHECKING:
    from trioserve.http.application import TrioserveApp

# The HTTP stack (quart, hypercorn, every API) is imported by the commands that serve, so
# ``trioserve pull`` and ``trioserve models`` start in a fraction of the time.

log = logging.getLogger("trioserve")

EXIT_WORKER_FAILED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trioserve", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser(
        "serve", help="serve the OpenAI-compatible API",
        description="Serve the OpenAI-compatible chat API. Every flag can also be set with the "
                    "TRIOSERVE_* environment variable shown; flags win.")
    Settings.add_arguments(serve_cmd)
    pull_cmd = commands.add_parser(
        "pull", help="download a GGUF model from the Hugging Face Hub into its cache",
        description="Download a GGUF from the Hugging Face Hub into the standard cache "
                    "(HF_HOME / HF_HUB_CACHE), resuming an interrupted pull and checking the "
                    "Hub's checksum; HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE apply. Serve it "
                    "with --model-path hf:<repo>[:<quant or file>].")
    pull_cmd.add_argument("ref", nargs="?", metavar="REPO[:QUANT|:FILE.gguf]",
                          help="e.g. bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M (Q4_K_M picks "
                               "the repo's *Q4_K_M*.gguf, any case; a split GGUF pulls every part)")
    pull_cmd.add_argument("--revision", default="main", help="branch, tag or commit [main]")
    pull_cmd.add_argument("--list", action="store_true", help="list the cached models instead")
    commands.add_parser("models", help="list the GGUF models in the Hugging Face cache",
                        description="List the GGUF models in the Hugging Face cache "
                                    "(repo, file, size, the reference that serves it).")
    add_state_command(commands)  # trioserve state list|purge (the persistent state store)
    return parser


def pull(ref: str, revision: str) -> int:
    """``trioserve pull``: print the local path of the pulled GGUF; exit 2 for a malformed
    reference or revision (one line, like argparse's usage errors), 1 on any other failure."""
    try:
        path = hub.resolve_model_ref(ref, offline=hub.offline_from_env(), revision=revision)
    except hub.HubRefError as exc:
        print(f"trioserve: {exc}", file=sys.stderr)
        return 2
    except hub.HubError as exc:
        print(f"trioserve: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def list_models() -> int:
    """``trioserve models``: the cached GGUF models as a table on stdout."""
    models = hub.cached_models()
    if not models:
        print(f"no GGUF models in the Hugging Face cache ({hub.cache_dir()})")
        return 0
    rows = [("REPO", "FILE", "SIZE", "SERVE WITH")] + [
        (m.repo_id, m.filename, hub.size_text(m.size), f"--model-path {m.ref}") for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


def hub_path(ref: str) -> str:
    """The local file of a hub model named in the registry (``--model-path hf:…``, also
    among several, or in ``--models-config``): the registry's path resolver, pulling the
    model (a bar on a terminal, log lines otherwise) if it is not cached.

    Raises:
        ValueError: the reference cannot be resolved (the registry names the model with it).
    """
    try:
        path = hub.resolve_model_ref(ref, offline=hub.offline_from_env())
    except hub.HubError as exc:
        raise ValueError(str(exc)) from None
    log.info("model %s is %s", ref, path)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "state":
        return run_state_command(args)
    if args.command in ("pull", "models"):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        # The Hub client's HTTP library logs every request at INFO: a pull's lines are ours
        # (progress, and a failure's one line), not its requests.
        for name in ("httpx", "httpx2"):  # (huggingface_hub 2.x uses the latter)
            logging.getLogger(name).setLevel(logging.WARNING)
        if args.command == "models" or args.list:
            return list_models()
        if not args.ref:
            print("trioserve: pull needs a REPO[:QUANT|:FILE.gguf] (or --list)", file=sys.stderr)
            return 2
        return pull(args.ref, args.revision)
    return serve_command(args)


def serve_command(args: argparse.Namespace) -> int:
    """``trioserve serve``: check the settings and the models, start a lone model's workers
    (worker/early_start.py: they load while the HTTP stack imports), build the app, serve."""
    from trioserve.http.guard import check_startup
    from trioserve.worker.early_start import EarlyStarts

    try:
        settings = Settings.from_env().with_overrides(args)
        settings.check_engine()
        check_startup(settings)
        # Resolving the registry's hub models (``hf:`` paths, hub_path) may download files:
        # done here, before the event loop starts, where blocking is harmless.
        registry = build_registry(settings, resolve_path=hub_path)
    except (SettingsError, ValueError, RegistryError) as exc:  # a usage error, like argparse's
        print(f"trioserve: {exc}", file=sys.stderr)
        return 2
    with EarlyStarts.start(registry, settings) as early:
        from trioserve.http.application import create_quart_app

        try:
            quart_app = create_quart_app(settings, registry=registry, early=early)
        except RegistryError as exc:  # the models, checked as the app is built: nothing served yet
            print(f"trioserve: {exc}", file=sys.stderr)
            return 2
        try:
            return trio.run(serve_forever, quart_app)
        except* KeyboardInterrupt:
            # A second Ctrl-C while draining (the first one drains): stop now, without a
            # traceback; the workers see their stdin close and exit on their own.
            pass
    print("trioserve: interrupted while draining: stopped without waiting", file=sys.stderr)
    return EXIT_INTERRUPTED


async def serve_forever(quart_app: TrioserveApp, *,
                        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> int:
    """Serve ``quart_app`` (built, not started) until SIGTERM/SIGINT or a fatal worker
    failure; return the exit status."""
    from hypercorn.config import Config

    from trioserve.http.application import asgi_app
    from trioserve.http.server import bind_address, serve

    settings = quart_app.services.settings
    host = quart_app.services.host
    config = Config()
    config.bind = [bind_address(settings.host, settings.port)]
    config.graceful_timeout = settings.drain_timeout
    config.errorlog = "-"
    shutdown = trio.Event()

    async def on_signal() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("received %s: draining", signal.Signals(signum).name)
                shutdown.set()
                return

    async def on_fatal() -> None:
        await host.wait_fatal()
        log.error("no model's workers can be kept alive (%s): shutting down", host.reason)
        shutdown.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signal)
        nursery.start_soon(on_fatal)
        await serve(asgi_app(quart_app), config, max_connections=settings.max_connections,
                    shutdown_trigger=shutdown.wait, freeze_heap=True, task_status=task_status)
        nursery.cancel_scope.cancel()
    return EXIT_WORKER_FAILED if host.fatal else 0


if __name__ == "__main__":
    sys.exit(main())
