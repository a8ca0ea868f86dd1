"""Figures of the evaluation chapter: ``fig:sample_gamma`` (E1), ``fig:damping_gamma_*`` (E3) and
``fig:sample_blockdiag_gamma`` (block-diagonal study), from the tidy records of
:mod:`companion.experiments.evaluate_runs` (a list of dicts, as
:func:`~companion.experiments.evaluate_runs.read_records` gives).

Every point of a figure is a per-batch ratio averaged over the evaluated batches with a +-1 sd bar (the paper:
"averaged across 100 evaluations, error bars the standard deviation"), on log axes: so the average is the geometric
mean and the bar +-1 sd of the log ratios (:func:`log_errorbar`), symmetric on the axis and never down to its floor.
The glued ratios are that geometric mean too (the statistic the verdicts decide on); the summary table alone keeps the
arithmetic mean +- sd (:func:`stage_series`, ``summary_rows``), and the glue ``mean_kinds`` says which is which. Figures
are laid out at the page width (at most two panels a row) so their text stays >= 9 px as shown
(``tests/book/test_figures.py``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..experiments.evaluate_runs import usable, summary_rows
from ..experiments.setups import BLOCKDIAG_SETUPS, CPU_SETUPS, EVALUATION_KNOBS as DEFAULTS, resolve
from ..experiments.verdicts import (BLOCK_RULES, DECIDED, E1_AGGREGATION, E1_RULES, E3_RULES, FAILS, HOLDS,
                                    INCONCLUSIVE, RULES, TENTH_DECADE, WHY_T, decide, e1_batches, summary)
from ..experiments.verdicts.evaluation import near_zero_contrast, top_edge_bests
from .style import SEQUENCE_COLORS, method_color
from .common import PAGE_WIDTH_IN, log_band, plain_log_ticks

LABELS = {"sgd": "SGD", "ef": "EF", "ief": "iEF", "sf": "SF", "hf": "HF", "kfac": "KFAC", "ekfac": "eKFAC",
          "iekfac": "ieKFAC"}
DAMPING_AXES = ("ief", "paper")


def damping_axis(record: dict[str, Any], axis: str = "ief") -> float:
    """The damping of a record on the plotted axis: THE axis-conversion point of the chapter.

    ``"ief"``: as stored, the package's sum-loss convention. ``"paper"``: the paper code's token-mean loss,
    ``lambda_paper = lambda_ief / K^2`` with ``K = target_tokens`` of the record's batch.
    """
    if axis not in DAMPING_AXES:
        raise ValueError(f"unknown damping axis {axis!r}; accepted: {', '.join(DAMPING_AXES)}")
    lam = float(record["damping"])
    return lam if axis == "ief" else lam / float(record["target_tokens"]) ** 2


def _per_batch(records, setup, kind="e1"):
    """``{(stage, batch): {method: record}}`` for one setup."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r["setup"] == setup and r["kind"] == kind:
            out.setdefault((r["stage"], r["batch"]), {})[r["method"]] = r
    return out


def stage_values(records, setup: str, numerator: str, denominator: str = "sgd",
                 field: str = "gamma") -> dict[int, list[float]]:
    """``{stage: [value per batch]}`` of ``gamma_num / gamma_den`` (or of the batch's ``imbalance`` with
    ``field="imbalance"``), skipping unusable gammas and non-finite values."""
    by_stage: dict[int, list[float]] = {}
    for (stage, _), methods in _per_batch(records, setup).items():
        if field == "imbalance":
            value = next(iter(methods.values()))["imbalance"]
        elif numerator in methods and denominator in methods and usable(methods[numerator]["gamma"]) \
                and usable(methods[denominator]["gamma"]):
            value = methods[numerator]["gamma"] / methods[denominator]["gamma"]
        else:
            continue
        if value is not None and np.isfinite(value):
            by_stage.setdefault(stage, []).append(value)
    return dict(sorted(by_stage.items()))


def stage_series(records, setup: str, numerator: str, denominator: str = "sgd", field: str = "gamma"):
    """``(stages, mean, sd)`` over batches of ``gamma_num / gamma_den`` (or of ``imbalance`` with field=...)."""
    by_stage = stage_values(records, setup, numerator, denominator, field)
    stages = sorted(by_stage)
    return (np.array(stages), np.array([np.mean(by_stage[s]) for s in stages]),
            np.array([np.std(by_stage[s]) for s in stages]))


def setups_of(records) -> list[str]:
    return list(dict.fromkeys(r["setup"] for r in records))


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # one per setup (colour is not the only cue)
MATH_PT = 13  # labels with sub/superscripts (gamma_EF): their scripts, 0.7 of this, stay >= 9 px at 90 dpi


def log_errorbar(ax, groups: dict[float, list[float]], error_bars: bool = True, **style):
    """Draw ``{x: values}`` on a logarithmic y axis: the geometric mean of each group with its +-1 sd band of the log
    values (:func:`companion.chapters.common.log_band`), so the bar is symmetric on the axis and never runs to its
    floor. Groups with a non-positive value are left out (they have no place on a log axis). Returns the errorbar
    container, or ``None`` where no group can be drawn."""
    xs, centre, low, high = [], [], [], []
    for x, values in groups.items():
        if len(values) and all(np.isfinite(v) and v > 0 for v in values):
            c, lo, hi = log_band(values)
            xs.append(x), centre.append(c), low.append(c - lo), high.append(hi - c)
    if not xs:
        return None
    return ax.errorbar(xs, centre, yerr=[low, high] if error_bars else None, **style)


def _grid(n: int, height: float, columns: int = 2, sharey: bool = False):
    """``(fig, axes)``: ``n`` panels in rows of at most ``columns`` at the page width (spare panels switched off)."""
    import matplotlib.pyplot as plt

    ncols = max(1, min(columns, n))
    nrows = max(1, -(-n // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(PAGE_WIDTH_IN, height * nrows + 0.7), squeeze=False,
                             sharey=sharey)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_axis_off()
    return fig, flat[:max(n, 1)]


def _figure_legend(fig, axes, ncol: int) -> None:
    """One legend for the figure, below its panels (the handles of the first panel that has any)."""
    for ax in axes:
        handles, labels = ax.get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="lower center", ncol=max(1, min(ncol, len(labels))), frameon=False)
            return


def plot_sample_gamma(records, setups: Sequence[str] | None = None, error_bars: bool = True):
    """``fig:sample_gamma``: gamma_EF/gamma_SGD, gamma_iEF/gamma_SGD, gamma_SF/gamma_EF and the imbalance vs stage,
    as a 2 x 2 grid at the page width, one colour and marker per setup
    (:data:`companion.chapters.style.SEQUENCE_COLORS`: setups are not methods); geometric mean over batches with its +-1
    sd band of the logs (:func:`log_errorbar`).

    ``error_bars=False``: as the paper's appendix figures for every task (``fig:lora_gamma``, ``fig:pt_gamma``)."""
    setups = list(setups or setups_of(records))
    panels = [("ef", "sgd", r"$\gamma_{EF}/\gamma_{SGD}$"), ("ief", "sgd", r"$\gamma_{iEF}/\gamma_{SGD}$"),
              ("sf", "ef", r"$\gamma_{SF}/\gamma_{EF}$"), (None, None, "imbalance (max/min grad norm)")]
    fig, axes = _grid(len(panels), 3.0)
    for k, setup in enumerate(setups):
        style = dict(marker=MARKERS[k % len(MARKERS)], ms=5, capsize=3, color=SEQUENCE_COLORS[k % len(SEQUENCE_COLORS)],
                     label=setup)
        for ax, (num, den, title) in zip(axes, panels):
            field = "imbalance" if num is None else "gamma"
            log_errorbar(ax, stage_values(records, setup, num, den or "sgd", field), error_bars, **style)
            ax.set_title(title, fontsize=MATH_PT if "$" in title else None)
    for i, ax in enumerate(axes):
        ax.set_yscale("log")
        ax.set_xlabel("training stage (%)" if i >= 2 else None)
        if i < 3:
            ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
        plain_log_ticks(ax)
    _figure_legend(fig, axes, 3)
    fig.tight_layout(rect=(0, 0.045 * (1 + (len(setups) - 1) // 3), 1, 1))
    return fig


def plot_blockdiag_gamma(records, setups: Sequence[str] | None = None):
    """``fig:sample_blockdiag_gamma``: iEF, ieKFAC, KFAC and eKFAC relative to SGD vs stage, one panel per setup (two
    per row at the page width), geometric mean over batches with its +-1 sd band of the logs."""
    setups = [s for s in (setups or setups_of(records))
              if any(r["setup"] == s and r["method"] == "iekfac" for r in records)]
    fig, axes = _grid(len(setups), 3.2)
    for ax, setup in zip(axes, setups):
        for k, method in enumerate(("ief", "iekfac", "kfac", "ekfac")):
            log_errorbar(ax, stage_values(records, setup, method), marker=MARKERS[k], ms=5, capsize=3,
                         color=method_color(LABELS[method]), label=LABELS[method])
        ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
        ax.set_yscale("log")
        plain_log_ticks(ax)
        ax.set_title(setup)
        ax.set_xlabel("training stage (%)")
        ax.set_ylabel(r"$\gamma / \gamma_{SGD}$", fontsize=MATH_PT)
    _figure_legend(fig, axes, 4)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def sweep_values(records, setup: str, stage: int, method: str, axis: str = "ief") -> dict[float, list[float]]:
    """``{damping: [gamma / gamma_SGD per batch]}`` at one stage (dampings on ``axis``, :func:`damping_axis`)."""
    by_lam: dict[float, list[float]] = {}
    for r in records:
        if (r["setup"] == setup and r["kind"] == "sweep" and r["stage"] == stage and r["method"] == method
                and usable(r["ratio"])):
            by_lam.setdefault(damping_axis(r, axis), []).append(r["ratio"])
    return dict(sorted(by_lam.items()))


def sweep_series(records, setup: str, stage: int, method: str, axis: str = "ief"):
    """``(dampings, mean, sd)`` of ``gamma / gamma_SGD`` over batches at one stage (dampings on ``axis``)."""
    by_lam = sweep_values(records, setup, stage, method, axis)
    lams = sorted(by_lam)
    return (np.array(lams), np.array([np.mean(by_lam[x]) for x in lams]),
            np.array([np.std(by_lam[x]) for x in lams]))


def plot_damping_gamma(records, setup: str, axis: str = "ief"):
    """``fig:damping_gamma_*``: gamma/gamma_SGD of EF, SF and iEF vs damping at the first, middle and last stage, two
    panels per row at the page width (the legend in the spare fourth), geometric mean over batches with its +-1 sd
    band of the logs."""
    if axis not in DAMPING_AXES:
        raise ValueError(f"unknown damping axis {axis!r}; accepted: {', '.join(DAMPING_AXES)}")
    stages = sorted({r["stage"] for r in records if r["setup"] == setup and r["kind"] == "sweep"})
    fig, axes = _grid(len(stages), 3.0, sharey=True)
    for i, (ax, stage) in enumerate(zip(axes, stages)):
        for k, method in enumerate(("ef", "sf", "ief")):
            log_errorbar(ax, sweep_values(records, setup, stage, method, axis), marker=MARKERS[k], ms=4, capsize=2,
                         color=method_color(LABELS[method]), label=LABELS[method])
        ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{setup}, stage {stage}%")
        ax.set_xlabel(r"damping $\lambda$ (" + ("package, sum loss" if axis == "ief" else "paper, token mean")
                      + ")")
        ax.set_ylabel(r"$\gamma / \gamma_{SGD}$" if i % 2 == 0 else None, fontsize=MATH_PT)
        plain_log_ticks(ax, "x")  # "1e-08", not 10 with a superscript at 0.7 of the tick size
    if axes and stages:
        plain_log_ticks(axes[0])  # the y axis is shared
    spare = len(axes) % 2 == 1 and len(axes) > 1
    if spare:  # the legend in the empty fourth panel's place
        handles, labels = axes[0].get_legend_handles_labels()
        fig.axes[len(axes)].legend(handles, labels, loc="center", frameon=False)
    else:
        _figure_legend(fig, axes, 3)
    fig.tight_layout(rect=(0, 0 if spare else 0.06, 1, 1))
    return fig


SUMMARY_METHODS = ("ef", "ief", "sf", "hf", "kfac", "ekfac", "iekfac")


def _plain(x: float, digits: int) -> str:
    """``x`` to ``digits`` significant digits, without an exponent from 1e-4 up (``46.1``, ``150``, ``0.0023``)."""
    if not np.isfinite(x) or abs(x) < 1:
        return f"{x:.{digits}g}"
    return f"{x:.{max(0, digits - 1 - int(np.floor(np.log10(abs(x)))))}f}"


def _mean_sd(mean: float, sd: float) -> str:
    """``"0.695 ± 0.002"``, joined by no-break spaces (the cell is also set ``nowrap``: a value is never split)."""
    return f"{_plain(mean, 3)}\u00a0±\u00a0{_plain(sd, 2)}"


def summary_table(rows: Sequence[dict[str, Any]]):
    """The chapter's summary of the E1 records (:func:`companion.experiments.evaluate_runs.summary_rows`): one row per
    setup and method (``gamma / gamma_SGD``) plus the setup's gradient-norm imbalance, one column per training stage,
    each cell ``mean ± sd`` over the batches. Returned as a pandas ``Styler`` whose cells never wrap inside a value
    (a narrow page shrinks the table's font instead, ``book/_static/fit-tables.js``)."""
    import pandas as pd

    cells = []
    for r in rows:
        if r["method"] in SUMMARY_METHODS:
            cells.append({"setup": r["setup"], "row": f"{LABELS[r['method']]} / SGD", "order": SUMMARY_METHODS.index(
                r["method"]), "stage": f"{r['stage']}%", "value": _mean_sd(r["mean"], r["sd"])})
        if r["method"] == "sgd" and r.get("imbalance_mean") is not None:
            cells.append({"setup": r["setup"], "row": "imbalance", "order": len(SUMMARY_METHODS),
                          "stage": f"{r['stage']}%", "value": _mean_sd(r["imbalance_mean"], r["imbalance_sd"])})
    if not cells:
        raise ValueError("no E1 records to summarise")
    frame = pd.DataFrame(cells)
    setups = list(dict.fromkeys(frame["setup"]))
    stages = list(dict.fromkeys(frame.sort_values("stage", key=lambda s: s.str.rstrip("%").astype(float))["stage"]))
    frame["setup"] = pd.Categorical(frame["setup"], setups)
    frame = frame.sort_values(["setup", "order"])
    wide = frame.pivot_table(index=["setup", "row"], columns="stage", values="value", aggfunc="first", sort=False,
                             observed=True)
    wide = wide[stages].fillna("–")
    wide.index.names = ["setup", "γ ratio"]
    wide.columns.name = "training stage"
    return wide.style.set_properties(**{"white-space": "nowrap"}).set_table_attributes('class="dataframe"')


# ------------------------------------------------------------------------------------------------ chapter numbers
# Which setups each of the chapter's figures shows: the paper's own at full scale; at cpu and smoke the cpu siblings
# (tweets-minilm-lora stands for T5 + LoRA, tweets-minilm-pt for T5 + prompt tuning, digits-mlp for CIFAR10 + MLP).
# The block-diagonal figure's setups have their home in the registry (companion.experiments.setups.BLOCKDIAG_SETUPS):
# the workflow's blockdiag_check job, which may not import the chapters, reads them there too.
GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte")
_CPU_FIGURES = {
    "sample_gamma": list(CPU_SETUPS),
    "lora_gamma": ["tweets-minilm-lora"],
    "pt_gamma": ["tweets-minilm-pt"],
    "damping": {"tweets-minilm-lora": ["fig:damping_gamma_cola-t5-lora", "fig:damping_gamma_rte-t5-lora"],
                "tweets-minilm-pt": ["fig:damping_gamma_sst2-t5-pt", "fig:damping_gamma_mrpc-t5-pt"],
                "digits-mlp": ["fig:damping_gamma_cifar10-mlp"]},
}
FIGURE_SETUPS = {
    "smoke": {**_CPU_FIGURES, "blockdiag": list(BLOCKDIAG_SETUPS["smoke"])},
    "cpu": {**_CPU_FIGURES, "blockdiag": list(BLOCKDIAG_SETUPS["cpu"])},
    "full": {
        "sample_gamma": ["cola-t5-lora", "sst2-t5-pt", "cifar100-vit-lora"],
        "lora_gamma": [f"{t}-t5-lora" for t in GLUE_TASKS] + ["cifar100-vit-lora"],
        "pt_gamma": [f"{t}-t5-pt" for t in GLUE_TASKS],
        "damping": {s: [f"fig:damping_gamma_{s}"] for s in ["cola-t5-lora", "sst2-t5-pt", "mrpc-t5-pt",
                                                             "cifar100-vit-lora", "rte-t5-lora", "cifar10-mlp"]},
        "blockdiag": list(BLOCKDIAG_SETUPS["full"]),
    },
}


def figure_setups(scale: str) -> tuple[dict[str, Any], list[str]]:
    """``(figures, setups)``: the setups each figure of the chapter shows at ``scale`` and all of them, in order."""
    if scale not in FIGURE_SETUPS:
        raise ValueError(f"scale must be one of {sorted(FIGURE_SETUPS)}, got {scale!r}")
    fig = FIGURE_SETUPS[scale]
    setups = list(dict.fromkeys(fig["sample_gamma"] + fig["lora_gamma"] + fig["pt_gamma"] + list(fig["damping"])
                                + fig["blockdiag"]))
    return fig, setups


def verdict_glue(records: list[dict[str, Any]], names: Sequence[str]) -> dict[str, str]:
    """For each rule of :mod:`companion.experiments.verdicts` in ``names``: ``rule_<name>`` (the rule and its
    thresholds, glued before the result), ``v_<name>`` (the verdict per setup, naming what fails) and ``d_<name>`` (the
    numbers behind it, per setup)."""
    out = {}
    for name in names:
        rule = RULES[name]
        found = rule.evaluate(records)
        why = rule.why.replace(WHY_T, "").strip()  # the paired-batch reason is glued once, as rule_decided
        out[f"rule_{name}"] = rule.statement + (" " + why if why else "")
        out[f"v_{name}"] = summary(found)
        out[f"d_{name}"] = "; ".join(f"{v.subject}: {v.detail}" for v in found) or "not measured at this scale"
    return out


def _stage_geomeans(records, method: str) -> dict[tuple[str, int], tuple[float, int]]:
    """``{(setup, stage): (geometric mean over batches of gamma_method / gamma_SGD, decided vs 1)}`` of the E1
    records: the statistic of the verdicts and of the figures' points (:func:`log_errorbar`)."""
    out = {}
    for setup in setups_of(records):
        for stage, batches in e1_batches(records, setup).items():
            logs = [row[method] for row in batches.values() if method in row]
            if logs:
                out[(setup, stage)] = (math.exp(float(np.mean(logs))), decide(logs))
    return out


def ratio_range(records, method: str) -> str:
    """``"0.251–60.5"``: the smallest and largest, over setups and stages, geometric mean over batches of
    ``gamma_method / gamma_SGD`` (the verdicts' statistic), or ``"not measured"``."""
    values = [g for g, _ in _stage_geomeans(records, method).values()]
    return f"{min(values):.3g}–{max(values):.3g}" if values else "not measured"


def mean_kinds(records, method: str = "ef") -> str:
    """Which average is which: at the (setup, stage) where they differ most, ``gamma_method / gamma_SGD`` as the
    geometric mean over batches (figures, ranges, verdicts) and as the arithmetic mean (the summary table)."""
    geo = _stage_geomeans(records, method)
    arith = {(r["setup"], r["stage"]): r["mean"] for r in summary_rows(records) if r["method"] == method}
    both = [(arith[k] / geo[k][0], k) for k in geo if k in arith]
    if not both:
        return "not measured"
    _, (setup, stage) = max(both)
    return (f"{LABELS[method]}/SGD at {setup}, stage {stage} %: {geo[(setup, stage)][0]:.3g} as the geometric mean "
            f"over batches (the figures' points, the ranges and every verdict), {arith[(setup, stage)]:.3g} as the "
            "arithmetic mean (the table)")


def ef_imbalance_glue(records) -> str:
    """Whether the gradient-norm imbalance accounts for where EF is and is not decided worse than SGD: per setup the
    imbalance (mean over batches, as in the table) and EF/SGD (geometric mean) from the first to the last stage, then
    over all setups and stages whether the imbalance separates the stages where EF is decided worse from those where
    it is decided better."""
    geo = _stage_geomeans(records, "ef")
    imb = {(r["setup"], r["stage"]): r["imbalance_mean"] for r in summary_rows(records)
           if r["method"] == "sgd" and r.get("imbalance_mean") is not None}
    keys = [k for k in geo if k in imb]
    if not keys:
        return "No E1 stage has both EF and an imbalance."
    parts = []
    for setup in dict.fromkeys(k[0] for k in keys):
        ks = sorted(k for k in keys if k[0] == setup)
        worse = sum(geo[k][1] > 0 for k in ks)
        parts.append(f"{setup}: imbalance {imb[ks[0]]:.3g} at {ks[0][1]} % to {imb[ks[-1]]:.3g} at {ks[-1][1]} % "
                     f"(largest {max(imb[k] for k in ks):.3g}), EF/SGD {geo[ks[0]][0]:.3g} to {geo[ks[-1]][0]:.3g}, "
                     f"EF decided worse than SGD at {worse} of {len(ks)} stages")
    worse = [imb[k] for k in keys if geo[k][1] > 0]
    better = [imb[k] for k in keys if geo[k][1] < 0]
    count = (f"over all {len(keys)} stages of the setups, EF is decided worse than SGD at {len(worse)}, better at "
             f"{len(better)} and undecided at {len(keys) - len(worse) - len(better)}")
    if not worse:
        verdict = f"{count}; the largest imbalance of this build is {max(imb[k] for k in keys):.3g}"
    elif not better:
        verdict = f"{count}; EF is decided worse from an imbalance of {min(worse):.3g}"
    elif max(better) < min(worse):
        verdict = (f"{count}: it is decided worse only at stages whose imbalance is at "
                   f"least {min(worse):.3g}, and decided better at stages whose imbalance is at most "
                   f"{max(better):.3g}: the imbalance separates the two, as the paper's account (the "
                   "inversely-scaled projection grows with the imbalance) predicts, and a setup whose imbalance stays "
                   "small is one where EF is not worse than SGD")
    else:
        verdict = (f"{count}; the imbalance alone does not separate them: EF is decided worse than SGD at an "
                   f"imbalance as low as {min(worse):.3g} and decided better at one as high as {max(better):.3g}")
    return "; ".join(parts) + ". " + verdict[0].upper() + verdict[1:] + "."


def damping_cost_glue(records) -> str:
    """What the near-zero damping costs each method (``e3_ief_robust``): per setup the range over sweep stages of
    gamma at the smallest damping over gamma at the method's best (geometric mean over batches), then where EF or SF
    is decided as flat as iEF (the sweep does not separate them) and where the contrast the paper draws is seen."""
    parts, flat, seen = [], [], []
    for setup in setups_of(records):
        rows = near_zero_contrast(records, setup)
        if not rows:
            continue
        costs = {"iEF": [r["iEF"][0] for r in rows.values()]}
        for name in ("EF", "SF"):
            costs[name] = [r[name][0] for r in rows.values() if r[name] is not None]
        parts.append(f"{setup}: " + ", ".join(f"{n} ×{_plain(min(c), 3)}–{_plain(max(c), 3)}"
                                              for n, c in costs.items() if c))
        as_flat = {name: [s for s, r in rows.items() if r[name] is not None and r[name][3] < 0]
                   for name in ("EF", "SF")}
        for name, stages in as_flat.items():
            if stages:
                flat.append(f"{name} on {setup} (stage(s) {', '.join(f'{s} %' for s in stages)})")
        if all(r["flat"] > 0 and all(r[n] is not None and r[n][3] > 0 for n in ("EF", "SF")) for r in rows.values()):
            seen.append(setup)
    if not parts:
        return "No setup has a damping sweep at this scale."
    text = "Cost of the near-zero damping (γ at the smallest damping over γ at the method's own best), over the " \
           "sweep stages: " + "; ".join(parts) + ". "
    text += (f"The paper's contrast (EF and SF need their damping, iEF does not) is decided at every sweep stage of "
             f"{', '.join(seen)}. " if seen else "No setup has the paper's contrast (EF and SF need their damping, iEF "
             "does not) decided at every sweep stage. ")
    text += (f"Decided as flat as iEF (their cost over iEF's below ×{TENTH_DECADE:.2f}): {'; '.join(flat)}: there that "
             "method needs no damping either, so the sweep cannot show iEF's advantage over it, and the claim is not "
             "counted as holding." if flat else "Neither EF nor SF is decided as flat as iEF at any sweep stage.")
    return text


def edge_glue(records) -> str:
    """Where EF's or SF's best damping is the sweep grid's top edge (:func:`top_edge_bests`), in words."""
    found = top_edge_bests(records)
    if not found:
        return "No best damping of EF or SF lies at the grid's top edge."
    grid = max(float(r["damping"]) for r in records if r["kind"] == "sweep" and r["damping"] is not None)
    where = "; ".join(f"{name} on {setup} (stage(s) {', '.join(f'{s} %' for s in stages)})"
                      for setup, name, stages in found)
    return (f"A best damping at the grid's top edge λ={grid:.0e}: {where}. There damping dominates the curvature "
            "and the damped update tends to SGD's direction (its γ/γ_SGD there is given with each verdict), so the "
            "\"optimally damped\" method is close to SGD, the optimum may lie beyond the grid, a rescue by damping is "
            "the method turned into SGD, and iEF compared with it is compared with SGD.")


SHORT_CLAIMS = {
    "e1_ef_worse": "EF worse than SGD", "e1_ief_better": "iEF better than SGD", "e1_order": "iEF > SF > EF",
    "e1_imbalance": "the imbalance grows and tracks EF and SF", "e3_best_moves": "the best damping moves",
    "e3_ief_robust": "iEF needs no damping where EF and SF do", "e3_ief_vs_sf": "iEF comparable to optimally damped SF",
    "e3_ief_vs_ef": "iEF better than EF at any damping",
    "e3_ef_signature": "un-damped EF far worse, rescued by damping",
    "bd_iekfac_better": "ieKFAC better than KFAC and eKFAC", "bd_iekfac_close": "ieKFAC close to exact iEF",
}


def agreement(records, names: Sequence[str]) -> str:
    """In words, what of a section agrees with the paper and what does not: the claims (:data:`SHORT_CLAIMS`) whose
    rule holds, does not hold and is inconclusive, each with its setups."""
    groups: dict[str, list[str]] = {HOLDS: [], FAILS: [], INCONCLUSIVE: []}
    for name in names:
        by = {o: [v.subject for v in RULES[name].evaluate(records) if v.verdict == o] for o in groups}
        for outcome, subjects in by.items():
            if subjects:
                groups[outcome].append(f"{SHORT_CLAIMS[name]} ({', '.join(subjects)})")
    heads = {HOLDS: "Agrees with the paper", FAILS: "Does not agree", INCONCLUSIVE: "Undecided on these batches"}
    parts = [f"{heads[o]}: {'; '.join(items)}." for o, items in groups.items() if items]
    return " ".join(parts) or "Not measured at this scale."


def chapter_glue(records: list[dict[str, Any]], scale: str, cite: Callable[[str], str]) -> dict[str, str]:
    """Every rule, verdict and number the evaluation chapter's prose glues, from the E1/E3 records (``cite``: a
    paper label -> "Fig. 3"); the verdicts are :mod:`companion.experiments.verdicts`'s.

    Every ratio glued here is the geometric mean over batches (the verdicts' and the figures' statistic); the summary
    table alone gives arithmetic means, and ``mean_kinds`` says which is which where they differ most."""
    fig, _ = figure_setups(scale)
    out: dict[str, str] = {"rule_decided": DECIDED + " " + WHY_T, "rule_aggregation": E1_AGGREGATION}
    out["scale_note"] = ("the paper's three representative setups" if scale == "full" else
                         f"a {scale}-scale analogue on this scale's setups, not the paper's T5 / ViT tasks")
    out.update(verdict_glue(records, E1_RULES + E3_RULES + BLOCK_RULES))
    for m in ("ef", "ief"):
        out[f"{m}_ratio_range"] = ratio_range(records, m)
    out["mean_kinds"] = mean_kinds(records, "ef")
    out["ef_imbalance"] = ef_imbalance_glue(records)
    out["e3_costs"] = damping_cost_glue(records)
    out["e3_edge"] = edge_glue(records)
    grid = sorted({float(r["damping"]) for r in records if r["kind"] == "sweep" and r["damping"] is not None})
    out["sweep_grid"] = (f"{len(grid)} from λ={grid[0]:.0e} to λ={grid[-1]:.0e}, log-spaced (the package's sum-loss "
                         "convention)" if grid else "no sweep at this scale")
    for key, names in (("agree_e1", E1_RULES), ("agree_e3", E3_RULES), ("agree_bd", BLOCK_RULES)):
        out[key] = agreement(records, names)
    out["lora_setups"] = ", ".join(fig["lora_gamma"])
    out["pt_setups"] = ", ".join(fig["pt_gamma"])
    out["appendix_note"] = (
        "for all of the paper's LoRA and prompt-tuning tasks" if scale == "full" else
        f"as a {scale}-scale analogue: the paper shows 8 LoRA and 7 prompt-tuning tasks; this scale has one sibling "
        "of each, whose curves are those of the E1 figure above")
    analogue = "" if scale == "full" else f"the {scale} analogue of "
    out["damping_map"] = "; ".join(f"{s}: {analogue}" + ", ".join(cite(label) for label in labels)
                                   for s, labels in fig["damping"].items())
    surprises = [f"{v.subject}: {v.surprise}" for v in RULES["bd_iekfac_close"].evaluate(records) if v.surprise]
    out["bd_surprise"] = ("Surprise (discussed, not counted against the claim): " + "; ".join(surprises) + "."
                          if surprises else "No stage has ieKFAC decided below exact iEF.")
    return out


def records_glue(records: list[dict[str, Any]], csv_paths: dict[str, Any], scale: str) -> dict[str, Any]:
    """What the chapter says of its records: batches per checkpoint, batch sizes, stages, E1's damping, CG steps and
    the CPU seconds the evaluation jobs took (from each setup's ``<csv>.parts/stage-*.json``)."""
    import json
    from pathlib import Path

    setups = list(csv_paths)
    stages = {s: sorted({r["stage"] for r in records if r["setup"] == s}) for s in setups}
    seconds = {}
    for setup, path in csv_paths.items():
        path = Path(path)
        parts = [json.loads(p.read_text()) for p in sorted(path.with_name(path.name + ".parts").glob("stage-*.json"))]
        seconds[setup] = sum(p.get("cpu_seconds", p["seconds"]) for p in parts)
    return {
        "n_batches": min(r["n"] for r in summary_rows(records)),
        "batch_sizes": ", ".join(f"{s}: {DEFAULTS[scale]['batch_size'] or resolve(s, scale).batch_size}"
                                 for s in setups),
        "stages": "; ".join(f"{s}: {', '.join(f'{x}%' for x in v)}" for s, v in stages.items()),
        "damping_e1": ", ".join(f"{s}: {resolve(s, scale).optimizers['ief'].damping:g}" for s in setups),
        "cg_iterations": DEFAULTS[scale]["cg_iterations"],
        "eval_seconds": ", ".join(f"{s}: {v:.1f} s" for s, v in seconds.items()),
    }
