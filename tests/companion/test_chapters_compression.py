"""The compression chapter's rules (companion.chapters.compression) on hand-made results: the damping chosen on
validation, the iEF-vs-EF verdict and the damping-robustness verdict."""
from __future__ import annotations

import numpy as np
import pandas as pd

from companion.chapters import compression as plots


def _results(acc: dict[tuple[str, float, float], list[float]], split: str = "test") -> pd.DataFrame:
    """Rows for (method, damping, sparsity) -> one accuracy per draw, on ``split`` and (the same) on validation."""
    rows = []
    for (method, damping, sparsity), values in acc.items():
        for draw, a in enumerate(values):
            for s in {split, "validation"}:
                rows.append(dict(method=method, draw=draw, damping=damping, sparsity=sparsity, split=s, accuracy=a,
                                 loss=1 - a))
    return pd.DataFrame(rows)


def test_chosen_damping_is_the_best_on_validation_ties_to_the_larger():
    r = _results({("ef", 1e-4, 0.9): [0.5, 0.5], ("ef", 1e-2, 0.9): [0.6, 0.6], ("ef", 1.0, 0.9): [0.6, 0.6],
                  ("ief", 1e-4, 0.9): [0.7, 0.7], ("ief", 1e-2, 0.9): [0.6, 0.6]})
    assert plots.chosen_dampings(r, 0.9) == {"ef": 1.0, "ief": 1e-4}


def test_beats_verdict_counts_wins_beyond_the_summed_sd():
    acc = {}
    for sp, ef, ief in ((0.5, [0.90, 0.90], [0.95, 0.95]),  # win: +5 points, sd 0
                        (0.7, [0.80, 0.82], [0.82, 0.84]),  # tie: +2 points, sds ~1.4 + 1.4
                        (0.9, [0.50, 0.50], [0.60, 0.60])):  # win
        acc[("ef", 1e-2, sp)] = ef
        acc[("ief", 1e-2, sp)] = ief
        acc[("magnitude", np.nan, sp)] = [0.4, 0.4]
    r = _results(acc)
    v = plots.beats_verdict(r, {"ef": 1e-2, "ief": 1e-2})
    assert v["wf_verdict"] == "iEF-WoodFisher beats EF-WoodFisher here"
    assert (v["wf_wins"], v["wf_losses"], v["wf_ties"]) == ("50 %, 90 %", "none", "70 %")
    # mirror: EF ahead everywhere
    swapped = r.replace({"method": {"ef": "ief", "ief": "ef"}})
    assert plots.beats_verdict(swapped, {"ef": 1e-2, "ief": 1e-2})["wf_verdict"] == \
        "EF-WoodFisher beats iEF-WoodFisher here"
    # one win, one loss, one tie: neither
    acc[("ief", 1e-2, 0.9)] = [0.40, 0.40]
    assert plots.beats_verdict(_results(acc), {"ef": 1e-2, "ief": 1e-2})["wf_verdict"] == \
        "neither beats the other here"


def test_robustness_rule():
    base = {("magnitude", np.nan, 0.9): [0.5, 0.5]}
    good = {**base, ("ef", 1e-8, 0.9): [0.2, 0.2], ("ief", 1e-8, 0.9): [0.6, 0.6], ("ef", 1.0, 0.9): [0.5, 0.5],
            ("ief", 1.0, 0.9): [0.5, 0.5], ("ggn", 1e-8, 0.9): [0.6, 0.6], ("ggn", 1.0, 0.9): [0.5, 0.5]}
    v = plots.robustness(_results(good), 0.9)
    assert v["wf_robust_verdict"] == "it carries over" and v["wf_robust_below"] == "none"
    assert v["wf_low_ief"] == "60.0 %" and v["wf_low_ef"] == "20.0 %"
    bad = {**good, ("ief", 1e-8, 0.9): [0.1, 0.1], ("ggn", 1e-8, 0.9): [0.1, 0.1]}
    v = plots.robustness(_results(bad), 0.9)
    assert v["wf_robust_verdict"] == "it does not carry over" and v["wf_robust_below"] == "1e-08"
    assert v["wf_low_reading"].startswith("the exact GGN fails there too")
    only_ief = {**bad, ("ggn", 1e-8, 0.9): [0.6, 0.6]}
    assert plots.robustness(_results(only_ief), 0.9)["wf_low_reading"].startswith("the exact GGN does not fail")


def test_ggn_comparison_applies_the_rule_against_the_exact_ggn_and_says_what_it_means():
    acc = {}
    for sp, ggn, ief in ((0.5, [0.95, 0.95], [0.95, 0.95]),  # level
                         (0.9, [0.60, 0.62], [0.70, 0.72]),  # iEF ahead by 10 points, sds ~1.4 + 1.4
                         (0.95, [0.30, 0.30], [0.50, 0.50])):  # iEF ahead by 20 points
        acc[("ggn", 1e-3, sp)] = ggn
        acc[("ief", 1e-4, sp)] = ief
        acc[("ef", 1e-2, sp)] = [0.2, 0.2]
        acc[("magnitude", np.nan, sp)] = [0.4, 0.4]
    chosen = {"ggn": 1e-3, "ief": 1e-4, "ef": 1e-2}
    g = plots.ggn_comparison(_results(acc), chosen)
    assert g["wf_ggn_verdict"] == "iEF-WoodFisher beats the exact GGN here"
    assert (g["wf_ggn_ahead"], g["wf_ggn_behind"], g["wf_ggn_level"]) == ("90 %, 95 %", "none", "50 %")
    assert g["wf_ggn_gap"] == ("at 95 % sparsity iEF-WoodFisher (λ = 0.0001) keeps 50.0 ± 0.0 % test accuracy and the "
                               "exact GGN (λ = 0.001) 30.0 ± 0.0 %, a difference of +20.0 points")
    assert g["wf_ggn_reading"].startswith("So here the approximation prunes better than the curvature it approximates")
    assert g["wf_ggn_rule"] == plots.RULE_GGN
    mirror = _results(acc).replace({"method": {"ggn": "ief", "ief": "ggn"}})
    flipped = plots.ggn_comparison(mirror, {"ggn": 1e-4, "ief": 1e-3, "ef": 1e-2})
    assert flipped["wf_ggn_verdict"] == "the exact GGN beats iEF-WoodFisher here"
    assert flipped["wf_ggn_reading"].startswith("That is what one expects of an approximation")
    level = {k: v for k, v in acc.items() if k[2] == 0.5}
    assert plots.ggn_comparison(_results(level), chosen)["wf_ggn_verdict"] == "neither beats the other here"
    # neither by the rule, but ahead at the highest sparsity: the reading names it and says what it means
    mixed = {**acc, ("ief", 1e-4, 0.9): [0.55, 0.57]}  # behind by 5 points at 90 %
    g = plots.ggn_comparison(_results(mixed), chosen)
    assert (g["wf_ggn_verdict"], g["wf_ggn_ahead"], g["wf_ggn_behind"]) == ("neither beats the other here", "95 %",
                                                                           "90 %")
    assert ("Yet iEF-WoodFisher is ahead of the exact GGN at 95 %, the study's highest sparsity (95 %, where most "
            "weights go at once) among them: at those sparsities the approximation prunes "
            "better") in g["wf_ggn_reading"]
    costs = pd.DataFrame({"method": ["ief", "ggn", "ief", "ggn"], "mean_diagonal": [0.04, 0.0004, 0.02, 0.0002]})
    assert plots.ggn_comparison(_results(acc), chosen, costs)["wf_ggn_scale"] == (
        "100 times the exact GGN's (0.03 against 0.0003)")
    assert plots.ggn_comparison(_results(acc), chosen)["wf_ggn_scale"] == "not stated"
    without = _results({k: v for k, v in acc.items() if k[0] != "ggn"})
    assert plots.ggn_comparison(without, chosen)["wf_ggn_verdict"] == "not run"
