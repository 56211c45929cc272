"""Summary printer: run the conformance suite and print a per-area and per-point markdown table.

    python -m conformance --base-url http://127.0.0.1:8000/v1 --model NAME [--scripted]
    python -m conformance --serve-trioserve fake|llama
    python -m conformance --serve-trioserve executorch --pte MODEL.pte   (tokenizer.json beside it)
    python -m conformance --serve-llama-server PATH/llama-server --gguf MODEL.gguf

Exit status: 0 if nothing failed, 1 if any point failed, 2 if the server could not be started.
Arguments after ``--`` go to pytest (e.g. ``-- -k streaming -x``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from conformance import AREAS, SPEC_VERSION
from conformance._support import DEFAULT_SCRIPT, HERE

DEFAULT_IDS = {"fake": "fake", "llama": "SmolLM2-135M-Instruct"}


# ---------------------------------------------------------------------------------------------
# Result collection


class Collector:
    """pytest plugin: one row per test (area, spec section, point, outcome, note)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}
        self.order: list[str] = []

    def pytest_collection_modifyitems(self, items):
        for item in items:
            area = next((a for a in AREAS if item.get_closest_marker(a)), "?")
            spec = item.get_closest_marker("spec")
            doc = (getattr(item.function, "__doc__", None) or item.name).strip().splitlines()[0]
            param = item.nodeid.split("[", 1)[1][:-1] if "[" in item.nodeid else ""
            self.rows[item.nodeid] = {
                "area": area,
                "spec": spec.args[0] if spec else "",
                "name": item.originalname if hasattr(item, "originalname") else item.name,
                "param": param,
                "doc": doc,
                "outcome": None,
                "note": "",
            }
            self.order.append(item.nodeid)

    def pytest_runtest_logreport(self, report):
        row = self.rows.get(report.nodeid)
        if row is None:
            return
        for k, v in report.user_properties:
            if k == "note":
                row["note"] = str(v)
        if report.skipped:
            row["outcome"] = "skip"
            lr = report.longrepr
            reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
            row["note"] = reason.removeprefix("Skipped: ")
        elif report.failed:
            row["outcome"] = "FAIL" if report.when == "call" else "ERROR"
            row["note"] = _first_line(report)
        elif report.when == "call" and row["outcome"] is None:
            row["outcome"] = "pass"


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    msg = crash.message if crash is not None else str(report.longrepr)
    msg = msg.replace("\n", " ").replace("|", "\\|")
    for prefix in ("AssertionError: ", "Failed: "):
        msg = msg.removeprefix(prefix)
    msg = msg.split(" assert ")[0]
    return msg[:160] + ("…" if len(msg) > 160 else "")


def render(col: Collector, title: str) -> str:
    lines = [f"### {title}", "", "| area | passed | failed | skipped |", "|---|---:|---:|---:|"]
    tot = [0, 0, 0]
    for area in AREAS:
        rows = [r for r in col.rows.values() if r["area"] == area]
        p = sum(r["outcome"] == "pass" for r in rows)
        f = sum(r["outcome"] in ("FAIL", "ERROR") for r in rows)
        s = sum(r["outcome"] == "skip" for r in rows)
        tot = [tot[0] + p, tot[1] + f, tot[2] + s]
        lines.append(f"| {area} | {p} | {f} | {s} |")
    lines.append(f"| **total** | **{tot[0]}** | **{tot[1]}** | **{tot[2]}** |")
    notes = {r["note"] for r in col.rows.values()}
    if col.rows and all(r["outcome"] == "skip" for r in col.rows.values()) and len(notes) == 1:
        return "\n".join(lines + ["", f"All points skipped: {notes.pop()}"]) + "\n"
    lines += ["", "| area | § | point | case | result | note |", "|---|---|---|---|---|---|"]
    for nodeid in col.order:
        r = col.rows[nodeid]
        outcome = r["outcome"] or "not run"
        doc = r["doc"].replace("|", "\\|")
        param = r["param"].replace("|", "\\|")
        lines.append(f"| {r['area']} | {r['spec']} | {doc} | {param} | {outcome} | {r['note']} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Starting a server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before it was ready")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code} {r.text[:120]!r}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.5)
    raise RuntimeError(f"{url} not 200 within {timeout:.0f}s (last: {last})")


class StartFailed(Exception):
    """The server to test did not become ready."""


@contextmanager
def served(cmd: list[str], env: dict[str, str], health_url: str, timeout: float, log_path: Path):
    print(f"conformance: starting {' '.join(cmd)}", file=sys.stderr)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        try:
            wait_health(health_url, proc, timeout)
        except RuntimeError as e:
            log.flush()
            tail = log_path.read_bytes()[-3000:].decode("utf-8", "replace")
            print(f"conformance: {e}\n--- server log tail ({log_path}) ---\n{tail}", file=sys.stderr)
            raise StartFailed from None
        print(f"conformance: server ready ({health_url}); log in {log_path}", file=sys.stderr)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the server's own pid: it stops its workers in order
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                print("conformance: server ignored SIGTERM for 15 s; killing its process group", file=sys.stderr)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        log.close()


def trioserve_cmd(host: str, port: int) -> list[str]:
    exe = Path(sys.executable).with_name("trioserve")
    if exe.exists() or shutil.which("trioserve"):
        return [str(exe) if exe.exists() else "trioserve", "serve", "--host", host, "--port", str(port)]
    return [sys.executable, "-m", "hypercorn", "trioserve.app:app", "--worker-class", "trio", "--bind", f"{host}:{port}"]


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL"), help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL"), help="served model id (default: the first listed)")
    ap.add_argument("--scripted", action="store_true", help="the server is trioserve's fake engine on conformance/script.json")
    ap.add_argument("--serve-trioserve", choices=["fake", "llama", "executorch"],
                    help="start trioserve on a free loopback port")
    ap.add_argument("--pte", help="the .pte for --serve-trioserve executorch (its tokenizer.json beside it)")
    ap.add_argument("--serve-llama-server", metavar="BIN", help="start llama.cpp's llama-server binary on a free loopback port")
    ap.add_argument("--gguf", help="model file for --serve-llama-server")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for the started server (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=120.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    ap.add_argument("--title", help="heading of the printed table")
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)

    env = dict(os.environ)
    env["CONFORMANCE_TIMEOUT"] = str(args.timeout)
    server_cm = None
    log_path = Path(tempfile.mkdtemp(prefix="conformance-")) / "server.log"
    if args.serve_trioserve or args.serve_llama_server:
        host, port = "127.0.0.1", free_port()
        args.base_url = f"http://{host}:{port}/v1"
        senv = dict(os.environ)
        if args.serve_trioserve:
            mode = args.serve_trioserve
            senv.update({"TRIOSERVE_ENGINE": mode, "TRIOSERVE_HOST": host, "TRIOSERVE_PORT": str(port)})
            # The dev loop's freshly built workers (tests/worker_process/conftest.py honours the same
            # variable), rather than the copy a possibly older `pip install` left in the package.
            dev_dir = os.environ.get("TRIOSERVE_WORKER_DIR")
            if dev_dir and "TRIOSERVE_WORKER_BIN" not in senv:
                senv["TRIOSERVE_WORKER_BIN"] = str(Path(dev_dir) / f"trioserve-{mode}-worker")
            if mode == "fake":
                senv["TRIOSERVE_FAKE_SCRIPT"] = str(DEFAULT_SCRIPT)
                args.scripted = True
            if mode == "executorch":
                if not args.pte:
                    ap.error("--serve-trioserve executorch needs --pte")
                pte = Path(args.pte).resolve()
                senv.update({"TRIOSERVE_MODEL_PATH": str(pte), "TRIOSERVE_TOKENIZER_PATH": str(pte.parent / "tokenizer.json")})
                args.model = args.model or pte.stem
            args.model = args.model or DEFAULT_IDS[mode]
            cmd = trioserve_cmd(host, port) + args.server_arg
        else:
            if not args.gguf:
                ap.error("--serve-llama-server needs --gguf")
            args.model = args.model or Path(args.gguf).stem.split(".")[0]
            cmd = [args.serve_llama_server, "-m", args.gguf, "-a", args.model, "--host", host, "--port", str(port),
                   "-t", "2", "-c", "2048"] + args.server_arg
        server_cm = served(cmd, senv, f"http://{host}:{port}/health", args.startup_timeout, log_path)
    if not args.base_url:
        ap.error("give --base-url (or OPENAI_BASE_URL), or --serve-trioserve / --serve-llama-server")

    env_keys = {"OPENAI_BASE_URL": args.base_url, "CONFORMANCE_SCRIPTED": "1" if args.scripted else "0",
                "CONFORMANCE_TIMEOUT": str(args.timeout)}
    if args.model:
        env_keys["OPENAI_MODEL"] = args.model
    os.environ.update(env_keys)

    col = Collector()
    t0 = time.monotonic()
    pytest_args = ["-q", "-p", "no:cacheprovider", "-c", str(HERE / "pytest.ini"), "--rootdir", str(HERE.parent),
                   str(HERE)] + extra
    if server_cm is not None:
        try:
            with server_cm:
                rc = pytest.main(pytest_args, plugins=[col])
        except StartFailed:
            return 2
    else:
        rc = pytest.main(pytest_args, plugins=[col])
    took = time.monotonic() - t0
    mode = "scripted, exact checks" if args.scripted else "real model, shape checks"
    title = args.title or f"Conformance (spec v{SPEC_VERSION}): {args.base_url} — model `{args.model}` ({mode})"
    table = render(col, title) + f"\n_{len(col.rows)} points in {took:.0f} s._\n"
    print()
    print(table)
    if args.out:
        Path(args.out).write_text(table, encoding="utf-8")
    failed = any(r["outcome"] in ("FAIL", "ERROR") for r in col.rows.values())
    if rc not in (0, 1, 5) and not failed:  # usage error, internal error, interrupted
        return int(rc)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
