"""The verdicts' vocabulary and their two ways of deciding (:mod:`companion.experiments.verdicts`): the outcomes, a
:class:`Verdict`, a :class:`Rule`, the paired t interval of a comparison over batches (:func:`decide`), its
aggregation over stages (:func:`over_stages`) and a ranking decided over seeds (:func:`pair_over_seeds`)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"
OUTCOMES = (HOLDS, FAILS, INCONCLUSIVE)
MIN_SEEDS = 3  # a ranking over seeds is decided on at least this many (the paper's three)
TENTH_DECADE = 10 ** 0.1  # 1.26: "flat" or "comparable" on the paper's log axes (a tenth of a decade)
DECADE = 10.0  # "far worse" / "rescued": a whole decade on the paper's log axes
NEAR_ZERO = 1e-6  # E3: the dampings iEF is claimed robust over (package convention), as E1's near-zero damping
ON_PAR_POINTS = 1.0  # E2, LoRA: "on par" = every seed's test difference within 1 percentage point
# two-sided 95 % Student-t quantiles by degrees of freedom (scipy.stats.t.ppf(0.975, dof); tests check them)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class Verdict:
    """One rule's outcome for one subject (a setup, or "setup, method").

    ``detail``: the numbers behind it; ``failures``: what fails, by name (stages, pairs); ``surprise``: a result the
    chapter must discuss rather than count (e.g. ieKFAC below exact iEF); ``pairs``: E2's per-pair seed results."""

    subject: str
    verdict: str
    detail: str
    failures: tuple[str, ...] = ()
    surprise: str | None = None
    pairs: tuple[PairResult, ...] = ()

    def __post_init__(self):
        if self.verdict not in OUTCOMES:
            raise ValueError(f"verdict must be one of {OUTCOMES}, got {self.verdict!r}")


@dataclass(frozen=True)
class PairResult:
    """A ranking ``a`` better than ``b`` on ``metric`` decided over seeds: ``diffs[seed]`` = the per-seed difference
    signed so that a negative value is in favour of the claim."""

    setup: str
    pair: str
    metric: str
    diffs: dict[int, float]
    verdict: str
    agreement: str


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


def pair_over_seeds(setup: str, pair: str, metric: str, diffs: dict[int, float]) -> PairResult:
    """A ranking over seeds: ``diffs[seed]`` < 0 is in favour. Holds iff every seed is in favour (>= MIN_SEEDS
    seeds), does not hold iff every seed is against, else inconclusive; a tie (0) or a missing value counts for
    neither side."""
    values = [d for d in diffs.values() if d is not None and not math.isnan(d)]
    pro, con = sum(d < 0 for d in values), sum(d > 0 for d in values)
    n = len(diffs)
    if n < MIN_SEEDS:
        verdict = INCONCLUSIVE
    else:
        verdict = HOLDS if pro == n else FAILS if con == n else INCONCLUSIVE
    return PairResult(setup, pair, metric, dict(diffs), verdict, f"{pro} of {n} seeds in favour, {con} against")


def summary(verdicts: Sequence[Verdict]) -> str:
    """One sentence over subjects: "holds for a, b; does not hold for c (what fails); inconclusive for d"."""
    if not verdicts:
        return "not measured at this scale"
    parts = []
    for outcome in OUTCOMES:
        hit = [v for v in verdicts if v.verdict == outcome]
        if hit:
            names = ", ".join(v.subject + (f" ({'; '.join(v.failures)})" if outcome == FAILS and v.failures else "")
                              for v in hit)
            parts.append(f"{outcome} for {names}")
    return "; ".join(parts)
