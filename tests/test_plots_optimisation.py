"""ief.plots.optimisation's curves (fig:curves-pt, fig:curves-lora, fig:mlp-curves): axes that show the range the
chapter discusses, and every optimiser visible."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from ief.plots.optimisation import BASELINES, curve_points, loss_axis, plot_curves  # noqa: E402


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
