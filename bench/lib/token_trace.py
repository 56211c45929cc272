"""Where a streamed token waits inside trioserve: a trioserve child process that notes, per
generation, when the worker reader handed each token to the generation's mailbox (``push``:
the control plane's read of the worker's pipe) and when the request handler took text out of
it (``take``: the handler woke). The fleet benchmark compares these with the client's own
arrival times (``time.perf_counter`` is CLOCK_MONOTONIC: one clock for every process).

    python -m bench.lib.token_trace TRACE.json serve --engine fake ...

runs ``trioserve serve ...`` and writes ``{marker: {"push": [t, ...], "take": [[t, chars],
...]}}`` to TRACE.json when the server exits; ``marker`` is the first ``stream N`` of the
generation's prompt (the client puts its stream number in its message). The cost is one
``perf_counter`` and one list append per token and per take. The garbage collector's passes
go under ``"_gc"``: ``[generation, start, seconds]`` each (a pause stops every task).
"""

from __future__ import annotations

import atexit
import gc
import json
import re
import sys
import time
from typing import Any

from trioserve.worker.generation import Generation

_MARKER = re.compile(r"stream \d+")


def install(path: str) -> None:
    """Wrap ``Generation.push`` and ``Generation.receive``; write the traces at exit."""
    traces: dict[str, dict[str, list[Any]]] = {}
    clock = time.perf_counter
    push, receive = Generation.push, Generation.receive

    def trace_of(gen: Generation) -> dict[str, list[Any]]:
        found = gen.__dict__.get("_bench_trace")
        if found is None:
            match = _MARKER.search(gen.params.prompt)
            found = {"push": [], "take": []}
            gen.__dict__["_bench_trace"] = found
            if match:
                traces[match.group(0)] = found
        return found

    def traced_push(self: Generation, text: str) -> None:
        trace_of(self)["push"].append(clock())
        push(self, text)

    async def traced_receive(self: Generation) -> str | None:
        piece = await receive(self)
        if piece:
            trace_of(self)["take"].append((clock(), len(piece)))
        return piece

    Generation.push = traced_push  # type: ignore[method-assign]
    Generation.receive = traced_receive  # type: ignore[method-assign]

    collections: list[list[float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            collections.append([info["generation"], started[0], clock() - started[0]])

    gc.callbacks.append(on_gc)

    def dump() -> None:
        with open(path, "w") as f:
            json.dump({**traces, "_gc": collections}, f)

    atexit.register(dump)


def main() -> int:
    install(sys.argv[1])
    from trioserve.cli import main as cli_main
    return cli_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
