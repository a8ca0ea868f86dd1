"""The paper's claims as rules that can fail, stated before the numbers (issue 19, items 3 and 4).

Each claim a chapter checks is a :class:`Rule`: its name, the paper's claim and ``\\label``, the rule in one or two
plain sentences with its thresholds (the sentence a chapter glues *before* the result), why the thresholds are what
they are, and a check over the records that gives, per setup (or per setup and method), a :class:`Verdict`:
``holds`` / ``does not hold`` / ``inconclusive``, the numbers behind it and what fails, by name.

Two ways of deciding, one per kind of record:

- **evaluation records** (E1, E3, block-diagonal; :mod:`.evaluate_runs`): a comparison at one checkpoint is decided
  on the per-batch log ratios (the batches are the same for every method and damping, so the comparison is paired):
  its 95 % Student-t interval of the mean (:func:`decide`) lies above the threshold, below it, or straddles it
  (undecided). A claim over stages then aggregates the stages as its rule says (:func:`over_stages`).
- **training runs** (E2): a ranking ``a < b`` is decided over seeds (:func:`pair_over_seeds`): the per-seed
  differences, ``holds`` iff all agree in favour of the claim on at least :data:`MIN_SEEDS` seeds, ``does not hold``
  iff all agree against, else ``inconclusive`` (a tie counts for neither side).

No plotting here: :mod:`ief.plots.evaluation`, :mod:`ief.plots.optimisation` and :mod:`ief.plots.train` format
these verdicts for their chapters.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
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


# ------------------------------------------------------------------------------------------ evaluation records
def _usable(x: Any) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _setups(records: Iterable[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["setup"] for r in records))


def e1_batches(records: Sequence[dict[str, Any]], setup: str) -> dict[int, dict[int, dict[str, float]]]:
    """``{stage: {batch: {method: log(gamma / gamma_SGD), "imbalance": log imbalance}}}`` of a setup's E1 records
    (usable values only; SGD's own log ratio is 0)."""
    out: dict[int, dict[int, dict[str, float]]] = {}
    for r in records:
        if r["setup"] != setup or r["kind"] != "e1":
            continue
        row = out.setdefault(r["stage"], {}).setdefault(r["batch"], {})
        if _usable(r["ratio"]):
            row[r["method"]] = math.log(r["ratio"])
        if r["method"] == "sgd" and _usable(r.get("imbalance")):
            row["imbalance"] = math.log(r["imbalance"])
    return dict(sorted(out.items()))


def _paired(batches: dict[int, dict[str, float]], a: str, b: str | None = None) -> list[float]:
    """Per batch ``log a - log b`` (``b=None``: ``log a``, i.e. against SGD), over the batches that have both."""
    return [row[a] - (row[b] if b else 0.0) for row in batches.values() if a in row and (b is None or b in row)]


def _ratio_text(logs: Sequence[float]) -> str:
    mean, low, high = interval(logs)
    return f"{math.exp(mean):.3g} (95 % interval {math.exp(low):.3g}–{math.exp(high):.3g})"


def _stage_rule(records, compare: Callable[[dict[int, dict[str, float]]], tuple[int, str] | None], every: bool,
                what: str) -> list[Verdict]:
    """Per setup: ``compare(batches of a stage)`` -> (outcome, text) or None (not measured at that stage)."""
    out = []
    for setup in _setups(records):
        stages = {s: c for s, b in e1_batches(records, setup).items() if (c := compare(b)) is not None}
        if not stages:
            continue
        outcomes = {s: c[0] for s, c in stages.items()}
        failures = tuple(f"stage {s} %: {c[1]}" for s, c in stages.items() if c[0] < 0)
        verdict = over_stages(outcomes, every)
        pro = sum(o > 0 for o in outcomes.values())
        detail = (f"{what} at {pro} of {len(stages)} stages; " + "; ".join(f"{s} %: {c[1]}" for s, c in stages.items()))
        out.append(Verdict(setup, verdict, detail, failures))
    return out


def _versus(a: str, b: str | None, label: str, threshold: float = 0.0):
    """A stage comparison ``a`` below ``b`` (SGD when None): +1 decided below, -1 decided above."""
    def compare(batches):
        logs = _paired(batches, a, b)
        if not logs:
            return None
        return -decide(logs, threshold), f"{label} {_ratio_text(logs)}"
    return compare


def _ef_worse(records):
    def compare(batches):
        logs = _paired(batches, "ef")
        return (decide(logs), f"EF/SGD {_ratio_text(logs)}") if logs else None
    return _stage_rule(records, compare, every=False, what="EF decided worse than SGD")


def _ief_better(records):
    return _stage_rule(records, _versus("ief", None, "iEF/SGD"), every=True, what="iEF decided better than SGD")


def _order(records):
    low, high = _versus("ief", "sf", "iEF/SF"), _versus("sf", "ef", "SF/EF")

    def compare(batches):
        a, b = low(batches), high(batches)
        if a is None or b is None:
            return None
        outcome = -1 if -1 in (a[0], b[0]) else 1 if a[0] == b[0] == 1 else 0
        return outcome, f"{a[1]}, {b[1]}"
    return _stage_rule(records, compare, every=False, what="iEF < SF < EF decided")


def _imbalance_tracks(records):
    out = []
    for setup in _setups(records):
        batches = e1_batches(records, setup)
        stages = [s for s, b in batches.items() if any("imbalance" in row for row in b.values())]
        if len(stages) < 3:
            out.append(Verdict(setup, INCONCLUSIVE, f"{len(stages)} stages with an imbalance: fewer than 3"))
            continue
        first, last = batches[stages[0]], batches[stages[-1]]
        growth = [last[k]["imbalance"] - first[k]["imbalance"] for k in first
                  if k in last and "imbalance" in first[k] and "imbalance" in last[k]]
        grows = decide(growth)
        corr, failures = {}, []
        for m, name in (("ef", "EF"), ("sf", "SF")):
            pts = [(np.mean([row["imbalance"] for row in batches[s].values() if "imbalance" in row]),
                    np.mean(_paired(batches[s], m))) for s in stages if _paired(batches[s], m)]
            corr[name] = float(np.corrcoef(np.array(pts).T)[0, 1]) if len(pts) >= 3 else float("nan")
        text = (f"imbalance ×{math.exp(np.mean(growth)):.3g} from stage {stages[0]} % to {stages[-1]} %; correlation "
                "over stages of log imbalance with " + ", ".join(f"log {k}/SGD {v:+.2f}" for k, v in corr.items()))
        if grows < 0:
            failures.append(f"the imbalance shrinks (×{math.exp(np.mean(growth)):.3g})")
        failures += [f"{k} does not track it (correlation {v:+.2f})" for k, v in corr.items() if v < 0]
        if failures:
            verdict = FAILS
        elif grows > 0 and all(v > 0.5 for v in corr.values()):
            verdict = HOLDS
        else:
            verdict = INCONCLUSIVE
        out.append(Verdict(setup, verdict, text, tuple(failures)))
    return out


def _iekfac_better(records):
    a, b = _versus("iekfac", "kfac", "ieKFAC/KFAC"), _versus("iekfac", "ekfac", "ieKFAC/eKFAC")

    def compare(batches):
        x, y = a(batches), b(batches)
        if x is None or y is None:
            return None
        outcome = -1 if -1 in (x[0], y[0]) else 1 if x[0] == y[0] == 1 else 0
        return outcome, f"{x[1]}, {y[1]}"
    return _stage_rule(records, compare, every=False, what="ieKFAC decided below both KFAC and eKFAC")


def _iekfac_close(records):
    out = []
    for setup in _setups(records):
        stages = {s: logs for s, b in e1_batches(records, setup).items() if (logs := _paired(b, "iekfac", "ief"))}
        if not stages:
            continue
        outcomes, below, texts = {}, [], []
        for stage, logs in stages.items():
            text = f"{stage} %: ieKFAC/iEF {_ratio_text(logs)}"
            texts.append(text)
            if decide(logs) < 0:  # below exact iEF: neither "close" nor "far", a surprise
                below.append(stage)
                outcomes[stage] = 0
            else:
                above = decide(logs, math.log(TENTH_DECADE))
                outcomes[stage] = -1 if above > 0 else 1 if above < 0 else 0
        failures = [f"stage {s} %: ieKFAC more than ×{TENTH_DECADE:.2f} above iEF" for s, o in outcomes.items()
                    if o < 0]
        verdict, surprise = over_stages(outcomes, every=False), None
        if below:
            at = ", ".join(f"{s} %" for s in below)
            surprise = (f"ieKFAC, a block-diagonal approximation of iEF, is decided closer to the natural gradient "
                        f"than exact iEF at stage(s) {at}")
            verdict = FAILS
            failures.append(f"ieKFAC is below exact iEF at stage(s) {at}")
        out.append(Verdict(setup, verdict, "; ".join(texts), tuple(failures), surprise))
    return out


# --------------------------------------------------------------------------------------------- E3 (sweeps)
def sweep_batches(records, setup: str, method: str) -> dict[int, dict[float, dict[int, float]]]:
    """``{stage: {damping: {batch: log(gamma / gamma_SGD)}}}`` of a setup's sweep records for ``method``."""
    out: dict[int, dict[float, dict[int, float]]] = {}
    for r in records:
        if (r["setup"] == setup and r["kind"] == "sweep" and r["method"] == method and r["damping"] is not None
                and _usable(r["ratio"])):
            out.setdefault(r["stage"], {}).setdefault(float(r["damping"]), {})[r["batch"]] = math.log(r["ratio"])
    return {s: dict(sorted(d.items())) for s, d in sorted(out.items())}


def _diff(x: dict[int, float], y: dict[int, float]) -> list[float]:
    return [x[b] - y[b] for b in x if b in y]


def _best(curve: dict[float, dict[int, float]]) -> float:
    return min(curve, key=lambda lam: np.mean(list(curve[lam].values())))


def _sweep_setups(records) -> list[str]:
    return [s for s in _setups(records) if any(r["setup"] == s and r["kind"] == "sweep" for r in records)]


def _best_moves(records):
    out = []
    for setup in _sweep_setups(records):
        for method, name in (("ef", "EF"), ("sf", "SF")):
            curves = sweep_batches(records, setup, method)
            best, near = {}, {}
            for stage, curve in curves.items():
                best[stage] = _best(curve)
                near[stage] = {lam for lam in curve if decide(_diff(curve[lam], curve[best[stage]])) <= 0}
            text = "best λ " + ", ".join(f"{s} %: {b:.0e} (near-best {min(near[s]):.0e}–{max(near[s]):.0e})"
                                         for s, b in best.items())
            stages = list(best)
            disjoint = [(a, b) for i, a in enumerate(stages) for b in stages[i + 1:] if not near[a] & near[b]]
            if len(stages) < 2:
                verdict, failures = INCONCLUSIVE, ()
            elif disjoint:
                verdict, failures = HOLDS, ()
            elif len(set(best.values())) == 1:
                verdict, failures = FAILS, (f"{name}'s best λ is {best[stages[0]]:.0e} at every sweep stage",)
            else:
                verdict, failures = INCONCLUSIVE, ()
            out.append(Verdict(f"{setup}, {name}", verdict, text, failures))
    return out


def _ief_robust(records):
    out = []
    for setup in _sweep_setups(records):
        outcomes, texts, failures = {}, [], []
        for stage, curve in sweep_batches(records, setup, "ief").items():
            small = {lam: c for lam, c in curve.items() if lam <= NEAR_ZERO}
            if len(small) < 2:
                continue
            means = {lam: np.mean(list(c.values())) for lam, c in small.items()}
            hi, lo = max(means, key=means.get), min(means, key=means.get)
            logs = _diff(small[hi], small[lo])
            outcomes[stage] = -decide(logs, math.log(TENTH_DECADE))
            texts.append(f"{stage} %: max/min ×{math.exp(means[hi] - means[lo]):.3g}")
            if outcomes[stage] < 0:
                failures.append(f"stage {stage} %: iEF at λ={hi:.0e} is ×{math.exp(means[hi] - means[lo]):.3g} "
                                f"its value at λ={lo:.0e}")
        if outcomes:
            out.append(Verdict(setup, over_stages(outcomes, every=True), "; ".join(texts), tuple(failures)))
    return out


def _ef_signature(records):
    out = []
    for setup in _sweep_setups(records):
        outcomes, texts, failures = {}, [], []
        for stage, curve in sweep_batches(records, setup, "ef").items():
            lam0 = min(curve)
            best = _best(curve)
            far = decide(list(curve[lam0].values()), math.log(DECADE))
            rescued = -decide(_diff(curve[best], curve[lam0]), -math.log(DECADE)) if best != lam0 else -1
            outcomes[stage] = -1 if -1 in (far, rescued) else 1 if far == rescued == 1 else 0
            u, b = math.exp(np.mean(list(curve[lam0].values()))), math.exp(np.mean(list(curve[best].values())))
            texts.append(f"{stage} %: un-damped EF/SGD {u:.3g}, best (λ={best:.0e}) {b:.3g}")
            if far < 0:
                failures.append(f"stage {stage} %: un-damped EF is {u:.3g}× SGD, not a decade worse")
            if rescued < 0:
                failures.append(f"stage {stage} %: damping improves EF only ×{u / b:.3g}, less than a decade")
        if outcomes:
            out.append(Verdict(setup, over_stages(outcomes, every=False), "; ".join(texts), tuple(failures)))
    return out


def _ief_vs_best(method: str, name: str, threshold: float):
    def check(records):
        out = []
        for setup in _sweep_setups(records):
            ief, other = sweep_batches(records, setup, "ief"), sweep_batches(records, setup, method)
            outcomes, texts, failures = {}, [], []
            for stage in [s for s in ief if s in other]:
                best = _best(other[stage])
                logs = _diff(ief[stage][min(ief[stage])], other[stage][best])
                if not logs:
                    continue
                outcomes[stage] = -decide(logs, math.log(threshold))
                texts.append(f"{stage} %: iEF/best {name} {_ratio_text(logs)}")
                if outcomes[stage] < 0:
                    failures.append(f"stage {stage} %: iEF is {math.exp(np.mean(logs)):.3g}× {name} at λ={best:.0e}")
            if outcomes:
                out.append(Verdict(setup, over_stages(outcomes, every=True), "; ".join(texts), tuple(failures)))
        return out
    return check


# ------------------------------------------------------------------------------------------------- the rules
E1_AGGREGATION = ("A claim of the paper for \"most stages\" holds for a setup when it is decided in its favour at a "
                  "strict majority of the setup's stages, does not hold when it can no longer reach one, and is "
                  "inconclusive otherwise; a claim for every stage (\"consistently\") holds when every stage is "
                  "decided in its favour and does not hold when one is decided against.")
DECIDED = ("A comparison at one checkpoint is decided when the 95 % t interval of the mean over its batches of the "
           "log ratio lies on one side of the threshold.")
WHY_T = ("The batches are the same for every method and damping, so every comparison is paired per batch; the "
         "interval makes a difference smaller than the batch-to-batch spread undecided instead of a coin flip.")

RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("e1_ef_worse", "EF has a poorer approximation quality than SGD for most training stages and tasks",
         "sec:eval_exp", "EF is worse than SGD at a stage when γ_EF/γ_SGD is decided above 1; the claim holds for a "
         "setup when that is so at a strict majority of its stages.", WHY_T, _ef_worse),
    Rule("e1_ief_better", "iEF consistently improves on SGD updates", "sec:exp",
         "iEF is better than SGD at a stage when γ_iEF/γ_SGD is decided below 1; the claim holds for a setup when "
         "that is so at every stage, and does not hold when iEF is decided worse at any.",
         "\"Consistently\" is read as every stage. " + WHY_T, _ief_better),
    Rule("e1_order", "for the majority of the training stages the approximation quality follows iEF > SF > EF",
         "sec:eval_exp", "The order holds at a stage when both γ_iEF/γ_SF and γ_SF/γ_EF are decided below 1; the "
         "claim holds for a setup at a strict majority of its stages.", WHY_T, _order),
    Rule("e1_imbalance", "the gradient-norm imbalance gets larger as training progresses and correlates with the EF "
         "and SF curves", "sec:eval_exp", "The imbalance grows when its per-batch ratio last/first stage is decided "
         "above 1; it tracks EF and SF when the correlation over stages of log imbalance with log γ_EF/γ_SGD and "
         "with log γ_SF/γ_SGD is above 0.5 for both (at least 3 stages). It does not hold when the imbalance is "
         "decided to shrink or a correlation is negative.",
         "A correlation of 0.5 explains a quarter of the variance over stages: less is not \"correlates well\".",
         _imbalance_tracks),
    Rule("e3_best_moves", "the optimal damping factor for EF and SF changes greatly with training stages",
         "sec:exp-damping", "Per method, the near-best dampings of a sweep stage are those whose γ is not decided "
         "above the lowest one's; the best damping moves when two sweep stages have no near-best damping in common, "
         "and does not move when the lowest point is the same damping at every sweep stage.",
         "The sweep has one damping per decade, so \"moves\" is at least a factor 10 that the batches can tell "
         "apart.", _best_moves),
    Rule("e3_ief_robust", "iEF robustly achieves great approximation quality with a near-zero damping factor",
         "sec:exp-damping", f"iEF is robust at a sweep stage when its γ at the worst and at the best damping "
         f"λ ≤ {NEAR_ZERO:g} differ by less than a factor {TENTH_DECADE:.2f} (decided); the claim holds when that is "
         "so at every sweep stage.",
         f"A factor {TENTH_DECADE:.2f} is a tenth of a decade: flat on the paper's log axes, where EF and SF move "
         "by decades over the same dampings.", _ief_robust),
    Rule("e3_ief_vs_sf", "iEF's approximation quality is comparable to the optimally-damped SF method",
         "sec:exp-damping", f"At each sweep stage, iEF at its smallest damping is comparable to SF at its best "
         f"damping when γ_iEF/γ_SF is decided below {TENTH_DECADE:.2f} (iEF better counts as comparable); the claim "
         "holds when that is so at every sweep stage.",
         f"{TENTH_DECADE:.2f} is a tenth of a decade on the paper's log axes; a factor 2 could hardly fail.",
         _ief_vs_best("sf", "SF", TENTH_DECADE)),
    Rule("e3_ief_vs_ef", "iEF's approximation quality is consistently better than the EF method", "sec:exp-damping",
         "At each sweep stage, iEF at its smallest damping beats EF at its best damping when γ_iEF/γ_EF is decided "
         "below 1; the claim holds when that is so at every sweep stage.", WHY_T, _ief_vs_best("ef", "EF", 1.0)),
    Rule("e3_ef_signature", "un-damped EF is far worse than SGD and a well-chosen damping significantly improves it",
         "sec:exp-damping", "At a sweep stage the signature is there when un-damped EF (the smallest damping) is "
         "decided more than a decade worse than SGD and EF at its best damping is decided more than a decade better "
         "than un-damped; it holds for a setup at a strict majority of its sweep stages.",
         "A decade is the scale of the paper's figure (un-damped EF two to three decades above SGD).", _ef_signature),
    Rule("bd_iekfac_better", "ieKFAC has a much better approximation quality than KFAC and eKFAC in most training "
         "stages", "fig:sample_blockdiag_gamma", "ieKFAC is better at a stage when γ_ieKFAC/γ_KFAC and "
         "γ_ieKFAC/γ_eKFAC are both decided below 1; the claim holds at a strict majority of the stages.",
         "\"Much\" is not tested: any decided improvement counts. " + WHY_T, _iekfac_better),
    Rule("bd_iekfac_close", "ieKFAC has a similar approximation quality to the exact iEF method",
         "fig:sample_blockdiag_gamma", f"ieKFAC is close to iEF at a stage when γ_ieKFAC/γ_iEF is decided below "
         f"{TENTH_DECADE:.2f} and not decided below 1; the claim holds at a strict majority of the stages. ieKFAC "
         "decided below exact iEF at any stage is a surprise (the approximation beating what it approximates): the "
         "claim is then reported as not holding, with the stages named.",
         f"{TENTH_DECADE:.2f} is a tenth of a decade on the paper's log axes.", _iekfac_close),
)}
E1_RULES = ("e1_ef_worse", "e1_ief_better", "e1_order", "e1_imbalance")
E3_RULES = ("e3_best_moves", "e3_ief_robust", "e3_ief_vs_sf", "e3_ief_vs_ef", "e3_ef_signature")
BLOCK_RULES = ("bd_iekfac_better", "bd_iekfac_close")


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


# ------------------------------------------------------------------------------------------------ E2 (runs)
LABELS = {"adamw": "AdamW", "adafactor": "Adafactor", "adam": "Adam", "sgd": "SGD", "ef": "EF", "sf": "SF",
          "ief": "iEF"}
RISE_WINDOWS = 20  # EF's instability: a run's loss averaged over this many equal windows of updates


def _name(optimizer: str) -> str:
    return LABELS.get(optimizer, optimizer)


def _per_seed(table, setup: str, optimizer: str, column: str, worst: float | None = None) -> dict[int, float]:
    """``{seed: value}`` of one optimiser's runs; a non-finite value becomes ``worst`` (a diverged run's loss is
    the worst possible, +inf) or NaN (undecided: e.g. private test labels)."""
    rows = table[(table.setup == setup) & (table.optimizer == optimizer)]
    out = {}
    for seed, v in zip(rows.seed, rows[column]):
        v = float(v)
        out[int(seed)] = v if math.isfinite(v) else (worst if worst is not None else float("nan"))
    return out


def _seed_diffs(x: dict[int, float], y: dict[int, float]) -> dict[int, float]:
    """``x - y`` per seed over the seeds of either (NaN where one is missing; inf - inf is NaN: a tie)."""
    out = {}
    for seed in sorted(set(x) | set(y)):
        a, b = x.get(seed, float("nan")), y.get(seed, float("nan"))
        out[seed] = float("nan") if (math.isinf(a) and math.isinf(b) and a == b) else a - b
    return out


def loss_rises(curves) -> dict[tuple[str, str, int], float]:
    """``{(setup, optimizer, seed): last / lowest}`` of each run's training loss averaged over
    :data:`RISE_WINDOWS` equal windows of updates (:func:`ief.experiments.aggregate.curve_bands`); +inf for a run
    whose averaged loss is not finite (it diverged)."""
    from .aggregate import curve_bands

    out = {}
    loss = curves[curves.quantity == "train_loss"]
    for (setup, opt, seed), run in loss.groupby(["setup", "optimizer", "seed"]):
        means = curve_bands(run, "train_loss", points=RISE_WINDOWS)["mean"].to_numpy(dtype=float)
        ok = means.size and np.all(np.isfinite(means)) and means.min() > 0
        out[(setup, opt, int(seed))] = float(means[-1] / means.min()) if ok else float("inf")
    return out


def _pairs_verdict(setup: str, pairs: list[PairResult], fail_text: Callable[[PairResult], str]) -> Verdict:
    """Holds iff every pair holds, does not hold iff some pair does not, else inconclusive."""
    outcomes = [p.verdict for p in pairs]
    verdict = (INCONCLUSIVE if not pairs else HOLDS if all(o == HOLDS for o in outcomes) else
               FAILS if FAILS in outcomes else INCONCLUSIVE)
    detail = "; ".join(f"{p.pair}: {p.agreement}" for p in pairs)
    return Verdict(setup, verdict, detail, tuple(fail_text(p) for p in pairs if p.verdict == FAILS), pairs=tuple(pairs))


def _fmt_diffs(p: PairResult, scale: float = 1.0) -> str:
    return ", ".join("n/a" if math.isnan(d) else f"{scale * d:+.3g}" for d in p.diffs.values())


def _ranking(pairs_of: Callable[[list[str]], list[tuple[str, str]]], column: str, higher_better: bool = False):
    """A ranking rule: for each pair ``(a, b)`` of a setup's optimisers, ``a`` better than ``b`` on ``column``."""
    def check(table, curves, opts):
        out = []
        for setup, optimizers in opts.items():
            present = [o for o in optimizers if ((table.setup == setup) & (table.optimizer == o)).any()]
            pairs = []
            for a, b in pairs_of(present):
                x = _per_seed(table, setup, a, column, None if higher_better else float("inf"))
                y = _per_seed(table, setup, b, column, None if higher_better else float("inf"))
                diffs = _seed_diffs(y, x) if higher_better else _seed_diffs(x, y)
                sign = ">" if higher_better else "<"
                pairs.append(pair_over_seeds(setup, f"{_name(a)} {sign} {_name(b)}", column, diffs))
            if pairs:
                out.append(_pairs_verdict(setup, pairs, lambda p: f"{p.pair} fails on every seed "
                                                                  f"(differences {_fmt_diffs(p)})"))
        return out
    return check


def _paper_order(present: list[str]) -> list[tuple[str, str]]:
    """tab:train's ranking iEF < baseline < SGD < SF < EF (the baseline: the first optimiser of the setup)."""
    order = [o for o in ["ief", present[0] if present else None, "sgd", "sf", "ef"] if o in present]
    return [(a, b) for i, a in enumerate(order) for b in order[i + 1:]]


def _ief_first(present: list[str]) -> list[tuple[str, str]]:
    return [("ief", o) for o in present if o != "ief"] if "ief" in present else []


def _ef_unstable(table, curves, opts):
    rise = loss_rises(curves)
    out = []
    for setup, optimizers in opts.items():
        if not any(k[:2] == (setup, "ef") for k in rise):
            continue
        per = {o: {k[2]: v for k, v in rise.items() if k[:2] == (setup, o)} for o in optimizers}
        pairs = [pair_over_seeds(setup, f"EF rises more than {_name(o)}", "loss rise", _seed_diffs(per[o], per["ef"]))
                 for o in optimizers if o != "ef" and per[o]]

        def mean(o):
            v = [x for x in per[o].values() if math.isfinite(x)]
            return f"{np.mean(v):.3g}×" if v else "diverged"

        v = _pairs_verdict(setup, pairs, lambda p: p.pair)
        if v.failures:  # one sentence naming every optimiser whose rise beats EF's on every seed
            of = {f"EF rises more than {_name(o)}": o for o in optimizers}
            v = Verdict(setup, v.verdict, v.detail, (f"EF's loss rise {mean('ef')} is not the largest: " + ", ".join(
                f"{_name(of[f])} {mean(of[f])}" for f in v.failures),), pairs=v.pairs)
        out.append(v)
    return out


def _ief_vs_baseline_test(table, curves, opts, methods=None):
    """Prompt tuning and the MLP: iEF's test score above the baseline's on every seed. LoRA ("competitive", 4 of 8
    each way): on par, every seed's difference within ON_PAR_POINTS points; does not hold when every seed's is
    beyond it on the same side."""
    from .setups import resolve, scales_of

    out = []
    for setup, optimizers in opts.items():
        base = optimizers[0]
        x = _per_seed(table, setup, "ief", "test_score")
        y = _per_seed(table, setup, base, "test_score")
        if not x or not y:
            continue
        method = (methods or {}).get(setup) or resolve(setup, scales_of(setup)[-1]).method
        diffs = _seed_diffs(y, x)  # baseline - iEF: negative = iEF ahead
        if method != "lora":
            p = pair_over_seeds(setup, f"iEF > {_name(base)} (test)", "test_score", diffs)
        else:
            gaps = [100 * abs(d) for d in diffs.values() if not math.isnan(d)]
            n = len(diffs)
            same_side = all(d > 0 for d in diffs.values()) or all(d < 0 for d in diffs.values())
            if n < MIN_SEEDS or len(gaps) < n:
                verdict = INCONCLUSIVE
            elif all(g <= ON_PAR_POINTS for g in gaps):
                verdict = HOLDS
            elif same_side and all(g > ON_PAR_POINTS for g in gaps):
                verdict = FAILS
            else:
                verdict = INCONCLUSIVE
            within = sum(g <= ON_PAR_POINTS for g in gaps)
            p = PairResult(setup, f"iEF on par with {_name(base)} (test)", "test_score", diffs, verdict,
                           f"{within} of {n} seeds within {ON_PAR_POINTS:g} point")
        out.append(_pairs_verdict(setup, [p], lambda q: f"{q.pair}: differences {_fmt_diffs(q, -100)} points"))
    return out


E2_RULES_LIST = (
    Rule("e2_loss_ranking", "the ranking of final training loss generally follows iEF < AdamW/Adafactor < SGD < SF < "
         "EF", "sec:opt-exp", "Every ordered pair of the ranking (10 with all five optimisers) is decided over "
         f"seeds: it holds when the lower-ranked optimiser's final loss is below the other's on every seed (at least "
         f"{MIN_SEEDS} seeds), does not hold when it is above on every seed, and is inconclusive otherwise; the "
         "ranking holds for a setup when every pair holds, and does not hold when some pair does not.",
         "Sign agreement over every seed needs no assumption on the spread of the losses; with three seeds a pair "
         "that agrees by chance has probability 1/4 (either sign).", _ranking(_paper_order, "final_train_loss")),
    Rule("e2_ief_lowest", "iEF consistently reaches the lowest training loss at the end of training", "sec:opt-exp",
         "iEF's final training loss is below every other optimiser's of the setup on every seed (each pair decided "
         "over seeds as above).", "As for the ranking.", _ranking(_ief_first, "final_train_loss")),
    Rule("e2_ief_best_test", "iEF achieves the best test performance for the majority of the tasks", "tab:sum-test",
         "iEF's test score is above every other optimiser's of the setup on every seed (each pair decided over "
         "seeds); the paper's claim is over tasks, this rule is per setup.", "As for the ranking.",
         _ranking(_ief_first, "test_score", higher_better=True)),
    Rule("e2_ef_unstable", "EF always suffers from unstable training: its training loss starts to diverge",
         "sec:opt-exp", f"A run's loss rise is the last over the lowest of its training loss averaged over "
         f"{RISE_WINDOWS} equal windows of updates (a diverged run: infinite). EF is unstable in a setup when its "
         "rise is larger than each other optimiser's on every seed (each pair decided over seeds).",
         "With a step size decaying to zero a converging run's rise is about 1; the rule ranks the rises instead of "
         "thresholding them, so EF must be the least stable optimiser of its setup, as the paper's curves show.",
         _ef_unstable),
    Rule("e2_ief_vs_baseline", "iEF achieves the best generalisation for prompt tuning (above Adafactor on 6 of 7 "
         "tasks) and remains competitive with AdamW for LoRA", "tab:sum-test", "Prompt tuning and the MLP: iEF's "
         "test score is above the baseline's on every seed. LoRA: on par when every seed's difference is within "
         f"{ON_PAR_POINTS:g} percentage point, not on par when every seed's is beyond it on the same side.",
         f"{ON_PAR_POINTS:g} point is the size of the paper's LoRA test differences where it calls them competitive.",
         _ief_vs_baseline_test),
)
RULES.update({r.name: r for r in E2_RULES_LIST})
E2_RULES = tuple(r.name for r in E2_RULES_LIST)


# ---------------------------------------------------------------------------------------- the training chapter
def _seed0(column: str, lowest: bool):
    def check(results):
        out = []
        for setup, r in results.groupby(level="setup"):
            values = r.droplevel("setup")[column].astype(float)
            if "iEF" not in values.index or not math.isfinite(values["iEF"]):
                out.append(Verdict(setup, INCONCLUSIVE, f"no iEF {column}"))
                continue
            others = values.drop("iEF").dropna()
            beaten = others[others <= values["iEF"]] if lowest else others[others >= values["iEF"]]
            detail = f"iEF {values['iEF']:.3g}; " + ", ".join(f"{o} {v:.3g}" for o, v in others.items())
            out.append(Verdict(setup, FAILS if len(beaten) else HOLDS, detail,
                               tuple(f"{o} {v:.3g} {'≤' if lowest else '≥'} iEF {values['iEF']:.3g}"
                                     for o, v in beaten.items())))
        return out
    return check


SEED0_RULES_LIST = (
    Rule("seed0_lowest_loss", "iEF achieves the lowest training loss for the majority of the tasks", "sec:opt-exp",
         "In the search's seed-0 run at each optimiser's chosen rate, iEF's final training loss is below every other "
         "optimiser's of the setup. One seed ranks; it does not decide (chapter E2 decides over seeds).",
         "A single run has no spread to decide on: this is a ranking of one draw.",
         _seed0("final train loss", lowest=True)),
    Rule("seed0_best_test", "iEF achieves the best test performance for the majority of the tasks", "tab:sum-test",
         "In the same seed-0 runs, iEF's test score is above every other optimiser's of the setup.",
         "As for the training loss.", _seed0("test (%)", lowest=False)),
)
RULES.update({r.name: r for r in SEED0_RULES_LIST})


def disagreements(seed0: Sequence[Verdict], e2: Sequence[Verdict]) -> list[str]:
    """Setups where the seed-0 verdict and the E2 (over seeds) verdict of the same claim differ, in words."""
    other = {v.subject: v for v in e2}
    return [f"{v.subject}: seed 0 {v.verdict}, over seeds {other[v.subject].verdict}" for v in seed0
            if v.subject in other and v.verdict != other[v.subject].verdict]
