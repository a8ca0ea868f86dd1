"""The time each Snakemake job took, read from Snakemake's own output (:class:`JobClock`) or its log file
(:func:`read_snakemake_log`): what the book's driver (:mod:`tools.book.driver`) logs for every build and what
:func:`tools.book.steps.record_cold_build` reads for a build logged before ``job_times`` existed."""
from __future__ import annotations

import re
import time
from pathlib import Path

JOB = re.compile(r"^\s*(?:local)?rule (\w+):\s*$")  # a job's first line: ``rule NAME:`` (``localrule`` too)
SEEDS_RULE = "train_seeds"  # the rules (train_seeds, train_seeds_1, ...) whose one job trains several seeds
_SEED_OUTPUT = re.compile(r"seed-(\d+)/summary\.json")


class JobClock:
    """The time each job of a Snakemake run took, from Snakemake's own output: a ``[timestamp]`` line, then a job's
    ``rule NAME:``, ``jobid: N`` and ``wildcards: ...`` when it starts, and ``Finished jobid: N (Rule: NAME)`` when it
    ends (one-second resolution); a ``train_seeds`` job's ``output:`` line names the runs it trained (``seeds``).
    ``seconds()``: ``{rule: seconds summed over its jobs}``, what the build log keeps to say where a build's time went;
    ``jobs()``: each job's rule, wildcards and seconds, what a chapter's cost is summed from
    (:func:`companion.chapters.cost.chapter_cost`). The same lines are in Snakemake's own log
    (``.snakemake/log/*.snakemake.log``), which :func:`read_snakemake_log` reads."""

    _STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ [\d:]+ \d{4})\]\s*$")
    _START = re.compile(r"^\s+jobid: (\d+)\s*$")
    _WILDCARDS = re.compile(r"^\s+wildcards: (.*)$")
    _OUTPUT = re.compile(r"^\s+output: (.*)$")
    _END = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)")

    def __init__(self) -> None:
        self.now: float | None = None
        self.rule: str | None = None
        self.last: str | None = None
        self.started: dict[str, tuple[str, float]] = {}
        self.wildcards: dict[str, dict[str, str]] = {}
        self.outputs: str | None = None  # the output line of the job being announced
        self.seeds: dict[str, list[int]] = {}
        self.spent: dict[str, float] = {}
        self.finished: list[dict] = []

    def line(self, line: str) -> None:
        if stamp := self._STAMP.match(line):
            self.now = time.mktime(time.strptime(" ".join(stamp.group(1).split()), "%a %b %d %H:%M:%S %Y"))
        elif job := JOB.match(line):
            self.rule, self.last, self.outputs = job.group(1), None, None
        elif (output := self._OUTPUT.match(line)) and self.rule is not None:
            self.outputs = output.group(1)
        elif (start := self._START.match(line)) and self.rule is not None and self.now is not None:
            self.started[start.group(1)] = (self.rule, self.now)
            if self.rule.startswith(SEEDS_RULE) and self.outputs is not None:
                self.seeds[start.group(1)] = [int(s) for s in _SEED_OUTPUT.findall(self.outputs)]
            self.rule, self.last = None, start.group(1)
        elif (wild := self._WILDCARDS.match(line)) and self.last is not None:
            pairs = (p.split("=", 1) for p in wild.group(1).split(", ") if "=" in p)
            self.wildcards[self.last] = {k.strip(): v.strip() for k, v in pairs}
            self.last = None
        elif (end := self._END.match(line)) and end.group(1) in self.started and self.now is not None:
            rule, began = self.started.pop(end.group(1))
            self.spent[rule] = self.spent.get(rule, 0.0) + self.now - began
            if rule != "all":
                job = {"rule": rule, "wildcards": self.wildcards.pop(end.group(1), {}),
                       "seconds": round(self.now - began, 1)}
                if end.group(1) in self.seeds:
                    job["seeds"] = self.seeds.pop(end.group(1))
                self.finished.append(job)

    def seconds(self) -> dict[str, float]:
        return {rule: round(s, 1) for rule, s in sorted(self.spent.items(), key=lambda kv: -kv[1]) if rule != "all"}

    def jobs(self) -> list[dict]:
        """Each finished job (``all`` left out), in the order they finished: ``{"rule", "wildcards", "seconds"}``,
        and ``"seeds"`` for a ``train_seeds`` job."""
        return list(self.finished)


def read_snakemake_log(path: Path) -> JobClock:
    """A :class:`JobClock` fed Snakemake's own log of a run (``.snakemake/log/<date>.snakemake.log``): each job's
    time for a build whose build-log entry predates ``job_times``."""
    clock = JobClock()
    with open(path) as fh:
        for line in fh:
            clock.line(line)
    return clock
