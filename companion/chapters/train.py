"""Figures and tables of the training chapter (``notebooks/train.ipynb``): one run of the paper's protocol and the
recorded cpu learning-rate search (``companion/experiments/lr_search/``), with the paper's E2 observations checked on
it."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..experiments import resolve
from ..paper import cite_keys
from ..experiments.search import final_loss_definition, search_table
from ..experiments.summaries import final_train_loss, final_window
from .style import method_color
from .common import PAGE_WIDTH_IN, plain_log_ticks

LABELS = {"ief": "iEF", "ef": "EF", "sf": "SF", "sgd": "SGD", "adamw": "AdamW", "adam": "Adam",
          "adafactor": "Adafactor", "ief-momentum": "iEF+M", "kfac": "KFAC", "ekfac": "eKFAC", "iekfac": "ieKFAC"}
# Markers and dashes per optimiser, so that optimisers drawn on top of each other (Adam and AdamW) stay visible.
MARKERS = {"iEF": "o", "EF": "X", "SF": "^", "SGD": "s", "AdamW": "D", "Adam": "v", "Adafactor": "P"}
DASHES = {"iEF": "", "EF": (4, 2), "SF": (1, 1), "SGD": (6, 2, 1, 2), "AdamW": "", "Adam": (3, 3), "Adafactor": (5, 1)}


def palette(names) -> dict[str, str]:
    return {n: method_color(n) for n in names}


def run_figure(losses, evals, summary, setup: str, optimizer: str):
    """Training loss per update with its moving mean and the final-loss window; validation metrics (two rows)."""
    import matplotlib.pyplot as plt

    losses = np.asarray(losses, dtype=float)
    color = method_color(LABELS[optimizer])
    fig, (ax_loss, ax_val) = plt.subplots(2, 1, figsize=(PAGE_WIDTH_IN, 7.4))
    steps = np.arange(1, len(losses) + 1)
    ax_loss.plot(steps, losses, color=color, alpha=0.35, lw=0.8, label="per update")
    window = max(1, min(16, len(losses) // 4))
    if len(losses) >= window:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax_loss.plot(steps[window - 1:], smooth, color=color, lw=1.8, label=f"moving mean of {window}")
    tail = final_window(len(losses))
    ax_loss.axvspan(len(losses) - tail + 0.5, len(losses) + 0.5, color="0.9", zorder=0,
                    label=f"last {tail} updates: final train loss {final_train_loss(losses):.3f}")
    finite = losses[np.isfinite(losses)]
    if len(finite) and finite.max() / max(finite.min(), 1e-12) > 5:
        ax_loss.set_yscale("log")
        plain_log_ticks(ax_loss)
    ax_loss.set(xlabel="update step", ylabel="train loss (mean per sample)",
                title=f"{setup}: {LABELS[optimizer]} training loss")
    ax_loss.legend()
    for k, name in enumerate(list(evals[0]["metrics"]) if evals else []):
        ax_val.plot([e["step"] for e in evals], [100 * e["metrics"][name] for e in evals], "o-", ms=3,
                    color=color if k == 0 else f"C{k}", label=name)
    best = summary["best_validation"]
    ax_val.axvline(best["step"], color="0.4", ls=":", label=f"best checkpoint (step {best['step']})")
    for epoch in range(1, summary["epochs"]):
        ax_val.axvline(epoch * summary["steps_per_epoch"], color="0.85", lw=0.8)
    ax_val.set(xlabel="update step", ylabel="validation metric (%)", title="validation")
    ax_val.legend()
    fig.tight_layout()
    return fig


def run_table(summary, setup: str, optimizer: str, lr: float, losses) -> pd.DataFrame:
    """One row: the run's learning rate, updates, final training loss (book definition), best validation, test."""
    def fmt(metrics):
        return ", ".join(f"{k} {100 * v:.1f}%" for k, v in metrics.items()) if metrics else "n/a (labels private)"

    best = summary["best_validation"]
    return pd.DataFrame([{
        "setup": setup, "optimizer": LABELS[optimizer], "lr": lr, "updates": summary["steps"],
        f"final train loss (last {final_window(len(losses))} updates)": final_train_loss(losses),
        "best validation": fmt(best["metrics"]), "best step": best["step"],
        "test (best checkpoint)": fmt(summary["test"]),
        "diverged at step": summary["diverged"]["step"] if summary["diverged"] else "-",
        "wall time (s)": round(summary["wall_time_s"], 1), "trainable parameters": summary["trainable_parameters"],
    }]).set_index("setup")


def trials_frame(records: dict) -> pd.DataFrame:
    """Every trial of every recorded search, one row per (setup, optimiser, learning rate)."""
    trials = pd.concat([pd.DataFrame(search_table(r)).assign(setup=name) for name, r in records.items()])
    trials["optimizer"] = trials["optimizer"].map(LABELS)
    return trials.reset_index(drop=True)


def search_figure(records: dict):
    """Best validation score and final train loss (as the record defines it, see :func:`loss_caption`) against the
    learning rate, one row per setup; the chosen rate starred, diverged trials as crosses on the axis. Loss axes are
    linear where the losses span a narrow range (the tweet setups: 0.8-1.1) and logarithmic where they span orders of
    magnitude (digits)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    trials = trials_frame(records)
    defs = loss_definitions(records)
    trials["validation (%)"] = 100 * trials["validation_score"].where(trials["diverged_at_step"].isna())
    trials["train loss"] = trials["final_train_loss"].where(trials["diverged_at_step"].isna())
    from matplotlib.lines import Line2D

    # Adam and AdamW run the same grid on digits and end close: Adam is drawn last, as large hollow rings around
    # AdamW's diamonds, so that neither hides the other
    ringed = "Adam"
    unknown = sorted(set(trials["optimizer"]) - set(MARKERS))
    if unknown:
        raise ValueError(f"search_figure draws {', '.join(MARKERS)}, not {', '.join(unknown)}: pass "
                         f"companion.experiments.search.restricted(record, optimizers) for the others")
    names = list(records)
    fig, axes = plt.subplots(len(names), 2, figsize=(PAGE_WIDTH_IN, 3.4 * len(names) + 0.9), squeeze=False)
    hue = palette(trials["optimizer"].unique())
    for row, name in enumerate(names):  # one row per setup: validation score, then training loss
        t = trials[trials["setup"] == name]
        chosen = t[t["chosen"]]
        for col, y in enumerate(("validation (%)", "train loss")):
            ax = axes[row, col]
            sns.lineplot(data=t[t["optimizer"] != ringed], x="lr", y=y, hue="optimizer", style="optimizer",
                         markers=MARKERS, dashes=DASHES, palette=hue, ax=ax, legend=(row == 0 and col == 0),
                         markersize=7, lw=1.3, alpha=0.9)
            ring = t[t["optimizer"] == ringed].sort_values("lr")
            if len(ring):
                ax.plot(ring["lr"], ring[y], ls=(0, (3, 3)), marker="o", ms=13, mfc="none", mew=1.8,
                        color=hue[ringed], zorder=6)
            ax.scatter(chosen["lr"], chosen[y], marker="*", s=170, c=[hue[o] for o in chosen["optimizer"]],
                       edgecolors="k", linewidths=0.6, zorder=5)
            for _, trial in t[t["diverged_at_step"].notna()].iterrows():
                ax.annotate("x", (trial["lr"], 0), xycoords=("data", "axes fraction"), color=hue[trial["optimizer"]],
                            ha="center", va="bottom", fontsize=10, fontweight="bold")
            ax.set_xscale("log")
            plain_log_ticks(ax, "x")  # "0.001", not 10 with a superscript at 0.7 of the tick size
            if y == "train loss":
                _loss_axis(ax, t["train loss"].dropna(), chosen["train loss"].dropna())
            ax.set(xlabel="learning rate" if row == len(names) - 1 else None, ylabel=None)
            ax.set_title(f"{name}: {'best validation score (%)' if col == 0 else _short_setup(defs[name])}",
                         fontsize=10)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 0].get_legend().remove()
    if ringed in hue:
        handles.append(Line2D([], [], ls=(0, (3, 3)), marker="o", ms=9, mfc="none", mew=1.8, color=hue[ringed]))
        labels.append(ringed)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False,
               bbox_to_anchor=(0.5, -0.01), markerscale=1.5, fontsize=10, handlelength=3)
    fig.suptitle("cpu learning-rate search (seed 0): star = chosen, x on the axis = diverged\n"
                 "(Adam, digits only: hollow rings drawn over AdamW)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _short_setup(definition: str) -> str:
    """A setup's loss definition for a panel title (short: two panels share the page width)."""
    import re

    if ";" in definition:
        return "train loss (mixed windows)"
    n, steps = re.search(r"last (\d+) of (\d+) updates", definition).groups()
    if "(last 10 %)" in definition:
        return f"final train loss (last {n} of {steps})"
    return f"train loss: {'all ' + steps if n == steps else f'last {n} of {steps}'} updates (runner's)"


def _loss_axis(ax, values: pd.Series, chosen: pd.Series) -> None:
    """Linear where the losses at the chosen rates lie within a factor 3 (the tweet setups, about 0.8-1.1), zoomed on
    them, so that the range the chapter discusses is readable (higher losses leave the top of the panel, marked);
    logarithmic where they span orders of magnitude (digits)."""
    if len(chosen) and chosen.max() / chosen.min() < 3:
        top = chosen.max() + 0.15 * (chosen.max() - values.min())
        ax.set_ylim(values.min() - 0.05 * (top - values.min()), top)
        if (values > top).any():
            ax.annotate(f"{int((values > top).sum())} trials above, off scale ↑", (0.02, 0.97),
                        xycoords="axes fraction", va="top", fontsize=9.5, color="0.35")
    elif len(values):
        ax.set_yscale("log")
        plain_log_ticks(ax)


def grids_table(records: dict) -> pd.DataFrame:
    rows = []
    for name, r in records.items():
        for o, rec in r["optimizers"].items():
            rows.append({"setup": name, "optimizer": LABELS[o], "grid": ", ".join(f"{v:g}" for v in rec["grid"]),
                         "grid source": cite_keys(rec["grid_source"]),
                         "chosen lr": "all diverged" if rec["chosen_lr"] is None else f"{rec['chosen_lr']:g}",
                         "registered lr": f"{resolve(name, 'cpu').optimizers[o].lr:g}"})
    return pd.DataFrame(rows).set_index(["setup", "optimizer"])


def trials_table(records: dict) -> pd.DataFrame:
    t = trials_frame(records)
    out = pd.DataFrame({
        "setup": t["setup"], "optimizer": t["optimizer"], "lr": t["lr"].map(lambda v: f"{v:g}"),
        "chosen": t["chosen"].map({True: "*", False: ""}), "validation (%)": (100 * t["validation_score"]).round(1),
        "final train loss": t["final_train_loss"].round(4),
        "loss averages": t["final_train_loss_definition"].map(_short),
        "diverged": t["diverged_at_step"].map(lambda s: "-" if pd.isna(s) else f"step {int(s)}"),
        "wall (s)": t["wall_time_s"].round(0)})
    return out.set_index(["setup", "optimizer", "lr"])


def _short(definition: str) -> str:
    """A trial's loss definition (:func:`~companion.experiments.search.final_loss_definition`) as a table cell:
    ``last 34 of 340 updates`` (the book's) or ``all 64 updates (runner's last-100 mean)``."""
    import re

    n, steps = re.search(r"last (\d+) of (\d+) updates", definition).groups()
    if "(last 10 %)" in definition:
        return f"last {n} of {steps} updates"
    return (f"all {steps} updates" if n == steps else f"last {n} of {steps} updates") + " (runner's last-100 mean)"


def loss_definitions(records: dict) -> dict[str, str]:
    """Per setup, what its recorded trials' ``final_train_loss`` averages, in words (several: joined by "; "). A
    diverged trial, whose updates stop at the divergence, is left out (its loss is over the updates it made)."""
    return {name: "; ".join(sorted({final_loss_definition(t) for o in r["optimizers"].values() for t in o["trials"]
                                    if not t.get("diverged")}))
            for name, r in records.items()}


def loss_caption(records: dict, rerun: bool = True) -> str:
    """The sentence under a figure or table of the search that says what its loss column is, per setup: the book's
    final training loss (last 10 % of the updates, recomputed from the per-update losses the record keeps) or, for
    records made before the record kept them, the runner's mean of the last 100 updates (only a new search brings
    those to the book's definition). ``rerun=False``: without the sentence naming that command (for glued text, where
    Markdown code is not rendered)."""
    defs = loss_definitions(records)
    new = [n for n, d in defs.items() if "(last 10 %)" in d and ";" not in d]
    old = [n for n in defs if n not in new]
    parts = [f"{n}: the book's final loss ({_short(defs[n])})" for n in new]
    parts += [f"{n}: {_short(d) if ';' not in d else d}" for n in old for d in [defs[n]]]
    text = "Train loss column, " + "; ".join(parts) + "."
    if old and rerun:
        text += (" The runner's 100-update mean is what records made before the search kept per-update losses hold; "
                 "a new search (`python -m companion search --setup SETUP --scale cpu`) replaces it by the book's.")
    return text


def results_table(records: dict) -> pd.DataFrame:
    """The search's run at each chosen rate: the seed-0 cpu result per (setup, optimiser)."""
    t = trials_frame(records)
    chosen = t[t["chosen"]]
    return pd.DataFrame({
        "setup": chosen["setup"], "optimizer": chosen["optimizer"], "lr": chosen["lr"].map(lambda v: f"{v:g}"),
        "final train loss": chosen["final_train_loss"].round(4),
        "loss averages": chosen["final_train_loss_definition"].map(_short),
        "best validation (%)": (100 * chosen["validation_score"]).round(1),
        "test (%)": (100 * chosen["test_score"]).round(1), "wall time (s)": chosen["wall_time_s"].round(1),
    }).set_index(["setup", "optimizer"])


def e2_only(results: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """One rule, one answer: the seed-0 results among each setup's E2 optimisers (chapter E2's: its baseline, SGD, EF,
    SF and iEF), which the seed-0 verdicts rank also where the search ran more, and ``{setup: [the others]}``, which
    the table shows and the page names."""
    from ..experiments.setups import e2_optimizers

    def names(setup: str) -> set[str] | None:
        try:
            return {LABELS.get(k, k) for k in e2_optimizers(setup)}
        except ValueError:  # not a setup of the registry: it has no E2 grid to restrict to
            return None

    e2_names = {s: names(s) for s in results.index.get_level_values("setup")}
    extra: dict[str, list[str]] = {}
    for s, o in results.index:
        if e2_names[s] is not None and o not in e2_names[s]:
            extra.setdefault(s, []).append(o)
    return results[[e2_names[s] is None or o in e2_names[s] for s, o in results.index]], extra


def e2_observations(results: pd.DataFrame) -> pd.DataFrame:
    """Per setup, iEF's rank by final train loss and by test score among the optimisers of the seed-0 results (1 =
    lowest loss / best test; every optimiser the search ran), the best of each, and the verdicts of the seed-0 rules
    of :mod:`companion.experiments.verdicts` (``seed0_lowest_loss``, ``seed0_best_test``) among the setup's E2
    optimisers (:func:`e2_only`)."""
    from ..experiments.verdicts import RULES

    same, _ = e2_only(results)
    verdicts = {name: {v.subject: v.verdict for v in RULES[name].evaluate(same)}
                for name in ("seed0_lowest_loss", "seed0_best_test")}
    rows = []
    for setup, r in results.groupby(level="setup"):
        r = r.droplevel("setup")
        loss, test = r["final train loss"].dropna(), r["test (%)"].dropna()
        rank_loss = int(loss.rank(method="min").get("iEF", np.nan)) if "iEF" in loss else None
        rank_test = int(test.rank(ascending=False, method="min").get("iEF", np.nan)) if "iEF" in test else None
        rows.append({
            "setup": setup, "optimisers": len(r), "iEF rank by train loss": rank_loss,
            "lowest train loss": f"{loss.idxmin()} ({loss.min():.3g})", "iEF rank by test": rank_test,
            "best test": f"{test.idxmax()} ({test.max():.1f}%)" if len(test) else "n/a",
            "iEF lowest loss among E2's (seed 0)": verdicts["seed0_lowest_loss"].get(setup),
            "iEF best test among E2's (seed 0)": verdicts["seed0_best_test"].get(setup),
        })
    return pd.DataFrame(rows).set_index("setup")


def e2_statements(results: pd.DataFrame, obs: pd.DataFrame, e2_table: pd.DataFrame | None = None,
                  verdicts: pd.DataFrame | None = None) -> dict[str, str]:
    """What the chapter glues of the seed-0 check: each seed-0 rule (``rule_<name>``) and its verdict per setup
    (``v_<name>``) among each setup's E2 optimisers (``seed0_scope`` names the search's others, which the table
    shows but the verdicts leave out), iEF's ranks, and ``e2_disagreement``: where chapter E2's verdicts over seeds
    (the same claims decided on ``e2_table``, the workflow's ``e2_runs.csv``) differ from seed 0's, or that they are
    not available. ``verdicts``: the workflow's ``verdicts.csv``
    (:func:`companion.experiments.verdict_table.read_verdicts`), read for chapter E2's verdicts where given (else
    they are decided here on ``e2_table``, without the runs' per-example test predictions)."""
    from ..experiments.setups import e2_optimizers
    from ..experiments.verdict_table import as_verdicts
    from ..experiments.verdicts import RULES, disagreements, summary

    same, extra = e2_only(results)
    out = {"seed0_scope": ("among each setup's E2 optimisers (its baseline, SGD, EF, SF and iEF), as chapter E2 "
                           "decides them; " + ("the search also ran " + "; ".join(
                               f"{', '.join(o)} on {s}" for s, o in extra.items()) + ", ranked in the table above "
                               "but not in these verdicts" if extra else "the search ran no other optimiser"))}
    for name in ("seed0_lowest_loss", "seed0_best_test"):
        out[f"rule_{name}"] = RULES[name].statement + " " + RULES[name].why
        out[f"v_{name}"] = summary(RULES[name].evaluate(same))
    for key, column in (("e2_ief_loss_ranks", "iEF rank by train loss"), ("e2_ief_test_ranks", "iEF rank by test")):
        out[key] = "; ".join(f"{s}: {'n/a' if pd.isna(r) else int(r)} of {n}"
                             for s, r, n in zip(obs.index, obs[column], obs["optimisers"]))
    out["e2_best_tests"] = "; ".join(f"{s}: {b}" for s, b in obs["best test"].items())
    out["e2_lowest_losses"] = "; ".join(f"{s}: {b}" for s, b in obs["lowest train loss"].items())
    if e2_table is None or e2_table.empty:
        out["e2_disagreement"] = ("Chapter E2's runs were not available to this build of the chapter, so the two are "
                                  "not compared here.")
        return out
    opts = {s: list(e2_optimizers(s)) for s in dict.fromkeys(e2_table.setup)}
    differ = []
    for seed0_rule, e2_rule, what in (("seed0_lowest_loss", "e2_ief_lowest", "iEF lowest training loss"),
                                      ("seed0_best_test", "e2_ief_best_test", "iEF best test score")):
        e2 = (as_verdicts(verdicts, None, e2_rule) if verdicts is not None else
              RULES[e2_rule].evaluate(e2_table, None, opts))
        found = disagreements(RULES[seed0_rule].evaluate(same), e2)
        differ += [f"{what}, {d}" for d in found]
    out["e2_disagreement"] = ("Chapter E2's verdicts over seeds differ from seed 0's here: " + "; ".join(differ) + "."
                              if differ else "Chapter E2's verdicts over seeds agree with seed 0's on every setup.")
    return out


def search_findings(records: dict, results: pd.DataFrame,
                    tweets_labels: Sequence[int] | Exception) -> tuple[pd.DataFrame, dict[str, str]]:
    """Where the paper's iEF rates fall on our grid (the 1/M convention), and the numbers the prose quotes.

    Args:
        records: the search's records, ``{setup: record}`` (:func:`companion.experiments.search.load_record` of each).
        results: :func:`results_table` of those records.
        tweets_labels: the validation labels of ``tweets-minilm-lora`` at ``cpu`` scale
            (:func:`companion.experiments.data.validation_labels`), whose two largest classes' shares the prose quotes;
            or the error that loading them raised (the page then says why they are not computed).

    Returns:
        ``(conventions, glue)``: one row per setup comparing the paper's iEF rate (over the batch size M) with our
        grid, and the chapter's glued sentences by key.
    """
    paper_ief = {"tweets-minilm-lora": resolve("rte-t5-lora", "full"), "tweets-minilm-pt": resolve("rte-t5-pt", "full"),
                 "digits-mlp": resolve("cifar10-mlp", "full")}
    glue, rows, brackets = {}, [], []
    for name, full in paper_ief.items():
        rec = records[name]["optimizers"]["ief"]
        paper_lr = full.optimizers["ief"].lr
        rows.append({"setup": name, "paper setup": full.name, "paper iEF lr": paper_lr, "batch M": full.batch_size,
                     "paper lr / M (our convention)": round(paper_lr / full.batch_size, 2),
                     "our grid": ", ".join(f"{v:g}" for v in rec["grid"]), "chosen here": rec["chosen_lr"],
                     "chosen below the paper's grid": rec["chosen_lr"] < min(set(rec["grid"]) -
                                                                             set(rec.get("grid_extended", [])))})
        glue[f"ief_lr_{name.replace('-', '_')}"] = f"{rec['chosen_lr']:g}"
        if full.method == "scratch":
            continue
        scaled = paper_lr / full.batch_size
        trials = sorted(rec["trials"], key=lambda t: t["lr"])
        below = [t for t in trials if t["lr"] <= scaled]
        above = [t for t in trials if t["lr"] > scaled]
        where = []
        if below:
            t = below[-1]
            where.append(f"our {t['lr']:g} ({100 * t['validation_score']:.1f}% validation, final train loss "
                         f"{t['final_train_loss']:.3g})")
        if above:
            t = above[0]
            where.append(f"{t['lr']:g} ({100 * t['validation_score']:.1f}%, {t['final_train_loss']:.3g})")
        brackets.append(f"{full.method}: {scaled:.2g}, " + ("between " + " and ".join(where) if len(where) == 2
                                                             else "next to " + where[0]))
    conventions = pd.DataFrame(rows).set_index("setup")
    glue["paper_ief_lrs"] = ", ".join(f"{full.optimizers['ief'].lr:g} "
                                      f"({'MLP' if full.method == 'scratch' else full.method})"
                                      for full in paper_ief.values())
    glue["paper_over_m"] = "; ".join(brackets)
    if isinstance(tweets_labels, Exception):  # a GPU machine without the cpu scale's packaged corpus: say so
        glue["one_class_accuracies"] = f"not computed here: {tweets_labels}"
    else:
        counts = pd.Series(tweets_labels).value_counts()
        glue["one_class_accuracies"] = " or ".join(f"{100 * c / len(tweets_labels):.1f}% ({c} of {len(tweets_labels)})"
                                                   for c in counts.iloc[:2])
    glue["update_counts"] = ", ".join(f"{next(iter(r['optimizers'].values()))['trials'][0]['steps']} updates for "
                                      f"{name}" for name, r in records.items())
    below = conventions["chosen below the paper's grid"]
    glue["ief_lr_below_paper_grid"] = f"{int(below.sum())} of {len(conventions)}"
    def paper_grid(name: str) -> set:  # the iEF grid of the paper, without the rates a search extended it by
        ief = records[name]["optimizers"]["ief"]
        return set(ief["grid"]) - set(ief.get("grid_extended", []))

    glue["ief_paper_grid_smallest"] = ", ".join(sorted({f"{min(paper_grid(n)):g}" for n in paper_ief}))
    extended = [(n, LABELS[o], rec) for n, r in records.items() for o, rec in r["optimizers"].items()
                if rec.get("grid_extended")]
    glue["extended_grids"] = "; ".join(
        f"{label} on {n} (added {', '.join(f'{v:g}' for v in rec['grid_extended'])}; chosen {rec['chosen_lr']:g})"
        for n, label, rec in extended) or "none"
    glue["extended_grid_count"] = f"{len(extended)} of {sum(len(r['optimizers']) for r in records.values())}"
    glue["extended_trials"] = str(sum(1 for _, _, rec in extended for t in rec["trials"]
                                      if t["lr"] in rec["grid_extended"]))
    not_lowest = []
    for name, r in records.items():
        for o, rec in r["optimizers"].items():
            losses = {t["lr"]: t["final_train_loss"] for t in rec["trials"] if t["final_train_loss"] is not None}
            if rec["chosen_lr"] is not None and losses and losses[rec["chosen_lr"]] > min(losses.values()):
                best_lr = min(losses, key=losses.get)
                not_lowest.append(f"{LABELS[o]} on {name} (chosen {rec['chosen_lr']:g}: loss "
                                  f"{losses[rec['chosen_lr']]:.3g}; lr {best_lr:g}: {losses[best_lr]:.3g})")
    glue["chosen_not_lowest_loss"] = "; ".join(not_lowest) if not_lowest else "no optimiser"
    loss = results["final train loss"]
    glue["ef_vs_ief_loss"] = "; ".join(f"{n}: EF {loss.loc[(n, 'EF')]:.3g} vs iEF {loss.loc[(n, 'iEF')]:.3g}"
                                       for n in records)
    tweets = loss[[s.startswith("tweets") for s in loss.index.get_level_values("setup")]].dropna()
    low = tweets.idxmin()
    glue["tweets_lowest_loss"] = f"{tweets.min():.3g} ({low[1]} on {low[0]})"
    glue["tweets_loss_range"] = f"{tweets.min():.2f} to {tweets.max():.2f}"  # at the chosen rates
    env = next(iter(records.values()))["environment"]
    glue["search_env"] = f"torch {env['torch']}, {env['torch_threads']} thread(s) per run on {env['cpu_count']} cores"
    return conventions, glue


def reproduction(records: dict, e2_table: pd.DataFrame | None) -> tuple[pd.DataFrame | None, dict[str, str]]:
    """Does today's code give the search's numbers? The E2 seed-0 run at an optimiser's chosen rate has the
    configuration of the search's trial at that rate, so the two must agree exactly (the runs are deterministic on
    one thread): one row per (setup, optimiser) of the E2 grid with both numbers and ``reproduced`` (validation
    score equal, final training loss within 1e-6), and the glue: ``search_reproduced`` (how many of how many) and
    ``search_not_reproduced`` (which, with the numbers, or "none"). ``(None, ...)`` without E2 runs of the
    searches' own scale (a smoke build's runs are not the cpu searches' configuration)."""
    if e2_table is None:
        text = "not checked in this build (no E2 runs)"
        return None, {"search_reproduced": text, "search_not_reproduced": text}
    scales = sorted({r.get("scale") for r in records.values()} - {None})
    if scales and "scale" in e2_table and not e2_table["scale"].isin(scales).any():
        text = (f"not checked in this build (its E2 runs are at scale {', '.join(sorted(set(e2_table['scale'])))}; "
                f"the searches were made at {', '.join(scales)})")
        return None, {"search_reproduced": text, "search_not_reproduced": text}
    rows = []
    e2_table = e2_table[e2_table["scale"].isin(scales)] if scales and "scale" in e2_table else e2_table
    seed0 = e2_table[e2_table["seed"] == 0].set_index(["setup", "optimizer"])
    for name, r in records.items():
        for o, rec in r["optimizers"].items():
            if (name, o) not in seed0.index or rec["chosen_lr"] is None:
                continue
            t = next((t for t in rec["trials"] if t["lr"] == rec["chosen_lr"] and t.get("seed", 0) == 0), None)
            if t is None:
                continue
            run = seed0.loc[(name, o)]
            same = (t["validation_score"] == run["val_score"]
                    and abs(t["final_train_loss"] - run["final_train_loss"]) <= 1e-6)
            rows.append({"setup": name, "optimizer": LABELS[o], "lr": f"{rec['chosen_lr']:g}",
                         "trial made": t.get("created") or "undated (before trials were dated)",
                         "search validation (%)": round(100 * t["validation_score"], 2),
                         "E2 seed 0 validation (%)": round(100 * run["val_score"], 2),
                         "search final loss": round(t["final_train_loss"], 4),
                         "E2 seed 0 final loss": round(run["final_train_loss"], 4),
                         "reproduced": "yes" if same else "no"})
    table = pd.DataFrame(rows).set_index(["setup", "optimizer"])
    bad = table[table["reproduced"] == "no"]
    return table, {
        "search_reproduced": f"{len(table) - len(bad)} of {len(table)}",
        "search_not_reproduced": "; ".join(
            f"{o} on {s} (validation {r['search validation (%)']} % in the search, {r['E2 seed 0 validation (%)']} % "
            f"now)" for (s, o), r in bad.iterrows()) or "none"}

