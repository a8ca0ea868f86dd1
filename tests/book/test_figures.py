"""Every figure function of the book's chapters (companion.chapters.*, the toy chapter's excepted:
tests/companion/test_toy.py) shows its smallest text at >= MIN_TEXT_PX as a reader sees it in the book's column (the
image's text size times its scale on the page), on synthetic records at the sizes the cpu and full scales give; the
inline PNG records that size (what tests/book/test_book_browser.py reads back in the built book); and bands on log axes
are computed in log space."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from companion.chapters.common import (BOOK_CONTENT_PX, MIN_TEXT_PX, log_band, min_text_px, png_text_record,  # noqa: E402
                              render_png, shown_text_px, use_book_style)


@pytest.fixture(autouse=True)
def book_style():
    with plt.rc_context():
        use_book_style()
        yield
    plt.close("all")


def _e1_records(setups, stages=(0, 50, 100), batches=3):
    recs = []
    for s_i, setup in enumerate(setups):
        for stage in stages:
            for batch in range(batches):
                jitter = 1 + 0.2 * batch
                for method, ratio in {"sgd": 1.0, "ef": 3.0 * jitter, "ief": 0.5 / jitter, "sf": 0.8 * jitter,
                                      "kfac": 0.9, "ekfac": 0.7 * jitter, "iekfac": 0.6 * jitter}.items():
                    recs.append({"setup": setup, "stage": stage, "kind": "e1", "batch": batch, "method": method,
                                 "damping": 1e-7, "gamma": ratio * (1 + s_i), "ratio": ratio,
                                 "imbalance": 5.0 * jitter, "target_tokens": 8})
                for lam in (1e-9, 1e-6, 1e-3, 1.0, 1e3):
                    for method in ("ef", "sf", "ief"):
                        ratio = (0.5 if method == "ief" else 2.0) * (1 + abs(math.log10(lam)) / 10) * jitter
                        recs.append({"setup": setup, "stage": stage, "kind": "sweep", "batch": batch,
                                     "method": method, "damping": lam, "gamma": ratio, "ratio": ratio,
                                     "imbalance": 5.0, "target_tokens": 8})
    return recs


def _curves(setups, optimizers, steps=64, log=False):
    rows = []
    for setup in setups:
        for k, o in enumerate(optimizers):
            for seed in (0, 1, 2):
                for step in range(1, steps + 1):
                    loss = 2.3 * 10 ** (-3 * step / steps) if log else 1.1 - 0.3 * step / steps
                    rows.append((setup, o, seed, "train_loss", step, loss * (1 + 0.1 * seed + 0.01 * k)))
                for step in range(steps // 4, steps + 1, steps // 4):
                    rows.append((setup, o, seed, "val_score", step, 0.5 + step / (4 * steps) + 0.01 * seed))
    return pd.DataFrame(rows, columns=["setup", "optimizer", "seed", "quantity", "step", "value"])


CPU = ["digits-mlp", "tweets-minilm-lora", "tweets-minilm-pt"]
FULL_LORA = [f"{t}-t5-lora" for t in ("cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte")] + ["cifar100-vit-lora"]
E2_OPTS = ("adamw", "sgd", "ef", "sf", "ief")


def _figures():
    """``(name, builder)`` of every figure the evaluation, E2, training and convergence chapters draw."""
    from companion.chapters import evaluation as ev
    from companion.chapters import optimisation as op

    cpu, full = _e1_records(CPU), _e1_records(FULL_LORA[:3] + ["sst2-t5-pt"])
    return [
        ("E1 sample_gamma, cpu", lambda: ev.plot_sample_gamma(cpu, CPU)),
        ("E1 lora_gamma, full (8 setups)", lambda: ev.plot_sample_gamma(_e1_records(FULL_LORA), FULL_LORA, False)),
        ("E3 damping_gamma", lambda: ev.plot_damping_gamma(cpu, "tweets-minilm-lora")),
        ("E3 damping_gamma, paper axis", lambda: ev.plot_damping_gamma(cpu, "digits-mlp", axis="paper")),
        ("blockdiag, cpu", lambda: ev.plot_blockdiag_gamma(cpu, CPU[:2])),
        ("blockdiag, full", lambda: ev.plot_blockdiag_gamma(full, FULL_LORA[:3])),
        ("E2 curves, one setup", lambda: op.plot_curves(_curves(["tweets-minilm-lora"], E2_OPTS),
                                                         ["tweets-minilm-lora"], {"tweets-minilm-lora": E2_OPTS},
                                                         title="LoRA: training loss and validation score, mean ± sd "
                                                               "over seeds (Fig. 13)")),
        ("E2 curves, 7 setups", lambda: op.plot_curves(_curves(FULL_LORA[:7], E2_OPTS, log=True), FULL_LORA[:7],
                                                        {s: E2_OPTS for s in FULL_LORA[:7]}, title="LoRA")),
    ]


@pytest.mark.parametrize("index", range(8))
def test_every_figure_shows_its_text_at_least_9_px_in_the_book_column(index):
    name, build = _figures()[index]
    fig = build()
    shown = shown_text_px(fig)
    px, text = min_text_px(fig)
    assert shown >= MIN_TEXT_PX, f"{name}: smallest text {text!r} shown at {shown:.1f} px (< {MIN_TEXT_PX})"
    assert px >= MIN_TEXT_PX


def test_the_train_and_convergence_figures_are_readable_too():
    from companion.experiments import CPU_SETUPS
    from companion.experiments.search import load_record
    from companion.chapters import train

    from companion.experiments.search import restricted
    from companion.experiments.setups import OPTIMIZERS, PRACTICAL_OPTIMIZERS

    records = {name: load_record(name, "cpu") for name in CPU_SETUPS}
    if any(r is None for r in records.values()):
        pytest.fail(f"a committed cpu search record is missing: {[n for n, r in records.items() if r is None]}")
    # as the training chapter draws them: the paper's optimisers and the baselines (the practical chapter tables its
    # own)
    records = {n: restricted(r, [o for o in OPTIMIZERS if o not in PRACTICAL_OPTIMIZERS]) for n, r in records.items()}
    fig = train.search_figure(records)
    assert shown_text_px(fig) >= MIN_TEXT_PX, min_text_px(fig)
    losses = list(np.linspace(1.1, 0.7, 64))
    evals = [{"step": s, "metrics": {"accuracy": 0.5 + s / 400}} for s in (16, 32, 48, 64)]
    summary = {"best_validation": {"step": 48, "metrics": {"accuracy": 0.62}}, "epochs": 2, "steps_per_epoch": 32}
    fig = train.run_figure(losses, evals, summary, "tweets-minilm-lora", "ief")
    assert shown_text_px(fig) >= MIN_TEXT_PX, min_text_px(fig)


def test_the_convergence_figures_are_readable_too():
    from companion.demos import theory
    from companion.chapters import convergence as plots

    cfg = plots.chapter_settings("smoke")
    cls, reg = theory.classification_problem(n_samples=7, seed=0), theory.regression_problem(n_samples=7, seed=0)
    over = theory.classification_problem(n_samples=cls.n_params + 9, seed=0)
    lemma = theory.lemma_check(cls.model, cls.inputs, cls.targets, cfg["lemma_dts"])
    lemma_over = theory.lemma_check(over.model, over.inputs, over.targets, cfg["lemma_dts"])
    flow_ce = theory.ief_flow(cls.model, cls.inputs, cls.targets, cfg["t_end"], cfg["dt"], loss="cross_entropy",
                              rtol=cfg["rtol"])
    flow_mse = theory.ief_flow(reg.model, reg.inputs, reg.targets, cfg["t_end_linear"], cfg["dt_linear"], loss="mse",
                               rtol=cfg["rtol_linear"])
    for fig in (plots.lemma_figure(lemma, lemma_over), plots.sublinear_figure(flow_ce, theory.sublinear_bound(flow_ce)),
                plots.linear_figure(flow_mse, theory.linear_bound(flow_mse, m=1.0)),
                plots.gram_figure(flow_ce, flow_mse)):
        assert shown_text_px(fig) >= MIN_TEXT_PX, min_text_px(fig)


def test_the_old_layout_fails_the_measure():
    """Today's measure fails what the book once showed: a 13 in wide four-panel row at 100 dpi with an
    8 pt legend, shown in a 690 px column (about 7 px), and a figure whose text is small in the image itself."""
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.2), dpi=100)
    for ax in axes:
        ax.plot([0, 50, 100], [1, 2, 3], label="digits-mlp")
    axes[0].legend(fontsize=8)
    assert shown_text_px(fig) < 7.5 < MIN_TEXT_PX
    fig, ax = plt.subplots(figsize=(4, 3), dpi=90)
    ax.set_title("small", fontsize=6)
    assert shown_text_px(fig) == pytest.approx(6 * 90 / 72)


def test_the_png_records_the_smallest_text_the_figure_draws():
    fig, ax = plt.subplots(figsize=(5, 3), dpi=90)
    ax.plot([1, 2], [1, 2])
    ax.set_title("title", fontsize=14)
    ax.annotate("note", (1.5, 1.5), fontsize=11)
    ax.tick_params(labelsize=12)
    ax.text(5, 5, "", fontsize=2)  # empty: never drawn, never counted
    px, natural = png_text_record(render_png(fig))
    assert px == pytest.approx(11 * 90 / 72) and natural < 5 * 90 + 1  # tight bounding box
    assert min_text_px(fig) == (pytest.approx(11 * 90 / 72), "note")
    wide = plt.figure(figsize=(20, 3), dpi=90)
    wide.add_subplot().set_title("x", fontsize=13)
    wide.axes[0].tick_params(labelsize=12)  # the smallest: the tick labels
    assert shown_text_px(wide) == pytest.approx(12 * 90 / 72 * BOOK_CONTENT_PX / png_text_record(render_png(wide))[1])


def test_sub_and_superscripts_count_at_their_own_size():
    """Mathtext draws gamma_EF's "EF" and 10^-8's "-8" at 0.7 of the font size: that is what a reader must read."""
    fig, ax = plt.subplots(figsize=(5, 3), dpi=90)
    ax.tick_params(labelsize=14)
    ax.set_title(r"$\gamma_{EF}$", fontsize=12)
    assert min_text_px(fig) == (pytest.approx(12 * 0.7 * 90 / 72), r"$\gamma_{EF}$")
    ax.set_title(r"$\gamma$ plain", fontsize=12)  # math without scripts: its own size
    assert min_text_px(fig)[0] == pytest.approx(12 * 90 / 72)


def test_a_figure_without_text_is_an_error():
    fig = plt.figure()
    ax = fig.add_subplot()
    ax.set_axis_off()
    with pytest.raises(ValueError, match="draws no text"):
        min_text_px(fig)


# ------------------------------------------------------------------------------------------- bands on log axes
def test_log_band_is_the_geometric_mean_and_one_sd_of_the_logs():
    values = [0.01, 0.1, 1.0, 10.0]
    centre, low, high = log_band(values)
    logs = [math.log(v) for v in values]  # oracle: explicit loop, float64
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert centre == pytest.approx(math.exp(mean), rel=1e-12)
    assert (low, high) == (pytest.approx(math.exp(mean - sd), rel=1e-12), pytest.approx(math.exp(mean + sd), rel=1e-12))
    assert low > 0 and centre / low == pytest.approx(high / centre)  # symmetric on the axis, never to the floor
    arithmetic_low = np.mean(values) - np.std(values)
    assert arithmetic_low < 0  # the linear band of the same values runs below zero: off a log axis
    assert log_band(np.array([3.0, 3.0], dtype=np.float32)) == pytest.approx((3.0, 3.0, 3.0))


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, -2.0], [1.0, float("nan")], [float("inf")]])
def test_log_band_refuses_values_a_log_axis_cannot_show(bad):
    with pytest.raises(ValueError, match="a log band needs positive finite values"):
        log_band(bad)


def test_e1_and_e3_bars_are_geometric_on_their_log_axes():
    from companion.chapters import evaluation as ev

    recs = _e1_records(["digits-mlp"])
    fig = ev.plot_sample_gamma(recs, ["digits-mlp"])
    bars = fig.axes[0].containers[0]  # gamma_EF / gamma_SGD at stages 0, 50, 100
    ys = bars.lines[0].get_ydata()
    values = [3.0 * (1 + 0.2 * b) for b in range(3)]
    centre, low, high = log_band(values)
    assert ys[0] == pytest.approx(centre)
    segments = bars.lines[2][0].get_segments()
    assert segments[0][0][1] == pytest.approx(low) and segments[0][1][1] == pytest.approx(high)
    fig = ev.plot_damping_gamma(recs, "digits-mlp")
    assert all(ax.get_yscale() == "log" for ax in fig.axes if ax.has_data())


def test_e2_bands_on_a_log_loss_axis_are_geometric_over_seeds():
    from companion.chapters.optimisation import log_curve_bands, plot_curves

    curves = _curves(["digits-mlp"], ("adam", "ief"), steps=40, log=True)
    bands = log_curve_bands(curves, "train_loss", points=10)
    one = bands[(bands.optimizer == "ief")].iloc[-1]
    c = curves[(curves.optimizer == "ief") & (curves.quantity == "train_loss")]
    per_seed = [c[(c.seed == k) & (c.step > 36)]["value"].mean() for k in (0, 1, 2)]  # the last window of 4
    assert (one["mean"], one["low"], one["high"]) == pytest.approx(log_band(per_seed)) and one["n"] == 3
    fig = plot_curves(curves, ["digits-mlp"], {"digits-mlp": ("adam", "ief")}, points=10)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    band = ax.collections[-1].get_paths()[0].vertices[:, 1]
    assert band.min() > 0
