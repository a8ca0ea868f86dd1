"""The book's driver: what ``make book`` runs (``python -m tools.book build``). It runs the workflow
(workflow/Snakefile, profile workflow/profiles/<profile>) with Snakemake, which decides what is out of date and calls
the build steps (:mod:`tools.book.steps`, through :mod:`tools.book.cli`); it shows Snakemake's output short (one line
per job) and times and logs every build in ``_build/build-log.jsonl`` (the book's timings page reads it): one JSON line
per build with its scale, kind (``cold``: every notebook executed and the book built; ``no-op``; ``partial``), exit
status, wall time, jobs run and their time by rule (``job_seconds``) and one by one (``job_times``: rule, wildcards,
seconds), the machine (``cores``, ``machine``), the cores other processes kept busy meanwhile (``other_cores``) and the
load average at its start and end. ``python -m tools.book record-cold-build`` copies a cold build from it into the
committed record ``book/cold-builds.json`` (:mod:`companion.chapters.cost`).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cpu import cpu_model

from . import steps
from .job_clock import JOB, JobClock

_DETAIL = re.compile(r"^\s+(input|output|log|jobid|reason|resources|threads|benchmark|priority|shell|message):")
_NOISE = re.compile(r"^(\[\w{3} \w{3} +\d+ [\d:]+ \d{4}\]|Select jobs to execute|Execute \d+ jobs|SNAKEMAKE|=+$|"
                    r"  (Date|Workflow ID|Platform|Host|User|Python version|Command|Snakefile|Base directory|"
                    r"Run directory|Working directory|Config file\(s\)|Config MD5):|Using shell:|"
                    r"Rules claiming more threads|Assuming unrestricted shared|Building DAG|Using profiles|"
                    r"Config file config/config.yaml is extended|\s*$)")


class OtherLoad:
    """The cores other processes kept busy while the build ran, on average (Linux ``/proc/stat``): the machine's
    busy time less the build's own (this process and its children: Snakemake and its jobs, once waited for), over
    the wall time; and the 1-minute load average at the start and the end. ``None`` where the system has neither.
    A build is only as comparable as this figure (the benchmarks' harness measures the same)."""

    def __init__(self) -> None:
        self.start = self._read()
        self.load0 = self._loadavg()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as fh:
                vals = [int(x) for x in fh.readline().split()[1:9]]
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return None
        t = os.times()
        busy = (sum(vals) - vals[3] - vals[4]) / tick  # all but idle and iowait
        return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()

    @staticmethod
    def _loadavg() -> float | None:
        try:
            return round(os.getloadavg()[0], 2)
        except OSError:
            return None

    def stop(self) -> dict:
        """``{"other_cores": ..., "load_average": [start, end]}`` (a value None where it could not be read)."""
        end, load1 = self._read(), self._loadavg()
        cores = None
        if self.start is not None and end is not None and end[2] > self.start[2]:
            cores = round(max(0.0, ((end[0] - self.start[0]) - (end[1] - self.start[1])) / (end[2] - self.start[2])), 2)
        return {"other_cores": cores,
                "load_average": [self.load0, load1] if self.load0 is not None and load1 is not None else None}


class _Console:
    """Snakemake's output made short: one line per job started (rule and wildcards), progress and everything after
    the first error in full."""

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.pending: str | None = None
        self.failing = False

    def _flush(self) -> None:
        if self.pending:
            print(f"[workflow] {self.pending}", flush=True)
            self.pending = None

    def line(self, line: str) -> None:
        self.failing = self.failing or bool(re.search(r"Error|Exception|Traceback|WorkflowError", line))
        if self.verbose or self.failing:
            self._flush()
            sys.stdout.write(line)
            sys.stdout.flush()
            return
        job = JOB.match(line)
        if job:
            self._flush()
            self.pending = job.group(1)
        elif line.strip().startswith("wildcards:") and self.pending:
            self.pending += " (" + line.split(":", 1)[1].strip() + ")"
            self._flush()
        elif not _DETAIL.match(line) and not _NOISE.match(line):
            self._flush()
            sys.stdout.write(line)
            sys.stdout.flush()


def build(scale: str, output: Path | None = None, profile: str = "default", extra: list[str] | None = None,
          log: Path = steps.BUILD_LOG, verbose: bool = False, config: list[str] | None = None) -> int:
    """Run the workflow (Snakemake) for ``scale``; time it and log it (``_build/build-log.jsonl``).

    ``config``: more ``KEY=VALUE`` settings of config/config.yaml (e.g. ``seeds=[0]``, ``runs=/scratch/runs``);
    ``extra``: arguments passed on to Snakemake (targets, ``-n``, ``--cores 2``)."""
    problem = steps.missing_build_tools()
    if problem:
        steps.log_line(f"FAILED before running anything: {problem}")
        return 1
    profile_dir = steps.ROOT / "workflow" / "profiles" / profile
    if not profile_dir.is_dir():
        available = ", ".join(sorted(p.name for p in (steps.ROOT / "workflow" / "profiles").iterdir()))
        steps.log_line(f"FAILED: unknown profile {profile!r}; available: {available}")
        return 2
    dry = any(a in ("-n", "--dry-run", "--dryrun") for a in extra or [])
    if profile == "slurm":  # the profile reads $SLURM_ACCOUNT and $SLURM_PARTITION (empty: the cluster's default)
        os.environ.setdefault("SLURM_PARTITION", "")
        if not os.environ.get("SLURM_ACCOUNT") and not dry:
            steps.log_line("FAILED: the slurm profile needs the account to charge: export SLURM_ACCOUNT=<account> "
                 "(sacctmgr show assoc user=$USER lists yours); SLURM_PARTITION optionally")
            return 2
    settings = [f"scale={scale}"] + ([f"book_output={output}"] if output else []) + list(config or [])
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(steps.ROOT / "workflow" / "Snakefile"),
               "--directory", str(steps.ROOT), "--profile", str(profile_dir), "--config", *settings, *(extra or [])]
    steps.log_line(f"scale={scale}, profile={profile}: snakemake " + " ".join(command[3:]))
    started = time.time()
    load = OtherLoad()
    jobs: dict[str, int] = {}
    noop = False
    console = _Console(verbose or any(a in ("-n", "--dry-run", "--dryrun") for a in extra or []))
    clock = JobClock()
    with subprocess.Popen(command, cwd=steps.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        try:
            for line in proc.stdout:
                console.line(line)
                clock.line(line)
                match = JOB.match(line)
                if match:
                    jobs[match.group(1)] = jobs.get(match.group(1), 0) + 1
                noop = noop or "Nothing to be done" in line
            returncode = proc.wait()
        except KeyboardInterrupt:  # Snakemake got the same SIGINT: let it stop its jobs cleanly
            returncode = proc.wait()
    wall = time.time() - started
    measured = load.stop()
    if not dry:
        executed = jobs.get("execute_notebook", 0)
        notebooks = len(list(steps.NOTEBOOKS.glob("*.ipynb")))
        kind = ("no-op" if noop else "cold" if executed == notebooks and jobs.get("book") else "partial")
        jobs.pop("all", None)
        entry = {"scale": scale, "profile": profile, "kind": kind, "returncode": returncode,
                 "wall_time_s": round(wall, 1), "jobs": jobs, "job_seconds": clock.seconds(),
                 "job_times": clock.jobs(), "cores": os.cpu_count(), "machine": cpu_model(), **measured,
                 "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(json.dumps(entry) + "\n")
    status = "done" if returncode == 0 else f"FAILED (snakemake exited with {returncode})"
    steps.log_line(f"{status} in {steps.format_minutes(wall)}; jobs {'planned' if dry else 'run'}: {jobs or 'none'}")
    if returncode == 0 and not dry:
        index = (Path(output).resolve() if output else steps.ROOT) / "_build" / "html" / "index.html"
        steps.log_line(f"open file://{index}")
    return returncode
