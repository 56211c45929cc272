"""CPU settings: the worker's thread count and OpenMP wait (CPU contention)."""


import pytest

from trioserve import config
from trioserve.cli import build_parser
from trioserve.config import Settings
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
