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

import trio
from hypercorn.config import Config

from trioserve.http.application import asgi_app, create_quart_app
from trioserve.config import Settings, SettingsError
from trioserve.http.guard import check_startup
from trioserve.http.server import bind_address, serve
from trioserve.registry import RegistryError

log = logging.getLogger("trioserve")

EXIT_WORKER_FAILED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trioserve", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser(
        "serve", help="serve the OpenAI-compatible API",
        description="Serve the OpenAI-compatible chat API. Every flag can also be set with the "
                    "TRIOSERVE_* environment variable shown; flags win.")
    Settings.add_arguments(serve_cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings.from_env().with_overrides(args)
        settings.check_engine()
        check_startup(settings)
    except (SettingsError, ValueError) as exc:  # a usage error, like argparse's
        print(f"trioserve: {exc}", file=sys.stderr)
        return 2
    try:
        return trio.run(serve_forever, settings)
    except RegistryError as exc:  # the models, checked as the app is built: nothing started yet
        print(f"trioserve: {exc}", file=sys.stderr)
        return 2


async def serve_forever(settings: Settings, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> int:
    """Serve until SIGTERM/SIGINT or a fatal worker failure; return the exit status."""
    quart_app = create_quart_app(settings)
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
                    shutdown_trigger=shutdown.wait, task_status=task_status)
        nursery.cancel_scope.cancel()
    return EXIT_WORKER_FAILED if host.fatal else 0


if __name__ == "__main__":
    sys.exit(main())
