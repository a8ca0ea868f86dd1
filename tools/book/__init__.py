"""The book builder, one module per role:

- :mod:`tools.book.steps`: the library of build steps (execute a notebook with its provenance, publish it, the
  timings page, MathJax, jupyter-book) and what the workflow reads (``from tools.book import steps as BOOK`` in
  workflow/rules/common.smk);
- :mod:`tools.book.driver`: what ``make book`` runs: Snakemake on the workflow, its output made short, each build
  timed and logged;
- :mod:`tools.book.record`: the recorded build (``book/recorded/cpu/``): recording a cpu build's executed chapters,
  the check that the record is not stale, and the book rendered from it (``make book FROM=record``);
- :mod:`tools.book.cli`: the command line ``python -m tools.book STEP`` (``build``, and each step as the workflow's
  rules call it).
"""
