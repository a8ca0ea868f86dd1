"""The evaluation chapter's rules (:mod:`companion.experiments.verdicts`): E1 (``sec:eval_exp``), E3
(``sec:exp-damping``) and the block-diagonal study (``fig:sample_blockdiag_gamma``), decided on the per-batch
records of :mod:`companion.experiments.evaluate_runs`."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .core import (DECADE, FAILS, HOLDS, INCONCLUSIVE, NEAR_ZERO, TENTH_DECADE, Rule, Verdict, decide, interval,
                   over_stages_holm)
from .stats import LEVEL, holm, sides, t_ppf

MARGIN = math.log(TENTH_DECADE)  # "better", "worse", "moves": by more than a tenth of a decade


def test_mean(logs: Sequence[float], threshold: float = 0.0, below: bool = True) -> tuple[int, float, float]:
    """``(outcome, p_for, p_against)`` of the claim that the mean of ``logs`` lies below ``threshold`` (``below``)
    or above it: +1 when the 95 % t interval decides for it, -1 against, 0 undecided (fewer than 2 values decide
    nothing); the p-values twice one-sided (:func:`.stats.sides`), for Holm's procedure over stages."""
    if len(logs) < 2:
        return 0, 1.0, 1.0
    v = np.asarray(logs, dtype=float)
    low, high = sides(float(v.mean()), float(v.std(ddof=1)) / math.sqrt(v.size), v.size - 1, threshold)
    p_for, p_against = (low, high) if below else (high, low)
    return (1 if p_for < LEVEL else -1 if p_against < LEVEL else 0), p_for, p_against


def test_band(logs: Sequence[float], band: float) -> tuple[int, float, float]:
    """``(outcome, p_for, p_against)`` of the claim that the mean of ``logs`` lies inside ``(-band, band)``: for when
    the 95 % interval lies inside it (two one-sided tests), against when it lies wholly outside (either side)."""
    if len(logs) < 2:
        return 0, 1.0, 1.0
    v = np.asarray(logs, dtype=float)
    m, se, dof = float(v.mean()), float(v.std(ddof=1)) / math.sqrt(v.size), v.size - 1
    p_for = max(sides(m, se, dof, band)[0], sides(m, se, dof, -band)[1])
    p_against = min(sides(m, se, dof, band)[1], sides(m, se, dof, -band)[0])
    return (1 if p_for < LEVEL else -1 if p_against < LEVEL else 0), p_for, p_against


def _all_of(*tests: tuple[int, float, float]) -> tuple[int, float, float]:
    """A stage claim that needs every one of ``tests``: for when all are (an intersection-union test: the largest
    p-value), against when any is (Bonferroni over them)."""
    outcome = -1 if any(t[0] < 0 for t in tests) else 1 if all(t[0] > 0 for t in tests) else 0
    return outcome, max(t[1] for t in tests), min(1.0, len(tests) * min(t[2] for t in tests))

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


def _stage_rule(records, compare: Callable[[dict[int, dict[str, float]]], tuple[Any, str] | None], every: bool,
                what: str) -> list[Verdict]:
    """Per setup: ``compare(batches of a stage)`` -> ((outcome, p_for, p_against), text) or None (not measured at
    that stage); the stages aggregated with Holm's procedure on both sides (:func:`.core.over_stages_holm`)."""
    out = []
    for setup in _setups(records):
        stages = {s: c for s, b in e1_batches(records, setup).items() if (c := compare(b)) is not None}
        if not stages:
            continue
        verdict, pro, con = over_stages_holm({s: c[0][1] for s, c in stages.items()},
                                             {s: c[0][2] for s, c in stages.items()}, every)
        failures = tuple(f"stage {s} %: {c[1]}" for s, c in stages.items() if c[0][0] < 0)
        detail = (f"{what} at {pro} of {len(stages)} stages (Holm), against at {con}; "
                  + "; ".join(f"{s} %: {c[1]}" for s, c in stages.items()))
        out.append(Verdict(setup, verdict, detail, failures))
    return out


def _versus(a: str, b: str | None, label: str, threshold: float = -MARGIN, below: bool = True):
    """A stage comparison: ``log a - log b`` (``b`` None: SGD) decided below ``threshold`` (``below``; default:
    ``a`` better than ``b`` by more than the margin) or above it."""
    def compare(batches):
        logs = _paired(batches, a, b)
        if not logs:
            return None
        return test_mean(logs, threshold, below), f"{label} {_ratio_text(logs)}"
    return compare


def _ef_worse(records):
    return _stage_rule(records, _versus("ef", None, "EF/SGD", MARGIN, below=False), every=False,
                       what=f"EF decided worse than SGD by more than ×{TENTH_DECADE:.2f}")


def _ief_better(records):
    return _stage_rule(records, _versus("ief", None, "iEF/SGD"), every=True,
                       what=f"iEF decided better than SGD by more than ×{TENTH_DECADE:.2f}")


def _both(first, second):
    """A stage comparison that needs both ``first`` and ``second`` (:func:`_all_of`); ``None`` where either is not
    measured."""

    def compare(batches):
        a, b = first(batches), second(batches)
        if a is None or b is None:
            return None
        return _all_of(a[0], b[0]), f"{a[1]}, {b[1]}"
    return compare


def _order(records):
    compare = _both(_versus("ief", "sf", "iEF/SF"), _versus("sf", "ef", "SF/EF"))
    return _stage_rule(records, compare, every=False, what="iEF < SF < EF decided (each by the margin)")


def within_stage_slope(batches: dict[int, dict[int, dict[str, float]]], method: str) -> tuple[float, float, int]:
    """``(slope, standard error, clusters)``: the slope of ``log gamma_method/gamma_SGD`` on the log imbalance
    within stages (each stage's means removed: stage fixed effects), its standard error clustered by batch (the
    same batch index at every stage is one cluster), on ``clusters - 1`` degrees of freedom; NaN where fewer than 3
    batches or no spread of the imbalance within a stage."""
    xs, ys, ids = [], [], []
    for stage, rows in batches.items():
        pts = [(b, r["imbalance"], r[method]) for b, r in rows.items() if "imbalance" in r and method in r]
        if len(pts) < 2:
            continue
        x, y = np.array([p[1] for p in pts]), np.array([p[2] for p in pts])
        xs.append(x - x.mean())
        ys.append(y - y.mean())
        ids += [p[0] for p in pts]
    if not xs:
        return float("nan"), float("nan"), 0
    x, y, ids = np.concatenate(xs), np.concatenate(ys), np.array(ids)
    sxx = float((x * x).sum())
    clusters = np.unique(ids)
    if sxx <= 0 or clusters.size < 3:
        return float("nan"), float("nan"), int(clusters.size)
    slope = float((x * y).sum()) / sxx
    u = y - slope * x
    g = np.array([float((x[ids == c] * u[ids == c]).sum()) for c in clusters])
    var = float((g * g).sum()) / sxx ** 2 * clusters.size / (clusters.size - 1)
    return slope, math.sqrt(var), int(clusters.size)


def _imbalance_tracks(records):
    out = []
    for setup in _setups(records):
        batches = e1_batches(records, setup)
        stages = [s for s, b in batches.items() if any("imbalance" in row for row in b.values())]
        if len(stages) < 2:
            out.append(Verdict(setup, INCONCLUSIVE, f"{len(stages)} stages with an imbalance: fewer than 2"))
            continue
        first, last = batches[stages[0]], batches[stages[-1]]
        growth = [last[k]["imbalance"] - first[k]["imbalance"] for k in first
                  if k in last and "imbalance" in first[k] and "imbalance" in last[k]]
        grows = test_mean(growth, 0.0, below=False)
        tests, texts, failures = [grows], [], []
        for m, name in (("ef", "EF"), ("sf", "SF")):
            slope, se, clusters = within_stage_slope({s: batches[s] for s in stages}, m)
            if not math.isfinite(slope) or se == 0 and slope == 0:
                tests.append((0, 1.0, 1.0))
                texts.append(f"{name}: no within-stage slope")
                continue
            p_below, p_above = sides(slope, se, clusters - 1)
            t = (1 if p_above < LEVEL else -1 if p_below < LEVEL else 0, p_above, p_below)
            tests.append(t)
            half = t_ppf(0.975, clusters - 1) * se
            texts.append(f"{name}: slope {slope:+.2f} (95 % interval {slope - half:+.2f} to {slope + half:+.2f})")
            if t[0] < 0:
                failures.append(f"{name} does not track it (within-stage slope {slope:+.2f}, decided below 0)")
        verdict_t = _all_of(*tests)
        if grows[0] < 0:
            failures.insert(0, f"the imbalance shrinks (×{math.exp(np.mean(growth)):.3g})")
        verdict = HOLDS if verdict_t[1] < LEVEL else FAILS if verdict_t[2] < LEVEL else INCONCLUSIVE
        text = (f"imbalance ×{math.exp(np.mean(growth)):.3g} from stage {stages[0]} % to {stages[-1]} %; slope of "
                "log γ/γ_SGD on the log imbalance within stages, batches as clusters: " + "; ".join(texts))
        out.append(Verdict(setup, verdict, text, tuple(failures) if verdict == FAILS else ()))
    return out


def _iekfac_better(records):
    compare = _both(_versus("iekfac", "kfac", "ieKFAC/KFAC"), _versus("iekfac", "ekfac", "ieKFAC/eKFAC"))
    return _stage_rule(records, compare, every=False,
                       what=f"ieKFAC decided below both KFAC and eKFAC by more than ×{TENTH_DECADE:.2f}")


def within_band(logs: Sequence[float], band: float) -> int:
    """A two-sided comparison with a band: ``+1`` when the 95 % t interval of the mean of ``logs`` lies inside
    ``[-band, band]``, ``-1`` when it lies wholly outside it (above ``band`` or below ``-band``), ``0`` when it crosses
    an edge of the band or there are fewer than 2 values (a single batch decides nothing, as in :func:`decide`).

    Args:
        logs: per-batch log ratios.
        band: the half-width of the band on the log scale (``log(TENTH_DECADE)``: within a factor 1.26 either way).

    Returns:
        +1 (close), -1 (far) or 0 (undecided).
    """
    if len(logs) < 2:
        return 0
    _, low, high = interval(logs)
    return 1 if -band < low and high < band else -1 if low > band or high < -band else 0


def _iekfac_close(records):
    band = math.log(TENTH_DECADE)
    out = []
    for setup in _setups(records):
        stages = {s: logs for s, b in e1_batches(records, setup).items() if (logs := _paired(b, "iekfac", "ief"))}
        if not stages:
            continue
        tests = {s: test_band(logs, band) for s, logs in stages.items()}
        outcomes = {s: t[0] for s, t in tests.items()}
        below = [s for s, logs in stages.items() if decide(logs) < 0]
        texts = [f"{s} %: ieKFAC/iEF {_ratio_text(logs)}" + (" (close)" if outcomes[s] > 0 else " (far)"
                                                              if outcomes[s] < 0 else " (undecided)")
                 for s, logs in stages.items()]
        failures = tuple(f"stage {s} %: ieKFAC/iEF {_ratio_text(stages[s])}, outside "
                         f"{1 / TENTH_DECADE:.2f}–{TENTH_DECADE:.2f}" for s, o in outcomes.items() if o < 0)
        surprise = None
        if below:  # the approximation decided better than what it approximates: discussed, not counted
            surprise = ("ieKFAC, a block-diagonal approximation of iEF, is decided closer to the natural gradient "
                        f"than exact iEF at stage(s) {', '.join(f'{s} %' for s in below)}")
        verdict, pro, _ = over_stages_holm({s: t[1] for s, t in tests.items()}, {s: t[2] for s, t in tests.items()},
                                           every=False)
        detail = f"close at {pro} of {len(stages)} stages (Holm); " + "; ".join(texts)
        out.append(Verdict(setup, verdict, detail, failures, surprise))
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


def at_top_edge(curve: dict[float, dict[int, float]], lam: float) -> bool:
    """Whether ``lam`` is the largest damping of a sweep ``curve`` (of at least two dampings): a best damping there
    is one the grid cannot place, since the lowest γ may lie beyond it."""
    return len(curve) > 1 and lam == max(curve)


def edge_text(curve: dict[float, dict[int, float]], lam: float) -> str:
    """``""``, or, for a damping at the sweep's top edge, the words that say what a best damping there means, with
    the method's γ/γ_SGD there (geometric mean over batches): near 1 when the update has become SGD's direction.

    Args:
        curve: ``{damping: {batch: log(gamma / gamma_SGD)}}`` of one method at one sweep stage.
        lam: the damping reported (a best damping).

    Returns:
        The clause to append after the damping (starting with ", "), or ``""`` inside the grid.
    """
    if not at_top_edge(curve, lam):
        return ""
    there = math.exp(np.mean(list(curve[lam].values())))
    return (f", at the grid's top edge λ={lam:.0e}, where damping dominates and the damped update tends to SGD's "
            f"direction (γ/γ_SGD there {there:.3g})")


def _sweep_setups(records) -> list[str]:
    return [s for s in _setups(records) if any(r["setup"] == s and r["kind"] == "sweep" for r in records)]


def cross_fit(curve: dict[float, dict[int, float]]) -> tuple[dict[float, dict[int, float]],
                                                             dict[float, dict[int, float]]]:
    """``(choose, test)``: a sweep ``curve`` split by batch, the even-numbered batches (in order) to choose a best
    damping on and the others to test it on, so that the batches that pick the best do not also judge it (the
    lowest of several noisy means is biased low)."""
    ids = sorted({b for c in curve.values() for b in c})
    pick = set(ids[0::2])
    return ({lam: {b: v for b, v in c.items() if b in pick} for lam, c in curve.items()},
            {lam: {b: v for b, v in c.items() if b not in pick} for lam, c in curve.items()})


def _best_moves(records):
    out = []
    for setup in _sweep_setups(records):
        for method, name in (("ef", "EF"), ("sf", "SF")):
            curves = sweep_batches(records, setup, method)
            halves = {s: cross_fit(c) for s, c in curves.items()}
            best = {s: _best(h[0]) for s, h in halves.items() if all(h[0].values())}
            edge = {s: at_top_edge(curves[s], b) for s, b in best.items()}
            tests, words = {}, []
            for s in best:
                for t in best:
                    if s != t:  # at stage t, on its test batches: stage s's best against t's own
                        logs = _diff(halves[t][1][best[s]], halves[t][1][best[t]])
                        tests[(s, t)] = test_mean(logs, MARGIN, below=False)
                        if tests[(s, t)][0] > 0:
                            words.append(f"{s} %'s best is ×{math.exp(np.mean(logs)):.3g} worse at {t} %")
            text = "best λ (chosen on half the batches, tested on the other half) " + ", ".join(
                f"{s} %: {b:.0e}{edge_text(curves[s], b)}" for s, b in best.items())
            moved = holm({k: v[1] for k, v in tests.items()})
            failures: tuple[str, ...] = ()
            if len(best) < 2:
                verdict = INCONCLUSIVE
            elif moved:
                verdict = HOLDS
                text += "; moves: " + "; ".join(words)
                if all(edge[a] or edge[b] for a, b in moved):
                    at_edge = ", ".join(f"{s} %" for s in best if edge[s])
                    text += (f"; the move rests on a best damping at the grid's top edge (stage(s) {at_edge}): there "
                             f"the best {name} is one whose damping dominates, i.e. close to SGD, and the optimum "
                             "may lie beyond the grid")
            elif all(v[0] < 0 for v in tests.values()) and len(set(best.values())) == 1 and edge[next(iter(best))]:
                verdict = INCONCLUSIVE
                text += ("; the best λ is the grid's top edge at every sweep stage: where the optimum lies beyond "
                         "it, and whether it moves there, the sweep cannot tell")
            elif all(v[0] < 0 for v in tests.values()):
                verdict = FAILS
                failures = (f"each stage's best {name} λ is decided within ×{TENTH_DECADE:.2f} of every other "
                            "stage's best there",)
            else:
                verdict = INCONCLUSIVE
            out.append(Verdict(f"{setup}, {name}", verdict, text, failures))
    return out


def near_zero_cost(curve: dict[float, dict[int, float]]) -> tuple[float, dict[int, float]]:
    """``(best damping, {batch: cost})``: per batch, what using the sweep's smallest damping instead of the method's
    best one costs, ``log gamma(smallest lambda) - log gamma(best lambda)`` (0 for a method best at the smallest).

    Args:
        curve: ``{damping: {batch: log(gamma / gamma_SGD)}}`` of one method at one sweep stage.

    Returns:
        The best damping (lowest mean log ratio over batches) and the per-batch costs.
    """
    best, lam0 = _best(curve), min(curve)
    return best, {b: curve[lam0][b] - curve[best][b] for b in curve[lam0] if b in curve[best]}


def near_zero_contrast(records, setup: str) -> dict[int, dict[str, Any]]:
    """Per sweep stage of ``setup`` (with at least two iEF dampings <= :data:`NEAR_ZERO`), what
    ``e3_ief_robust`` decides on the same batches.

    Args:
        records: evaluation records with sweeps (:func:`sweep_batches`).
        setup: the setup.

    Returns:
        ``{stage: {"flat": +1/0/-1 (iEF decided within TENTH_DECADE over lambda <= NEAR_ZERO, or decided not),
        "spread": iEF's max/min over those dampings, "hi", "lo": their dampings, "lam0": the smallest damping,
        "iEF": (cost, best damping), "EF" / "SF": (cost, best damping, per-batch log cost over iEF's, +1 decided
        above TENTH_DECADE, -1 decided below: as flat as iEF, 0 undecided) or None where not swept}}``; a cost is
        the geometric mean over batches of gamma at the smallest damping over gamma at the method's best
        (:func:`near_zero_cost`).
    """
    band = math.log(TENTH_DECADE)
    curves = {m: sweep_batches(records, setup, m) for m in ("ief", "ef", "sf")}
    out: dict[int, dict[str, Any]] = {}
    for stage, curve in curves["ief"].items():
        small = {lam: c for lam, c in curve.items() if lam <= NEAR_ZERO}
        if len(small) < 2:
            continue
        means = {lam: np.mean(list(c.values())) for lam, c in small.items()}
        hi, lo = max(means, key=means.get), min(means, key=means.get)
        ief_best, ief_cost = near_zero_cost(curve)
        flat = test_mean(_diff(small[hi], small[lo]), band, below=True)
        row: dict[str, Any] = {"flat": flat[0], "flat_test": flat,
                               "spread": math.exp(means[hi] - means[lo]), "hi": hi, "lo": lo, "lam0": min(curve),
                               "iEF": (math.exp(np.mean(list(ief_cost.values()))), ief_best)}
        for m, name in (("ef", "EF"), ("sf", "SF")):
            other = curves[m].get(stage)
            if not other:
                row[name] = None
                continue
            best, cost = near_zero_cost(other)
            logs = [cost[b] - ief_cost[b] for b in cost if b in ief_cost]
            t = test_mean(logs, band, below=False)
            row[name] = (math.exp(np.mean(list(cost.values()))), best, logs, t[0], t)
        out[stage] = row
    return out


def _ief_robust(records):
    out = []
    for setup in _sweep_setups(records):
        outcomes, texts, failures = {}, [], []
        for stage, row in near_zero_contrast(records, setup).items():
            votes_t = [row["flat_test"]]
            if row["flat"] < 0:
                failures.append(f"stage {stage} %: iEF at λ={row['hi']:.0e} is ×{row['spread']:.3g} its value at "
                                f"λ={row['lo']:.0e}")
            parts = [f"{stage} %: iEF max/min ×{row['spread']:.3g} over λ ≤ {NEAR_ZERO:g}; cost of "
                     f"λ={row['lam0']:.0e} instead of the best λ: iEF ×{row['iEF'][0]:.3g} (best {row['iEF'][1]:.0e})"]
            votes = [row["flat"]]
            for name in ("EF", "SF"):
                if row[name] is None:
                    parts.append(f"{name} not swept: the contrast is undecided")
                    votes.append(0)
                    votes_t.append((0, 1.0, 1.0))
                    continue
                cost, best, logs, c, t = row[name]
                votes.append(c)
                votes_t.append(t)
                curve = sweep_batches(records, setup, name.lower())[stage]
                text = (f"{name} ×{cost:.3g} (best {best:.0e}{edge_text(curve, best)}), {name}'s cost over iEF's "
                        f"{_ratio_text(logs) if logs else 'n/a'}")
                if c < 0:
                    text += f": {name} is as flat as iEF here, the sweep does not separate them"
                    failures.append(f"stage {stage} %: {name} pays no more than iEF for the near-zero damping "
                                    f"({name}'s cost over iEF's {_ratio_text(logs)}): the sweep does not separate "
                                    f"iEF from {name}")
                parts.append(text)
            texts.append(", ".join(parts))
            outcomes[stage] = _all_of(*votes_t)
        if outcomes:
            verdict = over_stages_holm({k: t[1] for k, t in outcomes.items()}, {k: t[2] for k, t in outcomes.items()},
                                       every=True)[0]
            out.append(Verdict(setup, verdict, "; ".join(texts), tuple(failures)))
    return out


def _ef_signature(records):
    out = []
    for setup in _sweep_setups(records):
        outcomes, texts, failures = {}, [], []
        for stage, curve in sweep_batches(records, setup, "ef").items():
            lam0 = min(curve)
            best = _best(curve)
            far_t = test_mean(list(curve[lam0].values()), math.log(DECADE), below=False)
            rescued_t = (test_mean(_diff(curve[best], curve[lam0]), -math.log(DECADE)) if best != lam0
                         else (-1, 1.0, 0.0))
            far, rescued = far_t[0], rescued_t[0]
            outcomes[stage] = _all_of(far_t, rescued_t)
            u, b = math.exp(np.mean(list(curve[lam0].values()))), math.exp(np.mean(list(curve[best].values())))
            edge = edge_text(curve, best)
            texts.append(f"{stage} %: un-damped EF/SGD {u:.3g}, best (λ={best:.0e}{edge}) {b:.3g}"
                         + ("; the rescue is damping turning EF into SGD" if edge else ""))
            if far < 0:
                failures.append(f"stage {stage} %: un-damped EF is {u:.3g}× SGD, not a decade worse")
            if rescued < 0:
                failures.append(f"stage {stage} %: damping improves EF only ×{u / b:.3g}, less than a decade")
        if outcomes:
            verdict = over_stages_holm({k: t[1] for k, t in outcomes.items()}, {k: t[2] for k, t in outcomes.items()},
                                       every=False)[0]
            out.append(Verdict(setup, verdict, "; ".join(texts), tuple(failures)))
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
                edge = edge_text(other[stage], best)
                outcomes[stage] = test_mean(logs, math.log(threshold))
                texts.append(f"{stage} %: iEF/best {name} {_ratio_text(logs)} ({name}'s best λ={best:.0e}{edge})")
                if outcomes[stage][0] < 0:
                    failures.append(f"stage {stage} %: iEF is {math.exp(np.mean(logs)):.3g}× {name} at "
                                    f"λ={best:.0e}{edge}")
            if outcomes:
                verdict = over_stages_holm({k: t[1] for k, t in outcomes.items()},
                                           {k: t[2] for k, t in outcomes.items()}, every=True)[0]
                out.append(Verdict(setup, verdict, "; ".join(texts), tuple(failures)))
        return out
    return check


def top_edge_bests(records) -> list[tuple[str, str, list[int]]]:
    """``[(setup, method name, stages)]``: where EF's or SF's best damping (lowest mean log ratio over batches) is
    the sweep grid's top edge, so that what the chapter reports as "best" is a damping that dominates the update.

    Args:
        records: evaluation records with sweeps (:func:`sweep_batches`).

    Returns:
        One entry per setup and method with at least one such sweep stage, in record order.
    """
    out = []
    for setup in _sweep_setups(records):
        for method, name in (("ef", "EF"), ("sf", "SF")):
            stages = [s for s, c in sweep_batches(records, setup, method).items() if at_top_edge(c, _best(c))]
            if stages:
                out.append((setup, name, stages))
    return out


# ------------------------------------------------------------------------------------------------- the rules
E1_AGGREGATION = ("A claim of the paper for \"most stages\" holds for a setup when the stages Holm's procedure counts "
                  "in its favour (a 95 % lower bound on how many truly are) are a strict majority, does not hold "
                  "when the stages Holm counts against it leave no majority reachable, and is inconclusive "
                  "otherwise; a claim for every stage (\"consistently\") holds when every stage is decided in its "
                  "favour and does not hold when Holm's procedure over the stages finds one against it. A claim of a "
                  f"difference (\"better\", \"worse\", \"moves\") needs it beyond ×{TENTH_DECADE:.2f}, a tenth of "
                  "a decade on the paper's log axes, and a difference decided within that counts against it.")
SCOPE = ("E1 and E3 measure one training trajectory per setup (the baseline optimiser's run with the evaluation seed) "
         "at its stage checkpoints: the batches are the only replicates, so a verdict speaks for that run's "
         "checkpoints, not for how another seed's run would come out.")
DECIDED = ("A comparison at one checkpoint is decided when the 95 % t interval of the mean over its batches of the "
           "log ratio lies on one side of the threshold. " + SCOPE)
WHY_T = ("The batches are the same for every method and damping, so every comparison is paired per batch; the "
         "interval makes a difference smaller than the batch-to-batch spread undecided instead of a coin flip.")

EVALUATION_RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("e1_ef_worse", "EF has a poorer approximation quality than SGD for most training stages and tasks",
         "sec:eval_exp", f"EF is worse than SGD at a stage when γ_EF/γ_SGD is decided above "
         f"{TENTH_DECADE:.2f}, and not when it is decided below {TENTH_DECADE:.2f}; the claim holds for a setup "
         "when Holm's count of stages for it is a strict majority.", WHY_T, _ef_worse),
    Rule("e1_ief_better", "iEF consistently improves on SGD updates", "sec:exp",
         f"iEF is better than SGD at a stage when γ_iEF/γ_SGD is decided below 1/{TENTH_DECADE:.2f}; the claim holds "
         "for a setup when that is so at every stage, and does not hold when Holm's procedure over the stages finds "
         f"one where γ_iEF/γ_SGD is decided above 1/{TENTH_DECADE:.2f} (a decided tie included).",
         "\"Consistently\" is read as every stage. " + WHY_T, _ief_better),
    Rule("e1_order", "for the majority of the training stages the approximation quality follows iEF > SF > EF",
         "sec:eval_exp", f"The order holds at a stage when both γ_iEF/γ_SF and γ_SF/γ_EF are decided below "
         f"1/{TENTH_DECADE:.2f}; the claim holds for a setup when Holm's count of such stages is a strict majority.",
         WHY_T, _order),
    Rule("e1_imbalance", "the gradient-norm imbalance gets larger as training progresses and correlates with the EF "
         "and SF curves", "sec:eval_exp", "The imbalance grows when its per-batch ratio last/first stage is decided "
         "above 1; it tracks EF (SF) when, within stages, the slope of log γ_EF/γ_SGD (log γ_SF/γ_SGD) on the log "
         "imbalance over the batches is decided above 0 (stage means removed, standard error clustered by batch). "
         "The claim holds when all three are decided for it, and does not hold when one is decided against it "
         "(Bonferroni over the three).",
         "A correlation of five stage means is driven by whatever trend the two share over training: it hardly "
         "fails (r = 0.86 on 5 points has a 95 % interval from -0.09 to 0.99). The within-stage slope asks the "
         "paper's mechanism directly: at one checkpoint, are the batches with the larger imbalance those on which "
         "EF and SF are worse?", _imbalance_tracks),
    Rule("e3_best_moves", "the optimal damping factor for EF and SF changes greatly with training stages",
         "sec:exp-damping", "Per method and sweep stage, the best damping is chosen on half the batches (the even-"
         "numbered) and judged on the other half. The best damping moves when, for some pair of sweep stages, one "
         f"stage's best is decided more than ×{TENTH_DECADE:.2f} worse than the other stage's own best there (Holm "
         "over the ordered pairs of stages); it does not move when every stage's best is decided within "
         f"×{TENTH_DECADE:.2f} of every other stage's best there. A best damping at the grid's top edge is named as "
         "such: there damping dominates and the update tends to SGD's direction, so a move that rests on it is "
         "reported with it, and the same best at the top edge at every stage is inconclusive (the optimum may lie "
         "beyond the grid).",
         "Choosing the best on the batches that then judge it favours it (the lowest of several noisy means is "
         "biased low); and without a margin any shift of the optimum becomes a \"move\" once there are enough "
         f"batches. ×{TENTH_DECADE:.2f} is a tenth of a decade on the paper's log axes.", _best_moves),
    Rule("e3_ief_robust", "iEF robustly achieves great approximation quality with a near-zero damping factor, "
         "unlike EF and SF, whose quality relies on careful damping tuning", "sec:exp-damping",
         f"At a sweep stage, on the same batches: iEF is flat when its γ at the worst and at the best damping "
         f"λ ≤ {NEAR_ZERO:g} are decided within a factor {TENTH_DECADE:.2f}; a method's cost of the near-zero "
         "damping is, per batch, its γ at the sweep's smallest damping over its γ at its own best damping; EF and SF "
         f"need the damping where iEF does not when their cost over iEF's is decided above {TENTH_DECADE:.2f}. A "
         "stage is for the claim when all three are decided in its favour, and against it when iEF is decided not "
         f"flat or EF's or SF's cost over iEF's is decided below {TENTH_DECADE:.2f} (they are as flat as iEF: the "
         "sweep does not separate iEF from them, and the detail says so). The claim holds when every sweep stage is "
         "for it and does not hold when one is against it.",
         f"The paper's claim is a contrast with EF and SF (\"unlike iEF which works well with any near-zero "
         f"damping\"): iEF's flatness alone cannot fail where EF and SF are as flat, so the rule also asks what the "
         f"near-zero damping costs each method against its own optimum, which is nothing for a method that needs no "
         f"damping. A factor {TENTH_DECADE:.2f} is a tenth of a decade: flat on the paper's log axes. The quality "
         "part (\"great\") is decided by the comparisons with optimally damped SF and with EF.", _ief_robust),
    Rule("e3_ief_vs_sf", "iEF's approximation quality is comparable to the optimally-damped SF method",
         "sec:exp-damping", f"At each sweep stage, iEF at its smallest damping is comparable to SF at its best "
         f"damping when γ_iEF/γ_SF is decided below {TENTH_DECADE:.2f} (iEF better counts as comparable); the claim "
         "holds when that is so at every sweep stage. A best damping of SF at the grid's top edge is named as such.",
         f"{TENTH_DECADE:.2f} is a tenth of a decade on the paper's log axes; a factor 2 could hardly fail.",
         _ief_vs_best("sf", "SF", TENTH_DECADE)),
    Rule("e3_ief_vs_ef", "iEF's approximation quality is consistently better than the EF method", "sec:exp-damping",
         f"At each sweep stage, iEF at its smallest damping beats EF at its best damping when γ_iEF/γ_EF is decided "
         f"below 1/{TENTH_DECADE:.2f}; the claim holds when that is so at every sweep stage. A best damping of EF "
         "at the grid's top edge (EF damped into SGD's direction) is named as such.", WHY_T,
         _ief_vs_best("ef", "EF", 1 / TENTH_DECADE)),
    Rule("e3_ef_signature", "un-damped EF is far worse than SGD and a well-chosen damping significantly improves it",
         "sec:exp-damping", "At a sweep stage the signature is there when un-damped EF (the smallest damping) is "
         "decided more than a decade worse than SGD and EF at its best damping is decided more than a decade better "
         "than un-damped; it holds for a setup when Holm's count of such sweep stages is a strict majority. A best "
         "damping at the "
         "grid's top edge is named as such: the rescue is then damping turning EF into SGD.",
         "A decade is the scale of the paper's figure (un-damped EF two to three decades above SGD).", _ef_signature),
    Rule("bd_iekfac_better", "ieKFAC has a much better approximation quality than KFAC and eKFAC in most training "
         "stages", "fig:sample_blockdiag_gamma", "ieKFAC is better at a stage when γ_ieKFAC/γ_KFAC and "
         f"γ_ieKFAC/γ_eKFAC are both decided below 1/{TENTH_DECADE:.2f}; the claim holds when Holm's count of such "
         "stages is a strict majority.",
         f"\"Much\" is read as more than ×{TENTH_DECADE:.2f}, a tenth of a decade. " + WHY_T, _iekfac_better),
    Rule("bd_iekfac_close", "ieKFAC has a similar approximation quality to the exact iEF method",
         "fig:sample_blockdiag_gamma", f"ieKFAC is close to iEF at a stage when the 95 % interval of "
         f"γ_ieKFAC/γ_iEF lies inside {1 / TENTH_DECADE:.2f}–{TENTH_DECADE:.2f} (either side of 1), far when it lies "
         "wholly outside that band (above or below), and undecided when it crosses an edge of the band; the claim "
         "holds at a strict majority of the stages. ieKFAC decided below exact iEF (the approximation beating what "
         "it approximates) is named as a surprise for the chapter to discuss, not counted against the claim.",
         f"\"Similar\" is two-sided: ieKFAC better than iEF is as similar as ieKFAC worse by the same factor. "
         f"{TENTH_DECADE:.2f} is a tenth of a decade on the paper's log axes. " + WHY_T, _iekfac_close),
)}
E1_RULES = ("e1_ef_worse", "e1_ief_better", "e1_order", "e1_imbalance")
E3_RULES = ("e3_best_moves", "e3_ief_robust", "e3_ief_vs_sf", "e3_ief_vs_ef", "e3_ef_signature")
BLOCK_RULES = ("bd_iekfac_better", "bd_iekfac_close")
