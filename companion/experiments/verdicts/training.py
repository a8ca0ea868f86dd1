"""The E2 and training chapters' rules (:mod:`companion.experiments.verdicts`): the paper's rankings of the optimisers
(``sec:opt-exp``, ``tab:sum-test``) decided over seeds on the E2 runs (:mod:`companion.experiments.aggregate`'s table
and
curves), and the training chapter's seed-0 ranks, which rank one draw and decide nothing."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .core import (FAILS, HOLDS, INCONCLUSIVE, ON_PAR_POINTS, SIGN_LEVEL, TENTH_DECADE, PairResult, Rule,
                   SeedPrice, Verdict, binomial_resolution, pair_over_seeds)
from .stats import LEVEL, Pooled, holm, pooled_blocks

# ------------------------------------------------------------------------------------------------ E2 (runs)
LABELS = {"adamw": "AdamW", "adafactor": "Adafactor", "adam": "Adam", "sgd": "SGD", "ef": "EF", "sf": "SF",
          "ief": "iEF", "ief-momentum": "iEF+M", "kfac": "KFAC", "ekfac": "eKFAC", "iekfac": "ieKFAC"}
RISE_WINDOWS = 20  # EF's instability: a run's loss averaged over at most this many equal windows of updates,
RISE_MIN_UPDATES = 8  # each of at least this many updates (a 64-update run: 8 windows of 8, not 20 of 3)
LOSS_COLUMNS = ("final_train_loss", "final_train_loss_full")  # compared as log ratios: losses span decades
POOLED_MAX_SEEDS = 4  # a setup with at most this many seeds decides its log ratios on the pooled variance
MARGIN = math.log(TENTH_DECADE)  # "unstable", "improves": a material difference, a tenth of a decade


def loss_column(table) -> str:
    """The final loss the rankings compare: the full training-set loss of the final checkpoint
    (``final_train_loss_full``, :mod:`companion.experiments.final_loss`; inf for a diverged run) where every run of
    the table (the rankings pass one setup's runs) has it, else the mean of the last 10 % of the minibatch losses
    (``final_train_loss``)."""
    full = "final_train_loss_full"
    return full if full in table.columns and table[full].notna().all() else "final_train_loss"


def _pooled(table, setup: str, optimizers: Sequence[str], column: str, worst: float | None) -> Pooled | None:
    """The setup's pooled residual variance of ``log column`` over its optimisers, the seeds as blocks
    (:func:`.stats.pooled_blocks`), for a setup with at most :data:`POOLED_MAX_SEEDS` seeds; None otherwise."""
    per = {o: {k: math.log(v) if v > 0 else float("nan") for k, v in _per_seed(table, setup, o, column, worst).items()}
           for o in optimizers}
    per = {o: v for o, v in per.items() if v}
    seeds = {k for v in per.values() for k in v}
    return pooled_blocks(per) if 2 <= len(seeds) <= POOLED_MAX_SEEDS else None


def _seed_minutes(table, setup: str, a: str, b: str) -> SeedPrice | None:
    """What one more seed of ``a`` and ``b`` costs: core-minutes, the two optimisers' mean recorded ``wall_time_s``
    (each run is one single-threaded process on this machine), and H200 GPU-minutes, their updates per run times the
    GPU benchmark records' bound on an update (:func:`companion.experiments.gpu_price.seed_gpu_minutes`)."""
    from ..gpu_price import seed_gpu_minutes
    from ..setups import resolve

    if table is None:
        return None
    rows = table[(table.setup == setup) & table.optimizer.isin([a, b])]
    core = None
    if "wall_time_s" in table.columns:
        per = rows.groupby("optimizer")["wall_time_s"].mean()
        core = float(per.sum()) / 60 if len(per) == 2 and np.isfinite(per).all() else None
    gpu = None
    if "steps" in table.columns and "scale" in table.columns and len(rows):
        steps = rows.groupby("optimizer")["steps"].max()
        if len(steps) == 2:
            try:
                family = resolve(setup, str(rows.scale.iloc[0])).family
            except ValueError:  # a setup of a test's table, not in the registry
                family = None
            gpu = seed_gpu_minutes(family, {o: float(n) for o, n in steps.items()}) if family else None
    return SeedPrice(core, gpu) if core is not None or gpu is not None else None


def _per_example(predictions, setup: str, a: str, b: str, diffs: dict[int, float]) -> np.ndarray | None:
    """``(seeds, examples)`` of ``correct(b) - correct(a)`` (negative: ``a`` ahead) over the seeds with a usable
    difference, from the runs' per-example test predictions; None where a run lacks them or where they do not
    reproduce the table's test score (a metric other than accuracy: the crossed analysis does not apply)."""
    if predictions is None or not len(predictions):
        return None
    seeds = sorted(k for k, d in diffs.items() if d is not None and math.isfinite(d))
    p = predictions[(predictions.setup == setup) & predictions.optimizer.isin([a, b])]
    if p.empty:
        return None
    wide = p.pivot_table(index=["optimizer", "seed"], columns="example", values="correct", aggfunc="first")
    if any((o, k) not in wide.index for o in (a, b) for k in seeds) or wide.isna().any().any():
        return None
    x = np.stack([wide.loc[(b, k)].to_numpy(float) - wide.loc[(a, k)].to_numpy(float) for k in seeds])
    if not np.allclose(x.mean(axis=1), [diffs[k] for k in seeds], atol=1e-6):
        return None
    return x


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


def _seed_diffs(x: dict[int, float], y: dict[int, float], log: bool = False) -> dict[int, float]:
    """``x - y`` per seed over the seeds of either (``log``: ``log x - log y``, for positive quantities that span
    decades); NaN where one is missing or not positive on a log scale; inf - inf is NaN: a tie."""
    out = {}
    for seed in sorted(set(x) | set(y)):
        a, b = x.get(seed, float("nan")), y.get(seed, float("nan"))
        if log:
            a, b = (math.log(v) if v > 0 else float("nan") for v in (a, b))
        out[seed] = float("nan") if (math.isinf(a) and math.isinf(b) and a == b) else a - b
    return out


def n_test_examples(setup: str, scale: str) -> int | None:
    """The size of ``setup``'s test set at ``scale``: the setup's kept size, else the whole split's
    (:data:`companion.experiments.data.FULL_SIZES`); None where neither is known."""
    from ..data import FULL_SIZES
    from ..setups import resolve

    cfg = resolve(setup, scale)
    n = cfg.sizes.get("test")
    return n if n is not None else FULL_SIZES.get(cfg.task, {}).get("test")


def available_examples(setup: str) -> int | None:
    """The most examples ``setup``'s data set holds where that is fixed (:data:`..data.DATASET_EXAMPLES`), else
    None (a data set of unknown size, or a name that is no registered setup)."""
    from ..data import DATASET_EXAMPLES
    from ..setups import SETUPS, resolve, scales_of

    return DATASET_EXAMPLES.get(resolve(setup, scales_of(setup)[-1]).task) if setup in SETUPS else None


def _resolution(table, setup: str, a: str, b: str, column: str) -> tuple[float, int | None]:
    """The test set's standard error of ``a``'s minus ``b``'s mean test accuracy (:func:`.core.binomial_resolution`)
    and its size; ``(0, None)`` for a training metric or where the scale or the test size is unknown."""
    if column != "test_score" or "scale" not in table.columns:
        return 0.0, None
    rows = table[table.setup == setup]
    if rows.empty:
        return 0.0, None
    examples = n_test_examples(setup, str(rows.scale.iloc[0]))
    mean = {o: float(rows[rows.optimizer == o][column].mean()) for o in (a, b)}
    if not examples or not all(math.isfinite(v) for v in mean.values()):
        return 0.0, examples
    return binomial_resolution(mean[a], mean[b], examples), examples


def _windows(steps: int) -> int:
    return max(1, min(RISE_WINDOWS, steps // RISE_MIN_UPDATES))


def loss_rises(curves) -> dict[tuple[str, str, int], float]:
    """``{(setup, optimizer, seed): climb}``: each run's largest climb of its training loss above the lowest loss it
    had reached before, as a factor.

    The loss is averaged over at most :data:`RISE_WINDOWS` equal windows of at least :data:`RISE_MIN_UPDATES`
    updates (:func:`companion.experiments.aggregate.curve_bands`); the first update's loss is the starting point, so
    a run whose loss leaves its initial value upwards and stays there climbs by that factor. A run that only
    descends has a climb of 1 (plus its windows' noise); +inf for a run whose averaged loss is not finite (it
    diverged)."""
    from ..aggregate import curve_bands

    out = {}
    loss = curves[curves.quantity == "train_loss"]
    for (setup, opt, seed), run in loss.groupby(["setup", "optimizer", "seed"]):
        run = run.sort_values("step")
        raw = run["value"].to_numpy(dtype=float)
        means = curve_bands(run, "train_loss", points=_windows(len(run)))["mean"].to_numpy(dtype=float)
        values = np.concatenate([raw[:1], means])
        ok = raw.size > 0 and np.all(np.isfinite(raw)) and values.min() > 0
        out[(setup, opt, int(seed))] = (float(np.max(values / np.minimum.accumulate(values))) if ok
                                        else float("inf"))
    return out


def _pairs_verdict(setup: str, pairs: list[PairResult], fail_text: Callable[[PairResult], str]) -> Verdict:
    """Holds iff every pair holds (an intersection-union test: no correction); does not hold iff Holm's procedure
    over the pairs' p-values against the claim rejects one (the chance of a false "does not hold" stays at 5 % over
    the family, not 2.5 % per pair); else inconclusive. A pair decided against at its own 95 % but not after Holm
    leaves the verdict inconclusive, and says so."""
    outcomes = [p.verdict for p in pairs]
    rejected = set(holm({i: p.p_against for i, p in enumerate(pairs)}, LEVEL))
    failing = [p for i, p in enumerate(pairs) if i in rejected]
    verdict = (INCONCLUSIVE if not pairs else HOLDS if all(o == HOLDS for o in outcomes) else
               FAILS if failing else INCONCLUSIVE)
    detail = "; ".join(f"{p.pair}: {p.agreement}" for p in pairs)
    needs = pairs_needs(pairs) if verdict == INCONCLUSIVE else None
    alone = [p.pair for i, p in enumerate(pairs) if p.verdict == FAILS and i not in rejected]
    if verdict == INCONCLUSIVE and alone:
        held = (f"{', '.join(alone)} against the claim at its own 95 % level but not after Holm's correction over "
                f"{len(pairs)} pairs")
        needs = f"{held}; {needs}" if needs else held
    return Verdict(setup, verdict, detail, tuple(fail_text(p) for p in failing), pairs=tuple(pairs), needs=needs)


def pairs_needs(pairs: Sequence[PairResult]) -> str | None:
    """What would decide the undecided pairs of a verdict, in words: the most seeds any of them needs (at 80 %
    power), or what else would (a larger test set; naming the pairs)."""
    open_ = [p for p in pairs if p.verdict == INCONCLUSIVE and p.needs]
    if not open_:
        return None
    seeds = {p.pair: int(p.needs.split()[1]) for p in open_ if p.needs.startswith("needs ") and
             p.needs.split()[1].isdigit()}
    other = [p for p in open_ if p.pair not in seeds]
    parts = []
    if seeds:
        worst = max(seeds, key=seeds.get)
        text = next(p.needs for p in open_ if p.pair == worst)
        parts.append(f"{text} for {worst}" if len(seeds) == 1 else
                     f"{text} for {worst}, the most of {len(seeds)} undecided pairs")
    never = [p.pair for p in other if p.needs.startswith("no number of seeds: the mean")]
    if never:
        parts.append("no number of seeds decides " + ", ".join(never))
    parts += [f"{p.pair}: {p.needs}" for p in other if p.pair not in never]
    return "; ".join(parts)


def _fails_text(p: PairResult, scale: float = 1.0, what: str = "") -> str:
    if math.isnan(p.mean):
        return f"{p.pair} fails ({p.agreement})"
    return (f"{p.pair} fails: mean {what}{scale * p.mean:+.3g}, 95 % interval {scale * p.low:+.3g} to "
            f"{scale * p.high:+.3g}")


def _ranking(pairs_of: Callable[[list[str]], list[tuple[str, str]]], column: str, higher_better: bool = False,
             margin: float = 0.0):
    """A ranking rule: for each pair ``(a, b)`` of a setup's optimisers, ``a`` better than ``b`` on ``column``,
    decided over seeds (:func:`.core.pair_over_seeds`): final losses as log ratios (a diverged run's loss is +inf;
    the full training-set loss where every run has it, :func:`loss_column`; the pooled variance for a setup with
    few seeds), test scores on the runs' per-example predictions where they exist (else widened by the test set's
    resolution, :func:`_resolution`); ``margin``: a claim of a material improvement."""

    def check(table, curves, opts, predictions=None):
        out = []
        for setup, optimizers in opts.items():
            col = loss_column(table[table.setup == setup]) if column in LOSS_COLUMNS else column
            log = col in LOSS_COLUMNS
            present = [o for o in optimizers if ((table.setup == setup) & (table.optimizer == o)).any()]
            pooled = _pooled(table, setup, present, col, float("inf")) if log else None
            pairs = []
            for a, b in pairs_of(present):
                x = _per_seed(table, setup, a, col, None if higher_better else float("inf"))
                y = _per_seed(table, setup, b, col, None if higher_better else float("inf"))
                diffs = _seed_diffs(y, x, log) if higher_better else _seed_diffs(x, y, log)
                sign = ">" if higher_better else "<"
                resolution, examples = _resolution(table, setup, a, b, col)
                per_example = _per_example(predictions, setup, a, b, diffs) if col == "test_score" else None
                pairs.append(pair_over_seeds(setup, f"{_name(a)} {sign} {_name(b)}", col, diffs,
                                             resolution=resolution, examples=examples,
                                             unit=100.0 if col == "test_score" else 1.0, per_example=per_example,
                                             pooled=pooled, seed_minutes=_seed_minutes(table, setup, a, b),
                                             margin=margin, available=available_examples(setup)))
            if pairs:
                unit = 100.0 if col == "test_score" else 1.0
                what = "log ratio " if log else "difference (points) " if unit == 100 else "difference "
                out.append(_pairs_verdict(setup, pairs, lambda p: _fails_text(p, unit, what)))
        return out
    return check


def _paper_order(present: list[str]) -> list[tuple[str, str]]:
    """tab:train's ranking iEF < baseline < SGD < SF < EF (the baseline: the first optimiser of the setup)."""
    order = [o for o in ["ief", present[0] if present else None, "sgd", "sf", "ef"] if o in present]
    return [(a, b) for i, a in enumerate(order) for b in order[i + 1:]]


def _ief_first(present: list[str]) -> list[tuple[str, str]]:
    return [("ief", o) for o in present if o != "ief"] if "ief" in present else []


def _ef_unstable(table, curves, opts, predictions=None):
    rise = loss_rises(curves)
    out = []
    for setup, optimizers in opts.items():
        if not any(k[:2] == (setup, "ef") for k in rise):
            continue
        per = {o: {k[2]: v for k, v in rise.items() if k[:2] == (setup, o)} for o in optimizers}
        logs = {o: {k: math.log(v) for k, v in per[o].items()} for o in optimizers if per[o]}
        seeds = {k for v in logs.values() for k in v}
        pooled = pooled_blocks(logs) if 2 <= len(seeds) <= POOLED_MAX_SEEDS else None
        pairs = [pair_over_seeds(setup, f"EF climbs more than {_name(o)}", "loss climb",
                                 _seed_diffs(per[o], per["ef"], log=True), pooled=pooled, margin=MARGIN,
                                 seed_minutes=_seed_minutes(table, setup, "ef", o))
                 for o in optimizers if o != "ef" and per[o]]

        def mean(o):
            v = [x for x in per[o].values() if math.isfinite(x)]
            return f"{float(np.exp(np.mean(np.log(v)))):.3g}×" if v else "diverged"

        v = _pairs_verdict(setup, pairs, lambda p: p.pair)
        if v.failures:  # one sentence naming every optimiser whose climb EF's is decided not to exceed by ×1.26
            of = {f"EF climbs more than {_name(o)}": o for o in optimizers}
            v = Verdict(setup, v.verdict, v.detail, (f"EF's loss climb {mean('ef')} is not decided ×"
                                                     f"{TENTH_DECADE:.2f} above: " + ", ".join(
                f"{_name(of[f])} {mean(of[f])}" for f in v.failures),), pairs=v.pairs, needs=v.needs)
        out.append(v)
    return out


def _ief_vs_baseline_test(table, curves, opts, methods=None, predictions=None):
    """Prompt tuning and the MLP: iEF's test score decided above the baseline's. LoRA ("competitive", 4 of 8 each
    way): on par, the mean difference decided within ±ON_PAR_POINTS points; not on par when decided beyond it. Both
    on the paired interval over seeds widened by the test set's resolution."""
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
        resolution, examples = _resolution(table, setup, "ief", base, "test_score")
        band = None if method != "lora" else ON_PAR_POINTS / 100
        name = f"iEF > {_name(base)} (test)" if band is None else f"iEF on par with {_name(base)} (test)"
        p = pair_over_seeds(setup, name, "test_score", diffs, resolution=resolution, band=band, examples=examples,
                            unit=100.0, per_example=_per_example(predictions, setup, "ief", base, diffs),
                            seed_minutes=_seed_minutes(table, setup, "ief", base),
                            available=available_examples(setup))
        out.append(_pairs_verdict(setup, [p], lambda q: _fails_text(q, -100.0, "iEF minus baseline, points: ")
                                  if band is None else _fails_text(q, 100.0, "baseline minus iEF, points: ")))
    return out


DECIDED_OVER_SEEDS = ("A pair is decided over seeds on the per-seed differences (final losses as log ratios, test "
                      "scores in percentage points): it holds when the 95 % interval of their mean lies on the "
                      "claim's side of 0, does not hold when it lies on the other side, and is undecided when it "
                      "straddles 0. The interval, stated before the runs are read: a final loss is the full "
                      "training-set loss of the final checkpoint where the runs have it; a setup with at most "
                      f"{POOLED_MAX_SEEDS} seeds takes the variance of its log ratios pooled over all its optimisers "
                      "with the seeds as blocks, unless a check of the equal variances it assumes (each pair's "
                      "difference variance against the pooled one, F tests, Bonferroni) rejects them at 5 % (then "
                      "each pair its own); a test score is decided on the runs' per-example predictions, "
                      "seeds and test examples crossed (the seeds' spread, the examples' and their interaction, "
                      "with Satterthwaite's t), or, for a run without them, with the test set's binomial error "
                      f"added; a pair with a diverged run is decided by the exact sign test at level {SIGN_LEVEL:g}. "
                      "A claim over several pairs holds when every pair holds and does not hold when Holm's "
                      "procedure over its pairs finds one against it (a false \"does not hold\" at most 5 % of the "
                      "time however many pairs).")
WHY_OVER_SEEDS = ("An interval narrows as seeds (and test examples) are added, so more evidence decides more pairs "
                  "in either direction; an undecided pair says how many seeds would decide it with 80 % power at "
                  "its observed mean and spread, the range that the spread's own uncertainty gives, and what they "
                  "would cost in core-minutes of this machine and, as an upper estimate from the GPU benchmark "
                  "records, in H200 GPU-minutes (the run's updates at the recorded time of an update of a model at "
                  "least as large).")

# What every rule over seeds shares (how a pair is decided, and what would decide it): a rule's own text says only
# what is particular to its claim, so that a chapter states the shared part once, before the claims.
OVER_SEEDS = DECIDED_OVER_SEEDS + " " + WHY_OVER_SEEDS


E2_RULES_LIST = (
    Rule("e2_loss_ranking", "the ranking of final training loss generally follows iEF < AdamW/Adafactor < SGD < SF < "
         "EF", "sec:opt-exp", "Every ordered pair of the ranking (10 with all five optimisers) is decided over "
         "seeds on the log ratio of the two final losses; the ranking holds for a setup when every pair holds, and "
         "does not hold when Holm's procedure over the pairs finds one against it.", OVER_SEEDS,
         _ranking(_paper_order, "final_train_loss")),
    Rule("e2_ief_lowest", "iEF consistently reaches the lowest training loss at the end of training", "sec:opt-exp",
         "iEF's final training loss is decided below every other optimiser's of the setup (each pair decided over "
         "seeds as for the ranking).", OVER_SEEDS, _ranking(_ief_first, "final_train_loss")),
    Rule("e2_ief_best_test", "iEF achieves the best test performance for the majority of the tasks", "tab:sum-test",
         "iEF's test score is decided above every other optimiser's of the setup (each pair decided over seeds and "
         "test examples crossed); the paper's claim is over tasks, this rule is per setup.",
         OVER_SEEDS, _ranking(_ief_first, "test_score", higher_better=True)),
    Rule("e2_ef_unstable", "EF always suffers from unstable training: its training loss starts to diverge",
         "sec:opt-exp", f"A run's loss climb is the largest factor by which its training loss, averaged over at most "
         f"{RISE_WINDOWS} equal windows of at least {RISE_MIN_UPDATES} updates, rises above the lowest loss it had "
         "reached before, starting from its first update's loss (a diverged run: infinite). EF is unstable in a "
         f"setup when its climb is decided larger than each other optimiser's by more than ×{TENTH_DECADE:.2f} "
         "(each pair decided over seeds on the log ratio of the climbs), and is not when a climb of another "
         f"optimiser is decided within ×{TENTH_DECADE:.2f} of EF's or above it (Holm over the pairs).",
         "A run that settles has a climb near 1 whatever its step size does; a loss that leaves its starting value "
         "upwards, or climbs back after a low, shows as a factor. Windows of several updates keep a short run's batch "
         "noise from posing as a climb; ranking the climbs against the same setup's other optimisers asks the "
         f"paper's question, that EF is the unstable one, and the margin ×{TENTH_DECADE:.2f} (a tenth of a decade) "
         "keeps a few per cent of climb either way from deciding it.", _ef_unstable),
    Rule("e2_ief_vs_baseline", "iEF achieves the best generalisation for prompt tuning (above Adafactor on 6 of 7 "
         "tasks) and remains competitive with AdamW for LoRA", "tab:sum-test", "Prompt tuning and the MLP: iEF's "
         "test score is decided above the baseline's. LoRA: on par when the 95 % interval of the mean difference "
         f"lies within ±{ON_PAR_POINTS:g} percentage point, not on par when it lies wholly beyond it; both intervals "
         "over seeds and test examples crossed.",
         f"{ON_PAR_POINTS:g} point is the size of the paper's LoRA test differences where it calls them competitive; "
         "an equivalence band can only be decided by an interval narrower than the band, so a small test set "
         "cannot show \"on par\" at all, and the verdict then says how large a test set would.",
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
