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

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
OUTCOMES = (HOLDS, FAILS, INCONCLUSIVE)
MIN_SEEDS = 2  # a paired interval over seeds needs a spread: at least two seeds with a finite difference
SIGN_LEVEL = 0.05  # the two-sided level of the exact sign test that decides a pair with a diverged run
MAX_SEEDS = 1000  # seeds_needed searches up to this many seeds
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
    set), in words; ``band``: the half-width of an "on par" claim's equivalence band (None: a "better" claim)."""

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

    def evaluate(self, *data: Any) -> list[Verdict]:
        """The rule's verdicts on ``data`` (evaluation records, or the E2 table and curves)."""
        return self.check(*data)


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
    """The standard error of a difference of two test accuracies measured on one test set of ``examples`` examples.

    The seeds share the test set, so its sampling error does not average out over seeds: it is added to the seeds'
    standard error in :func:`pair_over_seeds`. The two accuracies are treated as independent binomial proportions,
    sqrt((a(1-a) + b(1-b)) / n), which overstates the error of a paired comparison on the same examples (their
    predictions are positively correlated) and so errs towards "undecided". 0 where ``examples`` is None (unknown:
    private labels) or an accuracy is not in [0, 1].

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


Z975 = 1.96  # the two-sided 95 % normal quantile: the test set's binomial error is known, not estimated


def _half_width(sd: float, seeds: int, resolution: float) -> float:
    """The interval's half-width: the seeds' t half-width (their spread is estimated) and the test set's normal one
    (its binomial error is known) added in quadrature, as independent errors."""
    return math.hypot(t_quantile(seeds - 1) * sd / math.sqrt(seeds), Z975 * resolution)


def _target(mean: float, band: float | None) -> float:
    """How far the interval's half-width must shrink for the pair to be decided at this mean."""
    return abs(mean) if band is None else abs(band - abs(mean))


def seeds_needed(mean: float, sd: float, resolution: float = 0.0, band: float | None = None) -> int | None:
    """The fewest seeds whose 95 % interval (:func:`pair_over_seeds`) decides a pair whose per-seed differences keep
    the observed ``mean`` and standard deviation ``sd``; None where no number of seeds up to :data:`MAX_SEEDS` does
    (the mean sits on the threshold, or the test set's ``resolution`` alone is wider than the distance to it)."""
    target = _target(mean, band)
    if not math.isfinite(mean) or not math.isfinite(sd) or target == 0:
        return None
    for k in range(MIN_SEEDS, MAX_SEEDS + 1):
        if _half_width(sd, k, resolution) < target:
            return k
    return None


def _needs_text(mean: float, sd: float, resolution: float, band: float | None, examples: int | None,
                unit: float) -> str:
    k = seeds_needed(mean, sd, resolution, band)
    if k is not None:
        return f"needs {k} seeds"
    target = _target(mean, band)
    if resolution > 0 and examples and target > 0 and Z975 * resolution >= target:
        # the resolution scales as 1/sqrt(examples): the size below which it alone already spans the distance
        more = math.ceil(examples * (Z975 * resolution / target) ** 2)
        return (f"no number of seeds: the test set's resolution (±{Z975 * resolution * unit:.2g} at 95 %, "
                f"{examples} examples) is wider than the difference to decide ({target * unit:.2g}); needs more than "
                f"{more} test examples")
    return "no number of seeds: the mean difference sits on the threshold"


def pair_over_seeds(setup: str, pair: str, metric: str, diffs: dict[int, float], *, resolution: float = 0.0,
                    band: float | None = None, examples: int | None = None, unit: float = 1.0) -> PairResult:
    """A comparison decided over seeds: ``diffs[seed]`` < 0 is in favour of the claim.

    A "better" claim (``band`` None) holds when the 95 % interval of the mean difference lies below 0, does not hold
    when it lies above 0, and is inconclusive when it straddles 0. An "on par" claim (``band`` > 0) holds when the
    interval lies inside (-band, band), does not hold when it lies wholly outside, and is inconclusive otherwise.
    The interval is the paired Student-t interval over seeds, widened by ``resolution`` (the test set's,
    :func:`binomial_resolution`: it does not shrink with seeds) at the normal quantile, the two half-widths added in
    quadrature. More seeds narrow it, so more evidence decides
    more pairs, either way. With a diverged run among the seeds (an infinite difference) the mean is undefined and
    the exact two-sided sign test at :data:`SIGN_LEVEL` decides a "better" claim instead (at least 6 seeds can
    reach it). A missing value (NaN) is left out; fewer than :data:`MIN_SEEDS` usable seeds decide nothing.

    Args:
        setup: the setup's name.
        pair: the claim in words (``"iEF < SGD"``).
        metric: the metric compared.
        diffs: ``{seed: difference}``.
        resolution: the test set's standard error of the difference (0 for a training loss).
        band: an "on par" claim's half-width, in the differences' unit.
        examples: the test set's size (for the words of what an undecided pair needs).
        unit: the factor to the unit the words use (100 for percentage points).

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
                          f"{counts}; a diverged run: sign test p = {p:.2g}", needs=needs, band=band)
    v = np.asarray(values, dtype=float)
    mean, sd = float(v.mean()), float(v.std(ddof=1))
    half = _half_width(sd, n, resolution)
    low, high = mean - half, mean + half
    if band is None:
        verdict = HOLDS if high < 0 else FAILS if low > 0 else INCONCLUSIVE
    else:
        verdict = (HOLDS if -band < low and high < band else FAILS if low > band or high < -band else INCONCLUSIVE)
    needs = _needs_text(mean, sd, resolution, band, examples, unit) if verdict == INCONCLUSIVE else None
    text = f"{counts}; mean {mean * unit:+.3g} (95 % interval {low * unit:+.3g} to {high * unit:+.3g})"
    return PairResult(setup, pair, metric, dict(diffs), verdict, text, mean, low, high, needs, band)


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
