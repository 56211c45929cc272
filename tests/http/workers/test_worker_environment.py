"""The worker process really runs with the CPU settings' environment."""

from pathlib import Path

from ..conftest import live_server


def worker_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


async def test_worker_gets_the_spin_count(tmp_path):
    async with live_server(tmp_path, script=["x"], spin_count="1234") as srv:
        assert worker_environ(srv.pool.worker_pid)["GOMP_SPINCOUNT"] == "1234"


async def test_inherit_leaves_the_servers_own_value(tmp_path, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")
    async with live_server(tmp_path, script=["x"], spin_count="inherit") as srv:
        assert worker_environ(srv.pool.worker_pid)["GOMP_SPINCOUNT"] == "77"
