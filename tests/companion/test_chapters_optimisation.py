"""companion.chapters.optimisation's curves (fig:curves-pt, fig:curves-lora, fig:mlp-curves): axes that show the range
the chapter discusses, and every optimiser visible."""
from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from companion.chapters.optimisation import BASELINES, curve_points, loss_axis, plot_curves  # noqa: E402


def test_curve_points_average_at_least_four_updates():
    assert curve_points(64) == 16 and curve_points(340) == 85 and curve_points(42_100) == 100
    assert curve_points(3) == 1


def test_narrow_losses_get_a_linear_axis_over_their_range():
    """The tweet setups' means lie in about 0.7-1.1: a linear axis zoomed on them, not a log axis with two labels."""
    fig, ax = plt.subplots()
    assert loss_axis(ax, pd.Series([1.1, 0.95, 0.82, 0.71])) == "linear"
    lo, hi = ax.get_ylim()
    assert 0.6 < lo < 0.71 and 1.1 < hi < 1.2 and ax.get_yscale() == "linear"
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi]
    assert len(labels) >= 4
    plt.close(fig)


def test_losses_over_orders_of_magnitude_get_a_log_axis_with_labelled_ticks():
    fig, ax = plt.subplots()
    assert loss_axis(ax, pd.Series([2.3, 0.3, 0.02, 0.001])) == "log"
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    labels = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi and t.get_text()]
    assert len(labels) >= 8 and "1" in labels and all("10^" not in s and "$" not in s for s in labels)
    plt.close(fig)


def _curves(optimizers, steps=64):
    rows = []
    for o in optimizers:
        for seed in (0, 1):
            for step in range(1, steps + 1):
                rows.append(("tweets-minilm-lora", o, seed, "train_loss", step, 1.1 - 0.3 * step / steps))
            for step in (16, 32, 48, 64):
                rows.append(("tweets-minilm-lora", o, seed, "val_score", step, 0.5 + step / 400))
    return pd.DataFrame(rows, columns=["setup", "optimizer", "seed", "quantity", "step", "value"])


def test_identical_curves_stay_distinguishable_and_the_baseline_is_on_top():
    """Two optimisers with the same curve: different line styles and markers, the baseline (AdamW) drawn last."""
    opts = ("adamw", "sgd", "ef", "sf", "ief")
    fig = plot_curves(_curves(opts), ["tweets-minilm-lora"], {"tweets-minilm-lora": opts})
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert len({(ln.get_linestyle(), ln.get_marker()) for ln in lines}) == len(opts)
    top = max(lines, key=lambda ln: ln.get_zorder())
    assert top.get_label().startswith("AdamW") and "adamw" in BASELINES
    assert ax.get_yscale() == "linear" and len(lines[0].get_xdata()) == 16  # 4 updates per point
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [s.split(" ")[0] for s in legend] == ["AdamW", "SGD", "EF", "SF", "iEF"]  # the paper's order
    plt.close(fig)


def test_no_setup_is_an_error():
    with pytest.raises(ValueError, match="no setup"):
        plot_curves(_curves(("ief",)), [], {})


def _grid(ef_rises: bool = True):
    """tweets-minilm-lora, five optimisers, three seeds: the paper's loss ranking on every seed; EF's loss rises at the
    end (or SGD's does)."""
    opts = ("adamw", "sgd", "ef", "sf", "ief")
    level = {"ief": 0.1, "adamw": 0.2, "sgd": 0.3, "sf": 0.4, "ef": 0.5}
    rows, curves = [], []
    for o in opts:
        for seed in range(3):
            rows.append({"setup": "tweets-minilm-lora", "optimizer": o, "seed": seed, "steps": 64,
                         "final_train_loss": level[o] + 0.01 * seed, "test_score": 0.8 + (0.002 * seed if o == "ief"
                                                                                         else 0.0),
                         "diverged_step": None})
            rising = o == ("ef" if ef_rises else "sgd")
            for step in range(1, 65):
                t = step / 64
                v = 1.1 - 0.5 * t + (4.0 * max(0.0, t - 0.5) ** 2 if rising else 0.0)
                curves.append(("tweets-minilm-lora", o, seed, "train_loss", step, v))
    return (pd.DataFrame(rows), pd.DataFrame(curves, columns=["setup", "optimizer", "seed", "quantity", "step",
                                                              "value"]), {"tweets-minilm-lora": list(opts)})


def test_e2_glue_states_the_rules_and_names_the_failing_pairs():
    from companion.chapters.optimisation import e2_findings

    table, curves, opts = _grid()
    glued = e2_findings(table, curves, ["tweets-minilm-lora"], opts, {"tweets-minilm-lora": "lora"})
    assert glued["v_e2_loss_ranking"] == "holds for tweets-minilm-lora"
    assert glued["v_e2_ef_unstable"] == "holds for tweets-minilm-lora"
    assert glued["v_e2_ief_vs_baseline"] == "holds for tweets-minilm-lora"  # within 1 point on every seed: on par
    assert glued["rule_e2_loss_ranking"].startswith("Every ordered pair of the ranking")
    from companion.experiments.verdicts import E2_RULES
    from companion.experiments.verdicts.training import DECIDED_OVER_SEEDS, WHY_OVER_SEEDS

    for name in E2_RULES:  # the chapter states how a pair over seeds is decided once, before the claims
        assert DECIDED_OVER_SEEDS[:60] not in glued[f"rule_{name}"] and WHY_OVER_SEEDS[:60] not in glued[f"rule_{name}"]
        assert "widened by" not in glued[f"rule_{name}"]  # test scores: seeds and examples crossed, not widened
    table, curves, opts = _grid(ef_rises=False)
    glued = e2_findings(table, curves, ["tweets-minilm-lora"], opts, {"tweets-minilm-lora": "lora"})
    assert glued["v_e2_ef_unstable"].startswith("does not hold for tweets-minilm-lora (EF's loss climb 1× is not "
                                                "decided ×1.26 above: AdamW 1×, SGD 1.")


def test_seed_table_has_every_pair_with_its_seeds():
    from companion.chapters.optimisation import seed_table

    table, curves, opts = _grid()
    pairs = seed_table(table, curves, ["tweets-minilm-lora"], opts, {"tweets-minilm-lora": "lora"}).reset_index()
    assert list(pairs.columns) == ["setup", "claim", "pair", "per-seed differences", "seeds", "in favour",
                                   "mean (95 % interval)", "verdict", "would be decided by"]
    row = pairs[pairs.pair == "iEF < AdamW"].iloc[0]  # final losses as log ratios: log(0.1 / 0.2) = -0.693
    assert row["per-seed differences"] == "-0.693, -0.647, -0.606" and row["seeds"] == "0, 1, 2"
    assert row["in favour"] == "3 of 3 seeds in favour, 0 against" and row["verdict"] == "holds"
    assert row["mean (95 % interval)"].startswith("-0.649 (") and row["would be decided by"] == ""
    assert (pairs.claim == "loss ranking").sum() == 10
    on_par = pairs[pairs.pair == "iEF on par with AdamW (test)"].iloc[0]
    assert on_par["per-seed differences"] == "+0, -0.2, -0.4"


def test_the_shown_pair_table_keeps_the_what_decides_column_wide():
    """The undecided pairs' sentences are the table's longest cells: drawn at least 24em wide, not squeezed to a few
    words a line, in the book's table class."""
    from companion.chapters.optimisation import pair_view, seed_table

    table, curves, opts = _grid()
    pairs = seed_table(table, curves, ["tweets-minilm-lora"], opts, {"tweets-minilm-lora": "lora"})
    html = pair_view(pairs).to_html()
    column = list(pairs.columns).index("would be decided by")
    assert 'class="dataframe"' in html and re.search(rf"td\.col{column}\s*\{{\s*min-width: 24em;", html)
    assert html.count("<td") == pairs.size


def test_every_glue_key_of_the_e2_chapter_is_computed():
    import json
    import re
    from pathlib import Path

    from companion.chapters.optimisation import e2_findings

    nb = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / "optimisation.ipynb").read_text())
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    keys = set(re.findall(r"\{glue:text\}`([^`:]+)", text))
    table, curves, opts = _grid()
    from companion.experiments.early_spike import SPIKE_KEYS  # the early-spike cell (spike_glue)

    from companion.chapters.optimisation import budget_glue, seed_table

    pairs = seed_table(table, curves, ["tweets-minilm-lora"], opts)
    computed = (set(e2_findings(table, curves, ["tweets-minilm-lora"], opts)) | {"e2_runs", "e2_scale"}
                | set(SPIKE_KEYS) | set(budget_glue(table, pairs)) | {"e2_cost"})
    budget = budget_glue(table, pairs)
    assert budget["e2_pairs_decided"].endswith(f"{(pairs.verdict == 'inconclusive').sum()} undecided at this scale")
    assert budget["e2_pairs_decided"].startswith(f"{(pairs.verdict != 'inconclusive').sum()} of {len(pairs)} pairs")
    assert keys <= computed, keys - computed
    for name in re.findall(r"\{glue:text\}`v_([a-z0-9_]+)`", text):
        assert text.index(f"`rule_{name}`") < text.index(f"`v_{name}`"), name


def test_the_coverage_table_says_seeds_as_ranges_and_seconds_to_a_tenth():
    """Sixty seeds read as one range (the row stays one line wide), a gap shows, a short run is listed, and the
    training seconds are summed over the seeds and rounded to a tenth (no six-decimal sums)."""
    from companion.chapters.optimisation import coverage_table, seed_span

    assert seed_span(range(60)) == "0–59" and seed_span([2, 0, 1, 1]) == "0, 1, 2"
    assert seed_span([*range(10), 12]) == "0–9, 12" and seed_span([5, 0, 1, 2, 3]) == "0–3, 5"
    table = pd.DataFrame({"setup": ["digits-mlp"] * 3 + ["tweets-minilm-lora"], "optimizer": ["ief"] * 3 + ["adamw"],
                          "seed": [0, 1, 2, 0], "steps": [340, 340, 338, 64], "diverged_step": [None, None, 7, None],
                          "wall_time_s": [1.123456, 1.2, 1.0, 55.54]})
    rows = coverage_table(table).set_index(["setup", "optimizer"])
    assert rows.loc[("digits-mlp", "iEF"), "seeds"] == "0, 1, 2" and rows.loc[("digits-mlp", "iEF"), "steps"] == 340
    assert rows.loc[("digits-mlp", "iEF"), "diverged"] == 1 and rows.loc[("digits-mlp", "iEF"), "wall_s"] == 3.3
    assert rows.loc[("tweets-minilm-lora", "AdamW"), "wall_s"] == 55.5


def test_many_seeds_differences_are_summarised_and_few_are_listed():
    """A pair over sixty seeds would make a cell of sixty numbers: beyond a dozen the cell gives their quartiles."""
    from companion.chapters.optimisation import LISTED_SEEDS, seed_differences

    assert seed_differences([-0.1, 0.02, float("nan")]) == "-0.1, +0.02, n/a"
    many = [float(k) for k in range(LISTED_SEEDS + 1)] + [float("nan")]
    assert seed_differences(many) == "min +0, quartiles +3 / +6 / +9, max +12; 1 n/a"
