"""trioserve's optional dependencies, computed at build time (scikit-build-core dynamic metadata).

Every extra is listed in pyproject.toml (``[tool.scikit-build.metadata.optional-dependencies]``)
and passed through unchanged, except ``executorch`` (also added to ``test``: the suite covers
that engine): it names the ``trioserve-executorch``
distribution, and in a source checkout that distribution is not on any index but in
``packages/executorch_worker``. So where that folder exists the extra points at it by a
``file:`` URL (``pip install '.[executorch]'`` then builds the ExecuTorch worker in the same
command); elsewhere (an sdist) it pins the same version. ``TRIOSERVE_EXECUTORCH_REQUIREMENT``
overrides both (e.g. ``trioserve-executorch==0.1.0`` when building a wheel to publish, whose
metadata must not hold a path of the build machine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path("packages") / "executorch_worker"


def executorch_requirement(version: str) -> str:
    override = os.environ.get("TRIOSERVE_EXECUTORCH_REQUIREMENT")
    if override:
        return override
    # The build backend runs in the project's root folder (PEP 517).
    package = Path.cwd() / PACKAGE_DIR
    if (package / "pyproject.toml").is_file():
        return f"trioserve-executorch @ {package.resolve().as_uri()}"
    return f"trioserve-executorch=={version}"


def dynamic_metadata(field: str, settings: dict[str, Any]) -> dict[str, list[str]]:
    if field != "optional-dependencies":
        raise ValueError(f"trioserve_extras provides optional-dependencies only, not {field!r}")
    extras = {name: list(reqs) for name, reqs in settings.items() if name != "executorch-version"}
    engine = executorch_requirement(str(settings["executorch-version"]))
    extras["executorch"] = [engine]
    # The test suite covers every engine, so the test extra installs this one too.
    extras["test"] = [*extras.get("test", []), engine]
    return extras
