"""companion.experiments.verdicts, deciding over seeds (core.pair_over_seeds) and the E2 and training chapters' rules
(verdicts.training): synthetic runs built to make each rule hold, fail and stay undecided, the records of the cold cpu
build where the old rules misfired, and the properties a decision that more evidence sharpens must have."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from companion.experiments import verdicts as V


def verdict(rule: str, *data) -> dict[str, V.Verdict]:
    return {v.subject: v for v in V.RULES[rule].evaluate(*data)}


# ------------------------------------------------------------------------------------------------ deciding
finite = st.floats(-10, 10, allow_nan=False).filter(lambda d: abs(d) > 1e-6)


@settings(deadline=None)  # the first example imports scipy
@given(st.lists(finite, min_size=1, max_size=8))
def test_negating_every_difference_swaps_holds_and_does_not_hold(diffs):
    d = dict(enumerate(diffs))
    a = V.pair_over_seeds("s", "a < b", "loss", d)
    b = V.pair_over_seeds("s", "b < a", "loss", {k: -x for k, x in d.items()})
    swap = {V.HOLDS: V.FAILS, V.FAILS: V.HOLDS, V.INCONCLUSIVE: V.INCONCLUSIVE}
    assert b.verdict == swap[a.verdict]
    if len(diffs) < V.MIN_SEEDS:
        assert a.verdict == V.INCONCLUSIVE and a.needs


@settings(deadline=None)
@given(st.lists(finite, min_size=2, max_size=6), st.integers(2, 5))
def test_more_seeds_like_these_never_undecide_a_pair(diffs, copies):
    """The same differences seen ``copies`` times (the same mean, a smaller standard error): a decided pair stays
    decided the same way, and an undecided one can become decided (more evidence sharpens; unanimity did not)."""
    few = V.pair_over_seeds("s", "p", "m", dict(enumerate(diffs)))
    many = V.pair_over_seeds("s", "p", "m", dict(enumerate(diffs * copies)))
    if few.verdict != V.INCONCLUSIVE:
        assert many.verdict == few.verdict
    assert many.high - many.low <= few.high - few.low + 1e-12


def test_a_pair_that_disagrees_on_one_seed_can_still_be_decided():
    """Nine of ten seeds in favour, one slightly against: unanimity called that inconclusive; the interval decides."""
    diffs = dict(enumerate([-1.0, -1.2, -0.8, -1.1, -0.9, -1.0, -1.3, -0.7, -1.0, 0.1]))
    got = V.pair_over_seeds("s", "a < b", "loss", diffs)
    assert got.verdict == V.HOLDS and got.high < 0 and got.agreement.startswith("9 of 10 seeds in favour, 1 against")


def test_an_undecided_pair_says_how_many_seeds_would_decide_it_with_80_percent_power():
    """The count is the noncentral t's, not the count at which the interval would just exclude 0 at the observed
    mean (about 50 % power): simulated pairs with that true mean and sd are decided at least 80 % of the time with
    it and less often with one seed fewer."""
    diffs = {0: -1.0, 1: 0.2, 2: -0.9}
    got = V.pair_over_seeds("s", "a < b", "loss", diffs)
    assert got.verdict == V.INCONCLUSIVE and "80 % power" in got.needs and "at the sd's 95 % limits" in got.needs
    k = int(got.needs.split()[1])
    mean, sd = np.mean(list(diffs.values())), np.std(list(diffs.values()), ddof=1)
    assert k == V.seeds_needed(mean, sd)
    assert k == pytest.approx(7.85 * (sd / mean) ** 2 + 1.92, abs=2)  # the normal approximation
    rng = np.random.default_rng(0)
    scipy_stats = pytest.importorskip("scipy.stats")
    for seeds, at_least in ((k, True), (k - 1, False)):
        z = rng.normal(mean, sd, (4000, seeds))
        half = scipy_stats.t.ppf(0.975, seeds - 1) * z.std(axis=1, ddof=1) / np.sqrt(seeds)
        rate = float(np.mean(np.abs(z.mean(axis=1)) > half))
        assert (rate >= 0.8 - 0.02) if at_least else (rate < 0.8 + 0.02), (seeds, rate)


def test_the_seeds_range_comes_from_the_sds_confidence_limits():
    """At 2 degrees of freedom the sd is known to within x0.52 to x6.3: the seeds needed span that squared."""
    low, high = V.stats.sd_limits(1.0, 2)
    assert (low, high) == pytest.approx((0.5207, 6.2847), abs=1e-3)
    got = V.pair_over_seeds("s", "a < b", "loss", {0: -1.0, 1: 0.2, 2: -0.9})
    a, b = got.needs.split("; ")[1].split(" at ")[0].split("–")
    assert int(a) < int(got.needs.split()[1]) and (b == ">1000" or int(b) > int(got.needs.split()[1]))


def test_a_tie_on_every_seed_decides_nothing_and_needs_no_number_of_seeds():
    got = V.pair_over_seeds("s", "p", "m", {0: 0.0, 1: 0.0, 2: 0.0})
    assert got.verdict == V.INCONCLUSIVE and got.needs.startswith("no number of seeds")
    # a missing seed is left out: three usable seeds decide, two this far apart do not (t with 1 dof is 12.7)
    assert V.pair_over_seeds("s", "p", "m", {0: -1.0, 1: -1.1, 2: -0.9, 3: math.nan}).verdict == V.HOLDS
    assert V.pair_over_seeds("s", "p", "m", {0: -1.0, 1: -2.0, 2: math.nan}).verdict == V.INCONCLUSIVE


def test_the_sign_test_decides_a_pair_with_a_diverged_run():
    assert V.sign_test(3, 0) == pytest.approx(0.25) and V.sign_test(6, 0) == pytest.approx(1 / 32)
    three = V.pair_over_seeds("s", "iEF < EF", "loss", {0: -math.inf, 1: -1.0, 2: -2.0})
    assert three.verdict == V.INCONCLUSIVE and three.needs == "needs 6 seeds"
    assert "sign test p = 0.25" in three.agreement
    six = V.pair_over_seeds("s", "iEF < EF", "loss", {k: -math.inf if k % 2 else -1.0 for k in range(6)})
    assert six.verdict == V.HOLDS and math.isnan(six.mean)


def test_the_test_sets_resolution_widens_the_interval_and_does_not_shrink_with_seeds():
    """Two accuracies near 0.75 on 512 examples: the difference's standard error is about 2.7 points, so a 2-point
    lead on every one of many seeds is not decided; on 100,000 examples it is."""
    r512 = V.binomial_resolution(0.76, 0.74, 512)
    assert r512 == pytest.approx(math.sqrt((0.76 * 0.24 + 0.74 * 0.26) / 512))
    diffs = {k: -0.02 + 0.001 * (k % 3 - 1) for k in range(30)}
    assert V.pair_over_seeds("s", "p", "t", diffs).verdict == V.HOLDS
    small = V.pair_over_seeds("s", "p", "t", diffs, resolution=r512, examples=512, unit=100)
    assert small.verdict == V.INCONCLUSIVE and small.needs.startswith("no number of seeds: the test set's error")
    big = V.pair_over_seeds("s", "p", "t", diffs, resolution=V.binomial_resolution(0.76, 0.74, 100_000))
    assert big.verdict == V.HOLDS
    assert V.binomial_resolution(0.7, 0.8, None) == 0.0 and V.binomial_resolution(1.5, 0.8, 100) == 0.0


@pytest.mark.parametrize("diffs, expected", [
    ([0.002, -0.001, 0.001, 0.0, 0.002, -0.002], V.HOLDS),  # within ±1 point, decided
    ([0.10, 0.11, 0.09, 0.10], V.FAILS),  # 10 points apart, decided beyond the band
    ([0.005, -0.015, 0.02], V.INCONCLUSIVE),  # an interval wider than the band
])
def test_on_par_is_an_equivalence_band_the_interval_must_lie_inside(diffs, expected):
    got = V.pair_over_seeds("s", "on par", "t", dict(enumerate(diffs)), band=0.01)
    assert got.verdict == expected
    flipped = V.pair_over_seeds("s", "on par", "t", {k: -d for k, d in enumerate(diffs)}, band=0.01)
    assert flipped.verdict == expected  # two-sided: either optimiser ahead is the same question


# ------------------------------------------------------------------------------------------------ E2 tables
OPTS = {"lora": ["adamw", "sgd", "ef", "sf", "ief"]}


def e2_table(losses: dict[str, list[float]], tests: dict[str, list[float]] | None = None, setup="lora",
             scale: str | None = None):
    rows = []
    for opt, values in losses.items():
        for seed, v in enumerate(values):
            row = {"setup": setup, "optimizer": opt, "seed": seed, "final_train_loss": v,
                   "test_score": (tests or {}).get(opt, [math.nan] * len(values))[seed]}
            rows.append(row if scale is None else dict(row, scale=scale))
    return pd.DataFrame(rows)


def curves_of(shapes: dict[str, list[np.ndarray]], setup="lora") -> pd.DataFrame:
    rows = [(setup, o, seed, "train_loss", step + 1, float(v)) for o, runs in shapes.items()
            for seed, run in enumerate(runs) for step, v in enumerate(run)]
    return pd.DataFrame(rows, columns=["setup", "optimizer", "seed", "quantity", "step", "value"])


PAPER_LOSSES = {"ief": [0.1, 0.12, 0.11], "adamw": [0.2, 0.21, 0.2], "sgd": [0.3, 0.31, 0.29],
                "sf": [0.4, 0.42, 0.41], "ef": [0.5, 0.52, 0.5]}


def test_the_loss_ranking_holds_fails_and_stays_undecided():
    got = verdict("e2_loss_ranking", e2_table(PAPER_LOSSES), None, OPTS)["lora"]
    assert got.verdict == V.HOLDS and len(got.pairs) == 10
    assert {p.pair for p in got.pairs} >= {"iEF < AdamW", "SF < EF", "AdamW < SGD"}
    swapped = verdict("e2_loss_ranking", e2_table({**PAPER_LOSSES, "sf": [0.6, 0.62, 0.6]}), None, OPTS)["lora"]
    assert swapped.verdict == V.FAILS and len(swapped.failures) == 1
    assert swapped.failures[0].startswith("SF < EF fails: mean log ratio +0.")
    assert "95 % interval" in swapped.failures[0]
    mixed = verdict("e2_loss_ranking", e2_table({**PAPER_LOSSES, "sf": [0.6, 0.3, 0.6]}), None, OPTS)["lora"]
    assert mixed.verdict == V.INCONCLUSIVE and not mixed.failures and mixed.needs.startswith("needs ")
    pair = next(p for p in mixed.pairs if p.pair == "SF < EF")
    assert pair.diffs == pytest.approx({0: math.log(0.6 / 0.5), 1: math.log(0.3 / 0.52), 2: math.log(0.6 / 0.5)})
    assert "undecidable at cpu for lora (needs " in V.summary([mixed], scale="cpu")


def test_a_diverged_run_has_the_worst_loss():
    """Three seeds, one of EF's diverged: the pairs with EF are decided by signs, which three seeds cannot do."""
    got = verdict("e2_loss_ranking", e2_table({**PAPER_LOSSES, "ef": [math.nan, 0.5, math.inf]}), None, OPTS)["lora"]
    ef_pairs = [p for p in got.pairs if "EF" in p.pair.split(" < ")[1] and p.pair.split(" < ")[1] == "EF"]
    assert ef_pairs and all(p.verdict == V.INCONCLUSIVE and p.needs == "needs 6 seeds" for p in ef_pairs)
    six = {o: v * 2 for o, v in PAPER_LOSSES.items()}
    six["ef"] = [math.inf, 0.5, 0.51, math.inf, 0.5, 0.52]
    assert verdict("e2_loss_ranking", e2_table(six), None, OPTS)["lora"].verdict == V.HOLDS


def test_ief_lowest_and_best_test():
    tests = {"ief": [0.9, 0.91, 0.9], "adamw": [0.8, 0.92, 0.8], "sgd": [0.7] * 3, "sf": [0.7] * 3, "ef": [0.6] * 3}
    table = e2_table(PAPER_LOSSES, tests)
    assert verdict("e2_ief_lowest", table, None, OPTS)["lora"].verdict == V.HOLDS
    best = verdict("e2_ief_best_test", table, None, OPTS)["lora"]
    assert best.verdict == V.INCONCLUSIVE and [p.pair for p in best.pairs if p.verdict != V.HOLDS] == ["iEF > AdamW"]
    worse = verdict("e2_ief_lowest", e2_table({**PAPER_LOSSES, "sgd": [0.05, 0.06, 0.05]}, tests), None, OPTS)
    assert worse["lora"].verdict == V.FAILS and worse["lora"].failures[0].startswith("iEF < SGD fails")


def test_a_test_score_comparison_carries_the_test_sets_resolution():
    """The same per-seed test differences: decided without a known test set, undecided on the 2,048 tweets of the cpu
    siblings (the table's scale names the setup, whose test size the rule reads)."""
    tests = {"ief": [0.77, 0.775, 0.77], "adafactor": [0.75, 0.755, 0.752]}
    opts = {"tweets-minilm-pt": ["adafactor", "ief"]}
    bare = e2_table({"ief": [0.1] * 3, "adafactor": [0.2] * 3}, tests, setup="tweets-minilm-pt")
    assert verdict("e2_ief_vs_baseline", bare, None, opts, {"tweets-minilm-pt": "pt"})["tweets-minilm-pt"].verdict \
        == V.HOLDS
    at_cpu = e2_table({"ief": [0.1] * 3, "adafactor": [0.2] * 3}, tests, setup="tweets-minilm-pt", scale="cpu")
    assert V.n_test_examples("tweets-minilm-pt", "cpu") == 2048
    got = verdict("e2_ief_vs_baseline", at_cpu, None, opts, {"tweets-minilm-pt": "pt"})["tweets-minilm-pt"]
    assert got.verdict == V.INCONCLUSIVE and "2048 examples" in got.pairs[0].needs


@pytest.mark.parametrize("method, ief, base, expected", [
    ("pt", [0.9, 0.9, 0.9], [0.8, 0.85, 0.8], V.HOLDS), ("pt", [0.7, 0.7, 0.7], [0.8, 0.85, 0.8], V.FAILS),
    ("pt", [0.9, 0.7, 0.9], [0.8, 0.85, 0.8], V.INCONCLUSIVE),
    ("lora", [0.805, 0.85, 0.8, 0.9, 0.81], [0.8, 0.852, 0.803, 0.9, 0.808], V.HOLDS),  # decided within 1 point
    ("lora", [0.7, 0.75, 0.7], [0.8, 0.85, 0.8], V.FAILS),  # AdamW 10 points ahead, decided beyond the band
    ("lora", [0.805, 0.75, 0.8], [0.8, 0.85, 0.808], V.INCONCLUSIVE),
])
def test_ief_against_the_baseline_on_test(method, ief, base, expected):
    n = len(ief)
    table = e2_table({"ief": [0.1] * n, "base": [0.2] * n}, {"ief": ief, "base": base})
    got = verdict("e2_ief_vs_baseline", table, None, {"lora": ["base", "ief"]}, {"lora": method})["lora"]
    assert got.verdict == expected
    if expected == V.FAILS:
        assert "points" in got.failures[0] and "95 % interval" in got.failures[0]


# ------------------------------------------------------------------------------------------------ EF's instability
def _run(shape: str, steps=100, level=1.0, seed=0):
    t = np.linspace(0, 1, steps)
    noise = 1 + 0.01 * np.random.default_rng(seed).standard_normal(steps)
    base = 1.0 - 0.5 * t
    return level * noise * (base if shape == "down" else base + 0.8 * np.clip(t - 0.5, 0, None) ** 2 * 4)


def test_ef_unstable_is_the_largest_loss_climb():
    opts = {"lora": ["sgd", "ef", "ief"]}
    curves = curves_of({"ef": [_run("rise", seed=k) for k in range(3)],
                        "sgd": [_run("down", seed=k + 3) for k in range(3)],
                        "ief": [_run("down", seed=k + 6) for k in range(3)]})
    assert verdict("e2_ef_unstable", None, curves, opts)["lora"].verdict == V.HOLDS
    calm = curves_of({"ef": [_run("down", seed=k) for k in range(3)],
                      "sgd": [_run("rise", seed=k + 3) for k in range(3)],
                      "ief": [_run("down", seed=k + 6) for k in range(3)]})
    got = verdict("e2_ef_unstable", None, calm, opts)["lora"]
    assert got.verdict == V.FAILS and got.failures[0].startswith("EF's loss climb 1") and "SGD 1.6" in got.failures[0]
    mixed = curves_of({"ef": [_run("rise"), _run("down", seed=1), _run("rise", seed=2)],
                       "sgd": [_run("down", seed=3), _run("rise", seed=4), _run("down", seed=5)]})
    assert verdict("e2_ef_unstable", None, mixed, {"lora": ["sgd", "ef"]})["lora"].verdict == V.INCONCLUSIVE


def test_a_loss_that_leaves_its_start_upwards_at_once_is_a_climb():
    """EF on digits in the cold cpu build: from ln 10 = 2.3 its seed-mean loss jumps above 10 within the first
    window and stays there (per-seed peaks of 500-2,050), ending at 12.8 ± 11.8. The old statistic (the last of 20
    windows over their lowest) was about 1 for it, as for every optimiser, so the verdict was "inconclusive"; the
    climb counts from the first update's loss."""
    rng = np.random.default_rng(0)
    steps = 400

    def ef(seed):
        run = np.exp(rng.normal(np.log(15), 0.8, steps))  # above 10 almost throughout, noisy
        run[0] = 2.3
        run[100 + 20 * seed] = 500 + 700 * seed  # a peak per seed
        return run

    def adam(seed):
        return 2.3 * np.exp(-np.linspace(0, 6, steps)) * np.exp(rng.normal(0, 0.05, steps))

    curves = curves_of({"ef": [ef(k) for k in range(3)], "adam": [adam(k) for k in range(3)],
                        "ief": [adam(k) for k in range(3)]}, setup="digits-mlp")
    climbs = V.loss_rises(curves)
    assert all(climbs[("digits-mlp", "ef", k)] > 5 for k in range(3))
    assert all(climbs[("digits-mlp", "adam", k)] < 1.5 for k in range(3))
    got = verdict("e2_ef_unstable", None, curves, {"digits-mlp": ["adam", "ef", "ief"]})["digits-mlp"]
    assert got.verdict == V.HOLDS


def test_a_short_runs_batch_noise_is_not_a_climb():
    """64 updates whose losses only wobble around a slow descent (the tweet runs): 8 windows of 8 updates, so
    3-update windows of batch noise no longer pose as a climb of EF's."""
    rng = np.random.default_rng(1)
    first = {k: 0.7 * np.exp(rng.normal(0, 0.15)) for k in range(3)}  # a seed's first batch: the same for all

    def noisy(seed):
        run = (0.7 - 0.001 * np.arange(64)) * np.exp(rng.normal(0, 0.15, 64))
        run[0] = first[seed]
        return run

    curves = curves_of({o: [noisy(k) for k in range(3)] for o in ("ef", "sgd", "ief")})
    assert all(c < 1.5 for c in V.loss_rises(curves).values())
    assert verdict("e2_ef_unstable", None, curves, {"lora": ["sgd", "ef", "ief"]})["lora"].verdict != V.HOLDS


def test_a_diverged_ef_run_is_the_largest_climb():
    run = _run("down")
    run[-5:] = np.nan
    curves = curves_of({"ef": [run] * 6, "sgd": [_run("rise", seed=k) for k in range(6)]})
    assert V.loss_rises(curves)[("lora", "ef", 0)] == math.inf
    assert verdict("e2_ef_unstable", None, curves, {"lora": ["sgd", "ef"]})["lora"].verdict == V.HOLDS


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


def test_summary_names_what_fails_and_what_would_decide():
    vs = [V.Verdict("a", V.HOLDS, ""), V.Verdict("b", V.FAILS, "", ("SF < EF",)), V.Verdict("c", V.INCONCLUSIVE, ""),
          V.Verdict("d", V.INCONCLUSIVE, "", needs="needs 12 seeds (iEF < SGD)")]
    assert V.summary(vs) == ("holds for a; does not hold for b (SF < EF); inconclusive for c, d (needs 12 seeds "
                             "(iEF < SGD))")
    assert V.summary(vs, scale="cpu") == ("holds for a; does not hold for b (SF < EF); inconclusive for c; "
                                          "undecidable at cpu for d (needs 12 seeds (iEF < SGD))")
    assert V.summary([]) == "not measured at this scale"
