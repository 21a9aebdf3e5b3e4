"""The architecture as a checked contract: the import-linter contracts and the ruff rules, both
configured in pyproject.toml (docs/operations.md, "The test suite")."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    """Layers (graph over store over scaling/), no Dagster in scaling/, no import cycles, stages
    importing each other only through specs or a listed exception."""
    result = run_tool("lint-imports", "--no-cache")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_ruff_is_clean():
    result = run_tool("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
