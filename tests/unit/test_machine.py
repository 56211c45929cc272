"""trioserve/machine.py: the CPUs this process may use (affinity capped by a cgroup quota, v1 and
v2, unreadable meaning unlimited)."""

from pathlib import Path

from trioserve import machine
from trioserve.machine import usable_cpus


def test_usable_cpus_is_the_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda: None)
    assert usable_cpus() == 4
    monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda: 2.5)
    assert usable_cpus() == 2
    monkeypatch.setattr(machine, "cgroup_cpu_quota", lambda: 0.5)
    assert usable_cpus() == 1


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota(tmp_path):
    proc = tmp_path / "proc-cgroup"
    _write(proc, "0::/app.slice/srv\n")
    _write(tmp_path / "fs/app.slice/srv/cpu.max", "150000 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path / "fs", proc) == 1.5
    _write(tmp_path / "fs/app.slice/srv/cpu.max", "max 100000\n")
    assert machine.cgroup_cpu_quota(tmp_path / "fs", proc) is None


def test_cgroup_v1_quota(tmp_path):
    proc = tmp_path / "proc-cgroup"
    _write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    group = tmp_path / "fs/cpu,cpuacct/docker/abc"
    _write(group / "cpu.cfs_quota_us", "200000\n")
    _write(group / "cpu.cfs_period_us", "100000\n")
    assert machine.cgroup_cpu_quota(tmp_path / "fs", proc) == 2.0
    _write(group / "cpu.cfs_quota_us", "-1\n")
    assert machine.cgroup_cpu_quota(tmp_path / "fs", proc) is None


def test_cgroup_quota_unreadable_means_unlimited(tmp_path):
    assert machine.cgroup_cpu_quota(tmp_path / "fs", tmp_path / "missing") is None
    proc = tmp_path / "proc-cgroup"
    _write(proc, "0::/\n")  # v2 path without a cpu.max file (the root cgroup has none)
    assert machine.cgroup_cpu_quota(tmp_path / "fs", proc) is None
    _write(proc, "garbage\n0::/\n")
    assert machine.cgroup_cpu_quota(tmp_path / "fs", proc) is None
