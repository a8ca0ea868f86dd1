"""companion.experiments.verdicts.stats and what the rules over seeds build on it: the crossed seeds x examples
analysis of a test comparison, Holm's procedure on the failing side, the pooled variance with seeds as blocks and the
margin of a claim of a material difference, each on synthetic records with a known answer; simulated null records
for the false "does not hold" rate; more evidence never undecides."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from companion.experiments import verdicts as V
from companion.experiments.verdicts import stats as S

scipy_stats = pytest.importorskip("scipy.stats")


def verdict(rule: str, *data, **extra) -> dict[str, V.Verdict]:
    return {v.subject: v for v in V.RULES[rule].evaluate(*data, **extra)}


# ------------------------------------------------------------------------------------------------ the pieces
def test_sides_match_the_95_percent_interval():
    for mean, se, dof in ((0.5, 0.2, 2), (-0.5, 0.2, 8), (0.1, 0.2, 30)):
        below, above = S.sides(mean, se, dof)
        half = scipy_stats.t.ppf(0.975, dof) * se
        assert (above < 0.05) == (mean - half > 0) and (below < 0.05) == (mean + half < 0)
    assert S.sides(1.0, 0.0, math.inf) == (1.0, 0.0)


def test_holm_steps_down_and_stops_at_the_first_it_cannot_reject():
    assert S.holm({"a": 0.01, "b": 0.02, "c": 0.5}) == ["a", "b"]  # 0.01 < 0.05/3, 0.02 < 0.05/2
    assert S.holm({"a": 0.02, "b": 0.02, "c": 0.02}) == []  # 0.02 > 0.05/3: none
    assert S.holm({"a": 0.04}) == ["a"] and S.holm({"a": math.nan, "b": 0.001}) == ["b"]


def test_power_is_the_noncentral_ts():
    assert S.power(0.5, 1.0, 20) == pytest.approx(
        scipy_stats.nct.sf(scipy_stats.t.ppf(0.975, 19), 19, 0.5 * math.sqrt(20))
        + scipy_stats.nct.cdf(-scipy_stats.t.ppf(0.975, 19), 19, 0.5 * math.sqrt(20)))
    k = S.seeds_for_power(0.5, 1.0)
    assert S.power(0.5, 1.0, k) >= 0.8 > S.power(0.5, 1.0, k - 1)
    assert S.seeds_for_power(0.0, 1.0) is None and S.seeds_for_power(1e-3, 1.0) is None  # beyond 1000 seeds


def _crossed_draw(rng, seeds, examples, s_seed, s_example, s_resid, mean=0.0):
    return (mean + rng.normal(0, s_seed, (seeds, 1)) + rng.normal(0, s_example, (1, examples))
            + rng.normal(0, s_resid, (seeds, examples)))


@pytest.mark.parametrize("components", [(0.05, 0.3, 0.5), (0.3, 0.05, 0.5), (0.1, 0.1, 1.0)])
def test_the_crossed_interval_covers_at_95_percent(components):
    """Seeds and examples both random: the interval covers the true mean about 95 % of the time whichever term
    dominates (the independent-binomials interval is wider; fixing the seeds, as McNemar does, narrower)."""
    rng = np.random.default_rng(1)
    hits = []
    for _ in range(1500):
        c = S.crossed(_crossed_draw(rng, 4, 200, *components))
        half = S.t_ppf(0.975, c.dof) * c.se
        hits.append(abs(c.mean) < half)
    assert 0.93 <= np.mean(hits) <= 0.975


def test_crossed_estimates_the_variance_of_the_grand_mean():
    rng = np.random.default_rng(2)
    s_seed, s_ex, s_res, seeds, n = 0.2, 0.4, 0.6, 5, 100
    draws = [S.crossed(_crossed_draw(rng, seeds, n, s_seed, s_ex, s_res)) for _ in range(600)]
    true = s_seed ** 2 / seeds + s_ex ** 2 / n + s_res ** 2 / (seeds * n)
    assert np.mean([c.var for c in draws]) == pytest.approx(true, rel=0.15)
    assert np.var([c.mean for c in draws]) == pytest.approx(true, rel=0.2)
    with pytest.raises(ValueError, match="at least 2 seeds and 2 examples"):
        S.crossed(np.zeros((1, 5)))


# ------------------------------------------------------------------------------------------------ test pairs
def _predictions(setup: str, correct: dict[str, np.ndarray]) -> pd.DataFrame:
    rows = [{"setup": setup, "optimizer": o, "seed": s, "example": i, "correct": float(v)}
            for o, m in correct.items() for s, row in enumerate(m) for i, v in enumerate(row)]
    return pd.DataFrame(rows)


def _systematic(rng, seeds=3, n=512, base=0.66, better=0.07, worse=0.03, noise=0.01):
    """iEF and Adafactor on the same 512 examples: iEF right and Adafactor wrong on 7 % of them, the reverse on
    3 %, the same examples at every seed (a systematic 4-point lead) but for ``noise`` of flips per seed."""
    a = (rng.random(n) < base).astype(float)
    b = a.copy()
    idx = rng.permutation(n)
    k1, k2 = int(better * n), int(worse * n)
    right = idx[:k1]
    b[right], a[right] = 0.0, 1.0
    wrong = idx[k1:k1 + k2]
    b[wrong], a[wrong] = 1.0, 0.0
    ief, other = [], []
    for _ in range(seeds):
        flip = rng.random(n) < noise
        ief.append(np.where(flip, 1 - a, a))
        other.append(b.copy())
    return np.array(ief), np.array(other)


def test_a_test_pair_the_old_rule_leaves_undecided_is_decided_on_its_per_example_predictions():
    """The cpu setup's 2,048 tweets, three seeds, a systematic 2-point lead: the independent-binomials term (±2.9
    points) leaves it "no number of seeds decides"; the crossed analysis sees that the two optimisers disagree on
    only a twentieth of the examples, and decides it."""
    setup = "tweets-minilm-pt"
    n = V.n_test_examples(setup, "cpu")
    ief, ada = _systematic(np.random.default_rng(3), n=n, better=0.035, worse=0.015)
    table = pd.DataFrame([{"scale": "cpu", "setup": setup, "optimizer": o, "seed": s, "final_train_loss": 0.5,
                           "test_score": float(m[s].mean())} for o, m in (("ief", ief), ("adafactor", ada))
                          for s in range(3)])
    opts, methods = {setup: ["adafactor", "ief"]}, {setup: "pt"}
    old = verdict("e2_ief_vs_baseline", table, None, opts, methods)[setup]
    assert old.verdict == V.INCONCLUSIVE and f"{n} examples" in old.pairs[0].needs
    preds = _predictions(setup, {"ief": ief, "adafactor": ada})
    new = verdict("e2_ief_vs_baseline", table, None, opts, methods, predictions=preds)[setup]
    assert new.verdict == V.HOLDS and f"seeds x {n} examples" in new.pairs[0].agreement
    assert new.pairs[0].high - new.pairs[0].low < old.pairs[0].high - old.pairs[0].low


def test_per_example_predictions_that_do_not_give_the_score_are_not_used():
    """A metric other than accuracy (the table's score is not the mean of the per-example correctness): the
    crossed analysis does not apply and the pair falls back to the per-seed interval."""
    setup = "tweets-minilm-pt"
    ief, ada = _systematic(np.random.default_rng(3))
    table = pd.DataFrame([{"scale": "cpu", "setup": setup, "optimizer": o, "seed": s, "final_train_loss": 0.5,
                           "test_score": float(m[s].mean()) - 0.1} for o, m in (("ief", ief), ("adafactor", ada))
                          for s in range(3)])
    table.loc[table.optimizer == "ief", "test_score"] += 0.01
    preds = _predictions(setup, {"ief": ief, "adafactor": ada})
    got = verdict("e2_ief_vs_baseline", table, None, {setup: ["adafactor", "ief"]}, {setup: "pt"},
                  predictions=preds)[setup]
    assert "examples, " not in got.pairs[0].agreement


@pytest.mark.parametrize("lead, expected", [(0.04, V.HOLDS), (-0.04, V.FAILS), (0.0, V.INCONCLUSIVE)])
def test_the_crossed_rule_holds_fails_and_stays_undecided(lead, expected):
    rng = np.random.default_rng(4)
    x = _crossed_draw(rng, 3, 512, 0.005, 0.3, 0.1, mean=-lead)  # negative: in favour of the claim
    diffs = dict(enumerate(x.mean(axis=1)))
    got = V.pair_over_seeds("s", "a > b", "test_score", diffs, per_example=x, unit=100)
    assert got.verdict == expected
    if expected == V.INCONCLUSIVE:
        assert got.needs and ("seeds" in got.needs or "examples" in got.needs)


@settings(deadline=None, max_examples=30)
@given(st.integers(0, 2 ** 16), st.integers(2, 4))
def test_more_seeds_never_undecide_a_crossed_pair(seed, copies):
    rng = np.random.default_rng(seed)
    x = _crossed_draw(rng, 3, 60, 0.05, 0.3, 0.3, mean=rng.normal(0, 0.1))
    few = V.pair_over_seeds("s", "p", "t", dict(enumerate(x.mean(axis=1))), per_example=x)
    xx = np.concatenate([x] * copies)
    many = V.pair_over_seeds("s", "p", "t", dict(enumerate(xx.mean(axis=1))), per_example=xx)
    if few.verdict != V.INCONCLUSIVE:
        assert many.verdict == few.verdict
    assert many.high - many.low <= few.high - few.low + 1e-12


# ------------------------------------------------------------------------------------------------ Holm
def _null_pairs(rng, k, seeds):
    return [V.pair_over_seeds("s", f"p{j}", "m", dict(enumerate(rng.normal(0, 1, seeds)))) for j in range(k)]


def test_holm_keeps_the_false_does_not_hold_rate_at_5_percent_on_null_records():
    """Five pairs with no true difference (the boundary of the claim), three seeds each: any pair decided against
    at its own 95 % fails the claim 1 - 0.975^5 = 12 % of the time; Holm over the pairs keeps it at 5 %."""
    rng = np.random.default_rng(5)
    old, new = [], []
    for _ in range(1500):
        pairs = _null_pairs(rng, 5, 3)
        old.append(any(p.verdict == V.FAILS for p in pairs))
        new.append(V.training._pairs_verdict("s", pairs, lambda p: p.pair).verdict == V.FAILS)
    assert np.mean(old) > 0.08
    assert np.mean(new) <= 0.05


def test_a_pair_against_at_its_own_level_but_not_after_holm_leaves_the_claim_open():
    pairs = [V.pair_over_seeds("s", "a < b", "m", {0: 0.3, 1: 0.31, 2: 0.29, 3: 0.3}),  # p ~ 1e-5: rejected
             V.pair_over_seeds("s", "a < c", "m", {0: 0.1, 1: 0.3, 2: 0.2})]
    v = V.training._pairs_verdict("s", pairs, lambda p: p.pair)
    assert v.verdict == V.FAILS and v.failures == ("a < b",)
    weak = [V.pair_over_seeds("s", f"a < {c}", "m", {0: 0.1, 1: 0.25, 2: 0.2, 3: 0.12}) for c in "bcd"]
    assert all(p.verdict == V.FAILS for p in weak) and all(0.0125 < p.p_against < 0.05 / 3 or p.p_against > 0.0167
                                                          for p in weak)
    got = V.training._pairs_verdict("s", weak, lambda p: p.pair)
    assert got.verdict == V.INCONCLUSIVE and "not after Holm's correction over 3 pairs" in got.needs


@settings(deadline=None, max_examples=40)
@given(st.lists(st.floats(-1, 1), min_size=3, max_size=3), st.integers(2, 4))
def test_more_evidence_never_undecides_a_conjunction(means, copies):
    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.3, (3, 3))
    few = [dict(enumerate(m + noise[j])) for j, m in enumerate(means)]
    many = [dict(enumerate(list(d.values()) * copies)) for d in few]
    a = V.training._pairs_verdict("s", [V.pair_over_seeds("s", f"p{j}", "m", d) for j, d in enumerate(few)],
                                  lambda p: p.pair)
    b = V.training._pairs_verdict("s", [V.pair_over_seeds("s", f"p{j}", "m", d) for j, d in enumerate(many)],
                                  lambda p: p.pair)
    if a.verdict != V.INCONCLUSIVE:
        assert b.verdict == a.verdict


def test_over_stages_with_holm():
    # every stage: holds when all are decided for; does not hold only when Holm rejects one against
    assert V.over_stages_holm({0: 0.01, 50: 0.02}, {0: 1.0, 50: 1.0}, every=True)[0] == V.HOLDS
    assert V.over_stages_holm({0: 0.01, 50: 1.0}, {0: 1.0, 50: 0.04}, every=True)[0] == V.INCONCLUSIVE  # 0.04 > .025
    assert V.over_stages_holm({0: 0.01, 50: 1.0}, {0: 1.0, 50: 0.001}, every=True)[0] == V.FAILS
    # most stages: Holm's count for the claim must be a strict majority
    assert V.over_stages_holm({0: 0.001, 50: 0.01, 100: 0.9}, {0: 1, 50: 1, 100: 1}, every=False)[0] == V.HOLDS
    assert V.over_stages_holm({0: 0.02, 50: 0.02, 100: 0.9}, {0: 1, 50: 1, 100: 1}, every=False)[0] == \
        V.INCONCLUSIVE  # each decided at its own 95 %, but 0.02 > 0.05/3: Holm counts none
    assert V.over_stages_holm({0: 1, 50: 1, 100: 1}, {0: 0.001, 50: 0.01, 100: 1}, every=False)[0] == V.FAILS


# ------------------------------------------------------------------------------------------------ pooled, margin
def _table(values: dict[str, list[float]], setup="tweets") -> pd.DataFrame:
    return pd.DataFrame([{"setup": setup, "optimizer": o, "seed": s, "final_train_loss": v, "test_score": math.nan}
                         for o, vs in values.items() for s, v in enumerate(vs)])


def test_the_pooled_variance_decides_a_three_seed_pair_its_own_two_dof_cannot():
    """Five optimisers, three seeds that shift every optimiser alike (the blocks): iEF's 12 % lead over SF has a
    per-pair t on 2 dof (4.30) that leaves it open; pooled over the five optimisers it has 8 dof (2.31)."""
    rng = np.random.default_rng(6)
    block = np.log([1.0, 1.3, 0.8])
    level = {"ief": 0.0, "adafactor": 0.5, "sgd": 0.8, "sf": 0.12, "ef": 1.2}
    noise = {o: rng.normal(0, 0.04, 3) for o in level}
    losses = {o: list(np.exp(level[o] + block + noise[o])) for o in level}
    pooled = S.pooled_blocks({o: dict(enumerate(np.log(v))) for o, v in losses.items()})
    assert pooled.used and pooled.dof == 8
    per_pair = V.pair_over_seeds("s", "iEF < SF", "loss",
                                 dict(enumerate(np.log(losses["ief"]) - np.log(losses["sf"]))))
    got = verdict("e2_ief_lowest", _table(losses), None, {"tweets": list(level)})["tweets"]
    pair = next(p for p in got.pairs if p.pair == "iEF < SF")
    assert pair.high - pair.low < per_pair.high - per_pair.low and "pooled sd over 5 optimisers" in pair.agreement


def test_heterogeneous_residuals_fall_back_to_each_pairs_own_variance():
    """One optimiser a hundred times noisier than the other two: its pairs' differences vary far more than the
    pooled model allows, and each pair is decided on its own; equal spreads pass the check."""
    rng = np.random.default_rng(7)
    values = {o: dict(enumerate(rng.normal(0, s, 4))) for o, s in (("a", 0.01), ("b", 0.01), ("c", 1.0))}
    got = S.pooled_blocks(values)
    assert got is not None and got.homogeneity < 0.05 and not got.used
    assert S.pooled_blocks({"a": {0: 1.0, 1: math.inf}, "b": {0: 1.0, 1: 2.0}}) is None  # a diverged run
    rates = [S.pooled_blocks({o: dict(enumerate(rng.normal(0, 1, 3))) for o in "abcde"}).used for _ in range(300)]
    assert np.mean(rates) >= 0.95  # the check's level: equal spreads are pooled at least 95 % of the time


def _climbs(ef: float, other: float, seeds=6):
    """Loss curves whose climb is ``ef`` for EF and ``other`` for SGD (64 updates: a descent, a climb, a plateau)."""
    rows = []
    rng = np.random.default_rng(8)
    for o, c in (("ef", ef), ("sgd", other)):
        for s in range(seeds):
            f = c * math.exp(rng.normal(0, 0.01))
            run = np.r_[np.full(16, 1.0), np.full(16, 0.5), np.full(32, 0.5 * f)]
            rows += [("lora", o, s, "train_loss", i + 1, float(v)) for i, v in enumerate(run)]
    return pd.DataFrame(rows, columns=["setup", "optimizer", "seed", "quantity", "step", "value"])


@pytest.mark.parametrize("ef, other, expected, words", [
    (3.0, 1.5, V.HOLDS, None),  # EF climbs x2 more: beyond the margin
    (1.55, 1.5, V.FAILS, "a decided tie"),  # 3 % more: decided within x1.26, not the unstable one
    (1.5, 3.0, V.FAILS, "the other way"),
])
def test_ef_unstable_needs_its_climb_beyond_the_margin(ef, other, expected, words):
    got = verdict("e2_ef_unstable", None, _climbs(ef, other), {"lora": ["sgd", "ef"]})["lora"]
    assert got.verdict == expected
    if words:
        assert words in got.pairs[0].agreement and "not decided ×1.26 above" in got.failures[0]


def test_two_optimisers_that_never_disagree_on_a_small_test_set_are_not_decided_on_par():
    """16 test examples, identical predictions at both seeds: zero variance would call any band decided; the rule
    of three keeps what 32 agreeing pairs cannot exclude (±8 points) in the interval."""
    x = np.zeros((2, 16))
    got = V.pair_over_seeds("s", "on par", "test_score", {0: 0.0, 1: 0.0}, per_example=x, band=0.01, unit=100)
    assert got.verdict == V.INCONCLUSIVE and "rule of three" in got.agreement
    big = np.zeros((3, 5000))
    assert V.pair_over_seeds("s", "on par", "test_score", {0: 0.0, 1: 0.0, 2: 0.0}, per_example=big,
                             band=0.01).verdict == V.HOLDS


def test_a_test_comparison_that_needs_more_examples_says_their_price_or_that_the_data_set_is_too_small():
    """The examples' spread decides (the seeds agree example by example): more seeds cannot decide it, more test
    examples can; the words price them (re-scoring kept checkpoints, no training) or, beyond what the data set
    holds, say that no test split of it decides the comparison."""
    rng = np.random.default_rng(0)
    e = rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], size=60)
    e[:3] = -1.0
    x = np.tile(e, (10, 1))
    x[:, 5] += rng.normal(0, 0.01, 10)
    diffs = dict(enumerate(x.mean(axis=1)))
    got = V.pair_over_seeds("s", "a > b", "test_score", diffs, per_example=x, unit=100)
    assert got.verdict == V.INCONCLUSIVE and got.needs.startswith("no number of seeds at 60 test examples")
    assert "548 test examples at 10 seeds" in got.needs and "no training" in got.needs
    small = V.pair_over_seeds("s", "a > b", "test_score", diffs, per_example=x, unit=100, available=100)
    assert "more than the data set's 100 examples" in small.needs and "no training" not in small.needs
    assert V.pair_over_seeds("s", "a > b", "test_score", diffs, per_example=x, unit=100,
                             available=1000).needs == got.needs


def test_the_digits_data_set_bounds_its_test_split():
    from companion.experiments.verdicts.training import available_examples

    assert available_examples("digits-mlp") == 1797 and available_examples("tweets-minilm-lora") is None
