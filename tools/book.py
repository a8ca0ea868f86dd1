"""Build the book: execute every notebook with papermill at one scale, then ``jupyter-book build`` (no execution).

    python -m tools.book --scale cpu          # what `make book` runs (SCALE=cpu|smoke|full)

Steps, each printed with its duration:

1. For every ``notebooks/*.ipynb``: run it with papermill (parameters ``scale`` and ``out_dir``) into
   ``_build/executed/<scale>/``. An executed copy is reused when its fingerprint (the notebook source, its
   parameters, the ``ief`` package code and recorded data, and the versions of the packages it runs on) is
   unchanged; otherwise its output folder ``_build/figures/<scale>/<notebook>/`` is emptied and it runs again.
   Each run records its provenance (scale, parameters, git commit, package versions, wall time, fingerprint) next to it.
2. Copy each executed notebook into ``book/generated/`` with a provenance section appended: the chapters the book
   includes (``_toc.yml``). A notebook that fails stops the build, naming the notebook and the cell.
3. Make MathJax available offline (``npm install mathjax@3`` into ``_build/vendor`` the first time) and run
   ``jupyter-book build . -W`` with execution off.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCALES = ("smoke", "cpu", "full")
NOTEBOOKS = ROOT / "notebooks"
GENERATED = ROOT / "book" / "generated"
VENDOR = ROOT / "_build" / "vendor"
MATHJAX_VERSION = "3.2.2"
TRACKED_PACKAGES = ("torch", "transformers", "peft", "numpy", "matplotlib", "pandas", "papermill", "jupyter-book")


def _log(message: str) -> None:
    print(f"[book] {message}", flush=True)


def package_versions() -> dict[str, str]:
    versions = {}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ief", "notebooks"], cwd=ROOT,
                               capture_output=True, text=True, check=True)
        return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fingerprint(notebook: Path, parameters: dict) -> str:
    """Hash of everything an executed notebook depends on: its source, parameters, package code, versions."""
    h = hashlib.sha256()
    h.update(notebook.read_bytes())
    h.update(json.dumps(parameters, sort_keys=True).encode())
    for path in sorted(p for p in (ROOT / "ief").rglob("*") if p.suffix in (".py", ".json")):  # code + records
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    h.update(json.dumps(package_versions(), sort_keys=True).encode())
    return h.hexdigest()[:16]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class NotebookFailed(RuntimeError):
    pass


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _source_cell(executed: Path, executed_index: int) -> tuple[int, str]:
    """Index in the source notebook (papermill inserts an injected-parameters cell) and the cell's first line."""
    import nbformat

    cells = nbformat.read(executed, as_version=4).cells
    injected = sum("injected-parameters" in c.metadata.get("tags", []) for c in cells[:executed_index])
    lines = cells[executed_index].source.strip().splitlines() if executed_index < len(cells) else []
    return executed_index - injected, lines[0] if lines else ""


def execute(notebook: Path, scale: str, executed_root: Path | None = None) -> tuple[Path, dict]:
    """Run one notebook (or reuse its executed copy); returns the executed path and its provenance."""
    import papermill

    out_dir = (executed_root or ROOT / "_build" / "executed") / scale
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = out_dir / notebook.name
    record = executed.with_suffix(".provenance.json")
    parameters = {"scale": scale, "out_dir": str(Path("_build") / "figures" / scale / notebook.stem)}
    key = fingerprint(notebook, parameters)
    if executed.exists() and record.exists():
        previous = json.loads(record.read_text())
        if previous.get("fingerprint") == key:
            _log(f"{notebook.name}: unchanged (fingerprint {key}), reusing the executed copy from "
                 f"{previous['finished']} ({previous['wall_time_s']:.0f} s then)")
            return executed, previous
    _log(f"{notebook.name}: executing at scale={scale} ...")
    figures = ROOT / parameters["out_dir"]
    if figures.is_dir():  # a build product: start clean, so no stale figure or training run is reused
        shutil.rmtree(figures)
    start = time.time()
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env_path) if p)
    partial = executed.with_suffix(".partial.ipynb")
    try:
        papermill.execute_notebook(str(notebook), str(partial), parameters=parameters, kernel_name="python3",
                                   cwd=str(ROOT), progress_bar=False)
    except papermill.PapermillExecutionError as err:
        index, first_line = _source_cell(partial, err.cell_index)
        raise NotebookFailed(
            f"notebook {_shown(notebook)} failed in cell index {index} (`{first_line}`): {err.ename}: {err.evalue}\n"
            f"the partially executed notebook is {_shown(partial)}"
        ) from err
    os.replace(partial, executed)
    wall = time.time() - start
    provenance = {
        "notebook": _shown(notebook),
        "scale": scale,
        "parameters": parameters,
        "git_commit": git_commit(),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "wall_time_s": round(wall, 1),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "fingerprint": key,
    }
    _write_atomic(record, json.dumps(provenance, indent=2))
    _log(f"{notebook.name}: done in {wall:.1f} s")
    return executed, provenance


def provenance_markdown(p: dict) -> str:
    params = ", ".join(f"`{k}={v!r}`" for k, v in p["parameters"].items())
    packages = ", ".join(f"{k} {v}" for k, v in p["packages"].items() if v != "not installed")
    return (
        "## Provenance\n\n"
        "| | |\n| --- | --- |\n"
        f"| notebook | `{p['notebook']}` |\n| scale | `{p['scale']}` |\n| parameters | {params} |\n"
        f"| git commit | `{p['git_commit']}` |\n| executed | {p['finished']} in {p['wall_time_s']} s |\n"
        f"| Python | {p['python']} |\n| packages | {packages} |\n| fingerprint | `{p['fingerprint']}` |\n\n"
        "Rerun this chapter on a GPU with the paper's setups:\n\n"
        f"```bash\npapermill {p['notebook']} out.ipynb -p scale full\n```\n"
    )


def publish(executed: Path, provenance: dict) -> Path:
    """Copy the executed notebook into book/generated/ with its provenance appended."""
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell(provenance_markdown(provenance)))
    GENERATED.mkdir(parents=True, exist_ok=True)
    target = GENERATED / executed.name
    nbformat.write(nb, target)
    return target


def timings_table() -> str:
    """Markdown table of recorded execution times: one row per notebook, one column per scale."""
    rows = []
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = []
        for scale in SCALES:
            record = ROOT / "_build" / "executed" / scale / f"{notebook.stem}.provenance.json"
            if record.exists():
                cells.append(f"{json.loads(record.read_text())['wall_time_s']:.0f} s")
            else:
                cells.append("not run here")
        rows.append(f"| `{notebook.name}` | " + " | ".join(cells) + " |")
    if not rows:
        return "No notebooks yet.\n"
    header = "| notebook | " + " | ".join(SCALES) + " |\n| --- |" + " ---: |" * len(SCALES) + "\n"
    return header + "\n".join(rows) + "\n"


def mathjax() -> None:
    """MathJax 3 from the npm registry into _build/vendor/mathjax (served from the book's _static, no CDN)."""
    target = VENDOR / "mathjax" / "mathjax" / "es5" / "tex-chtml-full.js"
    if target.exists():
        return
    _log(f"installing MathJax {MATHJAX_VERSION} from the npm registry (once) ...")
    npm_dir = VENDOR / "npm"
    npm_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(npm_dir),
                    f"mathjax@{MATHJAX_VERSION}"], check=True)
    source = npm_dir / "node_modules" / "mathjax" / "es5"
    destination = VENDOR / "mathjax" / "mathjax" / "es5"
    shutil.rmtree(destination, ignore_errors=True)
    shutil.copytree(source, destination)


def jupyter_book(output: Path | None = None) -> Path:
    """Build the HTML into ``<output>/_build/html`` (default: the repository, i.e. ``_build/html``)."""
    base = ROOT if output is None else output
    html = base / "_build" / "html"
    exe = Path(sys.executable).with_name("jupyter-book")
    command = [str(exe) if exe.exists() else "jupyter-book", "build", str(ROOT), "-W", "--keep-going"]
    if output is not None:
        command += ["--path-output", str(output)]
    _log("jupyter-book build (execution off, warnings are errors) ...")
    subprocess.run(command, cwd=ROOT, check=True)
    return html / "index.html"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.book", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", default=os.environ.get("SCALE", "cpu"))
    parser.add_argument("--output", type=Path, default=None,
                        help="build into OUTPUT/_build/html instead of _build/html (the tests build the smoke book "
                             "into _build/smoke so a reader's book is left alone)")
    args = parser.parse_args(argv)
    if args.scale not in SCALES:
        parser.error(f"unknown scale {args.scale!r}; accepted: {', '.join(SCALES)}")
    started = time.time()
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb"))
    _log(f"scale={args.scale}: {len(notebooks)} notebooks")
    summary = []
    shutil.rmtree(GENERATED, ignore_errors=True)
    GENERATED.mkdir(parents=True)
    for notebook in notebooks:
        try:
            executed, provenance = execute(notebook, args.scale)
        except NotebookFailed as err:
            _log(f"FAILED: {err}")
            return 1
        publish(executed, provenance)
        summary.append((notebook.name, provenance["wall_time_s"]))
    (GENERATED / "timings.md").write_text(timings_table())
    mathjax()
    try:
        index = jupyter_book(args.output.resolve() if args.output else None)
    except subprocess.CalledProcessError as err:
        _log(f"FAILED: jupyter-book build exited with {err.returncode}")
        return 1
    _log("summary:")
    for name, wall in summary:
        _log(f"  {name:32s} {wall:8.1f} s (execution)")
    _log(f"book built in {time.time() - started:.0f} s: open file://{index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
