"""Figures and tables of E2 (``sec:opt-exp``, ``sec:app-mlp-cifar10``): curves with mean ± sd bands over seeds
(fig:curves-pt, fig:curves-lora, fig:mlp-curves) and the result tables with the paper's numbers beside ours
(tab:sum-test, tab:train, tab:validation, tab:test, tab:test-mlp).

Inputs are the tidy tables of :mod:`ief.experiments.aggregate` and :func:`ief.experiments.paper_results.paper_results`.
Drawing uses matplotlib, in seaborn's ``whitegrid`` style where seaborn is installed; colours are the project's
(:mod:`ief.style`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..experiments.aggregate import curve_bands, mean_sd
from ..style import method_color

LABELS = {"adamw": "AdamW", "adafactor": "Adafactor", "adam": "Adam", "sgd": "SGD", "ef": "EF", "sf": "SF",
          "ief": "iEF"}
METHOD_NAMES = {"pt": "Prompt Tuning", "lora": "LoRA", "scratch": "MLP from scratch"}
PAPER_METHOD = {"pt": "prompt-tuning", "lora": "lora", "scratch": "mlp"}
GLUE_ORDER = ["cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte", "cifar100", "cifar10"]
METRIC_NAMES = {"accuracy": "Acc", "matthews_correlation": "MCC", "f1": "F1", "accuracy_matched": "Acc-m",
                "accuracy_mismatched": "Acc-mm", "score": "score"}


@contextlib.contextmanager
def _style():
    try:
        import seaborn as sns
    except ImportError:  # matplotlib's defaults
        yield
        return
    with sns.axes_style("whitegrid"):
        yield


def label(optimizer: str) -> str:
    """The paper's name of an optimiser (``ief`` -> ``iEF``)."""
    return LABELS.get(optimizer, optimizer)


# -------------------------------------------------------------------------------------------------- figures
def plot_curves(curves: pd.DataFrame, setups: Sequence[str], optimizers: dict[str, Sequence[str]], *,
                validation: str = "val_score", points: int = 100, title: str | None = None):
    """Training loss (top) and validation metric (bottom) vs update step, one column per setup: mean over seeds
    with a ± sd band. The training loss is first averaged over ``points`` windows per run (the paper's 100 points)
    and drawn on a log axis whose bottom is half the lowest mean, where a band reaching ``mean - sd <= 0`` ends.

    ``optimizers``: the optimisers to draw per setup (the paper's table's, in its order). Returns the figure.
    """
    import matplotlib.pyplot as plt

    if not setups:
        raise ValueError("no setup to plot")
    loss = curve_bands(curves, "train_loss", points=points)
    val = curve_bands(curves, validation)
    with _style():
        width = max(4.2 * len(setups), 7.0)
        fig, axes = plt.subplots(2, len(setups), figsize=(width, 6.4), squeeze=False, sharex="col")
        for col, setup in enumerate(setups):
            for opt in optimizers[setup]:
                for row, bands in ((0, loss), (1, val)):
                    b = bands[(bands.setup == setup) & (bands.optimizer == opt)]
                    if b.empty:
                        continue
                    ax = axes[row, col]
                    color = method_color(label(opt))
                    ax.plot(b.step, b["mean"], color=color, lw=1.6, label=f"{label(opt)} (n={int(b.n.max())})")
                    ax.fill_between(b.step, b["mean"] - b["sd"], b["mean"] + b["sd"], color=color, alpha=0.18,
                                    lw=0)
            axes[0, col].set(title=setup, ylabel="training loss (per target token)", yscale="log")
            means = loss[(loss.setup == setup) & (loss["mean"] > 0)]["mean"]
            if len(means):  # log axis: a band whose lower edge (mean - sd) is <= 0 runs to the panel's bottom
                axes[0, col].set_ylim(bottom=0.5 * float(means.min()))
            axes[1, col].set(xlabel="update step", ylabel=f"validation {validation.removeprefix('val_')}")
            axes[0, col].legend(fontsize=8)
        if title:
            fig.suptitle(title, fontsize=10, wrap=True)
        fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------- tables
def ours_table(table: pd.DataFrame, column: str, optimizers: Sequence[str], setups: Sequence[str], *,
               scale: float = 1.0, digits: int = 2) -> pd.DataFrame:
    """``"mean ± sd"`` over seeds of ``column`` (times ``scale``): rows = optimisers, columns = setups."""
    out = pd.DataFrame(index=[label(o) for o in optimizers], columns=list(setups), dtype=object)
    for setup in setups:
        for opt in optimizers:
            v = table[(table.setup == setup) & (table.optimizer == opt)]
            out.loc[label(opt), setup] = mean_sd(v[column].dropna(), digits, scale) if column in v else "–"
    return out


def paper_table(paper: pd.DataFrame, table: str, method: str, optimizers: Sequence[str], *,
                metric: str | None = None, digits: int = 2) -> pd.DataFrame:
    """One of the paper's tables for ``method`` (``pt`` / ``lora`` / ``scratch``) as ``"value ± sd"`` strings:
    rows = optimisers, columns = ``task metric`` (or ``task`` where the task has one metric)."""
    p = paper[(paper.table == table) & (paper.method == PAPER_METHOD[method])]
    if metric is not None:
        p = p[p.metric == metric]
    if p.empty:
        return pd.DataFrame(index=[label(o) for o in optimizers])
    keys = sorted({(t, m) for t, m in zip(p.task, p.metric)},
                  key=lambda k: (GLUE_ORDER.index(k[0]) if k[0] in GLUE_ORDER else 99, k[1]))
    per_task = p.groupby("task")["metric"].nunique()
    names = {k: f"{k[0]} {METRIC_NAMES.get(k[1], k[1])}" if per_task[k[0]] > 1 else k[0] for k in keys}
    out = pd.DataFrame(index=[label(o) for o in optimizers], columns=[names[k] for k in keys], dtype=object)
    out[:] = "–"
    for r in p.itertuples():
        if r.optimizer not in optimizers:
            continue
        cell = f"{r.value:.{digits}f}" + ("" if np.isnan(r.sd) else f" ± {r.sd:.{digits}f}")
        out.loc[label(r.optimizer), names[(r.task, r.metric)]] = cell
    return out


def beside(ours: pd.DataFrame, paper: pd.DataFrame, ours_name: str, paper_name: str) -> pd.DataFrame:
    """Our table and the paper's side by side, under a two-level column header naming each source."""
    return pd.concat({ours_name: ours, paper_name: paper}, axis=1)


def ranking(values: dict[str, float]) -> list[str]:
    """Optimisers sorted by value (lowest first; NaN last)."""
    return sorted(values, key=lambda o: (np.isnan(values[o]), values[o]))
