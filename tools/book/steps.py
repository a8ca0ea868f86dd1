"""The book's build steps, a library: what the workflow's rules run (through :mod:`tools.book.cli`) and what
workflow/rules/common.smk reads (``from tools.book import steps as BOOK``: the scales, the thread variables, the
MathJax file, the package versions, whether npm is missing).

- :func:`execute`: run one notebook with papermill (parameters ``scale`` and ``out_dir``) into
  ``_build/executed/<scale>/``, in a kernel with one thread per library (no oversubscription), talking to it over
  local IPC sockets, printing a line per slow cell. Its output folder ``_build/figures/<scale>/<notebook>/`` is
  emptied first. The provenance (scale, parameters, git commit, package versions, wall time, the result files read
  with their hashes) is written next to it. A failing notebook raises :class:`NotebookFailed`, naming the notebook
  and the cell.
- :func:`publish`: copy an executed notebook into ``book/generated/`` with a provenance section appended.
- :func:`write_timings`: ``book/generated/timings.md``: the last cold build of each scale from the committed record
  ``book/cold-builds.json`` (:mod:`companion.chapters.cost`; :func:`record_cold_build` writes it from a build log),
  each chapter's cost in it, and this checkout's execution times and whole-book build times measured by the builds
  themselves (``_build/build-log.jsonl``, written by :mod:`tools.book.driver`).
- :func:`mathjax`: MathJax 3 from the npm registry into ``_build/vendor`` (once), so the book works offline.
- :func:`jupyter_book`: ``jupyter-book build . -W`` with execution off; prints a summary and the warnings.

Up to date or not is Snakemake's decision alone (its rerun triggers: a missing or older output, changed inputs,
params or rule code); nothing here fingerprints.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from companion.atomic import write_atomically
from companion.chapters import cost

from .job_clock import read_snakemake_log

ROOT = Path(__file__).resolve().parents[2]
SCALES = ("smoke", "cpu", "full")
NOTEBOOKS = ROOT / "notebooks"
GENERATED = ROOT / "book" / "generated"
VENDOR = ROOT / "_build" / "vendor"
BUILD_LOG = ROOT / "_build" / "build-log.jsonl"
MATHJAX_VERSION = "3.2.2"
MATHJAX_ENTRY = VENDOR / "mathjax" / "mathjax" / "es5" / "tex-chtml-full.js"
TRACKED_PACKAGES = ("torch", "transformers", "peft", "numpy", "matplotlib", "pandas", "papermill", "jupyter-book")
# One thread per job: torch (intra-op, OpenMP) and the BLAS libraries numpy/scipy may load.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS")
SLOW_CELL_S = 2.0  # cells slower than this get a progress line


def log_line(message: str) -> None:
    """One ``[book]`` line on stdout, flushed at once (a cluster log shows it as it happens)."""
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


class NotebookFailed(RuntimeError):
    pass


def code_digest(files: list[Path], path: Path, root: Path = ROOT) -> Path:
    """A file that stands for ``files``' contents, for the workflow's rules to depend on in their place.

    Snakemake's scheduler stats every input of every pending job on each of its passes (several a second while jobs
    run); with the package sources (~100 files) as each rule's inputs, a cold build's main process kept up to half a
    core busy doing so. One digest file per set of sources makes that one stat per job.

    The file holds the SHA-256 of the files' paths (relative to ``root``) and contents, and is rewritten only when
    that digest changes: its modification time is then the newest of the files' (the first time, so that a build
    made from these sources is up to date with it) or now (when it replaces an older digest: an edit, an added or a
    deleted file makes every output made before it out of date). A checkout that touches the files without
    changing them reruns nothing, where the files' own times would rerun everything.

    Args:
        files: the sources (existing files).
        path: the digest file (written atomically, its folder created).
        root: the folder the paths are hashed relative to (the checkout: moving it changes no digest).

    Returns:
        ``path``.
    """
    digest = hashlib.sha256()
    for source in sorted(files):
        digest.update(source.relative_to(root).as_posix().encode() + b"\0" + source.read_bytes() + b"\0")
    text = digest.hexdigest() + "\n"
    previous = path.read_text() if path.exists() else None
    if previous != text:
        write_atomically(path, text)
        stamp = time.time() if previous is not None else max(source.stat().st_mtime for source in files)
        os.utime(path, (stamp, stamp))
    return path


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _source_cell(executed: Path, executed_index: int) -> tuple[int, str]:
    """Index in the source notebook (papermill inserts an injected-parameters cell) and the cell's first line."""
    import nbformat

    cells = nbformat.read(executed, as_version=4).cells
    injected = sum("injected-parameters" in c.metadata.get("tags", []) for c in cells[:executed_index])
    lines = cells[executed_index].source.strip().splitlines() if executed_index < len(cells) else []
    return executed_index - injected, lines[0] if lines else ""


@contextlib.contextmanager
def single_threaded(threads: int = 1):
    """The kernel inherits this environment: one thread per library unless the caller already chose."""
    saved = {v: os.environ.get(v) for v in THREAD_VARIABLES + ("PYTHONPATH",)}
    for var in THREAD_VARIABLES:
        os.environ.setdefault(var, str(threads))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def _progress_engine(label: str):
    """A papermill engine that prints one line per slow code cell (papermill's own progress is a tqdm bar)."""
    from papermill.engines import NBClientEngine, NotebookExecutionManager

    class Manager(NotebookExecutionManager):
        def cell_start(self, cell, cell_index=None, **kwargs):
            self._cell_started = time.time()
            return super().cell_start(cell, cell_index, **kwargs)

        def cell_complete(self, cell, cell_index=None, **kwargs):
            took = time.time() - getattr(self, "_cell_started", time.time())
            if cell.cell_type == "code" and took >= SLOW_CELL_S:
                first = (cell.source.strip().splitlines() or [""])[0][:60]
                total = len(self.nb.cells)
                log_line(f"{label}: cell {cell_index + 1}/{total} took {took:.1f} s  ({first})")
            return super().cell_complete(cell, cell_index, **kwargs)

    class Engine(NBClientEngine):
        @classmethod
        def execute_notebook(cls, nb, kernel_name, output_path=None, progress_bar=False, log_output=False,
                             autosave_cell_every=30, **kwargs):
            nb_man = Manager(nb, output_path=output_path, progress_bar=False, log_output=log_output,
                             autosave_cell_every=autosave_cell_every)
            nb_man.notebook_start()
            try:
                cls.execute_managed_notebook(nb_man, kernel_name, log_output=log_output, **kwargs)
            finally:
                nb_man.notebook_complete()
            return nb_man.nb

    return Engine


@contextlib.contextmanager
def kernel_config():
    """The configuration of one notebook's kernel, valid inside the ``with`` block: the kernel talks to papermill
    over local IPC sockets in a directory of its own, removed afterwards.

    IPC sockets are never reachable from the network, and ipykernel's "Kernel is running over TCP without
    encryption" warning (ipykernel.kernelapp, for tcp without a CurveZMQ key) does not apply. The directory of its
    own matters: jupyter_client names IPC sockets ``<ip>-1`` ... ``<ip>-5`` with the first numbers whose files do not
    exist yet, and its default ``ip`` is ``kernel-ipc`` in the working directory, so two notebooks started at once
    in separate processes (the workflow runs them side by side) chose the same sockets, and one client read the
    other kernel's messages ("Invalid Signature", then a failed start; jupyter/jupyter_client#487)."""
    import tempfile

    from traitlets.config import Config

    with tempfile.TemporaryDirectory(prefix="ief-kernel-") as sockets:
        yield Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})


def execute(notebook: Path, scale: str, executed_root: Path | None = None,
            results: list[Path] | tuple[Path, ...] = (), runs_dir: str | None = None,
            results_dir: str | None = None) -> tuple[Path, dict]:
    """Run one notebook at ``scale``; returns the executed path and its provenance. ``results``: the result files
    the notebook reads (recorded with their hashes). ``runs_dir`` / ``results_dir`` (the workflow's training runs
    and tidy tables of this scale) are passed to a notebook whose parameters cell declares them, so the chapter reads
    what the workflow made instead of making it again."""
    import papermill
    from papermill.engines import papermill_engines

    notebook = Path(notebook)
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; accepted: {', '.join(SCALES)}")
    out_dir = (executed_root or ROOT / "_build" / "executed") / scale
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = out_dir / notebook.name
    record = executed.with_suffix(".provenance.json")
    parameters = {"scale": scale, "out_dir": str(Path("_build") / "figures" / scale / notebook.stem)}
    declared = papermill.inspect_notebook(str(notebook))
    for name, value in (("runs_dir", runs_dir), ("results_dir", results_dir)):
        if value is not None and name in declared:
            parameters[name] = str(value)
    label = notebook.name
    log_line(f"{label}: executing at scale={scale} ...")
    figures = ROOT / parameters["out_dir"]
    if figures.is_dir():  # a build product: start clean, so no stale figure or training run is reused
        shutil.rmtree(figures)
    engine = f"ief-progress-{notebook.stem}"
    papermill_engines.register(engine, _progress_engine(label))
    start = time.time()
    partial = executed.with_suffix(".partial.ipynb")
    try:
        with single_threaded(), kernel_config() as config:
            papermill.execute_notebook(str(notebook), str(partial), parameters=parameters, kernel_name="python3",
                                       cwd=str(ROOT), progress_bar=False, engine_name=engine, config=config)
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
        "threads": os.environ.get("OMP_NUM_THREADS", "1"),
        "results": {_shown(Path(p)): _sha256(Path(p)) for p in results},
        "wall_time_s": round(wall, 1),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    write_atomically(record, json.dumps(provenance, indent=2))
    log_line(f"{label}: done in {wall:.1f} s")
    return executed, provenance


def provenance_markdown(p: dict) -> str:
    params = ", ".join(f"`{k}={v!r}`" for k, v in p["parameters"].items())
    packages = ", ".join(f"{k} {v}" for k, v in p["packages"].items() if v != "not installed")
    read = ", ".join(f"`{k}` (sha256 {v})" for k, v in p.get("results", {}).items()) or "none"
    return (
        "## Provenance\n\n"
        "| | |\n| --- | --- |\n"
        f"| notebook | `{p['notebook']}` |\n| scale | `{p['scale']}` |\n| parameters | {params} |\n"
        f"| results read | {read} |\n"
        f"| git commit | `{p['git_commit']}` |\n| executed | {p['finished']} in {p['wall_time_s']} s |\n"
        f"| Python | {p['python']} |\n| packages | {packages} |\n\n"
        + rerun_markdown(p["notebook"])
    )


# Chapters whose full scale trains or evaluates the paper's setups (GPU + the Hugging Face hub); the others (toy
# problems, convergence checks, the setup tables) compute the same thing at every scale and need no GPU.
GPU_CHAPTERS = ("train", "optimisation", "evaluation")


def rerun_markdown(notebook: str) -> str:
    if Path(notebook).stem in GPU_CHAPTERS:
        return ("Rerun this chapter on a GPU with the paper's setups (hours per training run: see the chapter):\n\n"
                f"```bash\npapermill {notebook} out.ipynb -p scale full\n```\n")
    return ("This chapter needs no GPU at any scale; rerun it on its own with:\n\n"
            f"```bash\npapermill {notebook} out.ipynb -p scale cpu\n```\n")


def publish(executed: Path, provenance: dict | None = None, generated: Path = GENERATED) -> Path:
    """Copy the executed notebook into ``generated`` with its provenance appended."""
    import nbformat

    executed = Path(executed)
    if provenance is None:
        provenance = json.loads(executed.with_suffix(".provenance.json").read_text())
    nb = nbformat.read(executed, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell(provenance_markdown(provenance)))
    target = Path(generated) / executed.name
    text = nbformat.writes(nb)
    write_atomically(target, text if text.endswith("\n") else text + "\n")  # as nbformat.write ends a file
    return target


# ----------------------------------------------------------------------------------------------- timings
def read_build_log(path: Path = BUILD_LOG) -> list[dict]:
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            entries.append(json.loads(line))
    return entries


def format_minutes(seconds: float) -> str:
    """``"42 s"`` below two minutes, ``"3 min 05 s"`` below an hour, else ``"1 h 26 min"``
    (:func:`companion.chapters.cost.format_duration`)."""
    return cost.format_duration(seconds)


def _notebook_times(root: Path) -> str:
    rows = []
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = []
        for scale in SCALES:
            record = root / scale / f"{notebook.stem}.provenance.json"
            cells.append(f"{json.loads(record.read_text())['wall_time_s']:.0f} s" if record.exists()
                         else "not run here")
        rows.append(f"| `{notebook.name}` | " + " | ".join(cells) + " |")
    header = "| notebook | " + " | ".join(SCALES) + " |\n| --- |" + " ---: |" * len(SCALES) + "\n"
    return (header + "\n".join(rows) + "\n") if rows else "No notebooks yet.\n"


def chapter_costs_markdown(record: dict[str, dict]) -> str:
    """Per recorded scale whose entry has each job's time: every chapter's cost in that build
    (:func:`companion.chapters.cost.chapter_cost`: the jobs making what it reads, and its notebook)."""
    text = ""
    for scale in SCALES:
        entry = record.get(scale)
        if not entry or not entry.get("job_times"):
            continue
        rows = []
        for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
            c = cost.chapter_cost(notebook.stem, scale, record=record)
            parts = ", ".join(f"{name} {format_minutes(sec)} ({n})" for name, (n, sec) in c.by_rule.items())
            rows.append(f"| `{notebook.name}` | {format_minutes(c.seconds)} | {parts} |")
        text += (f"\nWhat each chapter cost in the last cold `{scale}` build: the job time of the jobs that make what "
                 "it reads (training runs, evaluations, studies; `notebook_results` in `config/config.yaml`) and of "
                 "its own notebook. The chapters share the grid's runs, so a run counts in every chapter that reads "
                 "it and the rows do not add up to the build.\n\n"
                 "| chapter | job time | by rule (jobs) |\n| --- | ---: | --- |\n" + "\n".join(rows) + "\n")
    return text


def timings_table(executed_root: Path | None = None, build_log: Path = BUILD_LOG, record: Path = cost.RECORD,
                  record_section: str = "") -> str:
    """Markdown for the timings page: ``record_section`` first (the recorded chapters' build and how many commits it
    is behind this checkout, :func:`tools.book.record.timings_markdown`, which the caller passes: the record module
    builds on this one), the last cold
    build of each scale from the committed record (``book/cold-builds.json``: date, machine, load, wall time, job time
    by rule, each chapter's cost), then this checkout's own measurements: each notebook's execution time per scale
    (from its provenance) and the whole-book builds logged by :func:`tools.book.driver.build` (the last cold build,
    every notebook executed, and the last no-op rebuild, per scale)."""
    root = executed_root or ROOT / "_build" / "executed"
    committed = cost.read_record(record)
    text = record_section + "\n" if record_section else ""
    text += ("### The last cold build of each scale\n\n"
            "A cold build executes every notebook and builds the book from nothing (`make book`, at a scale). Each "
            "scale's last one is committed in `book/cold-builds.json`, recorded from its build's log by "
            "`python -m tools.book record-cold-build`, so a fresh clone states them too; a loaded machine (other "
            "work beside the build) makes every time longer than on an idle one.\n\n"
            + cost.cold_builds_markdown(committed) + chapter_costs_markdown(committed)
            + "\n### This checkout's builds\n\n"
            "Each notebook's execution time, from the provenance of the notebooks executed in this checkout (a "
            "scale it has not run shows \"not run here\"):\n\n" + _notebook_times(root))
    builds, spent = [], []
    log = [e for e in read_build_log(build_log) if e.get("returncode") == 0]
    for scale in SCALES:
        for kind, what in (("cold", "cold build (every notebook executed, book built)"),
                           ("no-op", "no-op rebuild (nothing changed, nothing recomputed)")):
            done = [e for e in log if e.get("scale") == scale and e.get("kind") == kind]
            if done:
                e = done[-1]
                jobs = ", ".join(f"{n} {r}" for r, n in sorted(e.get("jobs", {}).items())) or "0 jobs"
                wall = format_minutes(e["wall_time_s"])
                builds.append(f"| `{scale}` | {what} | {wall} | {jobs} | {e['finished']} |")
                if kind == "cold" and e.get("job_seconds"):
                    spent.append(job_time_sentence(e))
    if builds:
        text += ("\nWhole-book builds (`make book`) in this checkout, timed by the build itself (`python -m tools.book "
                 "build`, logged in `_build/build-log.jsonl`); the build that made this page is logged after the page "
                 "was written, so these are the builds before it:\n\n"
                 "| scale | build | wall time | jobs run | finished |\n| --- | --- | ---: | --- | --- |\n"
                 + "\n".join(builds) + "\n")
    else:
        text += "\nNo whole-book build is logged in this checkout before the one that wrote this page.\n"
    if spent:
        text += "\nWhere those cold builds' time went:\n\n" + "\n".join(f"- {line}" for line in spent) + "\n"
    return text


def job_time_sentence(entry: dict) -> str:
    """Where a logged build's time went: its jobs' wall times summed by rule (Snakemake's start and finish times,
    :class:`tools.book.job_clock.JobClock`), their total against the build's wall time and its cores."""
    spent = entry["job_seconds"]
    total, wall, cores = sum(spent.values()), entry["wall_time_s"], entry.get("cores")
    parts = ", ".join(f"{rule} {format_minutes(s)}" for rule, s in spent.items() if s >= 1)
    busy = (f"; {total / wall:.2f} of its {cores} cores busy on average" if cores and wall > 0 else "")
    if entry.get("other_cores") is not None:
        busy += f", and other processes {entry['other_cores']:.2f} more"
    return (f"`{entry['scale']}`, finished {entry['finished']}: jobs took {format_minutes(total)} in all "
            f"({parts}) in {format_minutes(wall)} of wall time{busy}.")


def record_cold_build(log: Path, load: str, scale: str | None = None, note: str | None = None,
                      other_cores: float | None = None, machine: str | None = None,
                      total_wall_s: float | None = None, snakemake_log: Path | None = None,
                      record: Path | None = None) -> dict:
    """Record a build log's last successful cold build (of ``scale``) in the committed record
    (``python -m tools.book record-cold-build``; :func:`companion.chapters.cost.record_cold_build` writes it).

    Args:
        log: the build log (``_build/build-log.jsonl`` of the checkout that built).
        load: ``idle`` or ``loaded``.
        scale: the scale to record (None: the log's last cold build, whatever its scale).
        note: what to say of the load or the build.
        other_cores: the cores other processes kept busy, measured outside the driver (the log's own wins).
        machine: the machine's CPU, where the log does not name it.
        total_wall_s: the whole command's wall time, environment included, measured outside the driver.
        snakemake_log: Snakemake's own log of the build, for each job's time where the log entry has none.
        record: the record (default ``book/cold-builds.json``).

    Returns:
        The entry as recorded.

    Raises:
        ValueError: the log has no successful cold build (of ``scale``), or a bad ``load``.
        OSError: the log cannot be read.
    """
    if not Path(log).exists():
        raise OSError(f"no build log at {log}: a build (python -m tools.book build) writes it")
    entry = cost.last_cold_build(read_build_log(Path(log)), scale)
    job_times = None
    if not entry.get("job_times") and snakemake_log is not None:
        job_times = read_snakemake_log(Path(snakemake_log)).jobs()
    return cost.record_cold_build(entry, load, path=record or cost.RECORD, note=note, other_cores=other_cores,
                                  machine=machine, total_wall_s=total_wall_s, job_times=job_times)


def write_timings(generated: Path = GENERATED, record_section: str = "") -> Path:
    """Write :func:`timings_table` (after ``record_section``) to ``generated/timings.md`` (atomically); returns the
    path."""
    target = Path(generated) / "timings.md"
    write_atomically(target, timings_table(record_section=record_section))
    return target


# ---------------------------------------------------------------------------------------------- tools, book
def missing_build_tools() -> str | None:
    """What the build needs that pip does not install, as a message naming what to install (None: all there)."""
    if not MATHJAX_ENTRY.exists() and shutil.which("npm") is None:
        return ("npm is needed (once) to install MathJax for the book, and it is not on PATH: install Node.js and npm "
                "(Debian/Ubuntu: apt-get install npm; macOS: brew install node; conda: conda install -c conda-forge "
                "nodejs), then run the build again. Nothing has been executed yet.")
    return None


def mathjax() -> None:
    """MathJax 3 from the npm registry into _build/vendor/mathjax (served from the book's _static, no CDN)."""
    if MATHJAX_ENTRY.exists():
        return
    problem = missing_build_tools()
    if problem:
        raise RuntimeError(problem)
    log_line(f"installing MathJax {MATHJAX_VERSION} from the npm registry (once) ...")
    npm_dir = VENDOR / "npm"
    npm_dir.mkdir(parents=True, exist_ok=True)
    # --prefer-offline: a MathJax already in npm's cache (an earlier build, another checkout) installs offline
    subprocess.run(["npm", "install", "--silent", "--prefer-offline", "--no-audit", "--no-fund", "--prefix",
                    str(npm_dir), f"mathjax@{MATHJAX_VERSION}"], check=True)
    source = npm_dir / "node_modules" / "mathjax" / "es5"
    destination = MATHJAX_ENTRY.parent
    shutil.rmtree(destination, ignore_errors=True)
    shutil.copytree(source, destination)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def jupyter_book(output: Path | None = None, source: Path = ROOT) -> Path:
    """Build the HTML into ``<output>/_build/html`` (default: the repository, i.e. ``_build/html``).

    ``source``: the book's source tree (default the repository; the book from the record renders a tree of its own,
    :func:`tools.book.record.stage`). Every page is re-read (``--all``), so ``-W`` sees every warning; jupyter-book's
    own output (its configuration, colours) is kept out of the console: a summary line, or the warnings and errors
    when the build fails."""
    base = ROOT if output is None else Path(output).resolve()
    html = base / "_build" / "html"
    exe = Path(sys.executable).with_name("jupyter-book")
    command = [str(exe) if exe.exists() else "jupyter-book", "build", str(source), "-W", "--keep-going", "--all"]
    if output is not None or Path(source) != ROOT:
        command += ["--path-output", str(base)]
    log_line("jupyter-book build (execution off, warnings are errors) ...")
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_COLOR": "1", "TERM": "dumb"})
    lines = [_ANSI.sub("", line) for line in (done.stdout + done.stderr).splitlines()]
    notes = [line for line in lines if re.search(r"WARNING|ERROR|CRITICAL|Exception|Traceback", line)]
    if done.returncode != 0:
        shown = notes or lines[-40:]
        raise RuntimeError("jupyter-book build failed:\n" + "\n".join(shown))
    for line in notes:
        log_line(f"jupyter-book: {line}")
    pages = sum(1 for _ in html.rglob("*.html")) if html.exists() else 0
    log_line(f"jupyter-book: {pages} HTML pages in {time.time() - start:.0f} s, no warnings -> {_shown(html)}")
    return html / "index.html"
