"""Time to first token of a model that is not loaded, against the model's own start-up.

    python -m bench.model_load_bench [--runs 3] [--threads 2] [--write]

For SmolLM2-135M (the embedded model) and Gemma 3 270M (the test extra), interleaved run by run
so machine noise hits each alike, one streamed chat request of 8 tokens each time:

* **own start-up**: ``trioserve serve`` with that model alone, from spawning the server to the
  first token of its first request (sent once ``/health`` is ready): what a server per model
  costs to bring up.
* **on demand, page cache warm**: a server with both models (no pinned ones, no budget
  pressure); the model is unloaded (``POST /v1/models/{id}/unload``) and then asked for: request
  sent → first token, its load included.
* **on demand, page cache cold**: the same after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the
  model's file, which drops its clean cached pages (none are mapped once it is unloaded), so
  the load reads the file again. The table says whether the call was permitted.
* **loaded**: the same request once the model is loaded (the baseline a load adds to).
* **llama-server router** (with ``--llama-server BIN``, when that build has ``--models-dir``):
  ``llama-server --models-dir DIR --models-max 1`` (one child process per model, LRU by count),
  the same request for a model while the other one is loaded, so it evicts it and loads: request
  sent → first token.

Prints a table and a JSON line; ``--write`` records the table in docs/benchmarks/model-load.md with the
machine, load and date. Never asserts on time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.lib import REPO
from bench.lib.client import stream_chat
from bench.lib.machine import machine
from bench.lib.markdown import replace_section
from bench.lib.servers import ServerProcess
from bench.lib.stats import summary
from testkit import free_port
from testkit.worker_process import gemma_path, model_path

TEMPLATE = REPO / "tests" / "data" / "templates" / "gemma3.jinja"
MODES = ("own start-up", "on demand, warm", "on demand, cold", "loaded", "llama-server router")
BEGIN, END = "<!-- model-load:begin -->", "<!-- model-load:end -->"


def models() -> dict[str, dict[str, Any]]:
    """Each model's file and the settings it needs (the Gemma GGUF has no chat template)."""
    return {"smollm2": {"path": model_path()},
            "gemma3": {"path": gemma_path(), "chat_template": TEMPLATE}}


def body(model: str) -> dict[str, Any]:
    return {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}


def drop_page_cache(path: Path) -> bool:
    """Advise the kernel to drop ``path``'s cached pages; False when not permitted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


async def own_startup(tmp: Path, model_id: str, spec: dict[str, Any], threads: int) -> float:
    """Spawn → first token of a one-model server (module docstring)."""
    settings: dict[str, Any] = {"model_path": spec["path"], "model_id": model_id,
                                "threads": threads, "max_context": 1024, "slots": 1}
    if "chat_template" in spec:
        settings["chat_template"] = spec["chat_template"]
    t0 = time.perf_counter()
    server = ServerProcess.trioserve(tmp, **settings)
    try:
        await server.wait_ready()
        result = await stream_chat(server.port, body(model_id))
        return result["t_first"] - t0
    finally:
        server.stop()


def config(tmp: Path) -> Path:
    text = ""
    for model_id, spec in models().items():
        text += f'[[models]]\nid = "{model_id}"\npath = "{spec["path"]}"\ncontext = 1024\nslots = 1\n'
        if "chat_template" in spec:
            text += f'chat_template = "{spec["chat_template"]}"\n'
    path = tmp / "models.toml"
    path.write_text(text)
    return path


async def on_demand(port: int, model_id: str, path: Path, *, cold: bool) -> tuple[float, bool]:
    """Unload ``model_id``, optionally drop its file's pages, then request → first token."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
        response = await client.post(f"/v1/models/{model_id}/unload", json={})
        response.raise_for_status()
    dropped = drop_page_cache(path) if cold else False
    result = await stream_chat(port, body(model_id))
    return result["t_first"] - result["t_sent"], dropped


async def loaded_ttft(port: int, model_id: str) -> float:
    await stream_chat(port, body(model_id))  # loads it if it is not
    result = await stream_chat(port, body(model_id))
    return result["t_first"] - result["t_sent"]


ROUTER_TIMEOUT_S = 180.0


async def router_ttft(port: int, model_id: str) -> float:
    """Request → first token on the router; NaN (counted, shown as "no answer") when it gives no
    answer within ROUTER_TIMEOUT_S or fails."""
    with trio.move_on_after(ROUTER_TIMEOUT_S):
        try:
            result = await stream_chat(port, body(model_id))
        except (OSError, RuntimeError):
            return math.nan
        return float(result["t_first"] - result["t_sent"])
    return math.nan


def llama_router(tmp: Path, binary: str, threads: int) -> ServerProcess:
    """llama-server in router mode over a folder linking both models (ids: the file names)."""
    folder = tmp / "router-models"
    folder.mkdir()
    for model_id, spec in models().items():
        (folder / f"{model_id}.gguf").symlink_to(spec["path"])
    port = free_port()
    argv = [binary, "--models-dir", str(folder), "--models-max", "1", "--host", "127.0.0.1",
            "--port", str(port), "-t", str(threads), "-c", "1024", "-np", "1"]
    return ServerProcess(argv, port, "llama-server", tmp / "llama-server-router.log")


async def run(runs: int, threads: int, llama_server: str | None = None) -> dict[str, Any]:
    specs = models()
    times: dict[str, dict[str, list[float]]] = {m: {mode: [] for mode in MODES} for m in specs}
    dropped: list[bool] = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        server = ServerProcess.trioserve(tmp, models_config=config(tmp), threads=threads)
        router = llama_router(tmp, llama_server, threads) if llama_server else None
        try:
            await server.wait_ready()
            if router is not None:
                await router.wait_ready()
            for _ in range(runs):
                for model_id, spec in specs.items():
                    times[model_id]["own start-up"].append(
                        await own_startup(tmp, model_id, spec, threads))
                    seconds, _ = await on_demand(server.port, model_id, spec["path"], cold=False)
                    times[model_id]["on demand, warm"].append(seconds)
                    seconds, ok = await on_demand(server.port, model_id, spec["path"], cold=True)
                    times[model_id]["on demand, cold"].append(seconds)
                    dropped.append(ok)
                    times[model_id]["loaded"].append(await loaded_ttft(server.port, model_id))
                    if router is not None:  # the other model is the one loaded: this one loads
                        times[model_id]["llama-server router"].append(
                            await router_ttft(router.port, model_id))
        finally:
            server.stop()
            if router is not None:
                router.stop()
    failures = sum(math.isnan(x) for t in times.values() for x in t["llama-server router"])
    clean = {m: {mode: [x for x in v if not math.isnan(x)] for mode, v in t.items()}
             for m, t in times.items()}
    return {"times": {m: {mode: summary(v) for mode, v in t.items()} for m, t in clean.items()},
            "router_failures": failures,
            "fadvise_permitted": all(dropped), "runs": runs, "threads": threads}


def table(res: dict[str, Any]) -> list[str]:
    lines = ["| model | what | median s | min s | max s | runs |", "|---|---|---|---|---|---|"]
    for model_id, modes in res["times"].items():
        for mode, v in modes.items():
            if not v["n"]:
                continue
            lines.append(f"| {model_id} | {mode} | {v['median']:.2f} | {v['min']:.2f} | "
                         f"{v['max']:.2f} | {v['n']} |")
    failed = res.get("router_failures", 0)
    if failed:
        lines.append(f"\nllama-server router: {failed} request(s) without an answer within "
                     f"{ROUTER_TIMEOUT_S:g} s (left out of the figures above).")
    return lines


def record(res: dict[str, Any], lines: list[str]) -> None:
    info = machine()
    load = os.getloadavg()
    block = "\n".join([
        BEGIN, "## Loading a model on demand (bench/model_load_bench.py)", "",
        f"{datetime.date.today()}, {info['cpu']}, {info['cores']} cores (shared), load average "
        f"{load[0]:.1f} at the end, {res['threads']} model threads, `--cpu-extra-buffers auto` "
        f"(the default: a probe process before each load). Request → first token of an 8-token "
        f"streamed chat request; own start-up is spawn → first token of a one-model server. "
        f"posix_fadvise(DONTNEED) permitted: {res['fadvise_permitted']}.", "", *lines, "", END])
    replace_section(REPO / "docs" / "benchmarks" / "model-load.md", BEGIN, END, block)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="record the table in docs/benchmarks/model-load.md")
    ap.add_argument("--llama-server", help="a llama-server binary with router mode (--models-dir)")
    args = ap.parse_args(argv)
    res = trio.run(run, args.runs, args.threads, args.llama_server)
    lines = table(res)
    print("\n".join(lines))
    print(json.dumps(res))
    if args.write:
        record(res, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
