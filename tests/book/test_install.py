"""The install story holds beyond this machine (a pip user's own torch, a fresh venv).

- pip users install their torch first; the README's ``pip install -e ".[hf]"`` (the library) must then keep it. Checked
  by a real resolution: ``pip install --dry-run`` into a fresh venv that holds a stand-in ``torch`` (a bare
  ``dist-info``), reading pip's report; and, so that the check can fail, the same resolution with a stand-in below
  the accepted range must replace it.
- No extra names a package that pins or replaces torch (torchvision, through curvlinops -> BackPACK, replaced the
  CPU torch by a CUDA one once): those are installed with ``--no-deps`` from ``requirements/no-deps.txt``.
- scikit-learn (the cpu setup digits-mlp) is in an extra; ``make book``'s extras include it.
- ``make env``'s CPU wheel index is opt-in (``TORCH_INDEX``): unset, no index is added.
- ``environment.yml`` takes torch from conda-forge (the ``pytorch`` channel ends at 2.5) and installs extras only.

Offline: the resolution uses the ``file://`` indexes of this machine's pip configuration when it has any (the
project's machines hold a local mirror; PyPI is then not asked), otherwise pip's own configuration (CI, with
network). The local mirror lacks some of the book's and the tests' packages (myst-nb, jupyter-book, the SLURM
plugin, the exact hypothesis pin), so the full ``.[dev]`` set is checked by its declared names, not resolved.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())  # the library, ief
COMPANION = tomllib.loads((ROOT / "companion" / "pyproject.toml").read_text())  # the companion, ief-companion
LIBRARY = PYPROJECT["project"]["name"]
SELF = COMPANION["project"]["name"]
# every extra of both distributions, the library's named "ief[...]" as the companion's dependencies name them
EXTRAS: dict[str, list[str]] = {
    **COMPANION["project"]["optional-dependencies"],
    **{f"{LIBRARY}[{k}]": v for k, v in PYPROJECT["project"]["optional-dependencies"].items()}}
TORCH_REPLACERS = {"torch", "torchvision", "torchaudio", "curvlinops-for-pytorch", "backpack-for-pytorch"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(extras: list[str]) -> set[str]:
    """Every requirement name an install of ``.[extras]`` declares, self-references followed."""
    names, todo, seen = set(), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in EXTRAS[extra]:
            if _name(req) == SELF:
                todo += re.search(r"\[(.*)\]", req).group(1).split(",")
            elif _name(req) == LIBRARY and "[" in req:
                todo += [f"{LIBRARY}[{e}]" for e in re.search(r"\[(.*)\]", req).group(1).split(",")]
            else:
                names.add(_name(req))
    return names


def _readme_pip_target() -> str:
    """The package spec of the README's ``pip install -e ...`` line: the command this file resolves."""
    match = re.search(r'^pip install -e "?([^"\s]+)"?\s*$', (ROOT / "README.md").read_text(), flags=re.M)
    assert match, "the README has no `pip install -e ...` line"
    return match.group(1)


TARGET = _readme_pip_target()


def _pip_indexes() -> list[str]:
    """pip's arguments choosing indexes: the configured ``file://`` indexes alone when there are any."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout
    urls = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(("index-url", "extra-index-url")):
            urls += value.strip().strip("'\"").split()
    local = [u for u in urls if u.startswith("file:")]
    if not local:
        return []
    return ["--index-url", local[0], *[a for u in local[1:] for a in ("--extra-index-url", u)]]


def _venv_with_torch(path: Path, version: str) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    info = Path(purelib) / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    return python


def _dry_run(python: Path, target: str, report: Path) -> list[tuple[str, str]]:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
         "--disable-pip-version-check", "--report", str(report), *_pip_indexes(), target],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    items = json.loads(report.read_text())["install"]
    return [(i["metadata"]["name"].lower(), i["metadata"]["version"]) for i in items]


@pytest.mark.slow
def test_pip_keeps_the_torch_you_installed_first(tmp_path):
    target = TARGET  # the README's line, `pip install -e ".[hf,cpu-scale]"`
    kept = _dry_run(_venv_with_torch(tmp_path / "kept", "2.13.0"), target, tmp_path / "kept.json")
    names = {n for n, _ in kept}
    assert "torch" not in names and not names & TORCH_REPLACERS, sorted(names & TORCH_REPLACERS)
    assert {"transformers", "peft", LIBRARY} <= names  # it did resolve the extras
    old = _dry_run(_venv_with_torch(tmp_path / "old", "2.3.0"), target, tmp_path / "old.json")
    assert "torch" in {n for n, _ in old}, "a torch below the accepted range must be replaced (the check can fail)"


def test_no_extra_pulls_a_package_that_replaces_torch():
    everything = _closure(list(EXTRAS)) | {_name(r) for r in COMPANION["project"]["dependencies"]}
    assert not everything & TORCH_REPLACERS, sorted(everything & TORCH_REPLACERS)
    no_deps = {_name(line) for line in (ROOT / "requirements" / "no-deps.txt").read_text().splitlines()
               if line and not line.startswith(("#", " "))}
    assert {"curvlinops-for-pytorch", "backpack-for-pytorch"} <= no_deps


def test_scikit_learn_is_in_an_extra_of_the_book():
    assert "scikit-learn" in _closure(["cpu-scale"])
    assert "scikit-learn" in _closure(["book"]) and "scikit-learn" in _closure(["dev"])
    assert "scikit-learn" not in {_name(r) for p in (PYPROJECT, COMPANION) for r in p["project"]["dependencies"]}


def test_the_library_depends_on_torch_numpy_tqdm_and_optionally_hugging_face_only():
    assert {_name(r) for r in PYPROJECT["project"]["dependencies"]} == {"torch", "numpy", "tqdm"}
    assert set(PYPROJECT["project"]["optional-dependencies"]) == {"hf"}
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["ief", "ief.*"]


def _make_n(*args: str) -> str:
    # a child of `make test PYTHON=...` inherits the make variables, PYTHON among them (which skips the venv's recipe)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "PYTHON")}
    done = subprocess.run(["make", "--no-print-directory", "-n", "env", "VENV=/nonexistent/ief-venv", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_cpu_wheel_index_is_opt_in():
    plain = _make_n()
    assert "--require-hashes" in plain and "--extra-index-url" not in plain and "--index-url" not in plain
    url = "https://download.pytorch.org/whl/cpu"
    opted = _make_n(f"TORCH_INDEX={url}")
    lock_line = next(line for line in opted.splitlines() if "pip install" in line and "--require-hashes" in line)
    assert f"--extra-index-url {url}" in lock_line
    assert f"TORCH_INDEX={url}" in plain  # the failure hint names the way out


def test_environment_yml_takes_torch_from_conda_forge_and_extras_only():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"], "the pytorch channel ends at torch 2.5"
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert any(d.startswith("pytorch") for d in conda)
    pip_lines = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    for line in pip_lines:
        match = re.fullmatch(r"-e (\.|\./companion)\[(.*)\]", line)
        assert match, f"environment.yml installs something other than the two distributions' extras: {line!r}"
        extras = match.group(2).split(",")
        if match.group(1) == ".":
            extras = [f"{LIBRARY}[{e}]" for e in extras]
        assert set(extras) <= set(EXTRAS)
        assert not _closure(extras) & TORCH_REPLACERS


@pytest.mark.slow
def test_the_library_wheel_holds_ief_alone(tmp_path):
    """``python -m pip wheel .`` builds the library: every file of the wheel is ``ief/`` or its metadata."""
    import zipfile

    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "--disable-pip-version-check", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = tmp_path.glob("ief-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    version = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "ief" / "__init__.py").read_text(), re.M).group(1)
    dist_info = f"ief-{version}.dist-info"
    assert {name.split("/")[0] for name in names} == {"ief", dist_info}, names
    assert f"{dist_info}/licenses/LICENSE" in names, "the wheel carries the licence"
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: MIT" in metadata and "Author: The iEF companion authors" in metadata
    assert "Project-URL: Paper, https://arxiv.org/abs/2406.06420" in metadata


def test_the_library_imports_without_the_companions_packages():
    """``import ief`` (and its public modules but ``ief.hf``, which is transformers' Trainer) needs none of matplotlib,
    pandas, seaborn, papermill, scikit-learn or the companion (each made unimportable in a fresh interpreter), and
    imports neither transformers nor peft."""
    blocked = ["matplotlib", "pandas", "seaborn", "papermill", "sklearn", "companion"]
    code = ("import sys\n"
            f"for name in {blocked!r}:\n    sys.modules[name] = None\n"
            "import ief, ief.optim, ief.woodfisher\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('transformers', 'peft')]\n"
            "print(sorted(set(ief.__all__) - set(dir(ief))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
