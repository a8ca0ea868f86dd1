"""The book's command line, ``python -m tools.book STEP``: the driver (``build``, what ``make book`` runs) and each
build step the workflow's rules call (``execute``, ``publish``, ``timings``, ``mathjax``, ``jupyter-book``).

    python -m tools.book build --scale cpu              # what `make book` runs (SCALE=cpu|smoke|full, PROFILE=...)
    python -m tools.book build --scale smoke --output _build/smoke      # what `make test` runs first
    python -m tools.book execute notebooks/train.ipynb --scale full    # one step, as a rule runs it

- ``build``: run the workflow (:func:`tools.book.driver.build`); ``--`` passes the rest to Snakemake (``-n``).
- ``execute NOTEBOOK --scale S``: run one notebook with its provenance (:func:`tools.book.steps.execute`).
- ``publish EXECUTED``: copy it into ``book/generated/`` with its provenance (:func:`tools.book.steps.publish`).
- ``timings``: ``book/generated/timings.md`` (:func:`tools.book.steps.write_timings`).
- ``mathjax``: MathJax 3 from the npm registry into ``_build/vendor``, once (:func:`tools.book.steps.mathjax`).
- ``jupyter-book [--output D]``: the HTML, execution off, warnings are errors (:func:`tools.book.steps.jupyter_book`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import driver, steps


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand (``build`` when none is named); returns the exit status (0: done)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    subcommands = ("build", "execute", "publish", "timings", "mathjax", "jupyter-book")
    if not argv or argv[0] not in subcommands + ("-h", "--help"):
        argv = ["build", *argv]  # python -m tools.book --scale smoke
    parser = argparse.ArgumentParser(prog="python -m tools.book", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build", help="run the workflow (make book)")
    b.add_argument("--scale", default=os.environ.get("SCALE", "cpu"))
    b.add_argument("--output", type=Path, default=None,
                   help="build into OUTPUT/_build/html instead of _build/html (the tests build the smoke book "
                        "into _build/smoke so a reader's book is left alone)")
    b.add_argument("--profile", default=os.environ.get("PROFILE", "default"),
                   help="workflow/profiles/<PROFILE>: default (this machine) or slurm")
    b.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of config/config.yaml, e.g. seeds=[0] or runs=/scratch/runs (repeatable)")
    b.add_argument("--verbose", action="store_true", help="show Snakemake's output in full")
    b.add_argument("snakemake_args", nargs="*", help="passed on to snakemake (after --), e.g. -n or --cores 2")
    e = sub.add_parser("execute", help="execute one notebook (a workflow step)")
    e.add_argument("notebook", type=Path)
    e.add_argument("--scale", required=True)
    e.add_argument("--results", nargs="*", type=Path, default=[], help="result files the notebook reads")
    e.add_argument("--runs-dir", default=None, help="the workflow's training runs (passed as runs_dir if declared)")
    e.add_argument("--results-dir", default=None,
                   help="the workflow's tidy tables of this scale (passed as results_dir if declared)")
    p = sub.add_parser("publish", help="copy an executed notebook into book/generated with its provenance")
    p.add_argument("executed", type=Path)
    sub.add_parser("timings", help="write book/generated/timings.md")
    sub.add_parser("mathjax", help="install MathJax from npm into _build/vendor (once)")
    j = sub.add_parser("jupyter-book", help="jupyter-book build -W (execution off)")
    j.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    if args.step in ("build", "execute") and args.scale not in steps.SCALES:
        parser.error(f"unknown scale {args.scale!r}; accepted: {', '.join(steps.SCALES)}")
    try:
        if args.step == "build":
            return driver.build(args.scale, args.output, args.profile, args.snakemake_args, verbose=args.verbose,
                                config=args.config)
        if args.step == "execute":
            steps.execute(args.notebook, args.scale, results=args.results, runs_dir=args.runs_dir,
                          results_dir=args.results_dir)
        elif args.step == "publish":
            steps.publish(args.executed)
        elif args.step == "timings":
            steps.write_timings()
        elif args.step == "mathjax":
            steps.mathjax()
        else:
            steps.jupyter_book(args.output)
    except (steps.NotebookFailed, RuntimeError, subprocess.CalledProcessError) as err:
        steps.log_line(f"FAILED: {err}")
        return 1
    return 0
