"""Sphinx extension for reading the book beside the paper.

- ``{paper}`eqn:iEF_lsq``` renders as the paper's reader knows it, "Eq. (8)" (from ``companion/paper/labels.json``, made
  once from the LaTeX by ``python -m tools.paper_labels``); the raw key is kept only as the hover title. An unknown or
  unnumbered label is a build error (the book builds with ``-W``).
- ``{coverage}`summary``` puts the coverage sentence into prose, from code, never typed. (A full-scale run's cost is
  a generated block of the page's Markdown, ``companion.chapters.cost.fullcost_blocks``, so that GitHub shows it too.)
- ``{coverage-table}`` (a directive) writes the coverage table from the registry :mod:`companion.chapters.coverage` at
  build time, for the scale of the published chapters and the provenance records of this build, with each chapter
  linked: the page and the README cannot drift from the code.
- ``{benchmark-tables}`` (a directive) writes the benchmark tables from the committed JSON in ``benchmarks/results/``
  (:mod:`benchmarks.report`, the same text as the README's benchmark block) at build time.
- papermill's injected-parameters cell is dropped from the page: the parameters cell is shown once (its defaults;
  the values this build used are in the chapter's provenance section).
- Every figure can be enlarged with a click, offline (``book/_static/enlarge.js``, no CDN); tables show every row,
  wrap text, and a table or display equation wider than the page is set in a smaller font until it fits
  (``book/_static/book.css``, ``book/_static/fit-tables.js``).
"""
from __future__ import annotations

import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def paper_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    from companion.paper import cite

    label = text.strip()
    try:
        shown = cite(label)
    except KeyError as err:
        msg = inliner.reporter.error(f"{{paper}}: {err}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    return [nodes.abbreviation(shown, shown, explanation=f"paper: {label}", classes=["paper-ref"])], []


def coverage_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """``{coverage}`summary``` -> the registry's coverage count at the scale this book was built at."""
    from companion.chapters.coverage import book_state, coverage_sentence

    try:
        scale, executed = book_state(ROOT)
    except ValueError as err:
        msg = inliner.reporter.error(f"{{coverage}}: {err}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    return [nodes.Text(coverage_sentence(scale, executed))], []


class CoverageTable(Directive):
    """The paper's figures and tables, each with its status at each scale (regenerated, same figure as another,
    no analogue, wired but not executed), from the registry and this build's provenance records."""

    has_content = False

    def run(self):
        from companion.chapters.coverage import book_state, coverage_markdown, coverage_sentence

        scale, executed = book_state(ROOT)  # a ValueError (chapters of mixed scales) fails the build, naming them
        lines = [coverage_sentence(scale, executed), ""] + coverage_markdown(executed, links=True).splitlines()
        container = nodes.container(classes=["coverage"])
        self.state.nested_parse(StringList(lines, source="companion.chapters.coverage"), self.content_offset, container)
        return container.children


class BenchmarkTables(Directive):
    """The measured speed and memory tables, each with its machine, date, load and command (``benchmarks.report``);
    with an argument (a benchmark's name, e.g. ``defaults``), that benchmark's tables alone."""

    has_content = False
    optional_arguments = 1

    def run(self):
        from benchmarks.report import load, markdown

        container = nodes.container(classes=["benchmarks"])
        docs = load()
        if self.arguments:
            docs = [doc for doc in docs if doc["benchmark"] == self.arguments[0]]
            if not docs:
                raise self.error(f"no benchmark record named {self.arguments[0]!r} in benchmarks/results/")
        lines = markdown(docs, level="###").splitlines()
        self.state.nested_parse(StringList(lines, source="benchmarks.report"), self.content_offset, container)
        return container.children


def _cite_labels_in_docstrings(app, what, name, obj, options, lines) -> None:
    """The API page cites the paper by its numbers too: ``eqn:iEF_lsq`` in a docstring reads "Eq. (8)"."""
    from companion.paper import cite_keys

    lines[:] = [cite_keys(line) for line in lines]


def _drop_injected_parameters(app, doctree) -> None:
    for node in list(doctree.findall(nodes.container)):
        if "tag_injected-parameters" in node.get("classes", []):
            node.parent.remove(node)


def setup(app):
    app.add_role("paper", paper_role)
    app.add_role("coverage", coverage_role)
    app.add_directive("coverage-table", CoverageTable)
    app.add_directive("benchmark-tables", BenchmarkTables)
    app.connect("doctree-read", _drop_injected_parameters)
    app.connect("autodoc-process-docstring", _cite_labels_in_docstrings)
    app.add_css_file("book.css")
    app.add_js_file("enlarge.js")
    app.add_js_file("fit-tables.js")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
