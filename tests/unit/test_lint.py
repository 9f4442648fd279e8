"""The code passes the project's linter, formatter and type checker (ruff and mypy, configured in
pyproject.toml): what CI runs is what a contributor runs before a commit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = ["elaswave", "tests", "bench", "examples"]


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert found, "ruff is part of the test extra (pip install -e '.[test]')"
    return [found]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command: list[str]) -> None:
    r = subprocess.run([*_ruff(), *command, *CODE], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_mypy() -> None:
    """The package type-checks (``[tool.mypy]``): no error, and no suppression left unused."""
    r = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
