"""CPU settings: the worker's thread count and OpenMP wait (CPU contention)."""

from pathlib import Path

import pytest

from trioserve import config
from trioserve.cli import build_parser
from trioserve.config import Settings, usable_cpus
from trioserve.worker.launch import argv_for, env_for


def test_default_worker_env_bounds_openmp_spinning():
    env = env_for(Settings())
    assert set(env) == {"GOMP_SPINCOUNT"}
    assert int(env["GOMP_SPINCOUNT"]) < 300_000  # below libgomp's own default


def test_spin_count_from_env_flag_and_inherit():
    assert env_for(Settings.from_env({"TRIOSERVE_SPIN_COUNT": "1234"})) == {"GOMP_SPINCOUNT": "1234"}
    assert env_for(Settings.from_env({"TRIOSERVE_SPIN_COUNT": "Inherit"})) == {}
    args = build_parser().parse_args(["serve", "--spin-count", "0"])
    assert env_for(Settings().with_overrides(args)) == {"GOMP_SPINCOUNT": "0"}


@pytest.mark.parametrize("value", ["-1", "lots", "1e5", "", "10k"])
def test_bad_spin_count_names_the_variable(value):
    with pytest.raises(ValueError, match="TRIOSERVE_SPIN_COUNT"):
        Settings.from_env({"TRIOSERVE_SPIN_COUNT": value})


def test_threads_zero_passes_the_usable_cpus(monkeypatch):
    monkeypatch.setattr(config, "usable_cpus", lambda: 3)
    argv = argv_for(Settings(worker_bin="/w", model_path="/m.gguf"))
    assert argv[argv.index("--threads") + 1] == "3"
    argv = argv_for(Settings(worker_bin="/w", model_path="/m.gguf", threads=5))
    assert argv[argv.index("--threads") + 1] == "5"


def test_usable_cpus_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: None)
    assert usable_cpus() == 4
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: 2.5)
    assert usable_cpus() == 2
    monkeypatch.setattr(config, "_cgroup_cpu_quota", lambda: 0.5)
    assert usable_cpus() == 1


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota(tmp_path):
    proc = tmp_path / "proc-cgroup"
    _write(proc, "0::/app.slice/srv\n")
    _write(tmp_path / "fs/app.slice/srv/cpu.max", "150000 100000\n")
    assert config._cgroup_cpu_quota(tmp_path / "fs", proc) == 1.5
    _write(tmp_path / "fs/app.slice/srv/cpu.max", "max 100000\n")
    assert config._cgroup_cpu_quota(tmp_path / "fs", proc) is None


def test_cgroup_v1_quota(tmp_path):
    proc = tmp_path / "proc-cgroup"
    _write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    group = tmp_path / "fs/cpu,cpuacct/docker/abc"
    _write(group / "cpu.cfs_quota_us", "200000\n")
    _write(group / "cpu.cfs_period_us", "100000\n")
    assert config._cgroup_cpu_quota(tmp_path / "fs", proc) == 2.0
    _write(group / "cpu.cfs_quota_us", "-1\n")
    assert config._cgroup_cpu_quota(tmp_path / "fs", proc) is None


def test_cgroup_quota_unreadable_means_unlimited(tmp_path):
    assert config._cgroup_cpu_quota(tmp_path / "fs", tmp_path / "missing") is None
    proc = tmp_path / "proc-cgroup"
    _write(proc, "0::/\n")  # v2 path without a cpu.max file (the root cgroup has none)
    assert config._cgroup_cpu_quota(tmp_path / "fs", proc) is None
    _write(proc, "garbage\n0::/\n")
    assert config._cgroup_cpu_quota(tmp_path / "fs", proc) is None
