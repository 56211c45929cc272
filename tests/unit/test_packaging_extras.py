"""trioserve's extras as its build computes them (packages/build_meta/trioserve_extras.py): the
`executorch` extra, and the `test` extra, name the trioserve-executorch distribution by path in a
checkout (so one `pip install '.[executorch]'` builds the ExecuTorch worker) and by version
elsewhere."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

from testkit import REPO


def load_provider():
    spec = importlib.util.spec_from_file_location("trioserve_extras", REPO / "packages" / "build_meta" / "trioserve_extras.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings() -> dict:
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["scikit-build"]["metadata"]
    return {k: v for k, v in table["optional-dependencies"].items() if k not in ("provider", "provider-path")}


def test_in_a_checkout_the_extras_point_at_the_worker_distribution_by_path(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("TRIOSERVE_EXECUTORCH_REQUIREMENT", raising=False)
    extras = load_provider().dynamic_metadata("optional-dependencies", settings())
    want = f"trioserve-executorch @ {(REPO / 'packages' / 'executorch_worker').resolve().as_uri()}"
    assert extras["executorch"] == [want]
    assert extras["test"][-1] == want and "pytest>=8" in extras["test"]
    assert "executorch-version" not in extras
    # The folder named is a buildable project of that name and version.
    project = tomllib.loads((REPO / "packages" / "executorch_worker" / "pyproject.toml").read_text())
    assert project["project"]["name"] == "trioserve-executorch"
    assert project["project"]["version"] == settings()["executorch-version"]
    assert "executorch==1.5.1" in project["build-system"]["requires"]


def test_outside_a_checkout_the_extra_pins_the_version(monkeypatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRIOSERVE_EXECUTORCH_REQUIREMENT", raising=False)
    extras = load_provider().dynamic_metadata("optional-dependencies", settings())
    assert extras["executorch"] == ["trioserve-executorch==0.1.0"]


def test_the_requirement_can_be_overridden(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("TRIOSERVE_EXECUTORCH_REQUIREMENT", "trioserve-executorch==9.9")
    extras = load_provider().dynamic_metadata("optional-dependencies", settings())
    assert extras["executorch"] == ["trioserve-executorch==9.9"]


def test_the_worker_folder_does_not_look_like_a_versioned_archive_to_pip():
    # pip keeps a wheel built from a local folder in its persistent cache when the folder's URL
    # contains name-version (its egg-info pattern), and later installs reuse that wheel without
    # rebuilding: CI once ran a stale ExecuTorch worker from packages/trioserve-executorch.
    egg_info = re.compile(r"([a-z0-9_.]+)-([a-z0-9_.!+-]+)", re.IGNORECASE)
    assert not egg_info.search(load_provider().PACKAGE_DIR.as_posix())
