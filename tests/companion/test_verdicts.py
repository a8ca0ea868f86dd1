"""companion.experiments.verdicts: every rule on synthetic records built to make it hold, to make it fail and to leave
it inconclusive, asserting the verdict and what it names as failing."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from companion.experiments import verdicts as V
from companion.experiments.verdicts.evaluation import top_edge_bests

NOISE = (0.97, 1.0, 1.03)  # three batches: a tight spread, so a clear difference is decided
NOISE4 = (0.97, 1.0, 1.03, 1.01)  # four: a best damping chosen on two batches and judged on the other two
WIDE = (0.4, 1.0, 2.5)  # three batches spread over a decade: nothing near 1 is decided


# ------------------------------------------------------------------------------------------------ record makers
def e1(stages: dict[int, dict[str, float]], setup="s", spread=NOISE, imbalance=None) -> list[dict]:
    """E1 records: at each stage each method's ratio times the per-batch ``spread`` (SGD is 1)."""
    out = []
    for stage, ratios in stages.items():
        for b, f in enumerate(spread):
            for method, ratio in {"sgd": 1.0, **ratios}.items():
                r = 1.0 if method == "sgd" else ratio * f
                out.append({"setup": setup, "stage": stage, "kind": "e1", "batch": b, "method": method,
                            "damping": 1e-7, "gamma": r, "ratio": r,
                            "imbalance": None if imbalance is None else imbalance[stage] * (1 + 0.01 * b)})
    return out


def sweep(stages: dict[int, dict[str, dict[float, float]]], setup="s", spread=NOISE) -> list[dict]:
    out = []
    for stage, methods in stages.items():
        for method, curve in methods.items():
            for lam, ratio in curve.items():
                for b, f in enumerate(spread):
                    out.append({"setup": setup, "stage": stage, "kind": "sweep", "batch": b, "method": method,
                                "damping": lam, "gamma": ratio * f, "ratio": ratio * f, "imbalance": None})
    return out


LAMS = (1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1.0)


def unpaired(recs: list[dict], method: str) -> list[dict]:
    """Batch-to-batch spread over a decade that differs between dampings (a common factor per batch cancels in the
    paired comparisons): nothing within a factor of a few is decided."""
    for r in recs:
        if r["method"] == method:
            k = LAMS.index(r["damping"]) if r["damping"] in LAMS else 0
            r["ratio"] = r["gamma"] = r["ratio"] * WIDE[(r["batch"] + k) % 3]
    return recs


def v_curve(best: float, floor=0.6, slope=0.5) -> dict[float, float]:
    """A V-shaped sweep: ``floor`` at ``best``, up by ``slope`` decades per decade of damping away from it."""
    return {lam: floor * 10 ** (slope * abs(math.log10(lam / best))) for lam in LAMS}


def verdict(rule: str, *data) -> dict[str, V.Verdict]:
    return {v.subject: v for v in V.RULES[rule].evaluate(*data)}


# ------------------------------------------------------------------------------------------------ deciding
def test_t_quantiles_are_students():
    scipy_stats = pytest.importorskip("scipy.stats")
    for dof in range(1, 40):
        assert V.t_quantile(dof) == pytest.approx(scipy_stats.t.ppf(0.975, dof) if dof <= 30 else 1.96, abs=1e-3)
    with pytest.raises(ValueError, match="at least 1 degree"):
        V.t_quantile(0)


def test_decide_needs_a_spread_it_can_tell_apart():
    assert V.decide([0.5, 0.6, 0.55]) == 1 and V.decide([-0.5, -0.6, -0.55]) == -1
    assert V.decide([-1.0, 1.2, 0.1]) == 0 and V.decide([5.0]) == 0  # one batch decides nothing
    assert V.decide([0.5, 0.6, 0.55], threshold=1.0) == -1


@pytest.mark.parametrize("outcomes, every, expected", [
    ({0: 1, 50: 1, 100: -1}, False, V.HOLDS), ({0: 1, 50: -1, 100: -1}, False, V.FAILS),
    ({0: 1, 50: 0, 100: -1}, False, V.INCONCLUSIVE), ({0: 1, 50: 1, 100: -1, 25: -1}, False, V.FAILS),
    ({0: 1, 50: 1}, True, V.HOLDS), ({0: 1, 50: 0}, True, V.INCONCLUSIVE), ({0: 1, 50: -1}, True, V.FAILS),
    ({}, True, V.INCONCLUSIVE),
])
def test_over_stages(outcomes, every, expected):
    assert V.over_stages(outcomes, every) == expected


def test_a_verdict_is_one_of_three():
    with pytest.raises(ValueError, match="verdict must be one of"):
        V.Verdict("s", "holds for some setups", "")


# ------------------------------------------------------------------------------------------------ E1
@pytest.mark.parametrize("ef, expected", [
    ((2.0, 3.0, 0.5), V.HOLDS),  # worse than SGD at 2 of 3 stages: most stages
    ((0.5, 0.6, 3.0), V.FAILS),  # better at 2 of 3: a majority is out of reach
    ((2.0, 1.26, 0.5), V.INCONCLUSIVE),  # 1 for, 1 against, 1 undecided (EF at the margin x1.26)
    ((2.0, 1.0, 1.1), V.FAILS),  # EF at SGD's level twice: decided within the margin, not "worse"
])
def test_ef_worse_than_sgd(ef, expected):
    got = verdict("e1_ef_worse", e1({s: {"ef": r} for s, r in zip((0, 50, 100), ef)}))["s"]
    assert got.verdict == expected
    assert [f.split(":")[0] for f in got.failures] == [f"stage {s} %" for s, r in zip((0, 50, 100), ef) if r < 1.2]


@pytest.mark.parametrize("ief, spread, expected", [
    ((0.5, 0.4, 0.3), NOISE, V.HOLDS), ((0.5, 1.5, 0.3), NOISE, V.FAILS), ((0.9, 0.9, 0.9), WIDE, V.INCONCLUSIVE),
])
def test_ief_better_than_sgd_at_every_stage(ief, spread, expected):
    got = verdict("e1_ief_better", e1({s: {"ief": r} for s, r in zip((0, 50, 100), ief)}, spread=spread))["s"]
    assert got.verdict == expected
    assert bool(got.failures) == (expected == V.FAILS) and all("stage 50 %" in f for f in got.failures)


def test_ief_sf_ef_order():
    holds = e1({0: {"ief": 0.3, "sf": 0.6, "ef": 2.0}, 50: {"ief": 0.3, "sf": 0.6, "ef": 2.0},
                100: {"ief": 0.7, "sf": 0.6, "ef": 2.0}})
    got = verdict("e1_order", holds)["s"]
    assert got.verdict == V.HOLDS and got.failures == ("stage 100 %: iEF/SF 1.17 (95 % interval 1.17–1.17), "
                                                      "SF/EF 0.3 (95 % interval 0.3–0.3)",)
    fails = e1({0: {"ief": 0.3, "sf": 0.6, "ef": 0.5}, 50: {"ief": 0.3, "sf": 0.6, "ef": 0.5},
                100: {"ief": 0.3, "sf": 0.6, "ef": 2.0}})  # SF above EF at two stages
    assert verdict("e1_order", fails)["s"].verdict == V.FAILS
    # SF and EF indistinguishable over a wide spread: SF/EF is per batch paired, so make them differ per batch
    rec = e1({s: {"ief": 0.3, "sf": 0.6, "ef": 0.6} for s in (0, 50, 100)})
    for r in rec:
        if r["method"] == "ef":
            r["ratio"] = r["gamma"] = 0.6 * {0: 0.5, 1: 1.0, 2: 2.2}[r["batch"]]
    assert verdict("e1_order", rec)["s"].verdict == V.INCONCLUSIVE


def test_imbalance_grows_and_tracks():
    stages = {0: {"ef": 1.0, "sf": 0.8}, 50: {"ef": 2.0, "sf": 1.0}, 100: {"ef": 4.0, "sf": 1.5}}
    grows = verdict("e1_imbalance", e1(stages, imbalance={0: 2.0, 50: 4.0, 100: 8.0}))["s"]
    assert grows.verdict == V.HOLDS and "imbalance ×4" in grows.detail
    shrinks = verdict("e1_imbalance", e1(stages, imbalance={0: 8.0, 50: 4.0, 100: 2.0}))["s"]
    assert shrinks.verdict == V.FAILS and shrinks.failures[0].startswith("the imbalance shrinks")
    one = verdict("e1_imbalance", e1({0: stages[0]}, imbalance={0: 2.0}))["s"]
    assert one.verdict == V.INCONCLUSIVE and "fewer than 2" in one.detail


def _imbalance_records(ef_of, imbalance_of, stages=(0, 50, 100), batches=8) -> list[dict]:
    """E1 records whose EF ratio and SGD imbalance per (stage, batch) are given by functions (SF as EF)."""
    out = []
    for s in stages:
        for b in range(batches):
            for method, r in (("sgd", 1.0), ("ef", ef_of(s, b)), ("sf", ef_of(s, b))):
                out.append({"setup": "s", "stage": s, "kind": "e1", "batch": b, "method": method, "damping": 1e-7,
                            "gamma": r, "ratio": r, "imbalance": imbalance_of(s, b) if method == "sgd" else None})
    return out


def test_a_shared_trend_over_stages_is_not_tracking():
    """EF worsening and the imbalance growing over training, but within a stage the batches with the larger
    imbalance are not those where EF is worse: a correlation of stage means called that "tracks" (r = 1); the
    within-stage slope decides nothing, and decides against where the batches go the other way."""
    rng = np.random.default_rng(0)
    jitter = {(s, b): rng.normal(0, 0.1) for s in (0, 50, 100) for b in range(8)}
    trend = verdict("e1_imbalance", _imbalance_records(lambda s, b: 2 ** (s / 50) * math.exp(jitter[(s, b)]),
                                                        lambda s, b: 2 ** (s / 50) * (1 + 0.05 * b)))["s"]
    assert trend.verdict == V.INCONCLUSIVE and "slope" in trend.detail
    tracks = verdict("e1_imbalance", _imbalance_records(lambda s, b: 2 ** (s / 50) * (1 + 0.2 * b),
                                                         lambda s, b: 2 ** (s / 50) * (1 + 0.05 * b)))["s"]
    assert tracks.verdict == V.HOLDS
    against = verdict("e1_imbalance", _imbalance_records(lambda s, b: 2 ** (s / 50) / (1 + 0.2 * b),
                                                          lambda s, b: 2 ** (s / 50) * (1 + 0.05 * b)))["s"]
    assert against.verdict == V.FAILS and any(f.startswith("EF does not track it") for f in against.failures)


# ------------------------------------------------------------------------------------------------ E3
def test_best_damping_moves_per_method():
    """SF's best damping moves with the stage, EF's never does: the rule says so per method."""
    recs = sweep({0: {"ef": v_curve(1e-2), "sf": v_curve(1e-4)}, 50: {"ef": v_curve(1e-2), "sf": v_curve(1.0)},
                  100: {"ef": v_curve(1e-2), "sf": v_curve(1.0)}}, spread=NOISE4)
    got = verdict("e3_best_moves", recs)
    assert got["s, SF"].verdict == V.HOLDS
    assert got["s, EF"].verdict == V.FAILS and got["s, EF"].failures == (
        "each stage's best EF λ is decided within ×1.26 of every other stage's best there",)
    # three batches: one to judge on, which decides nothing
    assert verdict("e3_best_moves", sweep({0: {"sf": v_curve(1e-4)}, 50: {"sf": v_curve(1.0)}}))[
        "s, SF"].verdict == V.INCONCLUSIVE


def test_a_best_chosen_on_the_batches_that_judge_it_is_not_a_move():
    """Two dampings equally good at both stages, batch noise deciding which looks best at each stage: chosen on
    half the batches and judged on the other half, with the margin, no move is claimed."""
    rng = np.random.default_rng(1)
    recs = []
    for stage in (0, 50):
        for b in range(12):
            for lam in (1e-4, 1e-2):
                r = 0.6 * math.exp(rng.normal(0, 0.05))
                recs.append({"setup": "s", "stage": stage, "kind": "sweep", "batch": b, "method": "ef",
                             "damping": lam, "gamma": r, "ratio": r, "imbalance": None})
    assert verdict("e3_best_moves", recs)["s, EF"].verdict != V.HOLDS


def test_best_damping_that_moves_within_the_noise_is_inconclusive():
    flat = {lam: 0.6 for lam in LAMS}
    recs = unpaired(sweep({0: {"ef": {**flat, 1e-2: 0.59}}, 50: {"ef": {**flat, 1e-4: 0.59}}}), "ef")
    assert verdict("e3_best_moves", recs)["s, EF"].verdict == V.INCONCLUSIVE


def _ief(at: dict[float, float]) -> dict[float, float]:
    return {lam: at.get(lam, 0.5) for lam in LAMS}


NEEDS_DAMPING = {"ef": v_curve(1e-2), "sf": v_curve(1e-4)}  # EF and SF far worse un-damped than at their best


@pytest.mark.parametrize("curve, spread, expected", [
    (_ief({}), NOISE, V.HOLDS),
    (_ief({1e-6: 0.9}), NOISE, V.FAILS),  # x1.8 over lambda <= 1e-6
    (_ief({1e-6: 0.62}), None, V.INCONCLUSIVE),  # x1.24 but batches spread over a decade
    (_ief({1e-4: 5.0, 1.0: 50.0}), NOISE, V.HOLDS),  # above the near-zero range iEF may move
])
def test_ief_robust_to_near_zero_damping(curve, spread, expected):
    """iEF's own flatness over lambda <= 1e-6, with EF and SF that need their damping (the contrast holds)."""
    recs = sweep({0: {"ief": curve, **NEEDS_DAMPING}, 50: {"ief": curve, **NEEDS_DAMPING}}, spread=spread or NOISE)
    got = verdict("e3_ief_robust", recs if spread else unpaired(recs, "ief"))["s"]
    assert got.verdict == expected
    if expected == V.FAILS:
        assert got.failures[0] == "stage 0 %: iEF at λ=1e-06 is ×1.8 its value at λ=1e-10"


def test_ief_robust_does_not_hold_where_ef_and_sf_are_as_flat():
    """The review's tweet setups: EF and SF exactly as flat over damping as iEF (max/min 1.000). The contrast the
    claim makes is decided absent: the rule does not hold and says that the sweep does not separate them."""
    flat = {lam: 0.7 for lam in LAMS}
    recs = sweep({s: {"ief": _ief({}), "ef": {**flat}, "sf": {lam: 0.55 for lam in LAMS}} for s in (25, 50, 100)})
    got = verdict("e3_ief_robust", recs)["s"]
    assert got.verdict == V.FAILS
    assert got.failures[0] == ("stage 25 %: EF pays no more than iEF for the near-zero damping (EF's cost over "
                               "iEF's 1 (95 % interval 1–1)): the sweep does not separate iEF from EF")
    assert len(got.failures) == 6 and "SF is as flat as iEF here, the sweep does not separate them" in got.detail
    # only EF as flat, SF needing its damping: still not "holds"
    recs = sweep({s: {"ief": _ief({}), "ef": flat, "sf": v_curve(1e-4)} for s in (25, 50)})
    got = verdict("e3_ief_robust", recs)["s"]
    assert got.verdict == V.FAILS and all(" from EF" in f for f in got.failures)


def test_ief_robust_holds_where_ef_is_flat_near_zero_but_needs_a_larger_damping():
    """EF flat over lambda <= 1e-6 (as on the tweet setups) but 4x better at lambda = 1e-2: the near-zero damping
    costs EF a factor 4 and iEF nothing, so the contrast is there although EF's near-zero flatness equals iEF's."""
    ef = {lam: 2.0 if lam <= 1e-6 else 0.5 if lam == 1e-2 else 1.0 for lam in LAMS}
    recs = sweep({s: {"ief": _ief({}), "ef": ef, "sf": v_curve(1e-2)} for s in (25, 50)})
    got = verdict("e3_ief_robust", recs)["s"]
    assert got.verdict == V.HOLDS and "EF ×4 (best 1e-02), EF's cost over iEF's 4 (95 % interval 4–4)" in got.detail


def test_ief_robust_is_inconclusive_where_the_contrast_is_within_the_noise():
    """EF's cost x1.3 over iEF's, but EF's batches spread over a decade differently at each damping: undecided."""
    ef = {lam: 0.65 if lam == 1e-10 else 0.5 for lam in LAMS}
    recs = unpaired(sweep({s: {"ief": _ief({}), "ef": ef, "sf": v_curve(1e-2)} for s in (25, 50)}), "ef")
    got = verdict("e3_ief_robust", recs)["s"]
    assert got.verdict == V.INCONCLUSIVE and not got.failures


def test_a_best_damping_at_the_grids_top_edge_is_named():
    """EF best at lambda = 1 (the top of LAMS) at every stage: "best" is where damping dominates. The rules name it,
    a best that never leaves the edge is not "does not move", and a move that rests on it says so."""
    top = v_curve(1.0)  # decreasing all the way to the grid's top edge
    edge = "at the grid's top edge λ=1e+00, where damping dominates and the damped update tends to SGD's direction"
    recs = sweep({s: {"ief": _ief({}), "ef": top, "sf": v_curve(1e-4)} for s in (0, 50, 100)})
    recs4 = sweep({s: {"ief": _ief({}), "ef": top, "sf": v_curve(1e-4)} for s in (0, 50, 100)}, spread=NOISE4)
    moves = verdict("e3_best_moves", recs4)["s, EF"]
    assert moves.verdict == V.INCONCLUSIVE and edge in moves.detail and "the sweep cannot tell" in moves.detail
    assert verdict("e3_best_moves", recs4)["s, SF"].verdict == V.FAILS  # interior best, same at every stage
    vs_ef = verdict("e3_ief_vs_ef", recs)["s"]
    assert f"(EF's best λ=1e+00, {edge} (γ/γ_SGD there 0.6))" in vs_ef.detail
    signature = verdict("e3_ef_signature", recs)["s"]
    assert edge in signature.detail and "the rescue is damping turning EF into SGD" in signature.detail
    assert "EF ×1e+05 (best 1e+00, " + edge in verdict("e3_ief_robust", recs)["s"].detail
    # the best moves from 1e-4 to the top edge: holds, and says that the move rests on the edge
    recs = sweep({0: {"ef": v_curve(1e-4)}, 50: {"ef": top}, 100: {"ef": top}}, spread=NOISE4)
    got = verdict("e3_best_moves", recs)["s, EF"]
    assert got.verdict == V.HOLDS and "the move rests on a best damping at the grid's top edge (stage(s) 50 %, " \
        "100 %)" in got.detail
    assert top_edge_bests(recs) == [("s", "EF", [50, 100])]
    # a move between two interior bests does not mention the edge
    inner = verdict("e3_best_moves", sweep({0: {"ef": v_curve(1e-6)}, 50: {"ef": v_curve(1e-2)}}, spread=NOISE4))[
        "s, EF"]
    assert inner.verdict == V.HOLDS and "edge" not in inner.detail


def test_the_failure_names_a_best_sf_at_the_top_edge():
    recs = sweep({0: {"ief": _ief({}), "sf": v_curve(1.0, floor=0.2)}})
    got = verdict("e3_ief_vs_sf", recs)["s"]
    assert got.verdict == V.FAILS and got.failures == (
        "stage 0 %: iEF is 2.5× SF at λ=1e+00, at the grid's top edge λ=1e+00, where damping dominates and the "
        "damped update tends to SGD's direction (γ/γ_SGD there 0.2)",)


@pytest.mark.parametrize("sf_floor, spread, expected", [(0.45, NOISE, V.HOLDS), (0.2, NOISE, V.FAILS),
                                                        (0.42, WIDE, V.INCONCLUSIVE)])
def test_ief_comparable_to_optimally_damped_sf(sf_floor, spread, expected):
    recs = sweep({s: {"ief": _ief({}), "sf": v_curve(1e-2, floor=sf_floor)} for s in (0, 50)}, spread=spread)
    # iEF and SF per batch independently spread (not the same factor): shuffle SF's batches
    if spread is WIDE:
        for r in recs:
            if r["method"] == "sf":
                r["ratio"] = r["gamma"] = r["ratio"] / WIDE[r["batch"]] * WIDE[(r["batch"] + 1) % 3]
    got = verdict("e3_ief_vs_sf", recs)["s"]
    assert got.verdict == expected
    if expected == V.FAILS:
        assert got.failures == ("stage 0 %: iEF is 2.5× SF at λ=1e-02", "stage 50 %: iEF is 2.5× SF at λ=1e-02")


def test_ief_better_than_best_ef():
    ok = sweep({0: {"ief": _ief({}), "ef": v_curve(1e-2, floor=0.8)}})
    assert verdict("e3_ief_vs_ef", ok)["s"].verdict == V.HOLDS
    bad = sweep({0: {"ief": _ief({}), "ef": v_curve(1e-2, floor=0.8)}, 50: {"ief": _ief({}), "ef": v_curve(1e-2, 0.3)}})
    got = verdict("e3_ief_vs_ef", bad)["s"]
    assert got.verdict == V.FAILS and got.failures == ("stage 50 %: iEF is 1.67× EF at λ=1e-02",)


@pytest.mark.parametrize("slope, spread, expected", [(0.4, NOISE, V.HOLDS), (0.1, NOISE, V.FAILS),
                                                     (0.2, WIDE, V.INCONCLUSIVE)])
def test_the_ef_signature(slope, spread, expected):
    """Un-damped EF (lambda = 1e-10, 8 decades from the best 1e-2) far worse than SGD and rescued by damping: slope
    0.4 gives 0.6 * 10^3.2 ~ 950x SGD; 0.1: 0.6 * 10^0.8 ~ 3.8x, not a decade worse."""
    got = verdict("e3_ef_signature", sweep({s: {"ef": v_curve(1e-2, slope=slope)} for s in (0, 50, 100)},
                                           spread=spread))["s"]
    assert got.verdict == expected
    if expected == V.FAILS:
        assert got.failures[0] == "stage 0 %: un-damped EF is 3.78× SGD, not a decade worse"


# ------------------------------------------------------------------------------------------------ block-diagonal
def _bd(iekfac, kfac=0.9, ekfac=0.8, ief=0.5, spread=NOISE):
    return e1({s: {"ief": ief, "iekfac": iekfac, "kfac": kfac, "ekfac": ekfac} for s in (0, 50, 100)}, spread=spread)


def test_iekfac_better_than_kfac_and_ekfac():
    assert verdict("bd_iekfac_better", _bd(0.55))["s"].verdict == V.HOLDS
    got = verdict("bd_iekfac_better", _bd(0.85))["s"]  # between eKFAC and KFAC
    assert got.verdict == V.FAILS and len(got.failures) == 3 and "ieKFAC/eKFAC 1.06" in got.failures[0]
    assert verdict("bd_iekfac_better", _bd(0.75))["s"].verdict == V.FAILS  # x1.07 below eKFAC: within the margin
    rec = _bd(0.75, kfac=1.2)
    for r in rec:  # eKFAC per batch on both sides of ieKFAC
        if r["method"] == "ekfac":
            r["ratio"] = r["gamma"] = 0.8 * {0: 0.5, 1: 1.0, 2: 2.0}[r["batch"]]
    assert verdict("bd_iekfac_better", rec)["s"].verdict == V.INCONCLUSIVE


def test_iekfac_close_to_ief_is_two_sided():
    """Close: the interval of ieKFAC/iEF inside 1/1.26 .. 1.26; far: wholly outside, above or below."""
    close = verdict("bd_iekfac_close", _bd(0.55))["s"]  # x1.1 above iEF
    assert close.verdict == V.HOLDS and close.surprise is None and close.detail.startswith("close at 3 of 3 stages")
    far = verdict("bd_iekfac_close", _bd(1.0))["s"]  # x2 above iEF
    assert far.verdict == V.FAILS and far.failures[0] == ("stage 0 %: ieKFAC/iEF 2 (95 % interval 2–2), outside "
                                                          "0.79–1.26")
    below = verdict("bd_iekfac_close", _bd(0.2))["s"]  # x0.4: far below, and a surprise
    assert below.verdict == V.FAILS and len(below.failures) == 3 and below.surprise is not None
    rec = _bd(0.6)
    for r in rec:
        if r["method"] == "iekfac":
            r["ratio"] = r["gamma"] = 0.6 * {0: 0.5, 1: 1.0, 2: 2.0}[r["batch"]]
    got = verdict("bd_iekfac_close", rec)["s"]
    assert got.verdict == V.INCONCLUSIVE and not got.failures and "(undecided)" in got.detail


def test_iekfac_slightly_below_ief_is_close_and_a_surprise_not_a_failure():
    """ieKFAC 0.82x exact iEF: within the band, so close; decided below iEF, so named as a surprise."""
    beats = verdict("bd_iekfac_close", _bd(0.41))["s"]
    assert beats.verdict == V.HOLDS and not beats.failures
    assert beats.surprise == ("ieKFAC, a block-diagonal approximation of iEF, is decided closer to the natural "
                              "gradient than exact iEF at stage(s) 0 %, 50 %, 100 %")


def test_iekfac_close_on_the_reviewed_build_ratios():
    """The review's cold cpu build: ieKFAC/iEF 0.86-1.01 per stage (0.987-0.993 on digits from 25 %), read "does not
    hold" by the old one-sided rule. Per-batch spread of a few percent, independent for ieKFAC and iEF."""
    ratios = {0: 0.86, 25: 0.987, 50: 0.99, 75: 0.993, 100: 1.01}
    jitter = (0.98, 1.0, 1.02, 0.99, 1.01, 1.0)
    recs = e1({s: {"ief": 0.5, "iekfac": 0.5 * q} for s, q in ratios.items()}, spread=jitter)
    for r in recs:  # ieKFAC's batch-to-batch spread is not iEF's
        if r["method"] == "iekfac":
            r["ratio"] = r["gamma"] = r["ratio"] * jitter[(r["batch"] + 2) % 6] / jitter[r["batch"]]
    got = verdict("bd_iekfac_close", recs)["s"]
    assert got.verdict == V.HOLDS and not got.failures and got.detail.startswith("close at 5 of 5 stages")
    assert got.surprise is not None and "0 %" in got.surprise


# E2 and the training chapter's rules: tests/companion/test_verdicts_training.py


def test_every_rule_states_its_claim_label_and_thresholds():
    from companion.paper import cite

    for rule in V.RULES.values():
        assert rule.statement and rule.why and rule.claim
        assert cite(rule.label).startswith(("Fig.", "Sec", "Table", "Appendix")), rule.label  # a label of the paper


# ------------------------------------------------------------------------------------------------ this build's records
EXCERPT = Path(__file__).parent / "data" / "verdicts" / "cold_cpu_excerpt.json"


def _excerpt_records() -> list[dict]:
    """The records of ``data/verdicts/cold_cpu_excerpt.json`` (E1 iEF and ieKFAC of two setups at every stage, the
    sweep of EF, SF and iEF at one stage of two setups), shaped as :func:`read_records` gives them."""
    data = json.loads(EXCERPT.read_text())
    recs = []
    for setup, methods in data["e1"].items():
        for method, stages in methods.items():
            for stage, ratios in stages.items():
                recs += [{"setup": setup, "stage": int(stage), "kind": "e1", "batch": b, "method": method,
                          "damping": 1e-7, "gamma": r, "ratio": r, "imbalance": None} for b, r in enumerate(ratios)]
    for setup, sw in data["sweep"].items():
        for method in ("ief", "ef", "sf"):
            for lam, ratios in zip(sw["dampings"], sw[method]):
                recs += [{"setup": setup, "stage": sw["stage"], "kind": "sweep", "batch": b, "method": method,
                          "damping": lam, "gamma": r, "ratio": r, "imbalance": None} for b, r in enumerate(ratios)]
    return recs


def test_this_builds_iekfac_is_close_to_ief():
    """The review's misfire: ieKFAC/iEF 0.86-1.01 on tweets-minilm-lora and 0.987-0.993 on digits-mlp from 25 %,
    read "does not hold" because ieKFAC below iEF counted as a failure. Two-sided, they are close; digits-mlp's
    initial model (0.674) is far below and named."""
    got = verdict("bd_iekfac_close", _excerpt_records())
    lora, digits = got["tweets-minilm-lora"], got["digits-mlp"]
    assert lora.verdict == V.HOLDS and lora.detail.startswith("close at 5 of 5 stages (Holm); 0 %: ieKFAC/iEF 0.859 "
                                                              "(95 % "
                                                              "interval 0.833–0.887) (close)")
    assert digits.verdict == V.HOLDS and digits.failures == (
        "stage 0 %: ieKFAC/iEF 0.674 (95 % interval 0.593–0.766), outside 0.79–1.26",)
    assert "stage(s) 0 %, 50 %, 75 %, 100 %" in digits.surprise and "0 %, 25 %, 75 %" in lora.surprise


def test_this_builds_flat_ef_does_not_make_ief_robust_hold():
    """tweets-minilm-pt at 25 %: EF as flat over damping as iEF (the near-zero damping costs it x1.00): the rule
    does not hold there and says so. digits-mlp at 25 %: EF and SF pay x201 and x10.3, with their best at the grid's
    top edge, which the detail names."""
    got = verdict("e3_ief_robust", _excerpt_records())
    pt, digits = got["tweets-minilm-pt"], got["digits-mlp"]
    assert pt.verdict == V.FAILS and pt.failures == (
        "stage 25 %: EF pays no more than iEF for the near-zero damping (EF's cost over iEF's 1 (95 % interval "
        "0.997–1.01)): the sweep does not separate iEF from EF",)
    assert "SF's cost over iEF's 1.3 (95 % interval 1.2–1.41)" in pt.detail
    assert digits.verdict == V.HOLDS and "EF's cost over iEF's 201 (95 % interval 136–298)" in digits.detail
    edge = "at the grid's top edge λ=1e+02, where damping dominates and the damped update tends to SGD's direction"
    assert f"EF ×201 (best 1e+02, {edge} (γ/γ_SGD there 1.04))" in digits.detail
    assert f"(EF's best λ=1e+02, {edge} (γ/γ_SGD there 1.04))" in verdict("e3_ief_vs_ef", _excerpt_records())[
        "digits-mlp"].detail
    signature = verdict("e3_ef_signature", _excerpt_records())["digits-mlp"]
    assert signature.verdict == V.HOLDS and "the rescue is damping turning EF into SGD" in signature.detail
    assert top_edge_bests(_excerpt_records()) == [("digits-mlp", "EF", [25]), ("digits-mlp", "SF", [25])]
