"""The recorded build (tools/book/record.py, ``book/recorded/cpu/``): every chapter of the book is recorded, at the
cpu scale, with its source's code cells, as valid notebooks holding their figures, small, linked from the README and
the introduction; the check that says so fails on a record whose code differs (shown on a copy), and names each way a
synthetic record goes wrong; recording refuses a build it cannot vouch for; the timings page says how many commits the
record is behind; the book renders from the record with the command the publishing workflow
(.github/workflows/book.yml) runs, read from that file and run here as written, so the two cannot drift; the launch
buttons open the recorded notebooks.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from tools.book import record, steps

ROOT = steps.ROOT
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"
FOLDER = record.record_dir()


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _run_steps() -> list[str]:
    return [s["run"].strip() for s in _workflow()["jobs"]["build"]["steps"] if "run" in s]


# ------------------------------------------------------------------------------------------------ the record
def test_every_chapter_is_recorded_at_cpu_with_its_sources_code_cells():
    problems = record.check()
    assert not problems, ("the record is stale or wrong (re-record: make book, then make record):\n"
                          + "\n".join(problems))


def test_the_recorded_notebooks_are_valid_and_hold_their_figures_as_png():
    """What a reader opens on the repository's web page: valid nbformat, every figure a PNG output (no widget state,
    no run folder, no machine's paths), at most page width."""
    from companion.chapters.common import BOOK_CONTENT_PX

    manifest = record.read_manifest()
    figures = {}
    for name, chapter in manifest["chapters"].items():
        nb = nbformat.read(FOLDER / chapter["notebook"], as_version=4)
        nbformat.validate(nb)
        text = (FOLDER / chapter["notebook"]).read_text()
        assert "widget-view+json" not in text and "widget-state+json" not in text, name
        assert str(ROOT) not in text, f"{name}: a path of the machine that built it"
        assert nb.cells[1].metadata.get("tags") == [record.NOTE_TAG], f"{name}: no note under the title"
        assert manifest["commit"][:12] in nb.cells[1].source
        pngs = [o["data"]["image/png"] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                if "image/png" in o.get("data", {})]
        figures[name] = len(pngs)
        for png in pngs:
            import base64
            import struct

            width = struct.unpack(">I", base64.b64decode(png)[16:20])[0]
            assert width <= 2 * BOOK_CONTENT_PX, f"{name}: a {width} px wide PNG (page width: {BOOK_CONTENT_PX} px)"
    drawn = [n for n, k in figures.items() if k]
    assert len(drawn) >= len(figures) - 1, f"chapters without a PNG figure: {[n for n, k in figures.items() if not k]}"


def test_the_record_is_small_and_says_its_size():
    files = [f for f in FOLDER.rglob("*") if f.is_file()]
    big = [f"{f.relative_to(ROOT)} ({f.stat().st_size / 1e6:.1f} MB)" for f in files
           if f.stat().st_size > record.MAX_FILE_BYTES]
    assert not big, big
    total = sum(f.stat().st_size for f in files if f.name != record.MANIFEST)
    assert total < 16 * 2**20, f"the record is {total / 2**20:.1f} MiB"
    manifest = record.read_manifest()
    assert abs(manifest["size_bytes"] - total) < 200_000  # the manifest was written last
    assert manifest["scale"] == "cpu" and manifest["machine"]["cpu"] and manifest["machine"]["cores"]
    assert "wall_time_s" in manifest["build"], manifest["build"]
    assert not (FOLDER / record.INPUTS / "runs").exists() or all(
        f.name == "summary.json" for f in (FOLDER / record.INPUTS / "runs").rglob("*") if f.is_file())


def test_no_file_of_the_record_is_ignored_by_git():
    """The record's tables sit under ``inputs/results`` and ``inputs/runs``, names the checkout ignores elsewhere: a
    clone must get them (a record committed without them passed here and failed in a fresh clone)."""
    files = [str(f.relative_to(ROOT)) for f in FOLDER.rglob("*") if f.is_file()]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout == "", ignored.stdout


def test_the_readme_and_the_introduction_link_every_recorded_chapter():
    """The introduction holds the list :func:`record.links_block` writes (the commit, a link per chapter); the README
    links each chapter's recorded notebook by its path (its chapter map, ``companion.chapters.coverage.RECORDED``,
    and its prose)."""
    from companion.chapters.coverage import RECORDED

    manifest = record.read_manifest()
    assert RECORDED + "/" == str(FOLDER.relative_to(ROOT)) + "/"
    assert record.links_block(manifest, record.INTRO) in record.INTRO.read_text(), "re-run make record"
    for path in (record.README, record.INTRO):
        text = path.read_text()
        for name, chapter in manifest["chapters"].items():
            link = os.path.relpath(FOLDER / chapter["notebook"], path.parent)
            assert f"]({link})" in text, f"{path.name} does not link {link}"
            assert (path.parent / link).exists()


# ----------------------------------------------------------------------------------- the check, on a copy
def test_the_check_fails_on_a_copy_whose_code_cells_differ(tmp_path):
    """The real record, copied, then changed as a stale record would be: each change is reported."""
    copy = tmp_path / "cpu"
    shutil.copytree(FOLDER, copy)
    assert record.check(copy) == []
    name = record.toc_chapters()[0]
    path = copy / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    tags = lambda c: set(c.metadata.get("tags", []))  # noqa: E731
    cell = next(c for c in nb.cells if c.cell_type == "code" and not tags(c) & {"parameters", "injected-parameters"})
    cell.source += "\nprint('a line the source does not have')"
    nbformat.write(nb, path)
    problems = record.check(copy)
    assert len(problems) == 1 and problems[0].startswith(f"{name}: code cell") and "differs" in problems[0], problems


def _synthetic(tmp_path: Path, scale: str = "cpu", commit: str = "a" * 40) -> dict:
    """A source notebook, its executed copy with provenance, a table it read, a toc and a README with the links'
    markers, in tmp_path."""
    notebooks, executed = tmp_path / "notebooks", tmp_path / "_build" / "executed" / scale
    notebooks.mkdir()
    executed.mkdir(parents=True)
    source = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell(f'scale = "{scale}"')
    params.metadata["tags"] = ["parameters"]
    source.cells = [nbformat.v4.new_markdown_cell("# A chapter\n\nIts claim."), params,
                    nbformat.v4.new_code_cell("import pandas as pd\nx = 1"), nbformat.v4.new_code_cell("x + 1")]
    nbformat.write(source, notebooks / "chap.ipynb")
    ran = nbformat.from_dict(json.loads(nbformat.writes(source)))
    injected = nbformat.v4.new_code_cell(f'scale = "{scale}"\nout_dir = "_build/figures"')
    injected.metadata["tags"] = ["injected-parameters"]
    ran.cells.insert(2, injected)
    ran.cells[-1].outputs = [nbformat.v4.new_output("display_data", data={
        "text/plain": "2", "application/vnd.jupyter.widget-view+json": {"model_id": "x"}}),
        nbformat.v4.new_output("stream", name="stderr", text=f"wrote {tmp_path.resolve()}/_build/figures/a.png\n")]
    ran.cells[-1].metadata["papermill"] = {"duration": 0.1}
    ran.metadata["papermill"] = {"parameters": {"scale": scale}, "input_path": "/somewhere/chap.ipynb"}
    ran.metadata["widgets"] = {"state": {}}
    nbformat.write(ran, executed / "chap.ipynb")
    table = tmp_path / "results" / scale / "table.csv"
    table.parent.mkdir(parents=True)
    table.write_text("a,b\n1,2\n")
    provenance = {"notebook": "notebooks/chap.ipynb", "scale": scale, "parameters": {"scale": scale},
                  "git_commit": commit, "packages": {"torch": "x"}, "python": "3", "threads": "1",
                  "results": {f"results/{scale}/table.csv": steps._sha256(table)}, "wall_time_s": 1.0,
                  "finished": "2026-12-01 22:00:00 UTC"}
    (executed / "chap.provenance.json").write_text(json.dumps(provenance))
    (tmp_path / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nparts:\n  - caption: x\n    chapters:\n"
                                       "      - file: book/generated/chap\n")
    (tmp_path / "README.md").write_text(f"# x\n\n{record.LINKS_START}\nold\n{record.LINKS_END}\n\nmore\n")
    log = tmp_path / "build-log.jsonl"
    log.write_text(json.dumps({"scale": "cpu", "kind": "cold", "returncode": 0, "wall_time_s": 3600.0,
                               "jobs": {"train": 2}, "job_seconds": {"train": 5000.0}, "cores": 2,
                               "machine": "A CPU", "other_cores": 0.5, "finished": "2026-12-01 22:00:01 UTC"}) + "\n")
    return {"notebooks": notebooks, "executed_root": tmp_path / "_build" / "executed", "log": log,
            "folder": tmp_path / "record" / scale, "markdown": (tmp_path / "README.md",), "root": tmp_path,
            "committed": tmp_path / "none.json"}


def test_record_writes_the_chapters_their_inputs_manifest_and_links(tmp_path):
    args = _synthetic(tmp_path)
    manifest = record.record(**args)
    folder = args["folder"]
    assert manifest["scale"] == "cpu" and manifest["commit"] == "a" * 40 and manifest["machine"]["cpu"] == "A CPU"
    assert manifest["build"]["wall_time_s"] == 3600.0 and manifest["chapters"]["chap"]["title"] == "A chapter"
    assert (folder / "inputs" / "results" / "cpu" / "table.csv").read_text() == "a,b\n1,2\n"
    nb = nbformat.read(folder / "chap.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].source == "# A chapter"  # the note right under the title, the claim after it
    assert nb.cells[1].metadata["tags"] == [record.NOTE_TAG] and "1 h 00 min" in nb.cells[1].source
    assert nb.cells[2].source == "Its claim."
    assert nb.cells[-1].source.startswith("## Provenance")
    assert "widgets" not in nb.metadata and nb.metadata["papermill"] == {"parameters": {"scale": "cpu"}}
    assert all("papermill" not in c.metadata for c in nb.cells)
    assert "application/vnd.jupyter.widget-view+json" not in nbformat.writes(nb)
    assert nb.cells[-2].outputs[1]["text"] == "wrote _build/figures/a.png\n"  # the recording checkout's path
    readme = (tmp_path / "README.md").read_text()
    assert "old" not in readme and "- [A chapter](record/cpu/chap.ipynb)" in readme and readme.endswith("more\n")
    assert record.check(folder, notebooks=args["notebooks"], toc=tmp_path / "_toc.yml") == []


def test_the_check_names_each_way_a_record_goes_wrong(tmp_path):
    args = _synthetic(tmp_path)
    record.record(**args)
    folder, kw = args["folder"], {"notebooks": args["notebooks"], "toc": tmp_path / "_toc.yml"}
    source = nbformat.read(args["notebooks"] / "chap.ipynb", as_version=4)
    source.cells[-1].source = "x + 2"  # the chapter changed after it was recorded
    nbformat.write(source, args["notebooks"] / "chap.ipynb")
    assert record.check(folder, **kw) == [
        "chap: code cell 3 differs from the source (recorded: 'x + 1'); re-record after a cpu build (make book, "
        "then make record)"]
    source.cells.append(nbformat.v4.new_code_cell("x + 3"))
    nbformat.write(source, args["notebooks"] / "chap.ipynb")
    assert any("3 code cells recorded, 4 in the source" in p for p in record.check(folder, **kw))
    manifest = json.loads((folder / record.MANIFEST).read_text())
    manifest["scale"] = "smoke"
    (folder / record.MANIFEST).write_text(json.dumps(manifest))
    assert any("not 'cpu'" in p for p in record.check(folder, **kw))
    (folder / "chap.ipynb").unlink()
    assert any("a chapter of the book with no record" in p for p in record.check(folder, **kw))


@pytest.mark.parametrize("change", ["smoke", "dirty", "stale", "table"])
def test_record_refuses_a_build_it_cannot_vouch_for(tmp_path, change):
    args = _synthetic(tmp_path, scale="smoke" if change == "smoke" else "cpu",
                      commit="b" * 40 + ("-dirty" if change == "dirty" else ""))
    if change == "stale":
        nb = nbformat.read(args["notebooks"] / "chap.ipynb", as_version=4)
        nb.cells[-1].source = "x + 10"
        nbformat.write(nb, args["notebooks"] / "chap.ipynb")
    if change == "table":
        (tmp_path / "results" / "cpu" / "table.csv").write_text("changed\n")
    with pytest.raises(record.RecordError) as err:
        record.record(scale="smoke" if change == "smoke" else "cpu", **args)
    assert {"smoke": "only a cpu build", "dirty": "one clean commit", "stale": "older than these chapters",
            "table": "changed or went missing"}[change] in str(err.value)
    assert not args["folder"].exists()  # nothing half-written


# ------------------------------------------------------------------------------------------- the timings page
def test_the_timings_page_says_how_many_commits_the_record_is_behind(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    parent = subprocess.run(["git", "rev-parse", "HEAD~1"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert record.commits_behind(head) == (0, 0)
    between = subprocess.run(["git", "rev-list", "--count", f"{parent}..HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    assert record.commits_behind(parent)[0] == int(between) >= 1  # HEAD~1 is more than one behind after a merge
    assert record.commits_behind("0" * 40) is None
    args = _synthetic(tmp_path, commit=parent)
    record.record(**args)
    text = record.timings_markdown(args["folder"], rendered=True)
    assert f"It is {between} commit{'s' * (between != '1')} behind this checkout" in text
    assert "rendered from the record" in text
    assert "No chapter is recorded yet" in record.timings_markdown(tmp_path / "nothing")
    page = steps.timings_table(executed_root=tmp_path, record_section=text)
    assert page.startswith("### The recorded build") and "### The last cold build" in page


# --------------------------------------------------------------------------------- the book and its workflow
def test_the_publishing_workflow_runs_the_commands_the_tests_run():
    """.github/workflows/book.yml: the conventional Jupyter Book deploy to GitHub Pages on each push to main, whose
    run steps are ``make env`` (the install every target runs first: the same recipe, checked with ``make -n``) and
    ``make book FROM=record`` (its recipe checked with ``make -n``),
    and whose artifact is where that command writes the book."""
    flow = _workflow()
    assert flow[True]["push"]["branches"] == ["main"]  # YAML 1.1 reads the key `on` as True
    build = flow["jobs"]["build"]["steps"]
    uses = [s["uses"].split("@")[0] for s in build if "uses" in s]
    assert uses == ["actions/checkout", "actions/setup-python", "actions/upload-pages-artifact"]
    assert [s["uses"].split("@")[0] for s in flow["jobs"]["deploy"]["steps"]] == ["actions/deploy-pages"]
    assert flow["permissions"] == {"contents": "read", "pages": "write", "id-token": "write"}
    assert build[0]["with"]["fetch-depth"] == 0  # the timings page counts commits since the record's
    assert _run_steps() == ["make env", "make book FROM=record"]
    assert next(s for s in build if "upload-pages-artifact" in s.get("uses", ""))["with"]["path"] == "_build/html"
    lock = (ROOT / "requirements" / "ci.lock").read_text()
    assert f"Python {build[1]['with']['python-version']}" in lock.splitlines()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES",
                                                             "PYTHON", "BOOK_OUTPUT", "FROM")}
    env.update(flow["jobs"]["build"]["env"])

    def dry(*args: str) -> list[str]:
        done = subprocess.run(["make", "--no-print-directory", "-n", *args, "VENV=/nonexistent/ief-venv"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    install = dry(*_run_steps()[0].split()[1:])
    book = dry(*_run_steps()[1].split()[1:])
    assert book[:len(install)] == install and "--extra-index-url https://download.pytorch.org/whl/cpu" in install[2]
    assert book[len(install):] == ["/nonexistent/ief-venv/bin/python -m tools.book from-record "]


@pytest.mark.slow
def test_the_book_renders_from_the_record_as_the_workflow_runs_it(tmp_path):
    """The workflow's command, run as written (this interpreter as PYTHON, the book in a folder of its own): every
    chapter page says it is the recorded build and of which commit, the timings page that the book was rendered from
    the record, and the checkout's own book/generated/ is untouched."""
    command = _run_steps()[1]
    generated = {p: p.stat().st_mtime for p in steps.GENERATED.glob("*")} if steps.GENERATED.exists() else {}
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    env.update(PYTHON=sys.executable, BOOK_OUTPUT=str(tmp_path))
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    html = tmp_path / "_build" / "html"
    manifest = record.read_manifest()
    for name in record.toc_chapters():
        page = (html / "book" / "generated" / f"{name}.html").read_text()
        assert "The recorded" in page and manifest["commit"][:12] in page, name
        assert f"_sources/book/generated/{name}.ipynb" in page  # the notebook download
    assert "This book was rendered from the record" in (html / "book" / "intro.html").read_text()
    after = {p: p.stat().st_mtime for p in steps.GENERATED.glob("*")} if steps.GENERATED.exists() else {}
    assert after == generated


def test_the_launch_buttons_and_the_introductions_links_open_the_recorded_notebooks():
    """On GitHub Actions the book knows its repository and offers Binder and Colab, each opening the chapter's
    recorded notebook (book/_ext/record_book.py); elsewhere none (no file of the repository names its URL). The
    introduction's links to the recorded notebooks are downloads in the book (a link to a notebook outside the
    table of contents would be a build error)."""
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        import record_book
    finally:
        sys.path.pop(0)
    assert record_book.RECORDED == str(FOLDER.relative_to(ROOT)) + "/"
    assert record.launch_config({}) == {}
    github = {"GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": "someone/ief-companion",
              "GITHUB_REF_NAME": "main"}
    config = record.staged_config(yaml.safe_load((ROOT / "_config.yml").read_text()), github)
    options = config["sphinx"]["config"]["html_theme_options"]
    assert options["repository_url"] == "https://github.com/someone/ief-companion"
    assert options["launch_buttons"]["binderhub_url"] == "https://mybinder.org" and options["use_download_button"]
    url = "https://mybinder.org/v2/gh/someone/ief-companion/main?urlpath=tree/book/generated/train.ipynb"
    assert record_book.recorded_url(url).endswith("tree/book/recorded/cpu/train.ipynb")
    context = {"header_buttons": [{"label": "launch-buttons", "buttons": [{"url": url}]}]}
    record_book._point_launch_buttons_at_the_record(None, "book/generated/train", None, context, None)
    assert context["header_buttons"][0]["buttons"][0]["url"].endswith("book/recorded/cpu/train.ipynb")
    intro = record.INTRO.read_text()
    block = intro[intro.index(record.LINKS_START):intro.index(record.LINKS_END)]
    links = [line for line in block.splitlines() if line.startswith("- [")]
    assert links and all("](path:recorded/cpu/" in record_book.downloaded_links(line) for line in links)
    postbuild = (ROOT / "binder" / "postBuild").read_text()
    assert "\nmake env TORCH_INDEX=https://download.pytorch.org/whl/cpu\n" in postbuild  # the project's own install


def test_a_table_over_the_size_cap_is_recorded_compressed(tmp_path, monkeypatch):
    """No recorded file above the cap: a larger table is kept as NAME.xz (listed so in the manifest), the same bytes
    on a second record (no timestamp in the xz format), and pandas reads it back as the chapter read it."""
    import lzma

    import pandas as pd

    args = _synthetic(tmp_path)
    table = tmp_path / "results" / "cpu" / "table.csv"
    table.write_text("a,b\n" + "1,2\n3,4\n" * 2500)
    provenance = args["executed_root"] / "cpu" / "chap.provenance.json"
    p = json.loads(provenance.read_text())
    p["results"] = {"results/cpu/table.csv": steps._sha256(table)}
    provenance.write_text(json.dumps(p))
    monkeypatch.setattr(record, "MAX_FILE_BYTES", 10_000)
    manifest = record.record(**args)
    stored = args["folder"] / "inputs" / "results" / "cpu" / "table.csv.xz"
    assert manifest["chapters"]["chap"]["inputs"] == ["inputs/results/cpu/table.csv.xz"]
    assert not stored.with_suffix("").exists() and stored.stat().st_size < 10_000
    assert lzma.decompress(stored.read_bytes()) == table.read_bytes()
    assert pd.read_csv(stored).equals(pd.read_csv(table))
    first = stored.read_bytes()
    record.record(**args)
    assert stored.read_bytes() == first
