"""Shared helpers of the Python package's tests."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cli():
    env = os.environ.get("FLASHREF_CLI")
    if env:
        return env
    for candidate in (ROOT / "build/default/tools/flashref", ROOT / "build/release/tools/flashref"):
        if candidate.is_file():
            return str(candidate)
    return shutil.which("flashref")


@pytest.fixture(scope="session")
def cli():
    """The flashref command-line tool built from this tree (FLASHREF_CLI names another)."""
    path = _cli()
    if path is None:
        pytest.skip("the flashref CLI is not built (scripts/test builds it)")
    return path


def run_cli(cli, *args, expect=0):
    r = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == expect, r.stdout + r.stderr
    return r
