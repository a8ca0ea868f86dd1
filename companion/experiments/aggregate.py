"""Training runs gathered into tidy tables for E2 (``sec:opt-exp``): one row per run, and the curves step by step.

``python -m companion aggregate --scale X --runs RUNS --out DIR`` reads every finished run under ``RUNS/<scale>/`` (the
runner's layout, :mod:`.store`) and writes, atomically:

- ``DIR/e2_runs.csv``: one row per finished run: ``scale, setup, optimizer, seed``, the hyperparameters it ran with
  (``lr, damping, schedule``), ``steps``, ``final_train_loss`` (:func:`final_loss`), ``final_train_loss_full``
  (the full training-set loss of the final checkpoint, :func:`.final_loss.recorded`: inf for a diverged run, empty
  for a run recorded before it was measured), ``diverged_step``, the best
  validation checkpoint (``best_step``, ``val_<metric>``, ``val_score``), the test metrics of that checkpoint
  (``test_<metric>`` and their mean ``test_score``; empty where the labels are private, as for GLUE test) and
  ``wall_time_s``;
- ``DIR/e2_curves.csv``: the curves, long format: ``scale, setup, optimizer, seed, step, quantity, value`` with
  ``quantity`` = ``train_loss`` (every update) or ``val_<metric>`` / ``val_score`` (every validation).

Metrics are fractions as the runner records them (the paper's tables multiply them by 100). :func:`summarise` gives
mean ± sd over seeds (tab:train, tab:validation, tab:test); :func:`curve_bands` the mean ± sd curves of
fig:curves-pt / fig:curves-lora / fig:mlp-curves, the training loss averaged over windows as in the paper (100
points over training, each the mean of the batches since the previous point).
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import store
from .final_loss import recorded as full_loss
from .metrics import score
from .summaries import FINAL_FRACTION, final_window  # the book's one definition of "final"

RUNS_FILE = "e2_runs.csv"
CURVES_FILE = "e2_curves.csv"
PREDICTIONS_FILE = "e2_test_predictions.csv"  # setup, optimizer, seed, example, correct: per-example comparisons
KEYS = ["scale", "setup", "optimizer", "seed"]


def final_loss(losses: list[float] | np.ndarray, fraction: float = FINAL_FRACTION) -> float:
    """The final training loss of a run: the mean of the last ``ceil(fraction * steps)`` update losses (at least 1).

    The paper (tab:train) averages the last 100 steps of runs of thousands of steps; a fixed 100 would be the whole
    run at cpu and smoke scale (64 and 8 updates), so the window is a fraction of the run, which is ~the paper's
    share at full scale (e.g. 100 of 4,200 steps for SST-2 + T5 is 2.4 %; 10 % of 64 cpu steps is 7 steps).
    ``nan`` for a run without updates; a non-finite loss in the window makes the result non-finite (never hidden).
    The window is :func:`.summaries.final_window`'s, so a run's row equals its ``summary.json`` (and CLI line).
    """
    values = np.asarray(losses, dtype=float)
    if values.size == 0:
        return float("nan")
    return float(values[-final_window(values.size, fraction):].mean())


def _metric_columns(prefix: str, metrics: dict[str, float] | None) -> dict[str, float]:
    return {f"{prefix}_{k}": float(v) for k, v in (metrics or {}).items()}


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    """The ``e2_runs.csv`` row of one finished run as read by :func:`.store.read_run`."""
    s, opt = run["summary"], run["config"]["optimizer"]
    best = s["best_validation"]
    row: dict[str, Any] = {
        "scale": s["scale"], "setup": s["setup"], "optimizer": s["optimizer"], "seed": int(s["seed"]),
        "lr": opt["lr"], "damping": opt.get("damping"), "schedule": opt.get("schedule"),
        "steps": int(s["steps"]), "final_train_loss": final_loss(run["losses"]),
        "final_train_loss_full": full_loss(s),
        "diverged_step": (s.get("diverged") or {}).get("step"),
        "best_step": best["step"], "val_score": best["score"],
    }
    row.update(_metric_columns("val", best["metrics"]))
    row.update(_metric_columns("test", s.get("test")))
    row["test_score"] = score(s["test"]) if s.get("test") else float("nan")  # GLUE's per-task mean (tab:sum-test)
    row["wall_time_s"] = float(s["wall_time_s"])
    return row


def run_curves(run: dict[str, Any]) -> pd.DataFrame:
    """The long-format curve rows of one run: the training loss of every update, then every validation metric."""
    s = run["summary"] or {}
    cfg = run["config"]
    key = {"scale": s.get("scale", cfg["setup"]["scale"]), "setup": s.get("setup", cfg["setup"]["name"]),
           "optimizer": s.get("optimizer", cfg["optimizer"]["name"]), "seed": int(cfg["seed"])}
    rows = [dict(key, step=i + 1, quantity="train_loss", value=float(v)) for i, v in enumerate(run["losses"])]
    for e in run["evals"]:
        for name, v in (e.get("metrics") or {}).items():
            rows.append(dict(key, step=int(e["step"]), quantity=f"val_{name}", value=float(v)))
        rows.append(dict(key, step=int(e["step"]), quantity="val_score",
                         value=float("nan") if e.get("score") is None else float(e["score"])))
    return pd.DataFrame(rows, columns=[*KEYS, "step", "quantity", "value"])


def find_runs(runs: str | Path, scale: str) -> tuple[list[Path], list[Path]]:
    """``(finished, unfinished)`` run folders under ``runs/<scale>/`` (finished: ``summary.json`` exists)."""
    root = Path(runs) / scale
    folders = sorted(p.parent for p in root.glob("*/*/seed-*/config.json"))
    done = [p for p in folders if (p / "summary.json").exists()]
    return done, [p for p in folders if not (p / "summary.json").exists()]


def collect(runs: str | Path, scale: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(runs_table, curves)`` of every finished run under ``runs/<scale>/`` (sorted by setup, optimizer, seed).

    Raises ``FileNotFoundError`` naming the folder when it holds no finished run.
    """
    done, _ = find_runs(runs, scale)
    if not done:
        raise FileNotFoundError(f"no finished run under {Path(runs) / scale} (a run is finished when its "
                                f"summary.json exists; make them with `python -m companion train --scale {scale} "
                                f"--out {runs} ...` or `make book`)")
    read = [store.read_run(p) for p in done]
    table = pd.DataFrame([run_row(r) for r in read])
    first = [c for c in table.columns if not c.startswith(("val_", "test_")) and c != "wall_time_s"]
    metric_cols = sorted(c for c in table.columns if c.startswith("val_")) + \
        sorted(c for c in table.columns if c.startswith("test_"))
    table = table[first + metric_cols + ["wall_time_s"]].sort_values(KEYS, kind="stable").reset_index(drop=True)
    curves = pd.concat([run_curves(r) for r in read], ignore_index=True)
    return table, curves


def collect_predictions(runs: str | Path, scale: str) -> pd.DataFrame:
    """Every finished run's per-example test outcomes (its ``test_predictions.csv``,
    :func:`.store.read_test_predictions`)
    as ``setup, optimizer, seed, example, correct`` (``example``: ``split:idx``; ``correct``: 1 or 0); empty where
    no run has them (runs made before they were stored)."""
    rows = []
    for folder in find_runs(runs, scale)[0]:
        preds = store.read_test_predictions(folder)
        if not preds:
            continue
        s = store.read_json(folder / "summary.json")
        rows += [(s["setup"], s["optimizer"], int(s["seed"]), f"{split}:{idx}", int(pred == gold))
                 for split, idx, pred, gold in preds]
    return pd.DataFrame(rows, columns=["setup", "optimizer", "seed", "example", "correct"])


def _atomic_csv(df: pd.DataFrame, path: Path) -> None:
    buffer = io.StringIO()
    df.to_csv(buffer, index=False, lineterminator="\n")
    store.write_text(path, buffer.getvalue())


def aggregate(runs: str | Path, scale: str, out: str | Path) -> tuple[Path, Path]:
    """Write ``out/e2_runs.csv``, ``out/e2_curves.csv`` and ``out/e2_test_predictions.csv`` (atomically) from the
    finished runs; returns the first two paths."""
    table, curves = collect(runs, scale)
    out = Path(out)
    _atomic_csv(table, out / RUNS_FILE)
    _atomic_csv(curves, out / CURVES_FILE)
    _atomic_csv(collect_predictions(runs, scale), out / PREDICTIONS_FILE)
    return out / RUNS_FILE, out / CURVES_FILE


def read_tables(directory: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(runs_table, curves)`` as written by :func:`aggregate`."""
    directory = Path(directory)
    return pd.read_csv(directory / RUNS_FILE), pd.read_csv(directory / CURVES_FILE)


def read_predictions(directory: str | Path) -> pd.DataFrame | None:
    """The per-example test outcomes :func:`aggregate` wrote, or None where there are none."""
    path = Path(directory) / PREDICTIONS_FILE
    if not path.exists():
        return None
    frame = pd.read_csv(path)
    return frame if len(frame) else None


# ------------------------------------------------------------------------------------------------ summaries
def summarise(table: pd.DataFrame, columns: list[str] | None = None,
              by: tuple[str, ...] = ("setup", "optimizer")) -> pd.DataFrame:
    """Mean, sample sd (``ddof=1``; ``nan`` for one seed) and the number of seeds of ``columns`` per ``by`` group.

    Columns of the result: ``by``, ``n`` and ``<column>_mean`` / ``<column>_sd`` for each column (default:
    ``final_train_loss``, ``val_*``, ``test_*``). Non-finite values (a diverged loss) propagate to the mean.
    """
    if columns is None:
        columns = ["final_train_loss"] + [c for c in table.columns if c.startswith(("val_", "test_"))]
    missing = sorted(set(columns) - set(table.columns))
    if missing:
        raise ValueError(f"unknown column(s) {missing}; the table has: {', '.join(table.columns)}")
    groups = table.groupby(list(by), sort=False)
    out = groups.size().rename("n").reset_index()
    for c in columns:
        stats = groups[c].agg(mean=lambda v: float(np.mean(v)) if len(v) else float("nan"),
                              sd=lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else float("nan"))
        out[f"{c}_mean"] = stats["mean"].to_numpy()
        out[f"{c}_sd"] = stats["sd"].to_numpy()
    return out


def mean_sd(values: pd.Series | np.ndarray | list[float], digits: int = 2, scale: float = 1.0) -> str:
    """``"m ± sd"`` of ``values * scale`` (sd with ``ddof=1``; ``"m"`` alone for one value; ``"–"`` for none)."""
    v = np.asarray(values, dtype=float) * scale
    if v.size == 0:
        return "–"
    if v.size == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def curve_bands(curves: pd.DataFrame, quantity: str, points: int | None = None) -> pd.DataFrame:
    """Mean ± sd over seeds of one curve ``quantity`` per ``(setup, optimizer, step)``.

    ``points``: for ``train_loss``, average each run's losses over ``points`` equal windows of updates first (the
    paper's 100 points, each the mean of the batches since the previous point); ``step`` is then the window's last
    update. Columns: ``setup, optimizer, step, mean, sd, n`` (``sd`` is 0 where one seed has the step: a band of no
    width, for plotting; :func:`summarise` gives ``nan`` instead).
    """
    c = curves[curves["quantity"] == quantity]
    if c.empty:
        known = sorted(curves["quantity"].unique())
        raise ValueError(f"no curve {quantity!r}; quantities present: {', '.join(known)}")
    if points is not None:
        if points < 1:
            raise ValueError(f"points must be >= 1, got {points!r}")
        parts = []
        for _, run in c.groupby(["setup", "optimizer", "seed"], sort=False):
            run = run.sort_values("step")
            window = np.ceil(np.arange(1, len(run) + 1) * min(points, len(run)) / len(run)).astype(int)
            binned = run.assign(window=window).groupby("window").agg(
                step=("step", "max"), value=("value", "mean"), setup=("setup", "first"),
                optimizer=("optimizer", "first"), seed=("seed", "first"))
            parts.append(binned.reset_index(drop=True))
        c = pd.concat(parts, ignore_index=True)
    g = c.groupby(["setup", "optimizer", "step"], sort=False)["value"]
    out = g.agg(mean="mean", sd=lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0, n="size").reset_index()
    return out.sort_values(["setup", "optimizer", "step"], kind="stable").reset_index(drop=True)


@dataclass
class E2Grid:
    """The E2 runs a chapter shows: per-run rows and curves of the chosen setups and seeds, what the grid expects,
    what is missing, and where the numbers came from (``source``, in words)."""

    table: pd.DataFrame
    curves: pd.DataFrame
    setups: list[str]
    seeds: list[int]  # every seed of any chosen setup
    expected: list[tuple[str, str, int]]
    missing: list[tuple[str, str, int]]
    source: str
    seeds_by_setup: dict[str, list[int]] = field(default_factory=dict)  # each setup's seeds


def _tables_exist(results_dir: Path) -> bool:
    return (results_dir / RUNS_FILE).exists() and (results_dir / CURVES_FILE).exists()


def load_e2(scale: str, results_dir: str | Path | None = None, runs_dir: str | Path = "runs",
            setups: list[str] | None = None, seeds: list[int] | None = None) -> E2Grid:
    """The E2 grid of ``scale`` as it exists on disk; reads only (the workflow trains and aggregates the runs).

    Args:
        scale: ``"smoke"``, ``"cpu"`` or ``"full"``.
        results_dir: the workflow's aggregated tables, read when both exist (default ``results/<scale>``).
        runs_dir: the runs, aggregated here when ``results_dir`` has no tables.
        setups: default every E2 setup of the scale.
        seeds: the same seeds for every setup; default each setup's seeds in the scale's grid
            (:func:`.setups.scale_grid`: the paper's three, ten for digits at cpu; at smoke scale the seeds the runs
            have).

    Returns:
        An :class:`E2Grid`: the chosen setups' and seeds' rows and curves, the expected and the missing runs, and
        the source read. Read from the tables with every seed, ``table.attrs`` names the folder and the scale (the
        workflow's verdicts beside the tables were decided on these runs:
        :func:`.verdict_table.chapter_verdicts`).

    Raises:
        ValueError: an unknown ``scale`` (names the accepted ones).
        FileNotFoundError: neither tables nor finished runs exist (names the commands that make them).
    """
    from .setups import SCALES, e2_optimizers, e2_setups, scale_grid

    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    results_dir = Path(results_dir or f"results/{scale}")
    setups = list(e2_setups(scale) if setups is None else setups)
    grid = scale_grid(scale)
    by_setup = {s: list(seeds) if seeds is not None else list(grid.seeds_of(s)) for s in setups}
    if _tables_exist(results_dir):
        table, curves = read_tables(results_dir)
        source = f"the aggregated tables in {results_dir}"
    else:
        if not find_runs(runs_dir, scale)[0]:
            raise FileNotFoundError(
                f"no E2 runs under {Path(runs_dir) / scale} and no {RUNS_FILE} in {results_dir}. `make book` runs the "
                f"workflow that trains them (SCALE={scale}); by hand: `python -m companion train --setup S "
                f"--optimizer O --seed K --scale {scale} --out {runs_dir}` for every run, then "
                f"`python -m companion aggregate --scale {scale} --runs {runs_dir} --out {results_dir}`")
        table, curves = collect(runs_dir, scale)
        source = f"the runs in {Path(runs_dir) / scale} (aggregated here)"
    if scale == "smoke" and seeds is None:  # the smoke grid's seeds (the workflow's smoke grid has two)
        by_setup = {s: sorted(int(k) for k in table.seed.unique()) for s in setups}
    expected = [(s, o, k) for s in setups for o in e2_optimizers(s) for k in by_setup[s]]
    chosen = set((s, k) for s in setups for k in by_setup[s])
    table = table[pd.MultiIndex.from_arrays([table.setup, table.seed.astype(int)]).isin(list(chosen))]
    curves = curves[pd.MultiIndex.from_arrays([curves.setup, curves.seed.astype(int)]).isin(list(chosen))]
    have = set(zip(table.setup, table.optimizer, table.seed))
    present = [s for s in setups if s in set(table.setup)]
    if _tables_exist(results_dir) and seeds is None:  # every seed the workflow decided its verdicts on
        table.attrs.update(results_dir=str(results_dir), scale=scale)  # .verdict_table.chapter_verdicts reads them
    return E2Grid(table=table, curves=curves, setups=present,
                  seeds=sorted({k for s in setups for k in by_setup[s]}), expected=expected,
                  missing=[e for e in expected if e not in have], source=source,
                  seeds_by_setup={s: by_setup[s] for s in present})
