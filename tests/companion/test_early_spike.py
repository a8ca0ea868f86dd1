"""companion.experiments.early_spike: iEF's early loss spike on the MLP from scratch, measured and explained."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from companion.experiments.early_spike import (SPIKE_KEYS, curve_spikes, first_step, search_spikes, spike_glue,
                                               spike_stats)


def test_spike_stats_of_curves_with_and_without_a_spike():
    assert spike_stats([2.0, 30.0, 10.0, 3.0, 1.5, 2.5, 1.0]) == {
        "first": 2.0, "peak": 30.0, "peak_step": 2, "peak_ratio": 15.0, "last_above": 6}
    assert spike_stats([2.0, 1.0, 0.5]) == {"first": 2.0, "peak": 2.0, "peak_step": 1, "peak_ratio": 1.0,
                                            "last_above": 0}
    with pytest.raises(ValueError, match="finite first loss"):
        spike_stats([])
    with pytest.raises(ValueError, match=r"finite first loss, got \[nan\]"):
        spike_stats([math.nan, 1.0])


def test_curve_and_search_spikes_read_the_records():
    rows = [{"setup": "s", "optimizer": o, "seed": k, "step": t + 1, "quantity": q, "value": v}
            for o in ("ief", "sgd") for k in (0, 1) for q in ("train_loss", "val_score")
            for t, v in enumerate([2.0, 4.0 * (k + 1), 1.0] if o == "ief" else [2.0, 1.0, 0.5])]
    table = curve_spikes(pd.DataFrame(rows), "s")
    assert table["seed"].tolist() == [0, 1] and table["peak_ratio"].tolist() == [2.0, 4.0]
    assert table["last_above"].tolist() == [2, 2] and table["steps"].tolist() == [3, 3]
    record = {"optimizers": {"ief": {"chosen_lr": 3.0, "trials": [
        {"lr": 10.0, "seed": 0, "diverged": None, "train_losses": [2.0, 40.0, 3.0]},
        {"lr": 3.0, "seed": 0, "diverged": None, "train_losses": [2.0, 1.0, 0.5]}]}}}
    search = search_spikes(record)
    assert search["lr"].tolist() == [3.0, 10.0] and search["chosen"].tolist() == [True, False]
    assert search["peak_ratio"].tolist() == [1.0, 20.0]
    with pytest.raises(ValueError, match=r"no 'ef'; it has \['ief'\]"):
        search_spikes(record, "ef")


def test_spike_glue_says_whether_the_spike_persists():
    runs = pd.DataFrame([{"seed": 0, "steps": 340, "first": 2.3, "peak": 2.3, "peak_step": 1, "peak_ratio": 1.0,
                          "last_above": 0}])
    first = pd.DataFrame([{"seed": 0, "lr": lr, "loss": 2.3, "s": 0.9, "s_spread": 1.1, "asked": lr * 0.39,
                           "gram_min": 0.5, "damping": 1e-7, "batch_after": 2.0, "train_after": 2.1,
                           "logit_move": 1.0, "one_class": 0.4} for lr in (1.0, 10.0)])
    glued = spike_glue("digits-mlp", 1.0, 10, runs, None, first)
    assert set(glued) == set(SPIKE_KEYS) and len(glued) == len(SPIKE_KEYS)
    assert glued["sp_e2_verdict"].startswith("there is no spike at this rate")
    assert glued["sp_threshold"] == "2.56" and glued["sp_asked"] == "lr 1: 0.39, lr 10: 3.9"
    assert glued["sp_search"] == "no learning-rate search is recorded at this scale"
    assert glued["sp_gram_over_damping"] == "5e+06" and glued["sp_damping_verdict"] == "Damping plays no part"
    assert glued["sp_rescale_verdict"] == "iEF's rescaling singles out no sample"
    near_singular = first.assign(gram_min=1e-6, s_spread=3.0)
    other = spike_glue("digits-mlp", 1.0, 10, runs, None, near_singular)
    assert other["sp_damping_verdict"] == "Damping can matter here" and "differently" in other["sp_rescale_verdict"]
    spiky = runs.assign(peak_ratio=[14.1], peak_step=[2], last_above=[83])
    assert spike_glue("digits-mlp", 10.0, 10, spiky, None, first)["sp_e2_verdict"] == \
        "at this rate 1 of 1 seeds still spike (peak above 1.5× the first loss), the last back below its first " \
        "loss after update 83"
    with pytest.raises(ValueError, match="at least one E2 run"):
        spike_glue("digits-mlp", 1.0, 10, runs.iloc[:0], None, first)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf])
def test_first_step_refuses_bad_rates(bad):
    with pytest.raises(ValueError, match="learning rates must be finite numbers > 0"):
        first_step("digits-mlp", "smoke", [1.0, bad], seeds=[0])


def test_the_first_update_explains_the_spike_on_digits():
    """The explanation, pinned on the cpu setup itself (scikit-learn's digits, the runs' first update): iEF's step
    asks the linearised model for a loss decrease of lr * s_n per sample (J d = s); at initialisation s_n ~ 0.9 and
    l_n ~ ln 10, so at lr 10 it asks for ~3.9 times the loss and the loss after the step is many times the loss
    before, while at lr 1 it asks for ~0.39 of it and the loss falls. The Gram matrix is far from singular against
    the damping, so the damping plays no part."""
    first = first_step("digits-mlp", "cpu", [1.0, 10.0], seeds=[0])
    by = first.set_index("lr")
    for lr in (1.0, 10.0):
        assert by.loc[lr, "asked"] == pytest.approx(lr * by.loc[lr, "s"] / by.loc[lr, "loss"], rel=2e-2)
    assert by.loc[10.0, "asked"] > 3 and by.loc[10.0, "batch_after"] > 5 * by.loc[10.0, "loss"]
    assert by.loc[1.0, "asked"] < 0.5 and by.loc[1.0, "batch_after"] < by.loc[1.0, "loss"]
    assert (first["gram_min"] / first["damping"] > 1e4).all()
    assert (first["s_spread"] < 1.5).all()  # s_n is nearly equal at initialisation: iEF's 1/s_n is not the cause
