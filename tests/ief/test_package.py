"""The package's basics are true: one version (``ief.__version__``, which the build reads), ``python -m ief``, the
licence in the wheel, the citation file and the changelog naming the same version."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

import ief
from ief import __main__ as cli

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_has_one_home_that_the_build_reads():
    project = PYPROJECT["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ief.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", ief.__version__)


def test_python_m_ief_reports_the_version_and_what_is_installed():
    done = subprocess.run([sys.executable, "-m", "ief", "--version"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == f"ief {ief.__version__}", done.stderr
    text = cli.report()
    assert text.startswith(f"ief {ief.__version__} (distribution 'ief', imported as 'ief'")
    assert re.search(r"^torch \S+ \((CPU build|CUDA .*)\)$", text, flags=re.M)
    assert all(re.search(rf"^{name} ", text, flags=re.M) for name in cli.OPTIONAL)
    assert cli._version_of("no-such-distribution-here") == "not installed"


def test_licence_citation_and_changelog_agree_with_the_package():
    assert PYPROJECT["project"]["license"] == "MIT" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert PYPROJECT["project"]["authors"] and PYPROJECT["project"]["urls"]["Paper"].startswith("https://")
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["version"] == ief.__version__ and citation["license"] == "MIT"
    # the software entry: its authors are the package's and the licence's holder; no address the repository does not
    # state (the paper's is the only one it states)
    assert citation["type"] == "software" and citation["abstract"]
    assert [a["name"] for a in citation["authors"]] == [a["name"] for a in PYPROJECT["project"]["authors"]]
    assert f"Copyright (c) 2026 {citation['authors'][0]['name']}" in (ROOT / "LICENSE").read_text()
    stated = set(PYPROJECT["project"]["urls"].values())
    assert set(re.findall(r"https?://[^\s\"']+", (ROOT / "CITATION.cff").read_text())) <= stated
    assert "repository-code" not in citation or citation["repository-code"] in stated
    paper = citation["preferred-citation"]
    assert paper["title"] == "An Improved Empirical Fisher Approximation for Natural Gradient Descent"
    assert [a["family-names"] for a in paper["authors"]] == ["Wu", "Yu", "Zhang", "Woodland"]
    releases = re.findall(r"^## (\d+\.\d+\.\d+) — (\d{4}-\d\d-\d\d)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0][0] == ief.__version__, "the changelog's newest entry is this version"
    assert citation["date-released"] == releases[0][1]
