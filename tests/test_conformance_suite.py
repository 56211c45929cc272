"""Run the black-box conformance suite (conformance/) against trioserve, twice: on the
fake worker with exact scripted checks, and on the real embedded model with shape checks.

Each run starts `trioserve serve` on a free loopback port through the suite's own
launcher and fails if any contract point fails; the per-area table is printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_conformance(engine: str) -> None:
    result = subprocess.run([sys.executable, "-m", "conformance", "--serve-trioserve", engine],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(result.stdout[-6000:])
    assert result.returncode == 0, f"conformance ({engine}) failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"


def test_conformance_fake_engine_exact():
    run_conformance("fake")


@pytest.mark.slow
def test_conformance_real_model():
    run_conformance("llama")
