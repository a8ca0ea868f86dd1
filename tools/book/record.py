"""The recorded build: every chapter as a ``cpu`` build executed it, tracked in ``book/recorded/cpu/``, so a reader
opens the chapters (on the repository's web page, or the book rendered from them) without building anything.

- :func:`record` (``python -m tools.book record``, ``make record``): after a ``cpu`` build (``make book``), copy each
  chapter's executed notebook with its provenance section and a note saying which build it is, and the tables it
  read, into the record, with ``manifest.json`` stating the scale, the commit and the dates, the machine and what the
  build cost; then rewrite the introduction's list of links to the recorded chapters (the README links each one by
  its fixed path, ``companion.chapters.coverage.RECORDED``). It refuses a build
  that is not of one clean commit, not of every chapter, or older than a chapter's source notebook.
- :func:`check` (``python -m tools.book check-record``; ``tests/book/test_record.py``): what makes a record stale
  or wrong: a chapter of ``_toc.yml`` without a recorded notebook, a recorded notebook whose code cells differ from
  its source in ``notebooks/``, a record of another scale, a notebook that is not valid nbformat.
- :func:`stage` and :func:`build` (``python -m tools.book from-record``, ``make book FROM=record``): the HTML from the
  record, without training or executing: a source tree of the book in ``_build/record-source/`` whose
  ``book/generated/`` holds the recorded chapters (the checkout's own ``book/generated/`` and the workflow's outputs
  are left alone), rendered by jupyter-book as the workflow's last step renders a build.
- :func:`timings_markdown`: the timings page's section on the record: its commit, how many commits it is behind the
  checkout, its cost, and whether this book was rendered from it.

The standard library, nbformat and PyYAML; git is asked for commit dates and counts, and where it cannot answer the
page says so in words.
"""
from __future__ import annotations

import lzma
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from companion.atomic import write_atomically
from companion.chapters import cost

from . import steps

ROOT = steps.ROOT
SCALE = "cpu"  # the scale a record is of: the book a reader meets, built on a laptop (smoke is placeholders)
RECORDED = ROOT / "book" / "recorded"
MANIFEST = "manifest.json"
INPUTS = "inputs"  # the tables a chapter read, under their paths in the checkout (results/cpu/..., runs/cpu/...)
STAGE = ROOT / "_build" / "record-source"
TOC = ROOT / "_toc.yml"
README = ROOT / "README.md"
INTRO = ROOT / "book" / "intro.md"
MAX_FILE_BYTES = 2_000_000  # no tracked file above 2 MB: a larger table is kept xz-compressed (NAME.xz)
# The notebook-level papermill metadata kept (the parameters: the book reads the scale from them); the rest (absolute
# paths, times) is this machine's noise. Cell metadata dropped: papermill's and Jupyter's timing of each cell.
KEPT_PAPERMILL = ("parameters", "default_parameters", "version")
DROPPED_CELL_METADATA = ("papermill", "execution", "ExecuteTime", "collapsed", "scrolled")
WIDGET_MIME = ("application/vnd.jupyter.widget-view+json", "application/vnd.jupyter.widget-state+json")
NOTE_TAG = "recorded-build"  # the tag of the note cell a record adds under a chapter's title
# the code a chapter runs beside its notebook: commits touching these can change what a recorded chapter shows
CHAPTER_CODE = ("notebooks", "ief", "companion", "config", "workflow")
LINKS_START = "<!-- recorded: the executed chapters, by python -m tools.book record -->"
LINKS_END = "<!-- /recorded -->"


class RecordError(ValueError):
    """A build that cannot be recorded, or a record that cannot be used; the message says why and what to run."""


def record_dir(scale: str = SCALE, root: Path = RECORDED) -> Path:
    """The folder of a scale's record, ``book/recorded/<scale>/``."""
    return Path(root) / scale


def read_manifest(folder: Path | None = None) -> dict:
    """A record's manifest.

    Raises:
        RecordError: there is no manifest (nothing recorded yet).
    """
    path = Path(folder or record_dir()) / MANIFEST
    if not path.exists():
        raise RecordError(f"no record at {_shown(path.parent)}: after a cpu build (make book), run make record")
    return json.loads(path.read_text())


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


# ------------------------------------------------------------------------------------------------ the chapters
def toc_chapters(toc: Path = TOC) -> list[str]:
    """The chapters of ``_toc.yml`` that are notebooks of the book (``book/generated/<name>``), in the book's order."""
    import yaml

    data = yaml.safe_load(Path(toc).read_text())
    files = [c["file"] for part in data.get("parts", []) for c in part.get("chapters", [])]
    files += [c["file"] for c in data.get("chapters", [])]
    return [f.split("/")[-1] for f in files if f.startswith("book/generated/")]


def code_cells(nb) -> list[str]:
    """The sources of a notebook's code cells, papermill's injected-parameters cell left out."""
    return [c.source for c in nb.cells
            if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", [])]


def code_differences(recorded: Path, source: Path) -> list[str]:
    """How a recorded (executed) notebook's code cells differ from its source notebook's; [] when they are equal.

    Args:
        recorded: the executed notebook (a record's, or a build's).
        source: the chapter's notebook in ``notebooks/``.

    Returns:
        One line per difference: a code cell added, removed or changed (its number and first differing line).
    """
    import nbformat

    ours, theirs = code_cells(nbformat.read(recorded, as_version=4)), code_cells(nbformat.read(source, as_version=4))
    problems = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            line = next((x for x, y in zip(a.splitlines() + [""], b.splitlines() + [""]) if x != y), "")
            problems.append(f"code cell {i + 1} differs from the source (recorded: {line[:70]!r})")
    if len(ours) != len(theirs):
        problems.append(f"{len(ours)} code cells recorded, {len(theirs)} in the source")
    return problems


def check(folder: Path | None = None, notebooks: Path = steps.NOTEBOOKS, toc: Path = TOC) -> list[str]:
    """Everything that makes a record stale or wrong, in words; [] when the record is a valid ``cpu`` record of
    every chapter with the sources' code.

    Args:
        folder: the record (default ``book/recorded/cpu``).
        notebooks: the chapters' source notebooks.
        toc: the book's table of contents.
    """
    import nbformat

    folder = Path(folder or record_dir())
    try:
        manifest = read_manifest(folder)
    except RecordError as err:
        return [str(err)]
    problems = []
    if manifest.get("scale") != SCALE:
        problems.append(f"the record is of scale {manifest.get('scale')!r}, not {SCALE!r}")
    for name in toc_chapters(toc):
        path = folder / f"{name}.ipynb"
        if not path.exists() or name not in manifest.get("chapters", {}):
            problems.append(f"{name}: a chapter of the book with no record ({_shown(path)})")
            continue
        nb = nbformat.read(path, as_version=4)
        try:
            nbformat.validate(nb)
        except nbformat.ValidationError as err:
            problems.append(f"{name}: not valid nbformat: {str(err).splitlines()[0]}")
        scale = nb.metadata.get("papermill", {}).get("parameters", {}).get("scale")
        if scale != SCALE:
            problems.append(f"{name}: executed at scale {scale!r}, not {SCALE!r}")
        source = Path(notebooks) / f"{name}.ipynb"
        if not source.exists():
            problems.append(f"{name}: no source notebook {_shown(source)}")
            continue
        problems += [f"{name}: {p}; re-record after a cpu build (make book, then make record)"
                     for p in code_differences(path, source)]
    return problems


# ----------------------------------------------------------------------------------------------- recording
def _strip(nb, root: Path = ROOT) -> None:
    """Drop what is this machine's noise: widget state, per-cell timings, papermill's absolute paths; a path inside
    the checkout that an output prints is shown relative to it, as a reader's checkout has it."""
    prefix = str(Path(root).resolve()) + os.sep
    nb.metadata.pop("widgets", None)
    papermill = nb.metadata.get("papermill")
    if papermill is not None:
        nb.metadata["papermill"] = {k: papermill[k] for k in KEPT_PAPERMILL if k in papermill}
    for cell in nb.cells:
        for key in DROPPED_CELL_METADATA:
            cell.metadata.pop(key, None)
        for output in cell.get("outputs", []):
            for mime in WIDGET_MIME:
                output.get("data", {}).pop(mime, None)
            if isinstance(output.get("text"), str):
                output["text"] = output["text"].replace(prefix, "")
            for mime, value in output.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    output["data"][mime] = value.replace(prefix, "")


def build_cost(log: Path = steps.BUILD_LOG, committed: Path = cost.RECORD) -> dict:
    """What the recorded build cost: the build log's last successful cold ``cpu`` build, else the committed record's
    (``book/cold-builds.json``), with where it came from."""
    try:
        entry = cost.last_cold_build(steps.read_build_log(Path(log)), SCALE)
        source = _shown(Path(log))
    except ValueError:
        entry = cost.read_record(committed).get(SCALE)
        source = f"{_shown(Path(committed))} (the last cold cpu build recorded; this record's build was not cold)"
        if entry is None:
            return {"source": "none: no cold cpu build is logged or recorded"}
    keep = ("finished", "wall_time_s", "jobs", "job_seconds", "job_times", "cores", "machine", "other_cores",
            "load_average", "load", "note")
    return {"source": source, **{k: entry[k] for k in keep if k in entry}}


def cost_sentence(manifest: dict) -> str:
    """What the recorded build cost, and what rebuilding costs, in one sentence."""
    c = manifest.get("build", {})
    if "wall_time_s" not in c:
        return "Its build's cost was not logged; `make book` rebuilds every chapter."
    jobs = sum(s for *_, s in cost.job_time_by_rule(c))
    load = (f"; other processes kept {c['other_cores']:.2f} of the {c.get('cores', '?')} cores busy meanwhile"
            if c.get("other_cores") is not None else "")
    return (f"That build (`make book`: every training run, evaluation and notebook; {cost.machine_text(c)}) "
            f"took {cost.format_duration(c['wall_time_s'])} of wall time and {cost.format_duration(jobs)} of job "
            f"time{load}; rebuilding costs about as much, and rendering the book from this record (`make book "
            f"FROM=record`) runs nothing.")


def note_markdown(manifest: dict) -> str:
    """The note a recorded chapter opens with: which build it is, and what a rebuild costs (Markdown that GitHub's
    notebook viewer and the book both render)."""
    commit = manifest["commit"][:12]
    return (f"> **The recorded `{manifest['scale']}` build.** This chapter is shown as the `{manifest['scale']}` build "
            f"of commit `{commit}` ({manifest.get('commit_date', '?')[:10]}) executed it on "
            f"{manifest['built'][:10]}, recorded in `book/recorded/{manifest['scale']}/` so that it is read without "
            f"building. {cost_sentence(manifest)}")


def _note_cell(manifest: dict):
    import nbformat

    return nbformat.v4.new_markdown_cell(note_markdown(manifest), metadata={"tags": [NOTE_TAG]})


def _insert_note(nb, note) -> None:
    """The note right under the chapter's title: a first Markdown cell that opens with the title and goes on is split
    after the title's line (its text unchanged), and the note put between."""
    import nbformat

    first = nb.cells[0] if nb.cells else None
    if first is not None and first.cell_type == "markdown" and first.source.startswith("# "):
        title, _, rest = first.source.partition("\n")
        if rest.strip():
            first.source = title
            nb.cells.insert(1, nbformat.v4.new_markdown_cell(rest.lstrip("\n")))
    nb.cells.insert(1, note)


def _chapter_title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def record(scale: str = SCALE, executed_root: Path | None = None, folder: Path | None = None,
           notebooks: Path = steps.NOTEBOOKS, log: Path = steps.BUILD_LOG, committed: Path = cost.RECORD,
           markdown: tuple[Path, ...] | None = None, root: Path = ROOT) -> dict:
    """Record the executed chapters of a build (``python -m tools.book record``).

    Args:
        scale: the build's scale; only ``cpu`` is recorded.
        executed_root: the executed notebooks (default ``_build/executed``).
        folder: the record (default ``book/recorded/cpu``); its notebooks and inputs are replaced.
        notebooks: the chapters' source notebooks.
        log: the build log, for the build's cost.
        committed: the committed cold builds, for the cost where the log has no cold build.
        markdown: the files whose list of links to the recorded chapters is rewritten, where they hold its markers
            (default README.md, book/intro.md).
        root: the checkout the provenance's paths of the tables read are relative to.

    Returns:
        The manifest as written.

    Raises:
        RecordError: another scale, a chapter not executed, a build of several commits or of uncommitted code, a
            build older than a chapter's source, a table changed since the chapter read it, a file over 2 MB (a
            table: once compressed).
    """
    import nbformat

    if scale != SCALE:
        raise RecordError(f"only a {SCALE} build is recorded (got {scale!r}): the record is the book a reader meets")
    executed = Path(executed_root or ROOT / "_build" / "executed") / scale
    folder = Path(folder or record_dir(scale))
    names = sorted(p.stem for p in Path(notebooks).glob("*.ipynb"))
    provenance, missing = {}, []
    for name in names:
        nb_path, prov_path = executed / f"{name}.ipynb", executed / f"{name}.provenance.json"
        if not nb_path.exists() or not prov_path.exists():
            missing.append(name)
            continue
        provenance[name] = json.loads(prov_path.read_text())
    if missing:
        raise RecordError(f"not executed at scale {scale} in {_shown(executed)}: {', '.join(missing)}; run make book")
    commits = {p["git_commit"] for p in provenance.values()}
    if len(commits) != 1 or any(c.endswith("-dirty") or c == "unknown" for c in commits):
        raise RecordError(f"the chapters were executed at commits {sorted(commits)}: a record is one clean commit's "
                          "build; commit, then make book")
    stale = {n: d for n in names if (d := code_differences(executed / f"{n}.ipynb", Path(notebooks) / f"{n}.ipynb"))}
    if stale:
        raise RecordError("the build is older than these chapters' notebooks: "
                          + "; ".join(f"{n}: {d[0]}" for n, d in stale.items()) + "; run make book")
    commit = commits.pop()
    manifest = {
        "about": "The executed chapters of one cpu build, read without building (python -m tools.book record; "
                 "tools/book/record.py). Each notebook holds its outputs and its provenance; inputs/ holds the "
                 "tables the chapters read.",
        "scale": scale, "commit": commit,
        "commit_date": _git("show", "-s", "--format=%cI", commit, cwd=root) or "unknown",
        "built": max(p["finished"] for p in provenance.values()),
        "recorded": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "build": build_cost(log, committed), "chapters": {},
    }
    manifest["machine"] = {"cpu": manifest["build"].get("machine") or _cpu_model(),
                           "cores": manifest["build"].get("cores") or os.cpu_count()}
    texts, copies = {}, {}  # everything is made and checked before the record is touched
    for name in names:
        p = provenance[name]
        nb = nbformat.read(executed / f"{name}.ipynb", as_version=4)
        nb.cells.append(nbformat.v4.new_markdown_cell(steps.provenance_markdown(p)))
        _insert_note(nb, _note_cell(manifest))
        _strip(nb, Path(root))
        nbformat.validate(nb)
        text = nbformat.writes(nb)
        texts[f"{name}.ipynb"] = text if text.endswith("\n") else text + "\n"
        inputs = {rel: _checked_input(rel, digest, Path(root)) for rel, digest in p.get("results", {}).items()}
        copies.update(inputs)
        manifest["chapters"][name] = {"notebook": f"{name}.ipynb", "title": _chapter_title(nb),
                                      "inputs": [f"{INPUTS}/{rel}" for rel in inputs], "provenance": p}
    tables, renamed = {}, {}
    for rel, src in copies.items():
        name, tables[name] = _stored(rel, src)
        renamed[f"{INPUTS}/{rel}"] = f"{INPUTS}/{name}"
    for chapter in manifest["chapters"].values():
        chapter["inputs"] = [renamed[i] for i in chapter["inputs"]]
    sizes = {**{n: len(t.encode()) for n, t in texts.items()}, **{f"{INPUTS}/{n}": len(b) for n, b in tables.items()}}
    big = [f"{n} ({b / 1e6:.1f} MB)" for n, b in sizes.items() if b > MAX_FILE_BYTES]
    if big:
        raise RecordError(f"files over {MAX_FILE_BYTES / 1e6:.0f} MB would be recorded: {', '.join(big)}")
    shutil.rmtree(folder / INPUTS, ignore_errors=True)
    for old in folder.glob("*.ipynb"):
        old.unlink()
    for n, text in texts.items():
        write_atomically(folder / n, text)
    for stored, data in tables.items():
        write_atomically(folder / INPUTS / stored, data)
    manifest["size_bytes"] = sum(sizes.values())
    write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    for path in (README, INTRO) if markdown is None else markdown:
        update_links(path, manifest, folder)
    return manifest


def _stored(rel: str, src: Path) -> tuple[str, bytes]:
    """A table's name and bytes in the record: its path in the checkout and its bytes as read, or, over
    :data:`MAX_FILE_BYTES`, ``NAME.xz`` xz-compressed (the format stores no timestamp, so a re-record of the same table
    writes the same bytes; ``pd.read_csv`` reads either). xz, not gzip: the cpu grid's curves table (12 MB of CSV,
    sixty digits seeds) is 2.5 MB gzipped and 1.7 MB in xz."""
    data = src.read_bytes()
    if len(data) <= MAX_FILE_BYTES:
        return rel, data
    return rel + ".xz", lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)


def _cpu_model() -> str:
    from benchmarks.cpu import cpu_model

    return cpu_model()


def _checked_input(rel: str, digest: str, root: Path) -> Path:
    """A table a chapter read (``rel``: its path in the checkout, as the provenance names it), checked unchanged."""
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise RecordError(f"{rel}: a table read from outside the checkout cannot be recorded")
    source = root / rel
    if not source.exists() or steps._sha256(source) != digest:
        raise RecordError(f"{rel} changed or went missing since the chapter read it (sha256 {digest}); run make book")
    return source


# ------------------------------------------------------------------------------------------ links to the record
def links_markdown(manifest: dict, prefix: str) -> str:
    """A list linking each recorded chapter (``prefix``: the record's folder relative to the linking file)."""
    chapters = manifest["chapters"]
    order = [n for n in toc_chapters() if n in chapters] + sorted(set(chapters) - set(toc_chapters()))
    items = "\n".join(f"- [{chapters[n]['title'] or n}]({prefix}{chapters[n]['notebook']})" for n in order)
    return (f"The executed chapters, as the `{manifest['scale']}` build of commit `{manifest['commit'][:12]}` ran them "
            f"on {manifest['built'][:10]} (figures and tables as outputs; each opens on the repository's web page, "
            f"and downloads from the book):\n\n{items}\n")


def links_block(manifest: dict, path: Path, folder: Path | None = None) -> str:
    """:func:`links_markdown` between the markers, linked relative to ``path`` (the file that holds it)."""
    folder = Path(folder or record_dir(manifest["scale"])).resolve()
    prefix = os.path.relpath(folder, Path(path).resolve().parent).replace(os.sep, "/") + "/"
    return f"{LINKS_START}\n{links_markdown(manifest, prefix)}{LINKS_END}"


def update_links(path: Path, manifest: dict | None = None, folder: Path | None = None) -> bool:
    """Rewrite the links block of a Markdown file (between :data:`LINKS_START` and :data:`LINKS_END`); returns
    whether the file has the block."""
    text = Path(path).read_text()
    if LINKS_START not in text:
        return False
    start, end = text.index(LINKS_START), text.index(LINKS_END) + len(LINKS_END)
    block = links_block(manifest or read_manifest(folder), Path(path), folder)
    write_atomically(path, text[:start] + block + text[end:])
    return True


# ----------------------------------------------------------------------------------------------- staleness
def commits_behind(commit: str, cwd: Path = ROOT) -> tuple[int, int] | None:
    """How many commits the checkout is ahead of ``commit``: all of them, and those that touch the chapters' code
    (:data:`CHAPTER_CODE`); None where git cannot say (no git, a shallow clone without that commit)."""
    total = _git("rev-list", "--count", f"{commit}..HEAD", cwd=cwd)
    code = _git("rev-list", "--count", f"{commit}..HEAD", "--", *CHAPTER_CODE, cwd=cwd)
    if total is None or code is None or not total.isdigit():
        return None
    return int(total), int(code)


def timings_markdown(folder: Path | None = None, rendered: bool = False) -> str:
    """The timings page's section on the record: its build and commit, how many commits it is behind this
    checkout, and (``rendered``) that this book was rendered from it."""
    try:
        manifest = read_manifest(folder)
    except RecordError:
        return ("### The recorded build\n\nNo chapter is recorded yet: after a cpu build (`make book`), `make record` "
                "records them in `book/recorded/cpu/`.\n")
    behind = commits_behind(manifest["commit"])
    if behind is None:
        lag = ("How many commits it is behind this checkout is unknown here: git does not have that commit (a shallow "
               "clone) or is missing.")
    else:
        lag = (f"It is {behind[0]} commit{'s' * (behind[0] != 1)} behind this checkout, {behind[1]} of them changing "
               f"the chapters' code ({', '.join(f'`{c}/`' for c in CHAPTER_CODE)}).")
    how = ("**This book was rendered from the record** (`make book FROM=record`): nothing was trained or executed, "
           "every chapter is the recorded notebook. " if rendered else "")
    size = manifest.get("size_bytes", 0) / 2**20
    return (f"### The recorded build\n\n{how}The chapters in `book/recorded/{manifest['scale']}/` ({size:.1f} MiB, "
            f"linked from the introduction and the README) are the `{manifest['scale']}` build of commit "
            f"`{manifest['commit'][:12]}` ({manifest.get('commit_date', '?')[:10]}), executed on "
            f"{manifest['built']} ({manifest['machine']['cpu']}, {manifest['machine']['cores']} cores) and "
            f"recorded on {manifest['recorded']}. {lag} {cost_sentence(manifest)} Its build cost comes from "
            f"{manifest.get('build', {}).get('source', '?')}. After a cpu build, `make record` records it again.\n")


# ---------------------------------------------------------------------------------------- the book from it
_REPOSITORY = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")


def launch_config(environ: dict | None = None) -> dict:
    """The theme options that give the book its repository and its Binder and Colab buttons, where the build knows
    its repository: GitHub Actions states it (``GITHUB_SERVER_URL``, ``GITHUB_REPOSITORY``, ``GITHUB_REF_NAME``).
    The repository's own files name none, so a build elsewhere offers the notebook download alone: {}.

    Returns:
        Keys of ``sphinx.config.html_theme_options`` in ``_config.yml`` (which replaces what Jupyter Book derives
        from its ``repository:`` and ``launch_buttons:`` sections), to merge into it.
    """
    env = os.environ if environ is None else environ
    repo, server = env.get("GITHUB_REPOSITORY", ""), env.get("GITHUB_SERVER_URL", "")
    if not _REPOSITORY.match(repo) or server != "https://github.com":
        return {}
    return {"repository_url": f"{server}/{repo}", "repository_branch": env.get("GITHUB_REF_NAME") or "main",
            "path_to_docs": "", "use_repository_button": True,
            "launch_buttons": {"notebook_interface": "classic", "binderhub_url": "https://mybinder.org",
                               "colab_url": "https://colab.research.google.com"}}


def staged_config(config: dict, environ: dict | None = None) -> dict:
    """``_config.yml`` as the book from the record is built with: the launch settings of :func:`launch_config`
    merged into its theme options."""
    extra = launch_config(environ)
    if not extra:
        return config
    out = json.loads(json.dumps(config))
    options = out.setdefault("sphinx", {}).setdefault("config", {}).setdefault("html_theme_options", {})
    options.update({k: v for k, v in extra.items() if k != "launch_buttons"})
    options["launch_buttons"] = {**options.get("launch_buttons", {}), **extra["launch_buttons"]}
    return out


def stage(folder: Path | None = None, target: Path = STAGE, environ: dict | None = None) -> Path:
    """The book's source tree with the recorded chapters as ``book/generated/`` (the checkout's own is untouched).

    Args:
        folder: the record (default ``book/recorded/cpu``).
        target: where the tree is made (replaced).
        environ: where the repository is read from (:func:`launch_config`; default the process environment).

    Returns:
        The tree's root, for jupyter-book.

    Raises:
        RecordError: the record is missing or stale (:func:`check`).
    """
    import yaml

    folder = Path(folder or record_dir())
    problems = check(folder)
    if problems:
        raise RecordError("the record cannot be rendered:\n  " + "\n  ".join(problems))
    manifest = read_manifest(folder)
    target = Path(target)
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(ROOT / "book", target / "book", ignore=shutil.ignore_patterns("generated", "__pycache__"))
    shutil.copy2(TOC, target / "_toc.yml")
    config = staged_config(yaml.safe_load((ROOT / "_config.yml").read_text()), environ)
    write_atomically(target / "_config.yml", yaml.safe_dump(config, sort_keys=False))
    (target / "examples").symlink_to(ROOT / "examples", target_is_directory=True)  # api.md includes the quick start
    # the book's extension reads the benchmark tables (benchmarks.report) from beside the tree it renders
    (target / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    (target / "_build").mkdir()
    (target / "_build" / "vendor").symlink_to(steps.VENDOR, target_is_directory=True)  # MathJax, served offline
    generated = target / "book" / "generated"
    generated.mkdir()
    executed = target / "_build" / "executed" / manifest["scale"]
    executed.mkdir(parents=True)
    for name, chapter in manifest["chapters"].items():
        shutil.copy2(folder / chapter["notebook"], generated / chapter["notebook"])
        # the coverage table reads which chapters were executed, at which scale, from their provenance
        write_atomically(executed / f"{name}.provenance.json", json.dumps(chapter["provenance"], indent=2))
    text = (timings_markdown(folder, rendered=True) + "\n"
            + steps.timings_table(executed_root=target / "_build" / "not-executed-here"))
    write_atomically(generated / "timings.md", text)
    return target


def build(output: Path | None = None, folder: Path | None = None) -> int:
    """``make book FROM=record``: MathJax (once), the source tree (:func:`stage`), jupyter-book; returns the exit
    status (0: done), having said what failed."""
    started = time.time()
    try:
        source = stage(folder)
        steps.mathjax()
        index = steps.jupyter_book(output, source=source)
    except (RecordError, RuntimeError, OSError, subprocess.CalledProcessError) as err:
        steps.log_line(f"FAILED: {err}")
        return 1
    steps.log_line(f"the book from the record in {steps.format_minutes(time.time() - started)}: open file://{index}")
    return 0
