"""The statistics the verdicts decide with (:mod:`companion.experiments.verdicts`), each a formula a statistician can
check against its textbook:

- :func:`sides`: the two one-sided p-values of a t statistic, scaled so that each is below :data:`LEVEL` exactly
  when the two-sided 95 % interval lies on that side of the threshold;
- :func:`holm`: Holm's step-down procedure, which keeps the chance of any false rejection in a family at
  :data:`LEVEL`: the failing side of a conjunction over pairs or stages, and the count behind "most stages";
- :func:`crossed`: a test-score difference decided over seeds *and* the test examples both optimisers were scored on
  (a two-way crossed design without replication), its variance ``V = s2_seed/S + s2_example/n - MSE/(S n)`` and
  Satterthwaite's degrees of freedom;
- :func:`seeds_for_power`: the seeds that decide a difference with 80 % power (the noncentral t), and
  :func:`sd_limits`, the 95 % confidence limits of a standard deviation, which turn that count into a range;
- :func:`pooled_blocks`: one residual variance for all of a setup's optimisers with the seeds as blocks (a two-way
  model ``y[o, s] = mu[o] + a[s] + e``) and a check of the homogeneity it assumes (every pair's difference variance
  against the pooled one).
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

LEVEL = 0.05  # the two-sided level of every interval (95 %) and the family-wise level of Holm's procedure
POWER = 0.8  # the power "seeds needed" is computed for
MAX_SEEDS = 1000  # the most seeds or the power search goes to
HOMOGENEITY_LEVEL = 0.05  # the homogeneity check: below this p-value the pooled variance is not used


def _sp():
    """scipy.special (a dependency of the companion's notebooks extra, and of scikit-learn): its distribution
    functions directly, a hundred times cheaper per call than scipy.stats' frozen-distribution layer."""
    from scipy import special

    return special


def t_ppf(q: float, dof: float) -> float:
    """Student's t quantile ``q`` at ``dof`` (not necessarily whole) degrees of freedom; the normal one for inf."""
    if not dof > 0:
        raise ValueError(f"a t quantile needs dof > 0, got {dof}")
    sp = _sp()
    return float(sp.ndtri(q) if math.isinf(dof) else sp.stdtrit(dof, q))


def sides(mean: float, se: float, dof: float, threshold: float = 0.0) -> tuple[float, float]:
    """``(p_below, p_above)``: twice the one-sided p-values that the true mean lies below / above ``threshold``.

    ``p_below < LEVEL`` exactly when the two-sided ``1 - LEVEL`` t interval ``mean ± t se`` lies below ``threshold``
    (and ``p_above`` above it); both are capped at 1. A zero ``se`` decides by the sign of ``mean - threshold``
    alone (identical values: the interval is a point)."""
    d = mean - threshold
    if se == 0 or not math.isfinite(se):
        if se == 0:
            return (0.0, 1.0) if d < 0 else (1.0, 0.0) if d > 0 else (1.0, 1.0)
        return 1.0, 1.0
    cdf = float(_sp().stdtr(dof, d / se)) if math.isfinite(dof) else float(_sp().ndtr(d / se))
    return min(1.0, 2 * cdf), min(1.0, 2 * (1 - cdf))


def holm(pvalues: Mapping[Hashable, float], level: float = LEVEL) -> list[Hashable]:
    """The hypotheses Holm's step-down procedure rejects at family-wise ``level``: the smallest p-value against
    ``level / k``, the next against ``level / (k - 1)``, ..., stopping at the first that is not below its bound.

    Args:
        pvalues: ``{name: p}`` of the family's ``k`` hypotheses (NaN: never rejected).
        level: the family-wise error rate.

    Returns:
        The rejected names, smallest p first.
    """
    order = sorted(pvalues, key=lambda k: (math.inf if math.isnan(pvalues[k]) else pvalues[k]))
    out = []
    for i, name in enumerate(order):
        p = pvalues[name]
        if math.isnan(p) or p >= level / (len(order) - i):
            break
        out.append(name)
    return out


@dataclass(frozen=True)
class Crossed:
    """A difference ``X[s, i]`` (seed ``s``, test example ``i``) averaged over a crossed seeds x examples design.

    ``mean``: the grand mean; ``var``: the variance of it estimated from the three mean squares, floored at the
    largest of the two main effects' own shares (each of which alone underestimates it); ``dof``: Satterthwaite's;
    ``ms_seed``, ``ms_example``, ``mse``: the mean squares of seeds, examples and the residual."""

    mean: float
    var: float
    dof: float
    seeds: int
    examples: int
    ms_seed: float
    ms_example: float
    mse: float

    @property
    def se(self) -> float:
        return math.sqrt(self.var)

    def components(self) -> tuple[float, float, float]:
        """``(sigma2_seed, sigma2_example, sigma2_residual)``: the variance components (method of moments, >= 0)."""
        s, n = self.seeds, self.examples
        return (max(0.0, (self.ms_seed - self.mse) / n), max(0.0, (self.ms_example - self.mse) / s), self.mse)

    def var_at(self, seeds: int, examples: int) -> float:
        """The variance of the mean difference with ``seeds`` seeds and ``examples`` test examples."""
        s2s, s2e, s2r = self.components()
        return s2s / seeds + s2e / examples + s2r / (seeds * examples)


def crossed(x: np.ndarray) -> Crossed:
    """The crossed seeds x examples analysis of a paired test-score difference.

    ``x[s, i]`` is ``1[a right] - 1[b right]`` on test example ``i`` for the runs of seed ``s`` (or any per-example
    score difference). The seeds are random (a seed draws the initial model and the batch order) and so are the
    examples (a draw from the task's distribution): ``Var(mean) = s2_seed/S + s2_example/n + s2_resid/(S n)``,
    estimated without bias by ``(MS_seed + MS_example - MSE) / (S n)``; the degrees of freedom by Satterthwaite.
    Not McNemar's test, which fixes the seeds; not the independent-binomials error, which ignores that both
    optimisers are scored on the same examples.

    Args:
        x: ``(S, n)`` array, ``S >= 2`` seeds, ``n >= 2`` examples.

    Returns:
        The :class:`Crossed` estimate.

    Raises:
        ValueError: fewer than 2 seeds or examples, or a non-finite value.
    """
    x = np.asarray(x, dtype=float)
    if x.ndim != 2 or min(x.shape) < 2:
        raise ValueError(f"a crossed analysis needs at least 2 seeds and 2 examples, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("a crossed analysis needs finite per-example differences")
    s, n = x.shape
    grand = float(x.mean())
    rows, cols = x.mean(axis=1), x.mean(axis=0)
    ms_seed = n * float(((rows - grand) ** 2).sum()) / (s - 1)
    ms_example = s * float(((cols - grand) ** 2).sum()) / (n - 1)
    resid = x - rows[:, None] - cols[None, :] + grand
    mse = float((resid ** 2).sum()) / ((s - 1) * (n - 1))
    terms = ((ms_seed, s - 1), (ms_example, n - 1), (-mse, (s - 1) * (n - 1)))
    total = ms_seed + ms_example - mse
    floor = max(ms_seed, ms_example)
    if total < floor:  # a negative estimate of the residual's share: keep the larger main effect, and its dof
        var, dof = floor / (s * n), float(s - 1 if ms_seed >= ms_example else n - 1)
    else:
        denom = sum(m * m / d for m, d in terms)
        dof = total * total / denom if denom > 0 else math.inf
        var = total / (s * n)
    return Crossed(grand, var, max(float(s - 1), dof) if var > 0 else math.inf, s, n, ms_seed, ms_example, mse)


def power(target: float, sd: float, seeds: int, level: float = LEVEL) -> float:
    """The chance that ``seeds`` paired differences of true mean ``target`` (its distance to the threshold) and
    standard deviation ``sd`` give a two-sided ``1 - level`` t interval that excludes the threshold: the noncentral t
    ``P(|T(seeds - 1, target sqrt(seeds) / sd)| > t)``."""
    if seeds < 2:
        return 0.0
    if sd == 0:
        return 1.0 if target != 0 else 0.0
    sp, dof = _sp(), seeds - 1
    crit, ncp = t_ppf(1 - level / 2, dof), abs(target) * math.sqrt(seeds) / sd
    if ncp - crit > 10:  # beyond the noncentral t's numerical range (scipy returns NaN there): certain
        return 1.0
    p = float(1 - sp.nctdtr(dof, ncp, crit) + sp.nctdtr(dof, ncp, -crit))
    return p if math.isfinite(p) else float(sp.ndtr(ncp - crit) + sp.ndtr(-crit - ncp))


def seeds_for_power(target: float, sd: float, want: float = POWER, level: float = LEVEL) -> int | None:
    """The fewest seeds (>= 2) whose paired t interval decides a difference of true distance ``target`` to the
    threshold with probability ``want`` when the per-seed differences have standard deviation ``sd``: about
    ``7.85 (sd / target)^2 + 1.92`` at 80 % and 95 %. None when ``target`` is 0 or not finite, or more than
    :data:`MAX_SEEDS` would be needed."""
    if not (math.isfinite(target) and math.isfinite(sd)) or target == 0:
        return None
    if power(target, sd, MAX_SEEDS, level) < want:
        return None
    z = t_ppf(1 - level / 2, math.inf) + t_ppf(want, math.inf)
    k = min(MAX_SEEDS, max(2, math.ceil((z * sd / abs(target)) ** 2 + 1.92)))  # the normal approximation, then
    while k > 2 and power(target, sd, k - 1, level) >= want:  # power grows with the seeds: walk to the fewest
        k -= 1
    while power(target, sd, k, level) < want:
        k += 1
    return k


def sd_limits(sd: float, dof: int, level: float = LEVEL) -> tuple[float, float]:
    """The ``1 - level`` confidence limits of a standard deviation estimated as ``sd`` with ``dof`` degrees of
    freedom: ``sd sqrt(dof / chi2(1 - level/2))`` to ``sd sqrt(dof / chi2(level/2))`` (at 2 dof: x0.52 to x6.3)."""
    sp = _sp()  # chdtri(k, p) is the chi-square quantile of the upper tail p
    return sd * math.sqrt(dof / sp.chdtri(dof, level / 2)), sd * math.sqrt(dof / sp.chdtri(dof, 1 - level / 2))


@dataclass(frozen=True)
class Pooled:
    """One residual standard deviation for a setup's optimisers, the seeds as blocks: a contrast of two optimisers'
    means has standard error ``sd sqrt(2 / seeds)`` on ``dof = (optimisers - 1)(seeds - 1)``; ``homogeneity``: the
    p-value of Bartlett's test that every optimiser's residuals share one variance; ``used``: whether it is at least
    :data:`HOMOGENEITY_LEVEL` (else every pair is decided on its own differences)."""

    sd: float
    dof: int
    seeds: int
    optimizers: int
    homogeneity: float
    used: bool


def pooled_blocks(values: Mapping[str, Mapping[int, float]]) -> Pooled | None:
    """The pooled residual variance of ``values[optimizer][seed]`` (e.g. log final losses) over the seeds every
    optimiser has, from the two-way model ``y[o, s] = mu[o] + a[s] + e[o, s]`` (the seeds as blocks: a seed is one
    initial model and batch order for every optimiser).

    None where fewer than 2 optimisers or 2 common seeds have finite values (a diverged run: the sign test decides).
    """
    opts = [o for o in values if values[o]]
    seeds = sorted(set.intersection(*(set(values[o]) for o in opts))) if opts else []
    if len(opts) < 2 or len(seeds) < 2:
        return None
    y = np.array([[values[o][s] for s in seeds] for o in opts], dtype=float)
    if not np.isfinite(y).all():
        return None
    resid = y - y.mean(axis=1, keepdims=True) - y.mean(axis=0, keepdims=True) + y.mean()
    dof = (len(opts) - 1) * (len(seeds) - 1)
    sd = math.sqrt(float((resid ** 2).sum()) / dof)
    p = _pairs_homogeneity(y, sd * sd, dof)
    return Pooled(sd, dof, len(seeds), len(opts), p, bool(p >= HOMOGENEITY_LEVEL))


def _pairs_homogeneity(y: np.ndarray, s2: float, dof: int) -> float:
    """The p-value that every pair's differences have the variance ``2 s2`` the pooled model gives them: each pair's
    sample variance over ``2 s2`` is an F(S - 1, dof) ratio, tested two-sided, the smallest p-value Bonferroni-
    corrected over the pairs (a residual-based Bartlett test cannot see one noisy optimiser at 3 seeds: the block
    means spread its noise over the others' residuals)."""
    if s2 <= 0:
        return 1.0
    sp, (o, k), ps = _sp(), y.shape, []
    for a in range(o):
        for b in range(a + 1, o):
            c = float(sp.fdtr(k - 1, dof, np.var(y[a] - y[b], ddof=1) / (2 * s2)))
            ps.append(2 * min(c, 1 - c))
    return min(1.0, min(ps) * len(ps))
