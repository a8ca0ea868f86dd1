"""The chapter "Beyond the paper: iEF in practical optimisers" (``notebooks/practical.ipynb``): its runs, tables,
figures and glued sentences.

The chapter compares, per setup, the baseline (AdamW / Adafactor / Adam), the exact iEF of E2, iEF with momentum and
weight decay (``ief-momentum``, :mod:`ief.optim.momentum`) and, where every trainable parameter is an ``nn.Linear``,
the K-FAC family as optimisers (:class:`ief.optim.KFAC`). The baseline and iEF runs are E2's own; the others are the
grid's ``practical`` runs (``GRIDS[scale].practical`` in :mod:`companion.experiments.setups`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..experiments.aggregate import collect, load_e2, mean_sd
from ..experiments.setups import practical_optimizers, resolve
from .optimisation import label, plot_curves

KFAC_FAMILY = ("kfac", "ekfac", "iekfac")


@dataclass
class PracticalGrid:
    """The chapter's runs: ``table`` and ``curves`` as :func:`companion.experiments.aggregate.collect` gives them (only
    the chapter's optimisers), ``opts`` per setup, the ``missing`` runs and where the numbers come from."""
    table: pd.DataFrame
    curves: pd.DataFrame
    setups: list[str]
    seeds: list[int]
    opts: dict[str, list[str]]
    missing: list[tuple[str, str, int]]
    source: str
    seeds_by_setup: dict[str, list[int]] = field(default_factory=dict)


def load_practical(scale: str, results_dir: str | Path | None = None, runs_dir: str | Path | None = "runs",
                   setups: Sequence[str] | None = None, seeds: Sequence[int] | None = None) -> PracticalGrid:
    """The chapter's runs, read as E2's (:func:`~companion.experiments.aggregate.load_e2`: the workflow's tables, else
    the runs); runs finished after the tables were written are read from ``runs_dir``. Reads only: nothing is trained
    (the workflow trains the runs).

    Args:
        scale: ``"smoke"``, ``"cpu"`` or ``"full"``.
        results_dir: the aggregated tables (default ``results/<scale>``).
        runs_dir: the runs folder, read when ``results_dir`` has no tables or lacks some of the chapter's runs
            (``None``: the tables only, as the chapter reads them).
        setups: default every E2 setup of the scale.
        seeds: the same seeds for every setup; default each setup's seeds in the scale's grid (at smoke, the seeds
            the runs have).

    Returns:
        A :class:`PracticalGrid` (its ``missing`` lists the runs found nowhere).

    Raises:
        FileNotFoundError: no run and no table (names the commands that make them).
    """
    grid = load_e2(scale, results_dir, runs_dir or "runs", list(setups) if setups else None,
                   list(seeds) if seeds is not None else None)
    opts = {s: practical_optimizers(s, scale) for s in grid.setups}
    expected = [(s, o, k) for s in grid.setups for o in opts[s] for k in grid.seeds_by_setup[s]]
    chosen = [(s, k) for s in grid.setups for k in grid.seeds_by_setup[s]]

    def absent(table: pd.DataFrame) -> list[tuple[str, str, int]]:
        have = set(zip(table.setup, table.optimizer, table.seed))
        return [e for e in expected if e not in have]

    table, curves, source = grid.table, grid.curves, grid.source
    missing = absent(table)
    # runs finished after the tables: read them from the runs
    if missing and runs_dir is not None and (Path(runs_dir) / scale).is_dir():
        runs_table, runs_curves = collect(runs_dir, scale)
        runs_table = runs_table[pd.MultiIndex.from_arrays([runs_table.setup, runs_table.seed.astype(int)]).isin(chosen)]
        if len(absent(runs_table)) < len(missing):
            table = runs_table
            curves = runs_curves[pd.MultiIndex.from_arrays([runs_curves.setup, runs_curves.seed.astype(int)])
                                 .isin(chosen)]
            missing, source = absent(table), f"the runs in {Path(runs_dir) / scale} (aggregated here)"
    keep = pd.Series(False, index=table.index)
    for s, os_ in opts.items():
        keep |= (table.setup == s) & table.optimizer.isin(os_)
    table = table[keep]
    curves = curves[curves.set_index(["setup", "optimizer"]).index.isin(
        list(zip(table.setup, table.optimizer)))]
    return PracticalGrid(table.reset_index(drop=True), curves.reset_index(drop=True), grid.setups, grid.seeds, opts,
                         missing, source, dict(grid.seeds_by_setup))


def results_table(table: pd.DataFrame, opts: dict[str, list[str]]) -> pd.DataFrame:
    """Per setup and optimiser: the rate, final training loss, best validation and test score (percent), mean ±
    sd over seeds, the seeds and how many runs diverged.

    Args:
        table: the runs (:class:`PracticalGrid`'s ``table``).
        opts: the optimisers per setup, in the chapter's order.

    Returns:
        A frame indexed by ``(setup, optimizer)`` (optimisers by their labels).
    """
    rows = []
    for setup, optimizers in opts.items():
        for o in optimizers:
            r = table[(table.setup == setup) & (table.optimizer == o)]
            if r.empty:
                continue
            rows.append({"setup": setup, "optimizer": label(o), "lr": f"{float(r.lr.iloc[0]):g}",
                         "final train loss": mean_sd(r.final_train_loss, 3),
                         "validation (%)": mean_sd(r.val_score, 1, 100.0),
                         "test (%)": mean_sd(r.test_score, 1, 100.0),
                         "seeds": len(r), "diverged": int(r.diverged_step.notna().sum())})
    return pd.DataFrame(rows).set_index(["setup", "optimizer"])


def hyperparameters(setups: Sequence[str], scale: str, opts: dict[str, list[str]]) -> pd.DataFrame:
    """Each optimiser's settings per setup as the runs used them (rate, damping, momentum, weight decay, K-FAC's
    factor decay and refresh interval) and where the rate comes from.

    Args:
        setups: the setups.
        scale: the scale.
        opts: the optimisers per setup.

    Returns:
        A frame indexed by ``(setup, optimizer)``.
    """
    rows = []
    for setup in setups:
        cfg = resolve(setup, scale)
        for o in opts[setup]:
            c = cfg.optimizers[o]
            rows.append({"setup": setup, "optimizer": label(o), "lr": f"{c.lr:g}",
                         "damping": "" if c.damping is None else f"{c.damping:g}",
                         "momentum": f"{c.options['momentum']:g} (dampening {c.options['dampening']:g})"
                         if "momentum" in c.options else "",
                         "weight decay": f"{c.weight_decay:g}" if c.weight_decay else "",
                         "K-FAC factors": f"decay {c.options['factor_decay']:g}, inverse every "
                                          f"{c.options['inverse_every']} steps" if o in KFAC_FAMILY else "",
                         "rate from": "cpu search" if "lr search" in c.source else c.source.split(";")[0]})
    return pd.DataFrame(rows).set_index(["setup", "optimizer"])


def cost_table(costs: pd.DataFrame) -> pd.DataFrame:
    """:func:`companion.experiments.step_cost.step_costs` frames (concatenated) as the chapter shows them: milliseconds
    per update (median) and the ratio to the setup's baseline.

    Args:
        costs: rows of ``step_costs``.

    Returns:
        A frame indexed by ``(setup, optimizer)``.
    """
    out = costs.assign(optimizer=costs.optimizer.map(label),
                       **{"ms per update (median)": (1000 * costs.median_s).map(lambda v: f"{v:.3g}"),
                          "× baseline": costs.ratio.map(lambda v: f"{v:.2f}"),
                          "updates timed": costs.updates})
    return out.set_index(["setup", "optimizer"])[["ms per update (median)", "× baseline", "updates timed"]]


def curve_figures(curves: pd.DataFrame, setups: Sequence[str], opts: dict[str, list[str]], scale: str) -> dict:
    """The chapter's two figures: iEF with and without momentum beside each setup's baseline, and the K-FAC family
    beside iEF on the setups that have it (training loss and validation score, mean ± sd over seeds).

    Args:
        curves: the runs' curves.
        setups: the setups.
        opts: the optimisers per setup.
        scale: the scale (named in the titles).

    Returns:
        ``{"momentum": figure, "kfac": figure or None}``.
    """
    momentum = {s: [o for o in opts[s] if o not in KFAC_FAMILY] for s in setups}
    figures = {"momentum": plot_curves(curves, list(setups), momentum,
                                       title=f"iEF with and without momentum and weight decay beside the baseline "
                                             f"({scale} scale; beyond the paper)")}
    linear = [s for s in setups if any(o in KFAC_FAMILY for o in opts[s])]
    figures["kfac"] = plot_curves(curves, linear, {s: ["ief", *[o for o in opts[s] if o in KFAC_FAMILY]]
                                                   for s in linear},
                                  title=f"The K-FAC family as optimisers beside exact iEF ({scale} scale; beyond "
                                        f"the paper)") if linear else None
    return figures


def practical_glue(table: pd.DataFrame, opts: dict[str, list[str]], costs: pd.DataFrame | None = None
                   ) -> dict[str, str]:
    """The sentences the chapter glues: ``pr_over_seeds`` (how every rule decides a pair over seeds, and why), per
    rule of :mod:`companion.experiments.verdicts.practical` ``rule_<name>`` (the rule, glued before its result) and
    ``v_<name>`` (its verdict per setup: the workflow's ``verdicts.csv``,
    :func:`companion.experiments.verdict_table.chapter_verdicts`), and ``cost_<setup>`` (the cost ratios in words)
    when ``costs`` are given.

    Args:
        table: the runs.
        opts: the optimisers per setup, the baseline first.
        costs: :func:`companion.experiments.step_cost.step_costs` rows, or ``None``.

    Returns:
        ``{glue name: text}``.
    """
    from ..experiments.verdicts import RULES, summary
    from ..experiments.verdicts.practical import PRACTICAL_RULES

    from ..experiments.verdicts import n_test_examples

    out = {"pr_over_seeds": RULES[PRACTICAL_RULES[0]].why}  # one way of deciding, for every rule
    scale = str(table["scale"].iloc[0]) if "scale" in table.columns and len(table) else None
    sizes = {s: n_test_examples(s, scale) for s in opts} if scale else {}
    out["pr_resolution"] = "; ".join(f"one test example of {s} is {100 / n:.2g} points of its {n}"
                                     for s, n in sizes.items() if n) or "the test sets' sizes are not known here"
    from ..experiments.verdict_table import chapter_verdicts

    # the workflow's verdicts.csv where the chapter reads the whole grid from its tables, else the same rules here
    found = chapter_verdicts(table, PRACTICAL_RULES, lambda name: RULES[name].evaluate(table, None, opts))
    for name in PRACTICAL_RULES:
        out[f"rule_{name}"] = RULES[name].statement
        out[f"v_{name}"] = summary(found[name], scale=scale)
    if costs is not None:
        for setup, c in costs.groupby("setup", sort=False):
            base = label(c.baseline.iloc[0])
            out[f"cost_{setup}"] = ", ".join(f"{label(o)} {r:.2f}×" for o, r in zip(c.optimizer, c.ratio)
                                             if o != c.baseline.iloc[0]) + f" the time of an {base} update"
    return out


NO_SEARCH_RECORD = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "auto_lr-cpu.json"
_RUN_LABELS = {"default": "default (no search)", "auto": "lr='auto' (no search)", "searched": "searched"}


def no_search_table(record: str | Path = NO_SEARCH_RECORD) -> tuple[pd.DataFrame, dict[str, str]]:
    """The "no search" rows beside the searched ones: iEF with its default rate, with ``lr="auto"``
    (:mod:`ief.optim.auto_lr`) and with a searched rate, read from the committed record of
    ``python -m benchmarks auto_lr`` (the same initial model and batches for the three; the chapter reads, it does
    not train).

    Args:
        record: the benchmark's JSON record.

    Returns:
        ``(table, glue)``: one row per case and rate (the index; columns lr, final training loss, test accuracy,
        the adapted rate's range), and the glued sentences ``ns_rule`` (the rule, as the benchmark states it before its
        numbers: ``lr="auto"`` earns the default when on every case its final training loss is at most 1.1 times the
        searched rate's and no run diverged), ``ns_verdict`` (the cases that pass and fail) and ``ns_cases``.

    Raises:
        FileNotFoundError: no record (names the command that makes it).
    """
    import json

    record = Path(record)
    if not record.is_file():
        raise FileNotFoundError(f"no record {record}: `python -m benchmarks auto_lr --json {record}` makes it")
    cases = json.loads(record.read_text())["results"]["cases"]
    rows = []
    for case in cases:
        for key in ("default", "auto", "searched"):
            run = case["runs"][key]
            lr = run["lr"]
            rate = ("1 (default)" if lr is None else "auto" if lr == "auto" else f"{lr:g}")
            span = f"{run['rate_min']:.3g} – {run['rate_max']:.3g}" if lr == "auto" and run.get("rate_min") else ""
            rows.append({"case": case["case"], "rate": _RUN_LABELS[key], "lr": rate,
                         "final training loss": round(run["final_train_loss"], 4),
                         "test accuracy": "diverged" if run["diverged"] else f"{run['test_accuracy']:.3f}",
                         "adapted rate's range": span})
    passed = [c["case"] for c in cases if c["auto_within_10_percent"]]
    failed = [c for c in cases if not c["auto_within_10_percent"]]
    ratio = {c["case"]: c["runs"]["auto"]["final_train_loss"] / c["runs"]["searched"]["final_train_loss"]
             for c in cases}
    misses = ", ".join(f"{c['case']} ({ratio[c['case']]:.2g}× the searched rate's loss)" for c in failed)
    verdict = (f"it does not hold: lr='auto' is within the margin on {', '.join(passed) or 'no case'} but not on "
               f"{misses}, so the default rate is unchanged" if failed else
               f"it holds on every case ({', '.join(passed)})")
    diverged = [f"{c['case']} ({k})" for c in cases for k, r in c["runs"].items() if r["diverged"]]
    glue = {
        "ns_rule": "lr='auto' earns the default when, on every case, its final training loss is at most 1.1 times "
                   "the searched rate's and no run diverged",
        "ns_cases": "; ".join(f"{c['case']}: {c['note']}" for c in cases),
        "ns_verdict": verdict,
        "ns_diverged": ", ".join(diverged) if diverged else "no run diverged",
    }
    return pd.DataFrame(rows).set_index(["case", "rate"]), glue
