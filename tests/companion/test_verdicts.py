"""companion.experiments.verdicts: every rule on synthetic records built to make it hold, to make it fail and to leave it
inconclusive, asserting the verdict and what it names as failing."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from companion.experiments import verdicts as V

NOISE = (0.97, 1.0, 1.03)  # three batches: a tight spread, so a clear difference is decided
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


@given(st.lists(st.floats(-10, 10, allow_nan=False).filter(lambda d: d != 0), min_size=1, max_size=6))
def test_a_ranking_over_seeds_flips_with_the_signs(diffs):
    """Negating every per-seed difference swaps holds and does not hold; with fewer than 3 seeds nothing is decided."""
    d = dict(enumerate(diffs))
    a = V.pair_over_seeds("s", "a < b", "loss", d)
    b = V.pair_over_seeds("s", "b < a", "loss", {k: -x for k, x in d.items()})
    swap = {V.HOLDS: V.FAILS, V.FAILS: V.HOLDS, V.INCONCLUSIVE: V.INCONCLUSIVE}
    assert b.verdict == swap[a.verdict]
    if len(diffs) < V.MIN_SEEDS:
        assert a.verdict == V.INCONCLUSIVE
    elif all(x < 0 for x in diffs):
        assert a.verdict == V.HOLDS


def test_a_tie_or_a_missing_seed_counts_for_neither_side():
    assert V.pair_over_seeds("s", "p", "m", {0: -1.0, 1: -2.0, 2: 0.0}).verdict == V.INCONCLUSIVE
    assert V.pair_over_seeds("s", "p", "m", {0: -1.0, 1: -2.0, 2: math.nan}).verdict == V.INCONCLUSIVE


def test_a_verdict_is_one_of_three():
    with pytest.raises(ValueError, match="verdict must be one of"):
        V.Verdict("s", "holds for some setups", "")


# ------------------------------------------------------------------------------------------------ E1
@pytest.mark.parametrize("ef, expected", [
    ((2.0, 3.0, 0.5), V.HOLDS),  # worse than SGD at 2 of 3 stages: most stages
    ((0.5, 0.6, 3.0), V.FAILS),  # better at 2 of 3: a majority is out of reach
    ((2.0, 1.0, 0.5), V.INCONCLUSIVE),  # 1 for, 1 against, 1 undecided (EF at SGD's level)
])
def test_ef_worse_than_sgd(ef, expected):
    got = verdict("e1_ef_worse", e1({s: {"ef": r} for s, r in zip((0, 50, 100), ef)}))["s"]
    assert got.verdict == expected
    assert [f.split(":")[0] for f in got.failures] == [f"stage {s} %" for s, r in zip((0, 50, 100), ef) if r < 0.9]


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
    assert any(f.startswith("EF does not track it") for f in shrinks.failures)
    two = verdict("e1_imbalance", e1({0: stages[0], 100: stages[100]}, imbalance={0: 2.0, 100: 8.0}))["s"]
    assert two.verdict == V.INCONCLUSIVE and "fewer than 3" in two.detail


# ------------------------------------------------------------------------------------------------ E3
def test_best_damping_moves_per_method():
    """SF's best damping moves with the stage, EF's never does: the rule says so per method."""
    recs = sweep({0: {"ef": v_curve(1e-2), "sf": v_curve(1e-4)}, 50: {"ef": v_curve(1e-2), "sf": v_curve(1.0)},
                  100: {"ef": v_curve(1e-2), "sf": v_curve(1.0)}})
    got = verdict("e3_best_moves", recs)
    assert got["s, SF"].verdict == V.HOLDS
    assert got["s, EF"].verdict == V.FAILS and got["s, EF"].failures == ("EF's best λ is 1e-02 at every sweep stage",)


def test_best_damping_that_moves_within_the_noise_is_inconclusive():
    flat = {lam: 0.6 for lam in LAMS}
    recs = unpaired(sweep({0: {"ef": {**flat, 1e-2: 0.59}}, 50: {"ef": {**flat, 1e-4: 0.59}}}), "ef")
    assert verdict("e3_best_moves", recs)["s, EF"].verdict == V.INCONCLUSIVE


def _ief(at: dict[float, float]) -> dict[float, float]:
    return {lam: at.get(lam, 0.5) for lam in LAMS}


@pytest.mark.parametrize("curve, spread, expected", [
    (_ief({}), NOISE, V.HOLDS),
    (_ief({1e-6: 0.9}), NOISE, V.FAILS),  # x1.8 over lambda <= 1e-6
    (_ief({1e-6: 0.62}), None, V.INCONCLUSIVE),  # x1.24 but batches spread over a decade
    (_ief({1e-4: 5.0, 1.0: 50.0}), NOISE, V.HOLDS),  # above the near-zero range iEF may move
])
def test_ief_robust_to_near_zero_damping(curve, spread, expected):
    recs = sweep({0: {"ief": curve}, 50: {"ief": curve}}, spread=spread or NOISE)
    got = verdict("e3_ief_robust", recs if spread else unpaired(recs, "ief"))["s"]
    assert got.verdict == expected
    if expected == V.FAILS:
        assert got.failures[0] == "stage 0 %: iEF at λ=1e-06 is ×1.8 its value at λ=1e-10"


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
    rec = _bd(0.75)
    for r in rec:  # eKFAC per batch on both sides of ieKFAC
        if r["method"] == "ekfac":
            r["ratio"] = r["gamma"] = 0.8 * {0: 0.5, 1: 1.0, 2: 2.0}[r["batch"]]
    assert verdict("bd_iekfac_better", rec)["s"].verdict == V.INCONCLUSIVE


def test_iekfac_close_to_ief_and_the_surprise_when_it_beats_it():
    close = verdict("bd_iekfac_close", _bd(0.55))["s"]
    assert close.verdict == V.HOLDS and close.surprise is None
    far = verdict("bd_iekfac_close", _bd(1.0))["s"]  # x2 above iEF
    assert far.verdict == V.FAILS and far.failures[0] == "stage 0 %: ieKFAC more than ×1.26 above iEF"
    beats = verdict("bd_iekfac_close", _bd(0.41))["s"]  # 0.82x exact iEF: not "holds", a surprise named
    assert beats.verdict == V.FAILS and beats.surprise is not None and "0 %, 50 %, 100 %" in beats.surprise
    assert beats.failures == ("ieKFAC is below exact iEF at stage(s) 0 %, 50 %, 100 %",)
    rec = _bd(0.6)
    for r in rec:
        if r["method"] == "iekfac":
            r["ratio"] = r["gamma"] = 0.6 * {0: 0.5, 1: 1.0, 2: 2.0}[r["batch"]]
    assert verdict("bd_iekfac_close", rec)["s"].verdict == V.INCONCLUSIVE


# ------------------------------------------------------------------------------------------------ E2
OPTS = {"lora": ["adamw", "sgd", "ef", "sf", "ief"]}


def e2_table(losses: dict[str, list[float]], tests: dict[str, list[float]] | None = None, setup="lora"):
    rows = []
    for opt, values in losses.items():
        for seed, v in enumerate(values):
            rows.append({"setup": setup, "optimizer": opt, "seed": seed, "final_train_loss": v,
                         "test_score": (tests or {}).get(opt, [math.nan] * len(values))[seed]})
    return pd.DataFrame(rows)


def curves_of(shapes: dict[str, list[np.ndarray]], setup="lora") -> pd.DataFrame:
    rows = [(setup, o, seed, "train_loss", step + 1, float(v)) for o, runs in shapes.items()
            for seed, run in enumerate(runs) for step, v in enumerate(run)]
    return pd.DataFrame(rows, columns=["setup", "optimizer", "seed", "quantity", "step", "value"])


PAPER_LOSSES = {"ief": [0.1, 0.12, 0.11], "adamw": [0.2, 0.21, 0.2], "sgd": [0.3, 0.31, 0.29],
                "sf": [0.4, 0.42, 0.41], "ef": [0.5, 0.52, 0.5]}


def test_loss_ranking_over_seeds():
    table = e2_table(PAPER_LOSSES)
    got = verdict("e2_loss_ranking", table, None, OPTS)["lora"]
    assert got.verdict == V.HOLDS and len(got.pairs) == 10
    assert {p.pair for p in got.pairs} >= {"iEF < AdamW", "SF < EF", "AdamW < SGD"}
    swapped = e2_table({**PAPER_LOSSES, "sf": [0.6, 0.6, 0.6]})  # SF above EF on every seed
    got = verdict("e2_loss_ranking", swapped, None, OPTS)["lora"]
    assert got.verdict == V.FAILS and got.failures == ("SF < EF fails on every seed (differences +0.1, +0.08, +0.1)",)
    mixed = e2_table({**PAPER_LOSSES, "sf": [0.6, 0.3, 0.6]})  # SF < EF on one seed only: undecided
    got = verdict("e2_loss_ranking", mixed, None, OPTS)["lora"]
    assert got.verdict == V.INCONCLUSIVE and not got.failures
    pair = next(p for p in got.pairs if p.pair == "SF < EF")
    assert pair.diffs == pytest.approx({0: 0.1, 1: -0.22, 2: 0.1}) and pair.agreement == "1 of 3 seeds in favour, 2 against"
    two_seeds = e2_table({o: v[:2] for o, v in PAPER_LOSSES.items()})
    assert verdict("e2_loss_ranking", two_seeds, None, OPTS)["lora"].verdict == V.INCONCLUSIVE


def test_a_diverged_run_has_the_worst_loss():
    table = e2_table({**PAPER_LOSSES, "ef": [math.nan, 0.5, math.inf]})
    got = verdict("e2_loss_ranking", table, None, OPTS)["lora"]
    assert got.verdict == V.HOLDS


def test_ief_lowest_and_best_test():
    tests = {"ief": [0.9, 0.91, 0.9], "adamw": [0.8, 0.92, 0.8], "sgd": [0.7] * 3, "sf": [0.7] * 3, "ef": [0.6] * 3}
    table = e2_table(PAPER_LOSSES, tests)
    assert verdict("e2_ief_lowest", table, None, OPTS)["lora"].verdict == V.HOLDS
    best = verdict("e2_ief_best_test", table, None, OPTS)["lora"]
    assert best.verdict == V.INCONCLUSIVE and [p.pair for p in best.pairs if p.verdict != V.HOLDS] == ["iEF > AdamW"]
    worse = e2_table({**PAPER_LOSSES, "sgd": [0.05, 0.05, 0.05]}, tests)
    got = verdict("e2_ief_lowest", worse, None, OPTS)["lora"]
    assert got.verdict == V.FAILS and got.failures[0].startswith("iEF < SGD fails on every seed")


def _run(shape: str, steps=100, level=1.0):
    t = np.linspace(0, 1, steps)
    return level * (1.0 - 0.5 * t if shape == "down" else 1.0 - 0.5 * t + 0.8 * np.clip(t - 0.5, 0, None) ** 2 * 4)


def test_ef_unstable_is_the_largest_loss_rise():
    curves = curves_of({"ef": [_run("rise")] * 3, "sgd": [_run("down")] * 3, "ief": [_run("down")] * 3})
    opts = {"lora": ["sgd", "ef", "ief"]}
    assert verdict("e2_ef_unstable", None, curves, opts)["lora"].verdict == V.HOLDS
    calm = curves_of({"ef": [_run("down")] * 3, "sgd": [_run("rise")] * 3, "ief": [_run("down")] * 3})
    got = verdict("e2_ef_unstable", None, calm, opts)["lora"]
    assert got.verdict == V.FAILS
    assert got.failures == ("EF's loss rise 1× is not the largest: SGD 1.71×",)
    both = curves_of({"ef": [_run("down")] * 3, "sgd": [_run("rise")] * 3, "ief": [_run("rise", level=2.0)] * 3})
    got = verdict("e2_ef_unstable", None, both, opts)["lora"]
    assert got.failures == ("EF's loss rise 1× is not the largest: SGD 1.71×, iEF 1.71×",)
    mixed = curves_of({"ef": [_run("rise"), _run("down"), _run("rise")], "sgd": [_run("down"), _run("rise"),
                                                                                   _run("down")]})
    assert verdict("e2_ef_unstable", None, mixed, {"lora": ["sgd", "ef"]})["lora"].verdict == V.INCONCLUSIVE


def test_a_diverged_ef_run_is_the_largest_rise():
    run = _run("down")
    run[-5:] = np.nan
    curves = curves_of({"ef": [run] * 3, "sgd": [_run("rise")] * 3})
    assert V.loss_rises(curves)[("lora", "ef", 0)] == math.inf
    assert verdict("e2_ef_unstable", None, curves, {"lora": ["sgd", "ef"]})["lora"].verdict == V.HOLDS


@pytest.mark.parametrize("method, ief, base, expected", [
    ("pt", [0.9, 0.9, 0.9], [0.8, 0.85, 0.8], V.HOLDS), ("pt", [0.7, 0.7, 0.7], [0.8, 0.85, 0.8], V.FAILS),
    ("pt", [0.9, 0.7, 0.9], [0.8, 0.85, 0.8], V.INCONCLUSIVE),
    ("lora", [0.805, 0.85, 0.8], [0.8, 0.855, 0.808], V.HOLDS),  # every seed within 1 point: on par
    ("lora", [0.7, 0.75, 0.7], [0.8, 0.85, 0.8], V.FAILS),  # AdamW 10 points ahead on every seed
    ("lora", [0.805, 0.75, 0.8], [0.8, 0.85, 0.808], V.INCONCLUSIVE),
])
def test_ief_against_the_baseline_on_test(method, ief, base, expected):
    table = e2_table({"ief": [0.1] * 3, "base": [0.2] * 3}, {"ief": ief, "base": base})
    got = verdict("e2_ief_vs_baseline", table, None, {"lora": ["base", "ief"]}, {"lora": method})["lora"]
    assert got.verdict == expected
    if expected == V.FAILS:
        assert got.failures[0].endswith("differences -10, -10, -10 points") or "-15" in got.failures[0]


# ------------------------------------------------------------------------------------------------ training chapter
def _results(loss: dict[str, float], test: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame([{"setup": "lora", "optimizer": o, "final train loss": loss[o], "test (%)": test[o]}
                         for o in loss]).set_index(["setup", "optimizer"])


def test_seed0_rules_and_their_disagreement_with_e2():
    results = _results({"iEF": 0.1, "SGD": 0.3, "EF": 0.5}, {"iEF": 80.0, "SGD": 85.0, "EF": 70.0})
    low = verdict("seed0_lowest_loss", results)["lora"]
    test = verdict("seed0_best_test", results)["lora"]
    assert low.verdict == V.HOLDS and test.verdict == V.FAILS and test.failures == ("SGD 85 ≥ iEF 80",)
    nan = verdict("seed0_best_test", _results({"iEF": 0.1, "SGD": 0.3}, {"iEF": math.nan, "SGD": 1.0}))["lora"]
    assert nan.verdict == V.INCONCLUSIVE
    e2 = [V.Verdict("lora", V.INCONCLUSIVE, "")]
    assert V.disagreements([low], e2) == ["lora: seed 0 holds, over seeds inconclusive"]
    assert V.disagreements([low], [V.Verdict("lora", V.HOLDS, "")]) == []


def test_summary_names_what_fails():
    vs = [V.Verdict("a", V.HOLDS, ""), V.Verdict("b", V.FAILS, "", ("SF < EF",)), V.Verdict("c", V.INCONCLUSIVE, "")]
    assert V.summary(vs) == "holds for a; does not hold for b (SF < EF); inconclusive for c"
    assert V.summary([]) == "not measured at this scale"


def test_every_rule_states_its_claim_label_and_thresholds():
    from companion.paper import cite

    for rule in V.RULES.values():
        assert rule.statement and rule.why and rule.claim
        assert cite(rule.label).startswith(("Fig.", "Sec", "Table", "Appendix")), rule.label  # a label of the paper


def test_a_constant_curve_has_no_correlation_and_decides_nothing():
    stages = {0: {"ef": 1.0, "sf": 0.8}, 50: {"ef": 1.0, "sf": 1.0}, 100: {"ef": 1.0, "sf": 1.5}}
    got = verdict("e1_imbalance", e1(stages, imbalance={0: 2.0, 50: 4.0, 100: 8.0}))["s"]
    assert got.verdict == V.INCONCLUSIVE and "log EF/SGD undefined" in got.detail
