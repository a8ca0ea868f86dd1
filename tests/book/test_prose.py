"""The prose says what the code and the records say: the README's and benchmarks/README's generated blocks, the
commands the documents name, the book pages that render the coverage and the benchmark tables, and the paper's labels
the book's pages and notebooks cite. These pin documents (they change with the prose), so they live in the book's
tier; the generators themselves are tested in tests/companion."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

from benchmarks import report
from companion.chapters.coverage import readme_block
from companion.paper import labels

ROOT = Path(__file__).resolve().parents[2]
ROLE = re.compile(r"\{paper\}`([^`]+)`")
RAW_KEY = re.compile(r"(?<![\w{`/])(?:eqn|fig|tab|sec|lemma|theorem|ass|alg):[A-Za-z0-9_\-]+")


def test_documented_commands_name_existing_benchmarks():
    texts = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "book").glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.py"))]
    named = set()
    for path in texts:
        named |= set(re.findall(r"python -m benchmarks[. ](\w+)", path.read_text())) - {"NAME"}
    assert named, "no benchmark command found in the docs"
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / f"{n}.py").exists())
    assert not missing, f"documented benchmark commands without a module: {missing}"



def test_readme_block_equals_the_committed_json():
    assert report.block(report.load()) in (ROOT / "benchmarks" / "README.md").read_text(), (
        "benchmarks/README.md's block differs from benchmarks/results/*.json: "
        "run python -m benchmarks.report benchmarks/README.md")



def test_book_api_page_renders_the_same_tables():
    assert "```{benchmark-tables}\n```" in (ROOT / "book" / "api.md").read_text()
    ext = (ROOT / "book" / "_ext" / "paper_book.py").read_text()
    assert 'add_directive("benchmark-tables", BenchmarkTables)' in ext
    assert "from benchmarks.report import load, markdown" in ext



def test_readme_states_coverage_from_the_registry():
    assert readme_block() in (ROOT / "README.md").read_text(), (
        "the README's coverage block differs from companion/chapters/coverage.py: run "
        "python -m companion.chapters.coverage README.md")



def _book_texts() -> dict[str, str]:
    """Every text a reader meets: the book's markdown pages and the notebooks' markdown cells."""
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "book").glob("*.md")}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = nbformat.read(nb, as_version=4).cells
        texts[str(nb.relative_to(ROOT))] = "\n".join(c.source for c in cells if c.cell_type == "markdown")
    return texts



def test_every_label_the_book_cites_is_in_the_map():
    used = {(where, key) for where, text in _book_texts().items() for key in ROLE.findall(text)}
    assert used, "the book cites no label of the paper"
    unknown = [(w, k) for w, k in used if k not in labels()]
    assert not unknown, unknown



def test_no_raw_label_key_in_the_books_prose():
    raw = {}
    for where, text in _book_texts().items():
        text = ROLE.sub("", text)
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # shell examples may name files
        found = [k for k in RAW_KEY.findall(text) if k in labels()]
        if found:
            raw[where] = found
    assert not raw, raw


def test_the_book_pages_render_the_coverage_registry():
    """The coverage page and the introduction render the registry through their directives, and the coverage page
    sits before the errata in the table of contents."""
    assert "{coverage-table}" in (ROOT / "book" / "coverage.md").read_text()
    assert "{coverage}`summary`" in (ROOT / "book" / "intro.md").read_text()
    toc = (ROOT / "_toc.yml").read_text()
    assert "- file: book/coverage\n      - file: book/errata\n" in toc
