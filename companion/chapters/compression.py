"""The compression chapter (``notebooks/compression.ipynb``): one-shot pruning of the trained ``digits-mlp`` baseline
with magnitude, EF-, iEF-, SF-WoodFisher and the exact GGN (:mod:`ief.woodfisher`, ``sec:app-iEF-woodfisher``), over
sparsities, dampings and draws of the gradient sample; the tables, figures, rules and verdicts the chapter glues."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..experiments.compression import DEFAULTS, FISHERS, SETUP_SCALE, STUDY_FILES, read_study  # noqa: F401  (read, not run)
from .common import PAGE_WIDTH_IN, plain_log_ticks
from .style import method_color

METHODS = ("magnitude", *FISHERS)
LABELS = {"magnitude": "magnitude", "ef": "EF-WoodFisher", "ief": "iEF-WoodFisher", "sf": "SF-WoodFisher",
          "ggn": "exact GGN"}
# The project's colours (companion.chapters.style): magnitude takes SGD's grey (the curvature-free baseline), the exact
# GGN NGD's black (the exact Fisher), EF / iEF / SF their own.
COLORS = {"magnitude": method_color("SGD"), "ef": method_color("EF"), "ief": method_color("iEF"),
          "sf": method_color("SF"), "ggn": method_color("NGD")}
MARKERS = {"magnitude": "s", "ef": "X", "ief": "o", "sf": "^", "ggn": "D"}


def chosen_dampings(results: pd.DataFrame, sparsity: float) -> dict[str, float]:
    """Each curvature's damping: the grid value of the best mean validation accuracy at ``sparsity`` (ties: the
    larger damping, the safer one)."""
    val = results[(results.split == "validation") & (results.sparsity == sparsity) & (results.method != "magnitude")]
    means = val.groupby(["method", "damping"]).accuracy.mean().reset_index()
    out = {}
    for method, group in means.groupby("method"):
        best = group.accuracy.max()
        out[method] = float(group[group.accuracy == best].damping.max())
    return out


def at_chosen(results: pd.DataFrame, chosen: dict[str, float], split: str = "test") -> pd.DataFrame:
    """The rows of ``split`` at each method's chosen damping (magnitude: all its rows)."""
    r = results[results.split == split]
    keep = (r.method == "magnitude") | r.apply(lambda row: chosen.get(row.method) == row.damping, axis=1)
    return r[keep]


def summary(results: pd.DataFrame, chosen: dict[str, float], split: str = "test") -> pd.DataFrame:
    """Mean and sd over the draws per (sparsity, method) at the chosen dampings."""
    r = at_chosen(results, chosen, split)
    return r.groupby(["sparsity", "method"]).agg(acc_mean=("accuracy", "mean"), acc_sd=("accuracy", "std"),
                                                 loss_mean=("loss", "mean"), loss_sd=("loss", "std"),
                                                 draws=("draw", "nunique")).reset_index()


def _order(methods) -> list[str]:
    return [m for m in METHODS if m in set(methods)]


def accuracy_table(results: pd.DataFrame, chosen: dict[str, float], what: str = "acc") -> pd.DataFrame:
    """Sparsity x method, ``mean ± sd`` over the draws (accuracy in %, or the loss), at the chosen dampings."""
    s = summary(results, chosen)
    scale, digits = (100.0, 1) if what == "acc" else (1.0, 3)
    s["cell"] = [f"{m * scale:.{digits}f} ± {sd * scale:.{digits}f}" for m, sd in zip(s[f"{what}_mean"],
                                                                                      s[f"{what}_sd"])]
    table = s.pivot(index="sparsity", columns="method", values="cell")[_order(s.method)]
    table.index = [f"{100 * v:g} %" for v in table.index]
    table.index.name = "sparsity"
    table.columns = [LABELS[m] + ("" if m == "magnitude" else f" (λ={chosen[m]:g})") for m in table.columns]
    return table


def sparsity_figure(results: pd.DataFrame, chosen: dict[str, float], dense: tuple[float, float]):
    """Test accuracy and loss against sparsity, mean ± sd over the draws, each method at its chosen damping."""
    import matplotlib.pyplot as plt

    s = summary(results, chosen)
    fig, axes = plt.subplots(1, 2, figsize=(PAGE_WIDTH_IN, 3.3))
    for method in _order(s.method):
        g = s[s.method == method]
        label = LABELS[method] + ("" if method == "magnitude" else f" (λ={chosen[method]:g})")
        for ax, col, scale in ((axes[0], "acc", 100.0), (axes[1], "loss", 1.0)):
            ax.errorbar(100 * g.sparsity, scale * g[f"{col}_mean"], yerr=scale * g[f"{col}_sd"].fillna(0),
                        color=COLORS[method], marker=MARKERS[method], capsize=3, label=label)
    axes[0].axhline(100 * dense[0], color="0.5", lw=0.8, ls=":", label="dense (unpruned)")
    axes[1].axhline(dense[1], color="0.5", lw=0.8, ls=":")
    axes[0].set(xlabel="sparsity (%)", ylabel="test accuracy (%)")
    axes[1].set(xlabel="sparsity (%)", ylabel="test loss (mean CE)", yscale="log")
    plain_log_ticks(axes[1])
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, frameon=False,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    return fig


def damping_figure(results: pd.DataFrame, sparsity: float, costs: pd.DataFrame):
    """Mean validation accuracy at ``sparsity`` against the damping ``lambda`` (left) and against ``lambda`` relative
    to each curvature's own scale, its mean diagonal entry ``tr F / P`` (right); magnitude as a line."""
    import matplotlib.pyplot as plt

    val = results[(results.split == "validation") & (results.sparsity == sparsity)]
    scale = costs[costs.method != "magnitude"].groupby("method").mean_diagonal.mean()
    fig, axes = plt.subplots(1, 2, figsize=(PAGE_WIDTH_IN, 3.4), sharey=True)
    for method in _order(val.method):
        g = val[val.method == method]
        if method == "magnitude":
            for ax in axes:
                ax.axhline(100 * g.accuracy.mean(), color=COLORS[method], ls="--", label=LABELS[method])
            continue
        m = g.groupby("damping").accuracy.agg(["mean", "std"]).reset_index()
        for ax, x in ((axes[0], m.damping), (axes[1], m.damping / scale[method])):
            ax.errorbar(x, 100 * m["mean"], yerr=100 * m["std"].fillna(0), color=COLORS[method],
                        marker=MARKERS[method], capsize=3, label=LABELS[method])
    axes[0].set(xscale="log", xlabel="damping λ", ylabel=f"validation accuracy (%)\nat {100 * sparsity:g} % sparsity")
    axes[1].set(xscale="log", xlabel="λ / (tr F / P)")
    for ax in axes:
        plain_log_ticks(ax, "x")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, frameon=False,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    return fig


def damping_table(results: pd.DataFrame, sparsity: float) -> pd.DataFrame:
    """Damping x curvature: mean ± sd validation accuracy (%) at ``sparsity``."""
    val = results[(results.split == "validation") & (results.sparsity == sparsity) & (results.method != "magnitude")]
    s = val.groupby(["damping", "method"]).accuracy.agg(["mean", "std"]).reset_index()
    s["cell"] = [f"{100 * m:.1f} ± {100 * sd:.1f}" for m, sd in zip(s["mean"], s["std"])]
    table = s.pivot(index="damping", columns="method", values="cell")[_order(s.method)]
    table.index = [f"{v:g}" for v in table.index]
    table.index.name = "damping λ"
    table.columns = [LABELS[m] for m in table.columns]
    return table


def cost_table(costs: pd.DataFrame, samples: int, block_size: int | None, weights: int) -> pd.DataFrame:
    """Per method: seconds to build the curvature (mean over draws), to prune once, and what each block holds."""
    c = costs.groupby("method").agg(curvature_s=("curvature_s", "mean"), prune_s=("prune_s", "mean"))
    c = c.loc[_order(c.index)]
    b = weights if block_size is None else block_size
    held = {"magnitude": "nothing", "ggn": f"a dense {b} × {b} matrix (float64)"}
    out = pd.DataFrame({
        "curvature (s, mean over draws)": [f"{v:.2f}" for v in c.curvature_s],
        "one pruning (s, mean)": [f"{v:.3f}" for v in c.prune_s],
        "per block": [held.get(m, f"the thin SVD of its N × {b} rows (N = {samples}): V, {b} × {min(samples, b)}")
                      for m in c.index],
    }, index=[LABELS[m] for m in c.index])
    out.index.name = "method"
    return out


RULE_BEATS = ("at each sparsity, iEF-WoodFisher wins if its mean test accuracy over the draws exceeds "
              "EF-WoodFisher's by more than the sum of the two standard deviations, and loses if it falls short "
              "by more than that sum (each method at its own damping, chosen on the validation split). iEF beats "
              "EF here if it wins at more sparsities than it loses and at no fewer than half of them; EF beats "
              "iEF under the mirror condition; otherwise neither beats the other here.")


def beats_verdict(results: pd.DataFrame, chosen: dict[str, float]) -> dict[str, str]:
    """The rule :data:`RULE_BEATS` applied: the verdict, and the wins / losses / ties by sparsity."""
    s = summary(results, chosen).set_index(["sparsity", "method"])
    ahead, behind, level = _compare(s, "ief", "ef")
    verdict = _majority(ahead, behind, len(ahead) + len(behind) + len(level), "iEF-WoodFisher", "EF-WoodFisher")
    wins, losses, ties = ([f"{100 * sp:g} %" for sp in xs] for xs in (ahead, behind, level))
    fmt = lambda xs: ", ".join(xs) if xs else "none"  # noqa: E731
    return {"wf_verdict": verdict, "wf_wins": fmt(wins), "wf_losses": fmt(losses), "wf_ties": fmt(ties),
            "wf_rule": RULE_BEATS}


RULE_GGN = ("the same rule with the exact GGN in EF-WoodFisher's place: at each sparsity iEF-WoodFisher is ahead of "
            "the exact GGN if its mean test accuracy over the draws exceeds the GGN's by more than the sum of the two "
            "standard deviations, behind if it falls short by more than that sum, each at its own damping chosen on "
            "the validation split; iEF beats the exact GGN here if it is ahead at more sparsities than it is behind "
            "and at no fewer than half of them, the GGN beats iEF under the mirror condition, otherwise neither.")


def _compare(s: pd.DataFrame, a: str, b: str) -> tuple[list[float], list[float], list[float]]:
    """Sparsities where ``a``'s mean test accuracy is above ``b``'s by more than their summed sds, below, neither."""
    ahead, behind, level = [], [], []
    for sp in sorted({i for i, _ in s.index}):
        x, y = s.loc[(sp, a)], s.loc[(sp, b)]
        margin = float(np.nan_to_num(x.acc_sd) + np.nan_to_num(y.acc_sd))
        diff = float(x.acc_mean - y.acc_mean)
        (ahead if diff > margin else behind if diff < -margin else level).append(sp)
    return ahead, behind, level


def _majority(ahead: list, behind: list, n: int, a: str, b: str) -> str:
    """The verdict of :data:`RULE_BEATS` and :data:`RULE_GGN`: ``a`` beats ``b`` when it is ahead at more
    sparsities than behind and at no fewer than half of the ``n``; ``b`` beats ``a`` under the mirror condition."""
    if len(ahead) > len(behind) and len(ahead) >= n / 2:
        return f"{a} beats {b} here"
    if len(behind) > len(ahead) and len(behind) >= n / 2:
        return f"{b} beats {a} here"
    return "neither beats the other here"


def ggn_comparison(results: pd.DataFrame, chosen: dict[str, float],
                   costs: pd.DataFrame | None = None) -> dict[str, str]:
    """iEF-WoodFisher against the exact GGN, the curvature it approximates (:data:`RULE_GGN`): the verdict, the
    sparsities either way, the largest difference with its numbers, the two curvatures' scales, and what the result
    means.

    Args:
        results: the study's rows (``pruning_results.csv``).
        chosen: each curvature's damping (:func:`chosen_dampings`).
        costs: the study's costs (``pruning_costs.csv``), for each curvature's mean diagonal entry; None: not stated.

    Returns:
        Glue keys ``wf_ggn_rule``, ``wf_ggn_verdict``, ``wf_ggn_ahead``, ``wf_ggn_behind``, ``wf_ggn_level``,
        ``wf_ggn_gap``, ``wf_ggn_scale`` and ``wf_ggn_reading``; every value ``"not run"`` but the rule where the
        study has no GGN.
    """
    s = summary(results, chosen).set_index(["sparsity", "method"])
    keys = ("wf_ggn_verdict", "wf_ggn_ahead", "wf_ggn_behind", "wf_ggn_level", "wf_ggn_gap", "wf_ggn_scale",
            "wf_ggn_reading")
    if "ggn" not in {m for _, m in s.index}:
        return {"wf_ggn_rule": RULE_GGN, **{k: "not run" for k in keys}}
    ahead, behind, level = _compare(s, "ief", "ggn")
    verdict = _majority(ahead, behind, len(ahead) + len(behind) + len(level), "iEF-WoodFisher", "the exact GGN")
    pct = lambda sp: f"{100 * sp:g} %"  # noqa: E731
    fmt = lambda xs: ", ".join(pct(x) for x in xs) if xs else "none"  # noqa: E731
    gaps = {sp: float(s.loc[(sp, "ief")].acc_mean - s.loc[(sp, "ggn")].acc_mean) for sp in ahead + behind + level}
    widest = max(gaps, key=lambda sp: abs(gaps[sp]))
    cell = lambda m: (f"{100 * s.loc[(widest, m)].acc_mean:.1f} ± "  # noqa: E731
                      f"{100 * np.nan_to_num(s.loc[(widest, m)].acc_sd):.1f} %")
    gap = (f"at {pct(widest)} sparsity iEF-WoodFisher (λ = {chosen['ief']:g}) keeps {cell('ief')} test accuracy and "
           f"the exact GGN (λ = {chosen['ggn']:g}) {cell('ggn')}, a difference of {100 * gaps[widest]:+.1f} points")
    scale = "not stated"
    if costs is not None:
        diag = costs[costs.method.isin(["ief", "ggn"])].groupby("method").mean_diagonal.mean()
        if {"ief", "ggn"} <= set(diag.index) and diag["ggn"] > 0:
            scale = (f"{diag['ief'] / diag['ggn']:.0f} times the exact GGN's ({diag['ief']:.2g} against "
                     f"{diag['ggn']:.2g})")
    return {"wf_ggn_rule": RULE_GGN, "wf_ggn_verdict": verdict, "wf_ggn_ahead": fmt(ahead),
            "wf_ggn_behind": fmt(behind), "wf_ggn_level": fmt(level), "wf_ggn_gap": gap, "wf_ggn_scale": scale,
            "wf_ggn_reading": _ggn_reading(verdict, fmt(ahead), max(ahead) if ahead else None,
                                           max(gaps) if gaps else None)}


_WHY_AHEAD = ("The paper's argument does not predict this, and it does not contradict it either: the paper shows "
              "that iEF approximates the natural gradient better than EF and SF do, not that the Fisher is the best "
              "curvature to prune with. OBS reads the curvature as the loss's Hessian in a second-order model around "
              "the trained weights; that model is local, and one-shot pruning of most of the weights moves far from "
              "them. In the exact GGN the trained model's many well-fitted examples barely weigh in on which weights "
              "may go, since their terms have nearly vanished; in iEF they weigh as much as the others. Removing many "
              "weights at once moves their logits too, beyond where their loss is flat, and a curvature that still "
              "counts them protects them. This reading is ours, from one small MLP on one data set; the study does "
              "not test it on its own.")


def _ggn_reading(verdict: str, ahead: str, highest_ahead: float | None, highest: float | None) -> str:
    """What the GGN comparison means, and whether it is expected: ``ahead`` the sparsities where iEF-WoodFisher is
    ahead of the exact GGN (``"none"``: nowhere), ``highest_ahead`` the highest of them, ``highest`` the study's
    highest sparsity."""
    at_top = highest_ahead is not None and highest_ahead == highest
    if verdict.startswith("iEF"):
        return "So here the approximation prunes better than the curvature it approximates. " + _WHY_AHEAD
    if verdict.startswith("the exact GGN"):
        text = ("That is what one expects of an approximation against the curvature it approximates: the exact GGN "
                "is the Fisher itself.")
        if ahead != "none":
            text += f" iEF-WoodFisher is still ahead at {ahead}."
        return text
    text = ("By the rule neither prunes better here, and iEF-WoodFisher does it at EF's cost: its rows come from the "
            "same per-sample backward pass as EF's, where the exact GGN needs one per class (the cost table below).")
    if ahead != "none":
        text += (f" Yet iEF-WoodFisher is ahead of the exact GGN at {ahead}"
                 + (f", the study's highest sparsity ({100 * highest:g} %, where most weights go at once) among them"
                    if at_top else "")
                 + ": at those sparsities the approximation prunes better than the curvature it approximates. "
                 + _WHY_AHEAD)
    return text


RULE_ROBUST = ("at the sweep sparsity, iEF's robustness to damping carries over if, at every damping of the grid, "
               "iEF-WoodFisher's mean validation accuracy is at least EF-WoodFisher's less the sum of their standard "
               "deviations, and at the grid's smallest damping (the nearly undamped curvature) it is above "
               "EF-WoodFisher's by more than that sum.")


def robustness(results: pd.DataFrame, sparsity: float) -> dict[str, str]:
    """The rule :data:`RULE_ROBUST` applied, with the numbers it reads."""
    val = results[(results.split == "validation") & (results.sparsity == sparsity)]
    m = val.groupby(["method", "damping"]).accuracy.agg(["mean", "std"]).fillna(0.0)
    grid = sorted(val[val.method == "ief"].damping.unique())
    below = [d for d in grid if m.loc[("ief", d), "mean"] < m.loc[("ef", d), "mean"]
             - m.loc[("ief", d), "std"] - m.loc[("ef", d), "std"]]
    low = grid[0]
    gap = m.loc[("ief", low), "mean"] - m.loc[("ef", low), "mean"]
    above_low = gap > m.loc[("ief", low), "std"] + m.loc[("ef", low), "std"]
    holds = not below and above_low
    mag = val[val.method == "magnitude"].accuracy.mean()
    pct = lambda v: f"{100 * v:.1f} %"  # noqa: E731
    return {
        "wf_robust_rule": RULE_ROBUST,
        "wf_robust_verdict": "it carries over" if holds else "it does not carry over",
        "wf_robust_below": ", ".join(f"{d:g}" for d in below) if below else "none",
        "wf_low_damping": f"{low:g}",
        "wf_low_ef": pct(m.loc[("ef", low), "mean"]),
        "wf_low_ief": pct(m.loc[("ief", low), "mean"]),
        "wf_best_ef": pct(m.loc["ef", "mean"].max()),
        "wf_best_ief": pct(m.loc["ief", "mean"].max()),
        "wf_sweep_magnitude": pct(mag),
        "wf_low_ggn": pct(m.loc[("ggn", low), "mean"]) if ("ggn", low) in m.index else "not run",
        "wf_low_reading": _low_reading(m, low, mag),
        "wf_robust_meaning": ("iEF-WoodFisher needs less damping tuning than EF-WoodFisher here" if holds else
                              "the damping still has to be chosen, for iEF-WoodFisher as for EF-WoodFisher"),
    }


def _low_reading(m: pd.DataFrame, low: float, magnitude: float, points: float = 0.10) -> str:
    """What the smallest damping shows: whether iEF and the exact GGN fall more than ``points`` below magnitude
    pruning there (both: the failure is nearly undamped OBS itself; iEF only: iEF's approximation)."""
    ief_fails = m.loc[("ief", low), "mean"] < magnitude - points
    ggn_fails = ("ggn", low) in m.index and m.loc[("ggn", low), "mean"] < magnitude - points
    if ief_fails and ggn_fails:
        return ("the exact GGN fails there too, so what fails is nearly undamped OBS at this sparsity (many weights "
                "removed at once, each with its own update from an ill-conditioned curvature), not iEF's "
                "approximation of the Fisher")
    if ief_fails:
        return "the exact GGN does not fail there: at that damping iEF's curvature is the worse approximation"
    return f"iEF-WoodFisher stays within {100 * points:g} points of magnitude pruning there"



def scales(costs: pd.DataFrame) -> str:
    """Each curvature's mean diagonal entry ``tr F / P`` (mean over the draws), as text."""
    c = costs[costs.method != "magnitude"].groupby("method").mean_diagonal.mean()
    return "; ".join(f"{LABELS[m]} {c[m]:.2g}" for m in _order(c.index))
