"""Every verdict the book prints, as data: ``results/<scale>/verdicts.csv``.

``python -m companion verdicts --scale X --results DIR --runs RUNS`` evaluates every rule of
:mod:`companion.experiments.verdicts` on the workflow's tables (the E2 runs and curves, their per-example test
predictions, the practical runs, the evaluation records) and writes one row per rule and subject:

- ``claim`` (the rule's name), ``label`` (the paper's), ``setup`` (the subject: a setup, or "setup, method");
- ``verdict``: holds / does not hold / inconclusive;
- ``statistic``: per pair decided over seeds, the mean difference (log ratio, or points); else the verdict's first
  clause (how many stages for it);
- ``interval``: per pair, its 95 % interval;
- ``evidence``: the numbers behind the verdict in words (:attr:`.verdicts.Verdict.detail`);
- ``would_decide``: for an undecided verdict, what would decide it (seeds at 80 % power, test examples, their price);
- ``failures``: what fails, by name (a JSON list: :attr:`.verdicts.Verdict.failures`).

and, beside it, ``results/<scale>/verdict_pairs.csv``: one row per pair a verdict over seeds compared (``claim``,
``setup``, ``pair``, ``metric``, ``seeds`` and ``diffs`` as JSON lists, ``agreement``, ``mean``, ``low``, ``high``,
``verdict``, ``needs``, ``band``, ``p_for``, ``p_against``: :class:`.verdicts.PairResult`'s fields).

The chapters read these two tables (:func:`chapter_verdicts`): the verdicts have one home, this module, and a chapter
prints what the workflow decided, never a verdict of its own.
"""
from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from . import store

FILE = "verdicts.csv"
PAIRS_FILE = "verdict_pairs.csv"
COLUMNS = ["claim", "label", "setup", "verdict", "statistic", "interval", "evidence", "would_decide", "failures"]
PAIR_COLUMNS = ["claim", "setup", "pair", "metric", "seeds", "diffs", "agreement", "mean", "low", "high", "verdict",
                "needs", "band", "p_for", "p_against"]


def rows_of(name: str, verdicts) -> list[dict[str, str]]:
    """The table's rows of one rule's verdicts."""
    from .verdicts import RULES

    out = []
    for v in verdicts:
        unit = lambda p: 100.0 if p.metric == "test_score" else 1.0  # noqa: E731
        pairs = [p for p in v.pairs if not math.isnan(p.mean)]
        statistic = ("; ".join(f"{p.pair}: {unit(p) * p.mean:+.3g}" for p in pairs) if pairs
                     else v.detail.split(";")[0])
        interval = "; ".join(f"{p.pair}: {unit(p) * p.low:+.3g} to {unit(p) * p.high:+.3g}" for p in pairs)
        evidence = v.detail + (f" Fails: {'; '.join(v.failures)}." if v.failures else "")
        out.append({"claim": name, "label": RULES[name].label, "setup": v.subject, "verdict": v.verdict,
                    "statistic": statistic, "interval": interval, "evidence": evidence,
                    "would_decide": v.needs or "", "failures": json.dumps(list(v.failures))})
    return out


def pair_rows(name: str, verdicts) -> list[dict]:
    """The pairs table's rows of one rule's verdicts (one per pair a verdict over seeds compared)."""
    return [{"claim": name, "setup": v.subject, "pair": p.pair, "metric": p.metric,
             "seeds": json.dumps([int(k) for k in p.diffs]),
             "diffs": json.dumps([_number(d) for d in p.diffs.values()]),
             "agreement": p.agreement, "mean": p.mean, "low": p.low, "high": p.high, "verdict": p.verdict,
             "needs": p.needs or "", "band": p.band, "p_for": p.p_for, "p_against": p.p_against}
            for v in verdicts for p in v.pairs]


def _number(value: float) -> float | str:
    """A JSON-safe number: inf and NaN as strings (JSON has neither)."""
    return value if math.isfinite(value) else str(value)


def _e2_rows(scale: str, results_dir: Path, runs_dir: str | Path) -> list[dict[str, str]]:
    from .aggregate import load_e2, read_predictions
    from .setups import e2_optimizers, resolve
    from .verdicts import E2_RULES, RULES

    grid = load_e2(scale, results_dir, runs_dir)
    opts = {s: list(e2_optimizers(s)) for s in grid.setups}
    methods = {s: resolve(s, scale).method for s in grid.setups}
    predictions = read_predictions(results_dir)
    rows, pairs = [], []
    for name in E2_RULES:
        args = (grid.table, grid.curves, opts) + ((methods,) if name == "e2_ief_vs_baseline" else ())
        found = RULES[name].evaluate(*args, predictions=predictions)
        rows, pairs = rows + rows_of(name, found), pairs + pair_rows(name, found)
    return rows, pairs


def _practical_rows(scale: str, results_dir: Path, runs_dir: str | Path) -> list[dict[str, str]]:
    from .aggregate import load_e2, read_predictions
    from .setups import practical_optimizers
    from .verdicts import PRACTICAL_RULES, RULES

    if scale == "full":  # the practical optimisers are not part of the full grid
        return [], []
    grid = load_e2(scale, results_dir, runs_dir)  # every optimiser's runs of the E2 setups, the practical ones too
    opts = {s: practical_optimizers(s, scale) for s in grid.setups}
    predictions = read_predictions(results_dir)
    rows, pairs = [], []
    for name in PRACTICAL_RULES:
        found = RULES[name].evaluate(grid.table, None, opts, predictions=predictions)
        rows, pairs = rows + rows_of(name, found), pairs + pair_rows(name, found)
    return rows, pairs


def _evaluation_rows(results_dir: Path) -> list[dict[str, str]]:
    from .evaluate_runs import read_records
    from .verdicts import EVALUATION_RULES

    tables = sorted((results_dir / "eval").glob("*.csv"))
    records = [r for path in tables for r in read_records(path)]
    if not records:
        return []
    rows = []
    for name, rule in EVALUATION_RULES.items():
        rows += rows_of(name, rule.evaluate(records))
    return rows


def verdict_tables(scale: str, results_dir: str | Path, runs_dir: str | Path = "runs"
                   ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every rule's verdicts at ``scale`` from the workflow's tables in ``results_dir`` and the pairs they compared
    (see the module docstring).

    Raises:
        FileNotFoundError: no E2 tables or runs (names the commands that make them).
    """
    results_dir = Path(results_dir)
    (e2, e2_pairs), (practical, practical_pairs) = (_e2_rows(scale, results_dir, runs_dir),
                                                    _practical_rows(scale, results_dir, runs_dir))
    rows = e2 + practical + _evaluation_rows(results_dir)
    return pd.DataFrame(rows, columns=COLUMNS), pd.DataFrame(e2_pairs + practical_pairs, columns=PAIR_COLUMNS)


def verdict_table(scale: str, results_dir: str | Path, runs_dir: str | Path = "runs") -> pd.DataFrame:
    """:func:`verdict_tables`' verdicts alone."""
    return verdict_tables(scale, results_dir, runs_dir)[0]


def write_verdicts(scale: str, results_dir: str | Path, runs_dir: str | Path = "runs",
                   out: str | Path | None = None) -> Path:
    """Write :func:`verdict_tables` to ``out`` (default ``results_dir/verdicts.csv``) and the pairs beside it
    (``verdict_pairs.csv``), atomically, the pairs first; returns the verdicts' path."""
    path = Path(out) if out else Path(results_dir) / FILE
    verdicts, pairs = verdict_tables(scale, results_dir, runs_dir)
    for frame, where in ((pairs, path.with_name(PAIRS_FILE)), (verdicts, path)):
        buffer = io.StringIO()
        frame.to_csv(buffer, index=False, lineterminator="\n")
        store.write_text(where, buffer.getvalue())
    return path


def read_verdicts(results_dir: str | Path) -> pd.DataFrame | None:
    """The table :func:`write_verdicts` wrote, or None where the workflow has not written it."""
    path = Path(results_dir) / FILE
    return pd.read_csv(path, keep_default_na=False) if path.exists() else None


def read_pairs(results_dir: str | Path) -> pd.DataFrame | None:
    """The pairs table :func:`write_verdicts` wrote beside the verdicts, or None."""
    path = Path(results_dir) / PAIRS_FILE
    return pd.read_csv(path, keep_default_na=False) if path.exists() else None


def _float(value) -> float:
    return float("nan") if value == "" else float(value)


def as_verdicts(verdicts: pd.DataFrame, pairs: pd.DataFrame | None, claim: str) -> list:
    """The :class:`.verdicts.Verdict` objects (their pairs included) of one claim, read back from the tables."""
    from .verdicts import PairResult, Verdict

    def pairs_of(setup: str) -> tuple:
        if pairs is None:
            return ()
        rows = pairs[(pairs.claim == claim) & (pairs.setup == setup)]
        return tuple(PairResult(setup, r.pair, r.metric,
                                dict(zip(json.loads(r.seeds), map(float, json.loads(r.diffs)))),
                                r.verdict, r.agreement, _float(r["mean"]), _float(r.low), _float(r.high),
                                r.needs or None, None if r.band == "" else float(r.band), _float(r.p_for),
                                _float(r.p_against)) for _, r in rows.iterrows())

    return [Verdict(r.setup, r.verdict, r.evidence.split(" Fails: ")[0], tuple(json.loads(r.failures or "[]")),
                    pairs=pairs_of(r.setup), needs=r.would_decide or None)
            for _, r in verdicts[verdicts.claim == claim].iterrows()]


def chapter_verdicts(table: pd.DataFrame, names: Sequence[str], compute: Callable[[str], list]) -> dict[str, list]:
    """The verdicts a chapter prints, ``{claim: [Verdict]}`` for the subjects of ``table``: read from the workflow's
    ``verdicts.csv`` and ``verdict_pairs.csv`` where ``table`` was read from a results folder that holds them
    (:func:`.aggregate.load_e2` records the folder in ``table.attrs["results_dir"]`` when the chapter reads the
    whole grid), else ``compute(claim)`` (the same rules on the chapter's own table: a subset of the seeds, runs not
    yet aggregated, a test's table).

    Raises:
        ValueError: the verdicts table is older than the runs table it was decided on (names the command that
            rewrites it).
    """
    from .aggregate import RUNS_FILE

    folder = table.attrs.get("results_dir")
    found = read_verdicts(folder) if folder else None
    if found is None:
        return {name: compute(name) for name in names}
    path, runs = Path(folder) / FILE, Path(folder) / RUNS_FILE
    if runs.exists() and path.stat().st_mtime < runs.stat().st_mtime:
        raise ValueError(f"{path} is older than {runs}, whose runs it decides: rerun `python -m companion verdicts "
                         f"--scale {table.attrs.get('scale', 'X')} --results {folder}`")
    pairs = read_pairs(folder)
    subjects = set(table.setup)
    return {name: [v for v in as_verdicts(found, pairs, name) if v.subject in subjects] for name in names}
