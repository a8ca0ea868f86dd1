"""The repository is ruff-clean with its own configuration (pyproject.toml's [tool.ruff]: the rules it names and the
line length), by the ruff that requirements/ci.lock pins. Run by ``make test`` (and so by CI) with the rest of the
suite, so a finding fails one test naming every file, line and rule, and the other tests still run."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True)


def test_ruff_is_the_locked_one():
    lock = (ROOT / "requirements" / "ci.lock").read_text().splitlines()
    locked = next(line.split("==")[1].split()[0] for line in lock if line.startswith("ruff=="))
    version = _ruff("--version")
    assert version.returncode == 0, ("ruff is not installed in this environment: make env installs it from "
                                     f"requirements/ci.lock\n{version.stderr}")
    assert version.stdout.split() == ["ruff", locked], f"{version.stdout.strip()}; requirements/ci.lock pins {locked}"


def test_the_repository_is_ruff_clean():
    found = _ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert found.returncode == 0, f"ruff check . (pyproject.toml's [tool.ruff]):\n{found.stdout}{found.stderr}"


def test_the_check_reads_the_projects_configuration(tmp_path):
    """So that the check can fail: a line one character over pyproject.toml's limit and an unused import are found
    when ruff is given the project's configuration."""
    limit = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["line-length"]
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n\nx = " + repr("a" * (limit - 5)) + "\n")  # limit + 1 characters
    found = _ruff("check", "--no-cache", "--output-format", "concise", "--config", str(ROOT / "pyproject.toml"),
                  "probe.py", cwd=tmp_path)
    assert found.returncode == 1
    assert "probe.py:1:8: F401" in found.stdout and f"probe.py:3:{limit + 1}: E501" in found.stdout, found.stdout
