"""The book's command line, ``python -m tools.book STEP``: the driver (``build``, what ``make book`` runs) and each
build step the workflow's rules call (``execute``, ``publish``, ``timings``, ``mathjax``, ``jupyter-book``).

    python -m tools.book build --scale cpu              # what `make book` runs (SCALE=cpu|smoke|full, PROFILE=...)
    python -m tools.book build --scale smoke --output _build/smoke      # what `make test` runs first
    python -m tools.book execute notebooks/train.ipynb --scale full    # one step, as a rule runs it

- ``build``: run the workflow (:func:`tools.book.driver.build`); ``--`` passes the rest to Snakemake (``-n``).
- ``execute NOTEBOOK --scale S``: run one notebook with its provenance (:func:`tools.book.steps.execute`).
- ``publish EXECUTED``: copy it into ``book/generated/`` with its provenance (:func:`tools.book.steps.publish`).
- ``timings``: ``book/generated/timings.md`` (:func:`tools.book.steps.write_timings`).
- ``record-cold-build --log _build/build-log.jsonl --load idle|loaded``: put the log's last successful cold build
  into the committed record ``book/cold-builds.json``, replacing that scale's entry
  (:func:`tools.book.steps.record_cold_build`).
- ``record``: after a cpu build, its executed chapters and the tables they read into ``book/recorded/cpu/`` with
  their manifest, and the README's and the introduction's links to them (:func:`tools.book.record.record`).
- ``check-record``: what makes the record stale or wrong, one line each; exit 1 if anything
  (:func:`tools.book.record.check`).
- ``from-record [--output D]``: the HTML from the recorded chapters, nothing executed (``make book FROM=record``;
  :func:`tools.book.record.build`).
- ``mathjax``: MathJax 3 from the npm registry into ``_build/vendor``, once (:func:`tools.book.steps.mathjax`).
- ``jupyter-book [--output D]``: the HTML, execution off, warnings are errors (:func:`tools.book.steps.jupyter_book`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import driver, record, steps


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand (``build`` when none is named); returns the exit status (0: done)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    subcommands = ("build", "execute", "publish", "timings", "record-cold-build", "record", "check-record",
                   "from-record", "mathjax", "jupyter-book")
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
    r = sub.add_parser("record-cold-build", help="record a build log's last cold build in book/cold-builds.json")
    r.add_argument("--log", type=Path, default=steps.BUILD_LOG, help="the build log (default _build/build-log.jsonl)")
    r.add_argument("--load", required=True, choices=("idle", "loaded"),
                   help="idle: nothing else ran on the machine; loaded: other work shared it")
    r.add_argument("--scale", choices=steps.SCALES, default=None, help="the scale (default: the log's last cold build)")
    r.add_argument("--note", default=None, help="what to say of the load or the build, shown beside it")
    r.add_argument("--other-cores", type=float, default=None,
                   help="cores other processes kept busy on average, measured outside the driver (where the log "
                        "has no measurement of its own)")
    r.add_argument("--machine", default=None, help="the machine's CPU, where the log does not name it")
    r.add_argument("--total-wall-s", type=float, default=None,
                   help="the whole command's wall time, measured outside the driver (make book from a fresh clone, "
                        "its virtual environment included)")
    r.add_argument("--snakemake-log", type=Path, default=None,
                   help="Snakemake's own log of that build (.snakemake/log/*.snakemake.log), for each job's time "
                        "where the build log has none")
    r.add_argument("--record", type=Path, default=None, help="the record (default book/cold-builds.json)")
    sub.add_parser("record", help="record the executed chapters of a cpu build in book/recorded/cpu (make record)")
    sub.add_parser("check-record", help="say what makes the record stale or wrong (exit 1 if anything)")
    f = sub.add_parser("from-record",
                       help="the HTML from the recorded chapters, nothing executed (make book FROM=record)")
    f.add_argument("--output", type=Path, default=None, help="build into OUTPUT/_build/html instead of _build/html")
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
            steps.write_timings(record_section=record.timings_markdown())
        elif args.step == "record-cold-build":
            try:
                entry = steps.record_cold_build(args.log, args.load, scale=args.scale, note=args.note,
                                                other_cores=args.other_cores, machine=args.machine,
                                                total_wall_s=args.total_wall_s, snakemake_log=args.snakemake_log,
                                                record=args.record)
            except (ValueError, OSError) as err:  # no cold build in the log, a missing file: say so, no traceback
                steps.log_line(f"FAILED: {err}")
                return 1
            steps.log_line(f"recorded the cold {entry['scale']} build of {entry['finished']} "
                           f"({steps.format_minutes(entry['wall_time_s'])}, {entry['load']}) in "
                           f"{args.record or steps.cost.RECORD}")
        elif args.step == "record":

            try:
                manifest = record.record()
            except record.RecordError as err:
                steps.log_line(f"FAILED: {err}")
                return 1
            steps.log_line(f"recorded {len(manifest['chapters'])} chapters of commit {manifest['commit'][:12]} in "
                           f"{record.record_dir().relative_to(steps.ROOT)} ({manifest['size_bytes'] / 2**20:.1f} MiB)")
        elif args.step == "check-record":

            problems = record.check()
            for line in problems:
                steps.log_line(f"record: {line}")
            if problems:
                return 1
            steps.log_line("the record is a cpu build of every chapter, with the sources' code cells")
        elif args.step == "from-record":

            return record.build(args.output)
        elif args.step == "mathjax":
            steps.mathjax()
        else:
            steps.jupyter_book(args.output)
    except (steps.NotebookFailed, RuntimeError, subprocess.CalledProcessError) as err:
        steps.log_line(f"FAILED: {err}")
        return 1
    return 0
