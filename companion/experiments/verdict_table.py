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
- ``would_decide``: for an undecided verdict, what would decide it (seeds at 80 % power, test examples, their price).
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd

from . import store

FILE = "verdicts.csv"
COLUMNS = ["claim", "label", "setup", "verdict", "statistic", "interval", "evidence", "would_decide"]


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
                    "would_decide": v.needs or ""})
    return out


def _e2_rows(scale: str, results_dir: Path, runs_dir: str | Path) -> list[dict[str, str]]:
    from .aggregate import load_e2, read_predictions
    from .setups import e2_optimizers, resolve
    from .verdicts import E2_RULES, RULES

    grid = load_e2(scale, results_dir, runs_dir)
    opts = {s: list(e2_optimizers(s)) for s in grid.setups}
    methods = {s: resolve(s, scale).method for s in grid.setups}
    predictions = read_predictions(results_dir)
    rows = []
    for name in E2_RULES:
        args = (grid.table, grid.curves, opts) + ((methods,) if name == "e2_ief_vs_baseline" else ())
        rows += rows_of(name, RULES[name].evaluate(*args, predictions=predictions))
    return rows


def _practical_rows(scale: str, results_dir: Path, runs_dir: str | Path) -> list[dict[str, str]]:
    from .aggregate import load_e2, read_predictions
    from .setups import practical_optimizers
    from .verdicts import PRACTICAL_RULES, RULES

    if scale == "full":  # the practical optimisers are not part of the full grid
        return []
    grid = load_e2(scale, results_dir, runs_dir)  # every optimiser's runs of the E2 setups, the practical ones too
    opts = {s: practical_optimizers(s, scale) for s in grid.setups}
    predictions = read_predictions(results_dir)
    rows = []
    for name in PRACTICAL_RULES:
        rows += rows_of(name, RULES[name].evaluate(grid.table, None, opts, predictions=predictions))
    return rows


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


def verdict_table(scale: str, results_dir: str | Path, runs_dir: str | Path = "runs") -> pd.DataFrame:
    """Every rule's verdicts at ``scale`` from the workflow's tables in ``results_dir`` (see the module docstring).

    Raises:
        FileNotFoundError: no E2 tables or runs (names the commands that make them).
    """
    results_dir = Path(results_dir)
    rows = _e2_rows(scale, results_dir, runs_dir) + _practical_rows(scale, results_dir, runs_dir)
    rows += _evaluation_rows(results_dir)
    return pd.DataFrame(rows, columns=COLUMNS)


def write_verdicts(scale: str, results_dir: str | Path, runs_dir: str | Path = "runs",
                   out: str | Path | None = None) -> Path:
    """Write :func:`verdict_table` to ``out`` (default ``results_dir/verdicts.csv``), atomically; returns the path."""
    path = Path(out) if out else Path(results_dir) / FILE
    buffer = io.StringIO()
    verdict_table(scale, results_dir, runs_dir).to_csv(buffer, index=False, lineterminator="\n")
    store.write_text(path, buffer.getvalue())
    return path


def read_verdicts(results_dir: str | Path) -> pd.DataFrame | None:
    """The table :func:`write_verdicts` wrote, or None where the workflow has not written it."""
    path = Path(results_dir) / FILE
    return pd.read_csv(path, keep_default_na=False) if path.exists() else None
