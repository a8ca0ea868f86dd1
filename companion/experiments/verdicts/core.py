"""The verdicts' vocabulary and their two ways of deciding (:mod:`companion.experiments.verdicts`): the outcomes, a
:class:`Verdict`, a :class:`Rule`, the paired t interval of a comparison over batches (:func:`decide`), its
aggregation over stages (:func:`over_stages`), and a comparison decided over seeds (:func:`pair_over_seeds`): a paired
95 % interval of the per-seed differences, widened by a test set's binomial resolution where the metric is a test
accuracy (:func:`binomial_resolution`), that more seeds sharpen, with the seeds an undecided pair would need
(:func:`seeds_needed`)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .stats import LEVEL, MAX_SEEDS, POWER, Crossed, Pooled, crossed, holm, sd_limits, seeds_for_power, sides, t_ppf

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
OUTCOMES = (HOLDS, FAILS, INCONCLUSIVE)
MIN_SEEDS = 2  # a paired interval over seeds needs a spread: at least two seeds with a finite difference
SIGN_LEVEL = 0.05  # the two-sided level of the exact sign test that decides a pair with a diverged run
TENTH_DECADE = 10 ** 0.1  # 1.26: "flat" or "comparable" on the paper's log axes (a tenth of a decade)
DECADE = 10.0  # "far worse" / "rescued": a whole decade on the paper's log axes
NEAR_ZERO = 1e-6  # E3: the dampings iEF is claimed robust over (package convention), as E1's near-zero damping
ON_PAR_POINTS = 1.0  # E2, LoRA: "on par" = the mean test difference decided within 1 percentage point
# two-sided 95 % Student-t quantiles by degrees of freedom (scipy.stats.t.ppf(0.975, dof); tests check them)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class Verdict:
    """One rule's outcome for one subject (a setup, or "setup, method").

    ``detail``: the numbers behind it; ``failures``: what fails, by name (stages, pairs); ``surprise``: a result the
    chapter must discuss rather than count (e.g. ieKFAC below exact iEF); ``pairs``: E2's per-pair seed results;
    ``needs``: for an inconclusive verdict decided over seeds, what evidence would decide it, in words."""

    subject: str
    verdict: str
    detail: str
    failures: tuple[str, ...] = ()
    surprise: str | None = None
    pairs: tuple[PairResult, ...] = ()
    needs: str | None = None

    def __post_init__(self):
        if self.verdict not in OUTCOMES:
            raise ValueError(f"verdict must be one of {OUTCOMES}, got {self.verdict!r}")


@dataclass(frozen=True)
class PairResult:
    """A comparison of ``a`` with ``b`` on ``metric`` decided over seeds.

    ``diffs[seed]``: the per-seed difference, signed so that a negative value is in favour of the claim;
    ``agreement``: the sign count and the decision's statistic in words; ``mean``, ``low``, ``high``: the mean
    difference and its 95 % interval (NaN where a diverged run leaves it undefined: the sign test decides then);
    ``needs``: for an undecided pair, what would decide it at the observed mean and spread (seeds, or a larger test
    set), in words; ``band``: the half-width of an "on par" claim's equivalence band (None: a "better" claim);
    ``p_for``, ``p_against``: twice the one-sided p-values for and against the claim (:func:`.stats.sides`; below
    :data:`.stats.LEVEL` exactly when the pair's own 95 % interval decides that way), for Holm's procedure over a
    claim's pairs."""

    setup: str
    pair: str
    metric: str
    diffs: dict[int, float]
    verdict: str
    agreement: str
    mean: float = float("nan")
    low: float = float("nan")
    high: float = float("nan")
    needs: str | None = None
    band: float | None = None
    p_for: float = float("nan")
    p_against: float = float("nan")


@dataclass(frozen=True)
class Rule:
    """A paper claim and the rule that decides it.

    ``statement``: the rule in plain sentences with its thresholds (glued before the result); ``why``: why the
    thresholds are what they are; ``check``: records -> one :class:`Verdict` per subject."""

    name: str
    claim: str
    label: str
    statement: str
    why: str
    check: Callable[..., list[Verdict]] = field(repr=False)

    def evaluate(self, *data: Any, **extra: Any) -> list[Verdict]:
        """The rule's verdicts on ``data`` (evaluation records, or the E2 table and curves); ``extra``: what a rule
        over seeds also reads (``predictions``: the runs' per-example test predictions)."""
        return self.check(*data, **extra)


# ------------------------------------------------------------------------------------------------ deciding
def t_quantile(dof: int) -> float:
    """The two-sided 95 % Student-t quantile for ``dof`` degrees of freedom (1.96 beyond 30)."""
    if dof < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {dof}")
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


def interval(values: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``values`` and its 95 % t interval (``low = high = mean`` for one value)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("no values to decide on")
    mean = float(v.mean())
    if v.size < 2:
        return mean, mean, mean
    half = t_quantile(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return mean, mean - half, mean + half


def decide(values: Sequence[float], threshold: float = 0.0) -> int:
    """``+1`` if the 95 % t interval of the mean of ``values`` lies above ``threshold``, ``-1`` below, ``0`` if it
    straddles it or there are fewer than 2 values (a single batch decides nothing)."""
    if len(values) < 2:
        return 0
    _, low, high = interval(values)
    return 1 if low > threshold else -1 if high < threshold else 0


def over_stages(outcomes: dict[int, int], every: bool) -> str:
    """Aggregate per-stage outcomes (+1 for the claim, -1 against, 0 undecided).

    ``every=False`` ("most stages"): holds iff the stages decided for are a strict majority; does not hold iff they
    cannot become one (for + undecided <= half); else inconclusive. ``every=True`` ("consistently", "across all
    stages"): holds iff every stage is decided for; does not hold iff any is decided against; else inconclusive."""
    n = len(outcomes)
    if n == 0:
        return INCONCLUSIVE
    pro = sum(o > 0 for o in outcomes.values())
    con = sum(o < 0 for o in outcomes.values())
    if every:
        return HOLDS if pro == n else FAILS if con else INCONCLUSIVE
    return HOLDS if pro > n / 2 else FAILS if n - con <= n / 2 else INCONCLUSIVE


def sign_test(pro: int, con: int) -> float:
    """The exact two-sided sign test's p-value of ``pro`` seeds in favour and ``con`` against (ties dropped)."""
    n = pro + con
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(max(pro, con), n + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def binomial_resolution(accuracy_a: float, accuracy_b: float, examples: int | None) -> float:
    """The standard error of a difference of two test accuracies measured on one test set of ``examples`` examples,
    for a pair without per-example predictions (a run made before they were stored).

    The two accuracies are treated as independent binomial proportions, sqrt((a(1-a) + b(1-b)) / n), which
    overstates the error of a paired comparison on the same examples (their predictions are positively correlated)
    and so errs towards "undecided"; where the runs' per-example predictions exist, :func:`.stats.crossed` decides
    instead. 0 where ``examples`` is None (unknown: private labels) or an accuracy is not in [0, 1].

    Args:
        accuracy_a: one optimiser's mean test accuracy over seeds, in [0, 1].
        accuracy_b: the other's.
        examples: the test set's size.

    Returns:
        The standard error, in the accuracies' unit (a fraction).
    """
    if not examples or not all(0.0 <= p <= 1.0 for p in (accuracy_a, accuracy_b)):
        return 0.0
    return math.sqrt((accuracy_a * (1 - accuracy_a) + accuracy_b * (1 - accuracy_b)) / examples)


Z975 = 1.96  # the two-sided 95 % normal quantile


def _se_dof(sd: float, seeds: int, resolution: float) -> tuple[float, float]:
    """The standard error of a mean over ``seeds`` differences of spread ``sd`` plus a test set's known error
    ``resolution``, ``sqrt(sd^2/S + r^2)``, and its degrees of freedom by Satterthwaite
    ``(sd^2/S + r^2)^2 (S - 1) / (sd^2/S)^2`` (the resolution is known: infinite degrees of freedom)."""
    seed_var = sd * sd / seeds
    var = seed_var + resolution * resolution
    dof = math.inf if seed_var == 0 else var * var * (seeds - 1) / (seed_var * seed_var)
    return math.sqrt(var), dof


def _half_width(sd: float, seeds: int, resolution: float) -> float:
    """The interval's half-width of :func:`_se_dof`'s standard error at its degrees of freedom."""
    se, dof = _se_dof(sd, seeds, resolution)
    return t_ppf(0.975, dof) * se


def _target(mean: float, band: float | None) -> float:
    """How far the interval's half-width must shrink for the pair to be decided at this mean."""
    return abs(mean) if band is None else abs(band - abs(mean))


def seeds_needed(mean: float, sd: float, resolution: float = 0.0, band: float | None = None,
                 want: float = POWER) -> int | None:
    """The seeds that decide, with probability ``want`` (80 %), a pair whose per-seed differences have true mean
    ``mean`` and standard deviation ``sd`` (:func:`.stats.seeds_for_power`, the noncentral t); with a test set's
    known error ``resolution``, the fewest seeds with ``(t(.975) + t(want))^2 (sd^2/S + r^2) <= distance^2``.
    None where no number of seeds up to :data:`MAX_SEEDS` does (the mean sits on the threshold, or the test set's
    ``resolution`` alone is too wide)."""
    target = _target(mean, band)
    if not math.isfinite(mean) or not math.isfinite(sd) or target == 0:
        return None
    if resolution == 0:
        return seeds_for_power(target, sd, want)
    return _seeds_by_formula(target, sd * sd, resolution * resolution, want)


def _seeds_by_formula(target: float, var_seed: float, var_fixed: float, want: float = POWER,
                      var_cross: float = 0.0, examples: int = 1) -> int | None:
    """The fewest seeds S with ``(t(.975, S-1) + t(want, S-1))^2 (var_seed/S + var_fixed + var_cross/(S n)) <=
    target^2``; None beyond :data:`MAX_SEEDS`."""
    def enough(k: int) -> bool:
        q = t_ppf(0.975, k - 1) + t_ppf(want, k - 1)
        return q * q * (var_seed / k + var_fixed + var_cross / (k * examples)) <= target * target

    if not enough(MAX_SEEDS):
        return None
    lo, hi = 2, MAX_SEEDS
    if enough(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def _examples_needed(target: float, c: Crossed, seeds: int, want: float = POWER) -> int | None:
    """The fewest test examples n with ``(t(.975) + t(want))^2 c.var_at(seeds, n) <= target^2`` (normal quantiles:
    the examples term is the one that must shrink); None where the seeds' term alone is too wide."""
    q = (Z975 + t_ppf(want, math.inf)) ** 2
    s2s, s2e, s2r = c.components()
    room = target * target / q - s2s / seeds
    if room <= 0:
        return None
    return max(c.examples, math.ceil((s2e + s2r / seeds) / room))


@dataclass(frozen=True)
class SeedPrice:
    """What one more seed of a pair's two optimisers costs: ``core`` core-minutes of this machine (the runs' own
    wall times, one single-threaded process each) and ``gpu`` H200 GPU-minutes, an upper estimate from the GPU
    benchmark records (:mod:`companion.experiments.gpu_price`; None where no record bounds the setup's model)."""

    core: float | None
    gpu: float | None = None


def _price(more: int, seed_minutes: float | SeedPrice | None) -> str:
    """", about N core-minutes more (≤ G H200 GPU-minutes)" for ``more`` seeds; empty where nothing is known."""
    price = seed_minutes if isinstance(seed_minutes, SeedPrice) else SeedPrice(seed_minutes)
    if more <= 0 or not (price.core or price.gpu):
        return ""
    gpu = f"≤ {more * price.gpu:.2g} H200 GPU-minutes" if price.gpu else ""
    if not price.core:
        return f", {gpu} more"
    return f", about {more * price.core:.0f} core-minutes more" + (f" ({gpu})" if gpu else "")


def _range_text(target: float, sd: float, dof: int, resolution: float, band: float | None, mean: float) -> str:
    """" (range a–b from sd's 95 % limits)": the seeds at the two confidence limits of the per-seed sd."""
    if dof < 1 or sd <= 0:
        return ""
    low, high = sd_limits(sd, dof)
    a, b = seeds_needed(mean, low, resolution, band), seeds_needed(mean, high, resolution, band)
    return f"; {a if a else f'>{MAX_SEEDS}'}–{b if b else f'>{MAX_SEEDS}'} at the sd's 95 % limits"


def _needs_text(mean: float, sd: float, resolution: float, band: float | None, examples: int | None,
                unit: float, seeds: int = 2, sd_dof: int | None = None,
                seed_minutes: float | SeedPrice | None = None) -> str:
    k = seeds_needed(mean, sd, resolution, band)
    target = _target(mean, band)
    if k is not None:
        spread = _range_text(target, sd, seeds - 1 if sd_dof is None else sd_dof, resolution, band, mean)
        return f"needs {k} seeds (80 % power{spread}{_price(k - seeds, seed_minutes)})"
    if resolution > 0 and examples and target > 0 and (Z975 + t_ppf(POWER, math.inf)) * resolution >= target:
        more = math.ceil(examples * ((Z975 + t_ppf(POWER, math.inf)) * resolution / target) ** 2)
        return (f"no number of seeds: the test set's error (±{Z975 * resolution * unit:.2g} at 95 %, {examples} "
                f"examples, as independent binomials) is too wide for the difference to decide "
                f"({target * unit:.2g}); needs more than {more} test examples")
    return "no number of seeds: the mean difference sits on the threshold"


def _crossed_needs(c: Crossed, mean: float, band: float | None, unit: float,
                   seed_minutes: float | SeedPrice | None = None, available: int | None = None) -> str:
    """What decides an undecided crossed comparison at 80 % power: seeds at this test set, else test examples, with
    their price (no training: the runs' kept checkpoints scored on a larger test split) or, beyond ``available``
    (the most examples the data set holds), that no test split of this data set decides it."""
    target = _target(mean, band)
    if target == 0 or not math.isfinite(target):
        return "no number of seeds or examples: the mean difference sits on the threshold"
    s2s, s2e, s2r = c.components()
    k = _seeds_by_formula(target, s2s, s2e / c.examples, var_cross=s2r, examples=c.examples)
    if k is not None:
        return (f"needs {k} seeds at {c.examples} test examples (80 % power, from the seeds', examples' and "
                f"residual variance components{_price(k - c.seeds, seed_minutes)})")
    m = _examples_needed(target, c, c.seeds)
    if m is not None:
        price = (f": more than the data set's {available} examples, so no test split of it decides this"
                 if available is not None and m > available else
                 "; no training: each run's kept best checkpoint scored on them, one forward pass an example")
        return (f"no number of seeds at {c.examples} test examples (their spread alone is ±"
                f"{Z975 * math.sqrt(s2e / c.examples) * unit:.2g}); needs {m} test examples at {c.seeds} seeds "
                f"(80 % power{price})")
    return (f"needs more seeds and more test examples than this grid has: the difference to decide "
            f"({target * unit:.2g}) is within both terms' spread")


def _decide(mean: float, se: float, dof: float, band: float | None) -> tuple[str, float, float, float, float]:
    """``(verdict, low, high, p_for, p_against)`` of a difference (negative in favour of a "better" claim; inside
    ``±band`` in favour of an "on par" one) from its standard error at ``dof`` degrees of freedom; the p-values
    twice one-sided (:func:`.stats.sides`: below :data:`LEVEL` exactly when the 95 % interval decides that way)."""
    half = t_ppf(0.975, dof) * se
    low, high = mean - half, mean + half
    if band is None:
        p_for, p_against = sides(mean, se, dof)
        verdict = HOLDS if high < 0 else FAILS if low > 0 else INCONCLUSIVE
    else:
        p_for = max(sides(mean, se, dof, band)[0], sides(mean, se, dof, -band)[1])
        p_against = min(sides(mean, se, dof, band)[1], sides(mean, se, dof, -band)[0])
        verdict = HOLDS if -band < low and high < band else FAILS if low > band or high < -band else INCONCLUSIVE
    return verdict, low, high, p_for, p_against


def pair_over_seeds(setup: str, pair: str, metric: str, diffs: dict[int, float], *, resolution: float = 0.0,
                    band: float | None = None, examples: int | None = None, unit: float = 1.0,
                    per_example: np.ndarray | None = None, pooled: Pooled | None = None,
                    seed_minutes: float | SeedPrice | None = None, margin: float = 0.0,
                    available: int | None = None) -> PairResult:
    """A comparison decided over seeds: ``diffs[seed]`` < 0 is in favour of the claim.

    A "better" claim (``band`` None) holds when the 95 % interval of the mean difference lies below 0, does not hold
    when it lies above 0, and is inconclusive when it straddles 0. An "on par" claim (``band`` > 0) holds when the
    interval lies inside (-band, band), does not hold when it lies wholly outside, and is inconclusive otherwise.
    The interval, by the evidence at hand:

    - ``per_example`` (a test score with every run's per-example predictions): the crossed seeds x examples
      analysis (:func:`.stats.crossed`) with Satterthwaite's t; where the two optimisers (nearly) never disagree,
      the standard error is at least the rule of three's, ``sqrt(3 / S) / n``: as if they disagreed on 3 of the
      ``S n`` seed-example pairs, the most that seeing none excludes at 95 %;
    - ``pooled`` (a setup with few seeds whose optimisers' residuals pass the homogeneity check): the contrast's
      standard error ``sd sqrt(2/S)`` from the residual variance pooled over the setup's optimisers, seeds as
      blocks (:func:`.stats.pooled_blocks`), on its ``(O - 1)(S - 1)`` degrees of freedom;
    - else the paired t over seeds, with a test set's known ``resolution`` (:func:`binomial_resolution`) combined
      by Satterthwaite where the per-example predictions are missing.

    More seeds narrow every one of them, so more evidence decides more pairs, either way. With a diverged run among
    the seeds (an infinite difference) the mean is undefined and the exact two-sided sign test at
    :data:`SIGN_LEVEL` decides a "better" claim instead (at least 6 seeds can reach it). A missing value (NaN) is
    left out; fewer than :data:`MIN_SEEDS` usable seeds decide nothing. An undecided pair says what would decide
    it with 80 % power (:func:`seeds_needed`), with the range from the sd's confidence limits and, given
    ``seed_minutes`` (core-minutes per added seed of the pair), its price.

    Args:
        setup: the setup's name.
        pair: the claim in words (``"iEF < SGD"``).
        metric: the metric compared.
        diffs: ``{seed: difference}``.
        resolution: the test set's standard error of the difference (0 for a training loss).
        band: an "on par" claim's half-width, in the differences' unit.
        examples: the test set's size (for the words of what an undecided pair needs).
        unit: the factor to the unit the words use (100 for percentage points).
        per_example: ``(seeds, examples)`` per-example differences, signed as ``diffs``.
        pooled: the setup's pooled residual variance (used when ``pooled.used``).
        seed_minutes: what one more seed of the pair's two optimisers costs: core-minutes, or a :class:`SeedPrice`
            (core-minutes and H200 GPU-minutes).
        margin: a "better" claim of a material difference (log :data:`TENTH_DECADE` for "unstable", "improves"):
            it holds when the interval lies below ``-margin`` and does not hold when it lies above it (a decided
            tie within the margin, or the other way round, fails the claim; the agreement says which).
        available: the most test examples the setup's data set holds (None: not known), so that an undecided test
            comparison needing more says no test split of that data set decides it.

    Returns:
        The :class:`PairResult`.
    """
    values = [d for d in diffs.values() if d is not None and not math.isnan(d)]
    pro, con = sum(d < 0 for d in values), sum(d > 0 for d in values)
    n = len(values)
    counts = f"{pro} of {len(diffs)} seeds in favour, {con} against"
    if n < MIN_SEEDS:
        return PairResult(setup, pair, metric, dict(diffs), INCONCLUSIVE, counts,
                          needs=f"needs at least {MIN_SEEDS} seeds with a value")
    if any(math.isinf(d) for d in values):  # a diverged run: no mean, the signs decide
        p = sign_test(pro, con)
        verdict = (INCONCLUSIVE if band is not None or p >= SIGN_LEVEL else HOLDS if pro > con else FAILS)
        needs = None
        if verdict == INCONCLUSIVE and band is None and max(pro, con) == n:
            needs = "needs " + str(next(k for k in range(n, 64) if sign_test(k, 0) < SIGN_LEVEL)) + " seeds"
        return PairResult(setup, pair, metric, dict(diffs), verdict,
                          f"{counts}; a diverged run: sign test p = {p:.2g}", needs=needs, band=band,
                          p_for=p if pro > con and band is None else 1.0, p_against=p if con > pro else 1.0)
    v = np.asarray(values, dtype=float)
    mean, sd = float(v.mean()), float(v.std(ddof=1))
    if per_example is not None:
        c = crossed(per_example)
        mean, se, dof, how = c.mean, c.se, c.dof, f"seeds x {c.examples} examples, {c.dof:.3g} dof"
        floor = math.sqrt(3 / c.seeds) / c.examples  # no disagreement seen is not none: the rule of three
        if np.isin(per_example, (-1.0, 0.0, 1.0)).all() and se < floor:
            se, dof = floor, math.inf
            how = (f"seeds x {c.examples} examples; the optimisers disagree on almost none: the error is the rule "
                   f"of three's, at most 3 of {c.seeds * c.examples} seed-example pairs")
    elif pooled is not None and pooled.used and pooled.seeds == n:
        se, dof = pooled.sd * math.sqrt(2 / n), float(pooled.dof)
        how = f"pooled sd over {pooled.optimizers} optimisers, {pooled.dof} dof"
    else:
        se, dof = _se_dof(sd, n, resolution)
        how = None
    verdict, low, high, p_for, p_against = _decide(mean + margin, se, dof, band)
    low, high = low - margin, high - margin
    needs = None
    if verdict == INCONCLUSIVE:
        mean += margin  # what must be decided is the distance to the margin
        if per_example is not None:
            needs = _crossed_needs(c, mean, band, unit, seed_minutes, available)
        elif how is not None:  # pooled: the contrast's per-seed sd is sd sqrt(2), estimated on the pooled dof
            needs = _needs_text(mean, pooled.sd * math.sqrt(2), 0.0, band, examples, unit, n, pooled.dof,
                                seed_minutes)
        else:
            needs = _needs_text(mean, sd, resolution, band, examples, unit, n, None, seed_minutes)
        mean -= margin
    text = (f"{counts}; mean {mean * unit:+.3g} (95 % interval {low * unit:+.3g} to {high * unit:+.3g}"
            + (f"; {how})" if how else ")"))
    if margin and verdict == FAILS:
        text += ("; a decided tie: within the margin ×" if high < margin else "; decided the other way beyond "
                 "the margin ×") + f"{math.exp(margin):.3g}"
    return PairResult(setup, pair, metric, dict(diffs), verdict, text, mean, low, high, needs, band, p_for,
                      p_against)


def over_stages_holm(p_for: dict[int, float], p_against: dict[int, float], every: bool) -> tuple[str, int, int]:
    """Aggregate per-stage p-values (twice one-sided, :func:`.stats.sides`) with Holm on both sides.

    ``every=True`` ("consistently"): holds iff every stage is decided for at 95 % (an intersection-union test
    needs no correction); does not hold iff Holm's procedure over the stages rejects one stage against the claim.
    ``every=False`` ("most stages"): Holm's count of stages decided for (a 95 % lower bound on the number of stages
    truly for) is a strict majority: holds; Holm's count against leaves no majority reachable: does not hold.

    Returns:
        ``(verdict, stages counted for, stages counted against)``.
    """
    n = len(p_for)
    if n == 0:
        return INCONCLUSIVE, 0, 0
    against = len(holm(p_against))
    if every:
        pro = sum(p < LEVEL for p in p_for.values())
        return (HOLDS if pro == n else FAILS if against else INCONCLUSIVE), pro, against
    pro = len(holm(p_for))
    return (HOLDS if pro > n / 2 else FAILS if n - against <= n / 2 else INCONCLUSIVE), pro, against


def summary(verdicts: Sequence[Verdict], scale: str | None = None) -> str:
    """One sentence over subjects: "holds for a, b; does not hold for c (what fails); inconclusive for d".

    With ``scale``, an inconclusive verdict that says what would decide it (``needs``) reads "undecidable at
    <scale> for d (needs N seeds)": the runs of this scale cannot decide it, and the sentence says what would."""
    if not verdicts:
        return "not measured at this scale"
    groups: dict[str, list[str]] = {}
    for outcome in OUTCOMES:
        for v in (v for v in verdicts if v.verdict == outcome):
            if outcome == FAILS and v.failures:
                groups.setdefault(outcome, []).append(f"{v.subject} ({'; '.join(v.failures)})")
            elif outcome == INCONCLUSIVE and v.needs:
                word = f"undecidable at {scale}" if scale else outcome
                groups.setdefault(word, []).append(f"{v.subject} ({v.needs})")
            else:
                groups.setdefault(outcome, []).append(v.subject)
    return "; ".join(f"{word} for {', '.join(names)}" for word, names in groups.items())
