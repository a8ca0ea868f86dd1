"""The E2 and training chapters' rules (:mod:`companion.experiments.verdicts`): the paper's rankings of the optimisers
(``sec:opt-exp``, ``tab:sum-test``) decided over seeds on the E2 runs (:mod:`companion.experiments.aggregate`'s table and
curves), and the training chapter's seed-0 ranks, which rank one draw and decide nothing."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .core import FAILS, HOLDS, INCONCLUSIVE, MIN_SEEDS, ON_PAR_POINTS, PairResult, Rule, Verdict, pair_over_seeds

# ------------------------------------------------------------------------------------------------ E2 (runs)
LABELS = {"adamw": "AdamW", "adafactor": "Adafactor", "adam": "Adam", "sgd": "SGD", "ef": "EF", "sf": "SF",
          "ief": "iEF", "ief-momentum": "iEF+M", "kfac": "KFAC", "ekfac": "eKFAC", "iekfac": "ieKFAC"}
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
    :data:`RISE_WINDOWS` equal windows of updates (:func:`companion.experiments.aggregate.curve_bands`); +inf for a run
    whose averaged loss is not finite (it diverged)."""
    from ..aggregate import curve_bands

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
    from ..setups import resolve, scales_of

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


def disagreements(seed0: Sequence[Verdict], e2: Sequence[Verdict]) -> list[str]:
    """Setups where the seed-0 verdict and the E2 (over seeds) verdict of the same claim differ, in words."""
    other = {v.subject: v for v in e2}
    return [f"{v.subject}: seed 0 {v.verdict}, over seeds {other[v.subject].verdict}" for v in seed0
            if v.subject in other and v.verdict != other[v.subject].verdict]
