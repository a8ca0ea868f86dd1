"""What the book cost to build: the committed record of the last cold build of each scale, and each chapter's share.

A fresh clone has no ``_build/``, so the cold builds the book states live in a committed record,
``book/cold-builds.json`` (:data:`RECORD`): one entry per scale, written by ``python -m tools.book record-cold-build``
from a build's log (``_build/build-log.jsonl``, written by :mod:`tools.book.driver`). An entry holds what the driver
measured (the date it finished, the machine and its cores, the wall time, the jobs run and their time summed by rule,
and, where the log has them, each job's time and the cores other processes kept busy) and what the person recording
it says of the machine's load (``idle`` or ``loaded``, with a note).

What reads it: the timings page (:func:`tools.book.steps.timings_table`, through :func:`cold_builds_markdown`), and the
chapters, which state what they cost with :func:`chapter_cost` (the job time of the training runs, evaluations and
jobs whose results the chapter reads, and of its own notebook) and, for the E2 chapter's budget sentence,
:func:`e2_training_cost`. Which results a chapter reads is ``notebook_results`` in ``config/config.yaml``, the same
list the workflow gives its notebook job; which jobs make each kind of result is :data:`KIND_JOBS`.

Standard library only at import (the build steps read it while Snakemake parses the workflow); the chapter functions
import the setups' registry when called.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from companion.atomic import write_atomically

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "book" / "cold-builds.json"
CONFIG = ROOT / "config" / "config.yaml"
SCALES = ("smoke", "cpu", "full")
LOADS = ("idle", "loaded")
ABOUT = ("The last cold build of each scale (every notebook executed, the book built), one entry per scale, written by "
         "`python -m tools.book record-cold-build --log _build/build-log.jsonl --load idle|loaded` from the build's "
         "log; read by the book's timings page and the chapters' cost sentences (companion/chapters/cost.py).")
# Rules shown under one name in the job-time summary (the rest keep their own): a setup's evaluation is its
# per-stage jobs and the job assembling them; the book is its publishing, timings, MathJax and HTML jobs.
RULE_GROUPS = {"train": "train", "evaluate_stage": "evaluate", "evaluate": "evaluate",
               "execute_notebook": "notebooks", "publish": "book", "timings": "book", "mathjax": "book",
               "book": "book"}
GROUP_ORDER = ("train", "evaluate", "notebooks")
SEEDS_RULE = "train_seeds"  # the workflow's rules (train_seeds, train_seeds_1, ...) whose job trains several seeds


def rule_group(rule: str) -> str:
    """The name a rule's jobs are shown under (:data:`RULE_GROUPS`; a ``train_seeds`` rule's under ``train``)."""
    return "train" if rule.startswith(SEEDS_RULE) else RULE_GROUPS.get(rule, rule)


def train_runs(job: dict) -> list[tuple[str, str, int]]:
    """The training runs ``(setup, optimizer, seed)`` a recorded job made: one for a ``train`` job, its ``seeds``
    for a ``train_seeds`` job, none for any other job."""
    w = job.get("wildcards", {})
    if job["rule"] == "train":
        return [(w.get("setup"), w.get("optimizer"), int(w.get("seed", -1)))]
    if job["rule"].startswith(SEEDS_RULE):
        return [(w.get("setup"), w.get("optimizer"), int(seed)) for seed in job.get("seeds", [])]
    return []


# ----------------------------------------------------------------------------------------------------- formatting
def format_duration(seconds: float) -> str:
    """A duration as a reader reads it.

    Args:
        seconds: the duration (non-negative).

    Returns:
        ``"42 s"`` below two minutes, ``"3 min 05 s"`` below an hour, else ``"1 h 26 min"``.
    """
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min"


def _jobs(n: int) -> str:
    return f"{n} job" + ("" if n == 1 else "s")


# ------------------------------------------------------------------------------------------------- the record
def read_record(path: str | Path = RECORD) -> dict[str, dict]:
    """The committed cold builds, ``{scale: entry}`` (empty when the file does not exist).

    Args:
        path: the record (default :data:`RECORD`).

    Returns:
        One entry per recorded scale, as :func:`record_cold_build` wrote it.

    Raises:
        ValueError: the file is not a record (no ``builds`` object, an unknown scale, an entry without its wall time).
    """
    path = Path(path)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    builds = data.get("builds") if isinstance(data, dict) else None
    if not isinstance(builds, dict):
        raise ValueError(f"{path}: not a cold-build record (expected an object with 'builds')")
    for scale, entry in builds.items():
        if scale not in SCALES or not isinstance(entry, dict) or "wall_time_s" not in entry:
            raise ValueError(f"{path}: bad entry {scale!r}; scales: {', '.join(SCALES)}, each with its wall_time_s")
    return builds


def last_cold_build(log_entries: list[dict], scale: str | None = None) -> dict:
    """The last successful cold build of a build log (of ``scale``, or of any scale).

    Args:
        log_entries: the build log's entries, oldest first (``tools.book.steps.read_build_log``).
        scale: the scale wanted; None: the last cold build whatever its scale.

    Returns:
        The entry.

    Raises:
        ValueError: the log has no successful cold build (of that scale); the message says what it has.
    """
    cold = [e for e in log_entries if e.get("kind") == "cold" and e.get("returncode") == 0
            and (scale is None or e.get("scale") == scale)]
    if not cold:
        seen = ", ".join(f"{e.get('scale')} {e.get('kind')} (exit {e.get('returncode')})" for e in log_entries)
        raise ValueError(f"no successful cold build{f' at scale {scale}' if scale else ''} in the log; "
                         f"it has: {seen or 'nothing'}")
    return cold[-1]


def record_cold_build(entry: dict, load: str, path: str | Path = RECORD, note: str | None = None,
                      other_cores: float | None = None, machine: str | None = None,
                      total_wall_s: float | None = None, job_times: list[dict] | None = None) -> dict:
    """Put a cold build into the record, replacing that scale's entry (atomically).

    Args:
        entry: the build log's entry of a successful cold build (:func:`last_cold_build`).
        load: ``idle`` (nothing else ran) or ``loaded`` (other work shared the machine).
        path: the record (default :data:`RECORD`).
        note: what the recorder says of the load or the build, shown beside it.
        other_cores: the cores other processes kept busy on average, measured outside the driver; the log's own
            measurement (``other_cores``) wins when it has one.
        machine: the machine's CPU, where the log does not name it.
        total_wall_s: the whole command's wall time measured outside the driver (``make book`` from a fresh clone,
            its virtual environment included).
        job_times: each job's time (``[{"rule", "wildcards", "seconds"}]``), where the log has none (read from
            Snakemake's own log by ``tools.book``).

    Returns:
        The entry as recorded.

    Raises:
        ValueError: the entry is not a successful cold build, or ``load`` is neither idle nor loaded.
    """
    if entry.get("kind") != "cold" or entry.get("returncode") != 0:
        raise ValueError(f"only a successful cold build is recorded; this one is {entry.get('kind')!r} with exit "
                         f"status {entry.get('returncode')!r}")
    if load not in LOADS:
        raise ValueError(f"load must be one of {', '.join(LOADS)}, got {load!r}")
    if entry.get("scale") not in SCALES:
        raise ValueError(f"unknown scale {entry.get('scale')!r}; accepted: {', '.join(SCALES)}")
    keep = ("scale", "profile", "finished", "wall_time_s", "jobs", "job_seconds", "cores", "machine", "other_cores",
            "load_average", "job_times")
    out = {k: entry[k] for k in keep if entry.get(k) is not None}
    if "other_cores" not in out and other_cores is not None:
        out["other_cores"] = round(float(other_cores), 2)
    if "machine" not in out and machine:
        out["machine"] = machine
    if "job_times" not in out and job_times:
        out["job_times"] = job_times
    if total_wall_s is not None:
        out["total_wall_time_s"] = round(float(total_wall_s), 1)
    out["load"] = load
    if note:
        out["note"] = note
    path = Path(path)
    builds = read_record(path)
    builds[out["scale"]] = out
    ordered = {s: builds[s] for s in SCALES if s in builds}
    write_atomically(path, _dumps(ordered))
    return out


def _dumps(builds: dict[str, dict]) -> str:
    """The record as JSON a reader can scan: one line per field of an entry, one line per job."""
    lines = ["{", f' "about": {json.dumps(ABOUT)},', ' "builds": {']
    for i, (scale, entry) in enumerate(builds.items()):
        fields = []
        for key, value in entry.items():
            if key == "job_times":
                jobs = ",\n".join(f"    {json.dumps(job)}" for job in value)
                fields.append(f'   "job_times": [\n{jobs}\n   ]')
            else:
                fields.append(f"   {json.dumps(key)}: {json.dumps(value)}")
        comma = "," if i < len(builds) - 1 else ""
        lines.append(f"  {json.dumps(scale)}: {{\n" + ",\n".join(fields) + "\n  }" + comma)
    return "\n".join(lines + [" }", "}"]) + "\n"


# ------------------------------------------------------------------------------------------------- summaries
def job_time_by_rule(entry: dict) -> list[tuple[str, int, float]]:
    """A build's job time grouped as a reader asks for it: ``[(name, jobs, seconds)]``, train, evaluate and notebooks
    first, then the other rules by time (:data:`RULE_GROUPS`)."""
    jobs, spent = entry.get("jobs", {}), entry.get("job_seconds", {})
    groups: dict[str, list[float]] = {}
    for rule in set(jobs) | set(spent):
        if rule == "all":
            continue
        g = groups.setdefault(rule_group(rule), [0, 0.0])
        g[0] += int(jobs.get(rule, 0))
        g[1] += float(spent.get(rule, 0.0))
    first = [(n, *groups[n]) for n in GROUP_ORDER if n in groups]
    rest = sorted(((n, *v) for n, v in groups.items() if n not in GROUP_ORDER), key=lambda r: -r[2])
    return [(n, int(c), s) for n, c, s in first + rest]


def load_text(entry: dict) -> str:
    """``idle`` or ``loaded``, with the measured load of other processes and the recorder's note where there are."""
    text = entry.get("load", "load not stated")
    if entry.get("other_cores") is not None:
        text += (f": other processes kept {entry['other_cores']:.2f} of its {entry.get('cores', '?')} cores busy on "
                 "average")
    if entry.get("note"):
        text += f" ({entry['note']})"
    return text


def machine_text(entry: dict) -> str:
    """The machine: its CPU where recorded, and its cores."""
    cores = f"{entry['cores']} cores" if entry.get("cores") else "cores not recorded"
    return f"{entry['machine']}, {cores}" if entry.get("machine") else cores


def cold_builds_markdown(record: dict[str, dict]) -> str:
    """The timings page's section on the committed cold builds: one row per scale (a scale never recorded says so),
    then where each recorded build's job time went, by rule."""
    rows, spent = [], []
    for scale in SCALES:
        e = record.get(scale)
        if e is None:
            rows.append(f"| `{scale}` | no cold build recorded | | | | |")
            continue
        wall = format_duration(e["wall_time_s"])
        if e.get("total_wall_time_s"):
            wall += f" (the whole command, environment included: {format_duration(e['total_wall_time_s'])})"
        total = sum(s for _, _, s in job_time_by_rule(e))
        rows.append(f"| `{scale}` | {e.get('finished', '?')} | {machine_text(e)} | {load_text(e)} | {wall} | "
                    f"{format_duration(total)} |")
        parts = ", ".join(f"{name} {format_duration(s)} ({_jobs(n)})" for name, n, s in job_time_by_rule(e))
        spent.append(f"- `{scale}`: {parts}.")
    text = ("| scale | finished | machine | load | wall time | job time (all jobs) |\n"
            "| --- | --- | --- | --- | ---: | ---: |\n" + "\n".join(rows) + "\n")
    if spent:
        text += ("\nJob time by workflow rule (each job's time from Snakemake's start and finish lines, summed; "
                 "jobs run side by side, so it exceeds the wall time on several cores):\n\n" + "\n".join(spent) + "\n")
    return text


# ------------------------------------------------------------------------------------------------ per chapter
def _registry():
    from companion.experiments import setups

    return setups


def _is_baseline_run(job: dict, scale: str, setups: tuple[str, ...] | None = None) -> bool:
    reg = _registry()
    return any((setups is None or setup in setups) and optimizer == reg.baseline_optimizer(setup)
               and seed == reg.EVALUATION_SEED for setup, optimizer, seed in train_runs(job))


def _evaluation_of(job: dict, scale: str, setups: tuple[str, ...] | None = None) -> bool:
    if job["rule"] in ("evaluate_stage", "evaluate"):
        return setups is None or job.get("wildcards", {}).get("setup") in setups
    return _is_baseline_run(job, scale, setups)


def _chapter_run(job: dict, scale: str) -> bool:
    return tuple(_registry().TRAIN_CHAPTER_RUN[scale]) in train_runs(job)


def _compression(job: dict, scale: str) -> bool:
    baseline = scale in ("smoke", "cpu") and ("digits-mlp", "adam", 0) in train_runs(job)
    return job["rule"] == "compression" or baseline


def _blockdiag(job: dict, scale: str) -> bool:
    return job["rule"] == "blockdiag_check" or _evaluation_of(job, scale, _registry().blockdiag_setups(scale))


# notebook_results kind (config/config.yaml) -> the jobs that make it, their own inputs included: "e2" is aggregate_e2
# on every run of the grid; "early_spike" reads the E2 tables; "blockdiag_check" the evaluation tables and baseline
# runs of the block-diagonal figure's setups; "verdicts" the E2 tables and the evaluation tables
# (workflow/rules/results.smk).
KIND_JOBS = {
    "e2": lambda job, scale: bool(train_runs(job)) or job["rule"] == "aggregate_e2",
    "eval": _evaluation_of,
    "chapter_run": _chapter_run,
    "costs": lambda job, scale: job["rule"] == "step_costs",
    "early_spike": lambda job, scale: bool(train_runs(job)) or job["rule"] in ("early_spike", "aggregate_e2"),
    "compression": _compression,
    "blockdiag_check": _blockdiag,
    "verdicts": lambda job, scale: (bool(train_runs(job)) or job["rule"] in ("verdicts", "aggregate_e2")
                                    or _evaluation_of(job, scale)),
}


def notebook_results(config: str | Path = CONFIG) -> dict[str, list[str]]:
    """``{notebook stem: [result kinds]}`` from the workflow's configuration (``notebook_results``)."""
    import yaml

    kinds = (yaml.safe_load(Path(config).read_text()) or {}).get("notebook_results") or {}
    return {name.removesuffix(".ipynb"): list(v) for name, v in kinds.items()}


@dataclass(frozen=True)
class Cost:
    """Job time from one recorded cold build: ``seconds`` in all, ``by_rule`` ``{rule group: (jobs, seconds)}``, and
    the build it was measured in (``scale``, ``finished``, ``cores``, ``load``)."""

    seconds: float
    by_rule: dict[str, tuple[int, float]]
    scale: str
    finished: str
    cores: int | None
    load: str
    runs: int = 0

    def when(self) -> str:
        """Which build: ``"the last cold cpu build (finished 2026-11-28 03:45:00 UTC, 2 cores, loaded)"``."""
        cores = f", {self.cores} cores" if self.cores else ""
        return f"the last cold {self.scale} build (finished {self.finished}{cores}, {self.load})"


def _cost(jobs: list[dict], entry: dict) -> Cost:
    by: dict[str, list[float]] = {}
    for job in jobs:
        g = by.setdefault(rule_group(job["rule"]), [0, 0.0])
        g[0] += 1
        g[1] += float(job["seconds"])
    others = sorted((n for n in by if n not in GROUP_ORDER), key=lambda n: -by[n][1])
    order = [n for n in GROUP_ORDER if n in by] + others
    return Cost(seconds=sum(v[1] for v in by.values()), by_rule={n: (int(by[n][0]), by[n][1]) for n in order},
                scale=entry["scale"], finished=entry.get("finished", "?"), cores=entry.get("cores"),
                load=entry.get("load", "load not stated"), runs=sum(len(train_runs(job)) for job in jobs))


def _entry(scale: str, record: dict[str, dict] | None) -> dict | None:
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; accepted: {', '.join(SCALES)}")
    entry = (read_record() if record is None else record).get(scale)
    return entry if entry and entry.get("job_times") else None


def chapter_cost(notebook: str, scale: str, record: dict[str, dict] | None = None,
                 config: str | Path = CONFIG) -> Cost | None:
    """What a chapter cost in the last cold build of ``scale``: the jobs making the results it reads (its
    ``notebook_results``, through :data:`KIND_JOBS`: training runs, evaluations, studies) and its own notebook.

    A run read by two chapters counts in each (the chapters share the grid's runs).

    Args:
        notebook: the notebook's name (``"compression"`` or ``"compression.ipynb"``).
        scale: ``smoke``, ``cpu`` or ``full``.
        record: ``{scale: entry}`` (default: :func:`read_record`).
        config: the workflow's configuration, for ``notebook_results``.

    Returns:
        The :class:`Cost`, or None when no cold build of ``scale`` is recorded with each job's time.

    Raises:
        ValueError: an unknown scale, or a result kind of the configuration that :data:`KIND_JOBS` does not know.
    """
    entry = _entry(scale, record)
    if entry is None:
        return None
    stem = Path(notebook).name.removesuffix(".ipynb")
    kinds = notebook_results(config).get(stem, [])
    unknown = [k for k in kinds if k not in KIND_JOBS]
    if unknown:
        raise ValueError(f"result kinds {unknown} of {stem}.ipynb have no jobs in KIND_JOBS; known: "
                         f"{', '.join(KIND_JOBS)}")
    mine = [job for job in entry["job_times"]
            if (job["rule"] == "execute_notebook" and job.get("wildcards", {}).get("name") == stem)
            or any(KIND_JOBS[k](job, scale) for k in kinds)]
    return _cost(mine, entry)


def e2_training_cost(scale: str, record: dict[str, dict] | None = None) -> Cost | None:
    """The E2 training runs of the last cold build of ``scale``: every ``train`` job whose optimiser is one of its
    setup's E2 optimisers (the practical comparison's runs left out); ``runs`` is their number.

    Args:
        scale: ``smoke``, ``cpu`` or ``full``.
        record: ``{scale: entry}`` (default: :func:`read_record`).

    Returns:
        The :class:`Cost` (its ``seconds`` the summed job time, ``runs`` the number of runs), or None when no cold
        build of ``scale`` is recorded with each job's time.

    Raises:
        ValueError: an unknown scale.
    """
    entry = _entry(scale, record)
    if entry is None:
        return None
    reg = _registry()
    runs = [job for job in entry["job_times"] if train_runs(job)
            and job["wildcards"].get("optimizer") in reg.e2_optimizers(job["wildcards"]["setup"])]
    return _cost(runs, entry)


def cost_sentence(cost: Cost | None, what: str = "this chapter") -> str:
    """A glue-ready sentence: what ``what`` cost in job time, by rule, and in which build (or that no cold build of
    the scale is recorded with each job's time yet).

    Args:
        cost: :func:`chapter_cost` or :func:`e2_training_cost`.
        what: what the jobs are, as the sentence names them (lower case).

    Returns:
        e.g. "In the last cold cpu build (finished 2026-11-28 03:44:10 UTC, 2 cores, loaded), this chapter took
        78 s of job time: train 6 s (1 job), notebooks 39 s (1 job), compression 33 s (1 job)."
    """
    if cost is None:
        return (f"No cold build of this scale is recorded with each job's time (book/cold-builds.json), so what "
                f"{what} cost is not stated.")
    parts = ", ".join(f"{name} {format_duration(s)} ({_jobs(n)})" for name, (n, s) in cost.by_rule.items())
    return f"In {cost.when()}, {what} took {format_duration(cost.seconds)} of job time: {parts}."


# ------------------------------------------------------------------------------------------------------ README
README_START = "<!-- cold-build: from book/cold-builds.json by python -m companion.chapters.cost README.md -->"
README_END = "<!-- /cold-build -->"


def readme_sentence(record: dict[str, dict], scale: str = "cpu") -> str:
    """The README's statement of the last recorded cold build of ``scale`` (what ``make book`` builds): where and when
    it was measured, the load, its wall time and its job time by rule."""
    e = record.get(scale)
    if e is None:
        return f"No cold `{scale}` build is recorded yet (`book/cold-builds.json`)."
    when = e.get("finished", "?").split()[0]
    if e.get("load") == "loaded":
        load = "with other work loading the machine" + (
            f" (other processes kept {e['other_cores']:.2f} of its {e.get('cores', '?')} cores busy on average)"
            if e.get("other_cores") is not None else "")
    else:
        load = "otherwise idle"
    wall = format_duration(e["wall_time_s"])
    took = (f"{format_duration(e['total_wall_time_s'])} from a fresh clone (the workflow {wall})"
            if e.get("total_wall_time_s") else f"{wall} (the workflow)")
    groups = job_time_by_rule(e)
    main = [g for g in groups if g[0] in GROUP_ORDER]
    rest = [g for g in groups if g[0] not in GROUP_ORDER]
    parts = [f"{name} {format_duration(s)} ({_jobs(n)})" for name, n, s in main]
    if rest:
        parts.append(f"the other {_jobs(sum(n for _, n, _ in rest))} {format_duration(sum(s for *_, s in rest))}")
    total = sum(s for *_, s in groups)
    cores = f"{e['cores']}-core " if e.get("cores") else ""
    machine = f"a {cores}{e['machine']}" if e.get("machine") else f"a {cores}machine"
    return (f"Measured on {machine} on {when}, {load}: the last cold `make book` recorded "
            f"(`book/cold-builds.json`) took {took}; its jobs took {format_duration(total)} in all: "
            + ", ".join(parts) + ".")


def readme_block(record: dict[str, dict] | None = None) -> str:
    """:func:`readme_sentence` between the README's markers (inline, in its paragraph)."""
    return README_START + readme_sentence(read_record() if record is None else record) + README_END


FULLCOST_START = "<!-- fullcost: {setup} {optimizer}, by python -m companion.chapters.cost -->"
FULLCOST_END = "<!-- /fullcost -->"
_FULLCOST = re.compile(r"<!-- fullcost: (\S+) (\S+), by python -m companion\.chapters\.cost -->.*?<!-- /fullcost -->",
                       re.S)


def fullcost_blocks(text: str) -> str:
    """``text`` with every full-scale cost block (``<!-- fullcost: SETUP OPTIMIZER, ... -->...<!-- /fullcost -->``)
    holding :func:`companion.experiments.cost.cost_summary` of its run: the sentence a GPU user wants, readable where
    the page is read as plain Markdown (GitHub) as well as in the book."""
    from companion.experiments.cost import cost_summary

    def fill(match: re.Match) -> str:
        setup, optimizer = match.group(1), match.group(2)
        return (FULLCOST_START.format(setup=setup, optimizer=optimizer) + cost_summary(setup, optimizer)
                + FULLCOST_END)

    return _FULLCOST.sub(fill, text)


def update_readme(path: str | Path) -> None:
    """Rewrite the generated statements of a Markdown file (``python -m companion.chapters.cost README.md
    book/intro.md``): the README's cold-build statement from the record, and any full-scale cost block."""
    text = Path(path).read_text()
    if README_START in text:
        start, end = text.index(README_START), text.index(README_END) + len(README_END)
        text = text[:start] + readme_block() + text[end:]
    write_atomically(path, fullcost_blocks(text))


if __name__ == "__main__":
    import sys

    for target in sys.argv[1:] or ["README.md"]:
        update_readme(target)
