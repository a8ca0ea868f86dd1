"""Figures and tables of E2 (``sec:opt-exp``, ``sec:app-mlp-cifar10``): curves with mean ± sd bands over seeds
(fig:curves-pt, fig:curves-lora, fig:mlp-curves) and the result tables with the paper's numbers beside ours
(tab:sum-test, tab:train, tab:validation, tab:test, tab:test-mlp).

Inputs are the tidy tables of :mod:`companion.experiments.aggregate` and
:func:`companion.experiments.paper_results.paper_results`. Drawing uses matplotlib, in seaborn's ``whitegrid`` style
where seaborn is installed; colours are the project's (:mod:`companion.chapters.style`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..experiments.aggregate import curve_bands, mean_sd
from .style import method_color
from .common import log_band, plain_log_ticks

LABELS = {"adamw": "AdamW", "adafactor": "Adafactor", "adam": "Adam", "sgd": "SGD", "ef": "EF", "sf": "SF",
          "ief": "iEF", "ief-momentum": "iEF+M", "kfac": "KFAC", "ekfac": "eKFAC", "iekfac": "ieKFAC"}
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
# Line styles and markers per optimiser, so that curves drawn over each other stay distinguishable (the baseline,
# AdamW/Adafactor/Adam, is also drawn last, on top).
DASHES = {"iEF": "-", "EF": (0, (5, 2)), "SF": (0, (1, 1.5)), "SGD": (0, (6, 2, 1, 2)), "AdamW": (0, (3, 1.5)),
          "Adam": (0, (3, 1.5)), "Adafactor": (0, (3, 1.5)), "iEF+M": (0, (8, 2)), "KFAC": (0, (2, 2)),
          "eKFAC": (0, (4, 1, 1, 1)), "ieKFAC": (0, (1, 1))}
MARKERS = {"iEF": "o", "EF": "X", "SF": "^", "SGD": "s", "AdamW": "D", "Adam": "v", "Adafactor": "P", "iEF+M": "*",
           "KFAC": "<", "eKFAC": ">", "ieKFAC": "h"}
BASELINES = ("adamw", "adafactor", "adam")
LOG_SPAN = 10.0  # a loss panel is logarithmic when its mean curves span more than this factor, else linear
MIN_UPDATES_PER_POINT = 4


def curve_points(steps: int, points: int = 100) -> int:
    """How many points a training-loss curve of ``steps`` updates is drawn with: the paper's 100, but at least
    :data:`MIN_UPDATES_PER_POINT` updates per point (a 64-update cpu run: 16 points of 4 updates, not 64 single
    noisy batches)."""
    return max(1, min(points, steps // MIN_UPDATES_PER_POINT))


def loss_scale(means: pd.Series) -> str:
    """``"log"`` where the positive mean curves span more than :data:`LOG_SPAN`, else ``"linear"``."""
    values = means[np.isfinite(means) & (means > 0)]
    return "log" if len(values) and float(values.max()) / float(values.min()) > LOG_SPAN else "linear"


def loss_axis(ax, means: pd.Series, scale: str | None = None) -> str:
    """Fit a training-loss axis to the mean curves drawn on it, so that the range the chapter discusses is readable.

    Linear when the means span at most :data:`LOG_SPAN` (the tweet setups, about 0.7-1.1), with limits from the
    means (± sd bands may leave the panel); logarithmic with labelled 1-2-5 ticks where they span orders of
    magnitude (digits: 2.3 down to 1e-3). ``scale``: impose ``"linear"`` or ``"log"`` (default: :func:`loss_scale`).
    Returns ``"linear"`` or ``"log"``."""
    if scale not in (None, "linear", "log"):
        raise ValueError(f"scale must be None, 'linear' or 'log', got {scale!r}")
    values = means[np.isfinite(means) & (means > 0)]
    if values.empty:
        return "linear"
    lo, hi = float(values.min()), float(values.max())
    if (scale or loss_scale(values)) == "linear":
        pad = 0.08 * (hi - lo) or 0.05 * hi
        ax.set_ylim(lo - pad, hi + pad)
        return "linear"
    ax.set_yscale("log")
    ax.set_ylim(lo / 1.6, hi * 1.6)
    plain_log_ticks(ax)
    return "log"


def log_curve_bands(curves: pd.DataFrame, quantity: str, points: int | None = None) -> pd.DataFrame:
    """Per ``(setup, optimizer, step)``, the geometric mean over seeds of a curve and its band of +-1 sd of the log
    values (:func:`companion.chapters.common.log_band`), for a logarithmic axis: each seed's curve is first windowed as
    :func:`~companion.experiments.aggregate.curve_bands` does. Columns ``setup, optimizer, step, mean, low, high, n``; a
    step where a seed's value is not positive is left out (it has no place on a log axis)."""
    per_seed = [curve_bands(c, quantity, points).assign(seed=seed)
                for seed, c in curves[curves["quantity"] == quantity].groupby("seed")]
    rows = []
    for (setup, opt, step), g in pd.concat(per_seed).groupby(["setup", "optimizer", "step"], sort=False):
        v = g["mean"].to_numpy()
        if np.all(np.isfinite(v) & (v > 0)):
            centre, low, high = log_band(v)
            rows.append((setup, opt, step, centre, low, high, len(v)))
    out = pd.DataFrame(rows, columns=["setup", "optimizer", "step", "mean", "low", "high", "n"])
    return out.sort_values(["setup", "optimizer", "step"], kind="stable").reset_index(drop=True)


def plot_curves(curves: pd.DataFrame, setups: Sequence[str], optimizers: dict[str, Sequence[str]], *,
                validation: str = "val_score", points: int = 100, title: str | None = None):
    """Training loss (left) and validation metric (right) vs update step, one row per setup at the page width: mean
    over seeds with a ± sd band. The training loss is first averaged over windows per run (the paper's ``points``,
    at most one per :data:`MIN_UPDATES_PER_POINT` updates, :func:`curve_points`); its axis is fitted by
    :func:`loss_axis` (linear over the range of the means, or logarithmic with 1-2-5 ticks, where the curve is the
    geometric mean over seeds and the band ± sd of the log losses, :func:`log_curve_bands`). Each optimiser has its
    own line style and marker; the setup's baseline (AdamW/Adafactor/Adam) is drawn on top.

    ``optimizers``: the optimisers to draw per setup (the paper's table's, in its order). Returns the figure.
    """
    import matplotlib.pyplot as plt

    from .common import PAGE_WIDTH_IN

    if not setups:
        raise ValueError("no setup to plot")
    val = curve_bands(curves, validation)
    with _style():
        fig, axes = plt.subplots(len(setups), 2, figsize=(PAGE_WIDTH_IN, 3.2 * len(setups) + 1.1), squeeze=False)
        for row, setup in enumerate(setups):
            c = curves[(curves.setup == setup) & (curves.quantity == "train_loss")]
            steps = int(c.groupby(["optimizer", "seed"]).size().max()) if len(c) else 1
            windows = curve_points(steps, points)
            loss = curve_bands(curves[curves.setup == setup], "train_loss", points=windows)
            kind = loss_scale(loss[loss.optimizer.isin(optimizers[setup])]["mean"])
            if kind == "log":
                loss = log_curve_bands(curves[curves.setup == setup], "train_loss", points=windows)
            else:
                loss = loss.assign(low=loss["mean"] - loss["sd"], high=loss["mean"] + loss["sd"])
            val_bands = val.assign(low=val["mean"] - val["sd"], high=val["mean"] + val["sd"])
            order = sorted(optimizers[setup], key=lambda o: o in BASELINES)  # the baseline last: on top
            for z, opt in enumerate(order):
                for col, bands in ((0, loss), (1, val_bands)):
                    b = bands[(bands.setup == setup) & (bands.optimizer == opt)]
                    if b.empty:
                        continue
                    ax = axes[row, col]
                    name = label(opt)
                    color = method_color(name)
                    ax.plot(b.step, b["mean"], color=color, lw=2.2 if opt in BASELINES else 1.7,
                            ls=DASHES.get(name, "-"), marker=MARKERS.get(name), ms=5,
                            markevery=max(1, len(b) // 8), zorder=3 + z, label=f"{name} (n={int(b.n.max())})")
                    ax.fill_between(b.step, b["low"], b["high"], color=color, alpha=0.12, lw=0, zorder=1)
            shown = loss[(loss.setup == setup) & loss.optimizer.isin(optimizers[setup])]["mean"]
            loss_axis(axes[row, 0], shown, scale=kind)
            per = max(1, steps // windows)
            axes[row, 0].set(title=f"{setup}: training loss", ylabel=f"training loss ({kind} axis)",
                             xlabel=f"update step (each point: {per} updates)" if per > 1 else "update step")
            axes[row, 1].set(title=f"{setup}: validation", xlabel="update step",
                             ylabel=f"validation {validation.removeprefix('val_')}")
        handles, labels = [], []  # every row's optimisers (rows may differ: each setup's own baseline)
        for ax in axes[:, 0]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        rank = {f"{label(o)} ": i for i, o in enumerate(optimizers[setups[0]])}  # the paper's order in the legend
        pairs = sorted(zip(handles, labels), key=lambda hl: rank.get(hl[1].split("(")[0], len(rank)))
        handles, labels = [h for h, _ in pairs], [lab for _, lab in pairs]
        ncol = min(len(labels), 4)
        fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, handlelength=3.2)
        if title:
            fig.suptitle(title, wrap=True)
        legend_rows = -(-len(labels) // ncol) if labels else 1
        fig.tight_layout(rect=(0, (0.1 + 0.25 * legend_rows) / (3.2 * len(setups) + 1.1), 1, 1))
    return fig


# --------------------------------------------------------------------------------------------------- tables
def seed_span(seeds: Sequence[int]) -> str:
    """Seeds as a reader reads them: runs of consecutive seeds as ranges.

    Args:
        seeds: run seeds (any order, repeats allowed).

    Returns:
        e.g. ``"0–59"``, ``"0, 1, 2"`` (a run of three or fewer is listed) or ``"0–9, 12"``.
    """
    values, parts = sorted({int(k) for k in seeds}), []
    while values:
        end = 0
        while end + 1 < len(values) and values[end + 1] == values[end] + 1:
            end += 1
        parts.append(f"{values[0]}–{values[end]}" if end >= 3 else ", ".join(map(str, values[:end + 1])))
        values = values[end + 1:]
    return ", ".join(parts)


def coverage_table(table: pd.DataFrame) -> pd.DataFrame:
    """What the E2 table holds per setup and optimiser: its seeds, steps, diverged runs and training time.

    Args:
        table: the E2 runs table (``e2_runs.csv``: one row per run, with ``setup``, ``optimizer``, ``seed``,
            ``steps``, ``diverged_step`` and ``wall_time_s``).

    Returns:
        One row per (setup, optimiser) with the paper's optimiser names: ``seeds`` (:func:`seed_span`), ``steps``
        (the most of any seed), ``diverged`` (runs that diverged) and ``wall_s`` (training seconds, summed over the
        seeds, to a tenth of a second).
    """
    coverage = (table.groupby(["setup", "optimizer"])
                .agg(seeds=("seed", seed_span), steps=("steps", "max"), diverged=("diverged_step", "count"),
                     wall_s=("wall_time_s", "sum"))
                .reset_index())
    coverage["wall_s"] = coverage["wall_s"].round(1)
    coverage["optimizer"] = coverage["optimizer"].map(label)
    return coverage


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


# ------------------------------------------------------------------------------------------ tables and findings
SUM_TEST_PAPER = {("prompt-tuning", "glue"): "GLUE + T5 + Prompt Tuning", ("lora", "glue"): "GLUE + T5 + LoRA",
                  ("lora", "cifar100"): "CIFAR100 + ViT + LoRA"}
SUM_TEST_COLUMNS = ["AdamW", "Adafactor", "Adam", "SGD", "EF", "SF", "iEF"]


def sum_test_table(table: pd.DataFrame, paper: pd.DataFrame, setups: Sequence[str], opts: dict[str, Sequence[str]],
                   method: dict[str, str], mlp_citation: str) -> pd.DataFrame:
    """tab:sum-test: our test score per setup (mean ± sd over seeds, %) above the paper's average test scores (its
    three groups, and the MLP's test accuracy from tab:test-mlp, cited as ``mlp_citation``)."""
    rows = {f"ours: {s} ({METHOD_NAMES[method[s]]})": ours_table(table, "test_score", opts[s], [s], scale=100,
                                                                  digits=1)[s] for s in setups}
    p = paper[paper.table == "tab:sum-test"]
    for (m, task), name in SUM_TEST_PAPER.items():
        q = p[(p.method == m) & (p.task == task)]
        rows[f"paper: {name}"] = pd.Series({label(o): f"{v:.1f}" for o, v in zip(q.optimizer, q.value)})
    q = paper[(paper.table == "tab:test-mlp") & (paper.metric == "test_accuracy")]
    rows[f"paper: CIFAR10 + MLP ({mlp_citation})"] = pd.Series({label(o): f"{v:.1f}" for o, v in zip(q.optimizer,
                                                                                                      q.value)})
    return pd.DataFrame(rows).T.reindex(columns=SUM_TEST_COLUMNS).fillna("–")


def test_mlp_table(table: pd.DataFrame, paper: pd.DataFrame, setups: Sequence[str], opts: dict[str, Sequence[str]],
                   method: dict[str, str]) -> pd.DataFrame:
    """tab:test-mlp: validation and test accuracy of the MLP setups (ours, mean ± sd, %) above the paper's."""
    rows = {}
    names = (("val_score", "val_accuracy", "validation accuracy (%)"), ("test_score", "test_accuracy",
                                                                        "test accuracy (%)"))
    for s in (s for s in setups if method[s] == "scratch"):
        for col, _, name in names:
            rows[f"ours: {s}, {name}"] = ours_table(table, col, opts[s], [s], scale=100, digits=1)[s]
    q = paper[paper.table == "tab:test-mlp"]
    for _, metric, name in names:
        r = q[q.metric == metric]
        rows[f"paper: CIFAR10 + MLP, {name}"] = pd.Series(
            {label(o): f"{v:.1f}" + ("" if np.isnan(sd) else f" ± {sd:.2f}") for o, v, sd in zip(r.optimizer, r.value,
                                                                                                   r.sd)})
    return pd.DataFrame(rows).T.reindex(columns=["iEF", "Adam", "SGD", "SF", "EF"]).fillna("–")


def e2_findings(table: pd.DataFrame, curves: pd.DataFrame, setups: Sequence[str],
                opts: dict[str, Sequence[str]], method: dict[str, str] | None = None) -> dict[str, str]:
    """The sentences the chapter glues for the paper's three E2 observations: per rule of
    :mod:`companion.experiments.verdicts` (``E2_RULES``) ``rule_<name>`` (the claim's own rule, glued before the
    result; the way every pair over seeds is decided is the chapter's, stated once before the claims),
    ``v_<name>`` (the verdict per setup, naming the failing pairs), and the numbers: the mean final losses in order,
    each optimiser's mean loss rise, EF's diverged runs and iEF's test score against the baseline."""
    from ..experiments.verdicts import E2_RULES, RULES, loss_rises, summary
    from ..experiments.verdicts.training import OVER_SEEDS

    opts = {s: list(opts[s]) for s in setups}
    out: dict[str, str] = {}
    found = e2_verdicts(table, curves, opts, method)
    for name in E2_RULES:
        rule = RULES[name]
        # the claim's own rule; how every pair over seeds is decided is stated once, before the claims
        out[f"rule_{name}"] = rule.statement + ("" if rule.why == OVER_SEEDS else " " + rule.why)
        out[f"v_{name}"] = summary(found[name], scale=_scale_of(table))
    mean_loss = table.groupby(["setup", "optimizer"])["final_train_loss"].mean()
    out["e2_obs1_rankings"] = "; ".join(
        f"{s}: " + " < ".join(f"{label(o)} ({mean_loss[(s, o)]:.3g})" for o in
                              ranking({o: mean_loss.get((s, o), np.nan) for o in opts[s] if (s, o) in mean_loss}))
        for s in setups)
    rise = loss_rises(curves)
    mean_rise = {}
    for (s, o, _), v in rise.items():
        mean_rise.setdefault((s, o), []).append(v)
    out["e2_obs2_rises"] = "; ".join(
        f"{s}: " + ", ".join(f"{label(o)} {_rise_text(mean_rise[(s, o)])}" for o in opts[s] if (s, o) in mean_rise)
        for s in setups)
    ef = table[table.optimizer == "ef"]
    out["e2_obs2_ef_diverged"] = f"{int(ef.diverged_step.notna().sum())} of {len(ef)}"
    test = table.groupby(["setup", "optimizer"])["test_score"].mean()
    vs = [f"{s}: iEF {100 * test[(s, 'ief')]:.1f} vs {label(opts[s][0])} {100 * test[(s, opts[s][0])]:.1f}"
          for s in setups if (s, "ief") in test and (s, opts[s][0]) in test
          and not np.isnan(test[(s, "ief")]) and not np.isnan(test[(s, opts[s][0])])]
    out["e2_obs3_vs"] = "; ".join(vs) if vs else "no setup with test labels"
    return out


def e2_verdicts(table: pd.DataFrame, curves: pd.DataFrame, opts: dict[str, list[str]],
                method: dict[str, str] | None = None) -> dict[str, list]:
    """The E2 rules' verdicts, ``{claim: [Verdict]}``: the workflow's ``verdicts.csv`` where the chapter reads the
    whole grid from the workflow's tables (:func:`companion.experiments.verdict_table.chapter_verdicts`), else the
    same rules on ``table`` (with no per-example predictions: a test claim then takes the binomial resolution)."""
    from ..experiments.verdict_table import chapter_verdicts
    from ..experiments.verdicts import E2_RULES, RULES

    def compute(name: str) -> list:
        return RULES[name].evaluate(*(table, curves, opts) + ((method,) if name == "e2_ief_vs_baseline" else ()))

    return chapter_verdicts(table, E2_RULES, compute)


def _rise_text(values: Sequence[float]) -> str:
    finite = [v for v in values if np.isfinite(v) and v > 0]
    text = f"{float(np.exp(np.mean(np.log(finite)))):.3g}×" if finite else "diverged"
    return text + (f" ({len(values) - len(finite)} diverged)" if finite and len(finite) < len(values) else "")


def _scale_of(table: pd.DataFrame) -> str | None:
    return str(table["scale"].iloc[0]) if "scale" in table.columns and len(table) else None


LISTED_SEEDS = 12  # per-seed differences listed one by one up to this many seeds; more are summarised


def seed_differences(diffs: Sequence[float]) -> str:
    """A pair's per-seed differences as a table cell: each one up to :data:`LISTED_SEEDS` seeds, else their spread.

    Args:
        diffs: the differences, in seed order (NaN: a run without the metric, e.g. a diverged run).

    Returns:
        e.g. ``"-0.1, +0.02"``, or for many seeds ``"min -0.27, quartiles -0.17 / -0.066 / +0.036, max +0.26"``
        (with ``"; 2 n/a"`` where some are missing).
    """
    values = np.asarray(diffs, dtype=float)
    if len(values) <= LISTED_SEEDS:
        return ", ".join("n/a" if np.isnan(d) else f"{d:+.3g}" for d in values)
    known = values[~np.isnan(values)]
    missing = len(values) - len(known)
    if not len(known):
        return f"{missing} n/a"
    q1, q2, q3 = np.quantile(known, [0.25, 0.5, 0.75])
    return (f"min {known.min():+.3g}, quartiles {q1:+.3g} / {q2:+.3g} / {q3:+.3g}, max {known.max():+.3g}"
            + (f"; {missing} n/a" if missing else ""))


def seed_table(table: pd.DataFrame, curves: pd.DataFrame, setups: Sequence[str], opts: dict[str, Sequence[str]],
               method: dict[str, str] | None = None) -> pd.DataFrame:
    """The E2 rankings decided over seeds (:mod:`companion.experiments.verdicts`): one row per setup, claim and pair
    with the per-seed differences (signed so that negative is in favour of the claim; final losses and loss climbs as
    log ratios, test scores in percentage points; their quartiles beyond :data:`LISTED_SEEDS` seeds), how many seeds
    are in favour, the mean difference with its 95 % interval (for a test score over seeds and test examples
    crossed), the pair's verdict and, for an undecided pair, what would decide it. The pairs of ``e2_ief_lowest`` are
    the loss ranking's pairs with iEF, shown once, under the ranking."""
    from ..experiments.verdicts import E2_RULES

    opts = {s: list(opts[s]) for s in setups}
    rows = []
    found = e2_verdicts(table, curves, opts, method)
    for name in (n for n in E2_RULES if n != "e2_ief_lowest"):
        for v in found[name]:
            for p in v.pairs:
                unit = 100 if p.metric == "test_score" else 1
                interval = ("sign test (a diverged run)" if np.isnan(p.mean) else
                            f"{unit * p.mean:+.3g} ({unit * p.low:+.3g} to {unit * p.high:+.3g})")
                rows.append({"setup": p.setup, "claim": name.removeprefix("e2_").replace("_", " "), "pair": p.pair,
                             "per-seed differences": seed_differences([unit * d for d in p.diffs.values()]),
                             "seeds": seed_span(p.diffs),
                             "in favour": p.agreement.split(";")[0],
                             "mean (95 % interval)": interval, "verdict": p.verdict,
                             "would be decided by": p.needs or ""})
    if not rows:
        raise ValueError("no E2 runs to decide a ranking on")
    return pd.DataFrame(rows).set_index(["setup", "claim", "pair"])


def pair_view(pairs: pd.DataFrame, wide: str = "24em"):
    """:func:`seed_table` as the chapter shows it: the "would be decided by" column (a sentence per undecided pair)
    at least ``wide`` wide, so the browser's table layout does not squeeze it to a few words a line; the other
    columns as the book's stylesheet sets them.

    Args:
        pairs: :func:`seed_table`'s table.
        wide: a CSS length, the narrowest that column is drawn.

    Returns:
        A pandas ``Styler`` with the book's table class (``dataframe``).
    """
    column = pairs.columns.get_loc("would be decided by")
    return pairs.style.set_table_styles([{"selector": f"td.col{column}", "props": f"min-width: {wide};"}]) \
        .set_table_attributes('class="dataframe"')


def budget_glue(table: pd.DataFrame, pairs: pd.DataFrame) -> dict[str, str]:
    """What the chapter says about the runs' length and what the seeds decide: ``e2_budget`` (updates per run and
    seeds, per setup, from the runs table), ``e2_pairs_decided`` (how many of :func:`seed_table`'s pairs the seeds
    decide, and how many they leave undecided) and ``e2_needs`` (per setup, the most seeds an undecided pair needs
    at its observed mean and spread, and the pairs no number of seeds decides, with a seed's job time of the setup's
    E2 optimisers from the runs' own wall times)."""
    per = table.groupby("setup").agg(steps=("steps", "max"), seeds=("seed", "nunique"))
    verdicts = pairs["verdict"].value_counts()
    decided = int(verdicts.get("holds", 0) + verdicts.get("does not hold", 0))
    scale = _scale_of(table) or "this scale"
    needs = []
    open_ = pairs.reset_index()
    open_ = open_[open_["would be decided by"] != ""]
    for setup, rows in open_.groupby("setup", sort=False):
        counts = [int(t.split()[1]) for t in rows["would be decided by"] if t.startswith("needs ")
                  and t.split()[1].isdigit()]
        never = int(sum(t.startswith("no number") for t in rows["would be decided by"]))
        runs = table[table.setup == setup]
        seed_minutes = float(runs.groupby("seed")["wall_time_s"].sum().mean()) / 60 if "wall_time_s" in runs else None
        parts = []
        if counts:
            parts.append(f"{len(counts)} undecided pairs need up to {max(counts)} seeds "
                         f"(median {int(np.median(counts))})"
                         + (f", {max(counts) * seed_minutes:.0f} min of one core at {seed_minutes:.1f} min per seed"
                            if seed_minutes else ""))
        if never:
            parts.append(f"{never} no number of seeds decides (the test set's resolution, or a tie)")
        needs.append(f"{setup}: " + "; ".join(parts))
    from ..experiments.verdicts import n_test_examples

    sizes = {s: n_test_examples(s, scale) for s in per.index} if scale != "this scale" else {}
    resolution = "; ".join(f"{100 / n:.2g} points on {s}'s {n} test examples" for s, n in sizes.items() if n)
    return {"e2_budget": "; ".join(f"{s}: {int(r.steps)} updates, {int(r.seeds)} seeds" for s, r in per.iterrows()),
            "e2_test_resolution": resolution or "unknown here (no test set size at this scale)",
            "e2_pairs_decided": f"{decided} of {len(pairs)} pairs ({int(verdicts.get('holds', 0))} hold, "
                                f"{int(verdicts.get('does not hold', 0))} do not); "
                                f"{int(verdicts.get('inconclusive', 0))} undecided at {scale}",
            "e2_needs": "; ".join(needs) if needs else "every pair is decided"}


def method_tables(table: pd.DataFrame, paper: pd.DataFrame, setups: Sequence[str], opts: dict[str, Sequence[str]],
                  method: dict[str, str], column: str, paper_label: str, *, scale: str, times: float = 1.0,
                  digits: int = 2, metric: str | None = None) -> dict[str, pd.DataFrame]:
    """Per fine-tuning method, our ``column`` (mean ± sd over seeds, times ``times``) beside the paper's
    ``paper_label`` table (tab:train, tab:validation, tab:test), under headers naming each source (and, for a table
    whose transcription corrects the paper's caption, the correction: ``paper_results.CORRECTED``)."""
    from ..experiments.paper_results import CORRECTED

    out = {}
    for m in dict.fromkeys(method[s] for s in setups):
        ss = [s for s in setups if method[s] == m]
        ours = ours_table(table, column, opts[ss[0]], ss, scale=times, digits=digits)
        theirs = paper_table(paper, paper_label, m, opts[ss[0]], metric=metric, digits=digits)
        notes = (["its setups"] if scale != "full" else []) + ([CORRECTED[paper_label]] if paper_label in CORRECTED
                                                               else [])
        out[m] = beside(ours, theirs, f"ours ({scale})", "paper" + (f" ({'; '.join(notes)})" if notes else ""))
    return out
