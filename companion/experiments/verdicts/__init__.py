"""The paper's claims as rules that can fail, stated before the numbers, so that a verdict could come out otherwise.

Each claim a chapter checks is a :class:`Rule`: its name, the paper's claim and ``\\label``, the rule in one or two
plain sentences with its thresholds (the sentence a chapter glues *before* the result), why the thresholds are what
they are, and a check over the records that gives, per setup (or per setup and method), a :class:`Verdict`:
``holds`` / ``does not hold`` / ``inconclusive``, the numbers behind it and what fails, by name.

Two ways of deciding, one per kind of record:

- **evaluation records** (E1, E3, block-diagonal; :mod:`.evaluate_runs`): a comparison at one checkpoint is decided
  on the per-batch log ratios (the batches are the same for every method and damping, so the comparison is paired):
  its 95 % Student-t interval of the mean (:func:`decide`) lies above the threshold, below it, or straddles it
  (undecided). A claim over stages then aggregates the stages as its rule says (:func:`over_stages`).
- **training runs** (E2): a ranking ``a < b`` is decided over seeds (:func:`pair_over_seeds`): the 95 % paired t
  interval of the per-seed differences (final losses as log ratios, test scores in points widened by the test set's
  binomial resolution, :func:`binomial_resolution`) lies on the claim's side of 0 (``holds``), on the other
  (``does not hold``), or straddles it (``inconclusive``, with the seeds that would decide it: :func:`seeds_needed`);
  an "on par" claim is an equivalence band the interval must lie inside. A diverged run leaves the mean undefined:
  the exact sign test (:func:`sign_test`) decides then.

No plotting here: :mod:`companion.chapters.evaluation`, :mod:`companion.chapters.optimisation` and
:mod:`companion.chapters.train` format these verdicts for their chapters.
"""
from __future__ import annotations

from .core import (DECADE, FAILS, HOLDS, INCONCLUSIVE, MIN_SEEDS, NEAR_ZERO, ON_PAR_POINTS, OUTCOMES, SIGN_LEVEL,
                   TENTH_DECADE, PairResult, Rule, Verdict, binomial_resolution, decide, interval, over_stages,
                   over_stages_holm, pair_over_seeds, seeds_needed, sign_test, summary, t_quantile)
from .evaluation import (BLOCK_RULES, DECIDED, E1_AGGREGATION, E1_RULES, E3_RULES, EVALUATION_RULES, WHY_T,
                         e1_batches, sweep_batches)
from . import stats
from .practical import PRACTICAL_RULES, PRACTICAL_RULES_LIST
from .training import (E2_RULES, E2_RULES_LIST, RISE_MIN_UPDATES, RISE_WINDOWS, SEED0_RULES_LIST, disagreements,
                       loss_rises, n_test_examples, pairs_needs)

RULES: dict[str, Rule] = {**EVALUATION_RULES,
                          **{r.name: r for r in E2_RULES_LIST + SEED0_RULES_LIST + PRACTICAL_RULES_LIST}}

__all__ = [
    "HOLDS", "FAILS", "INCONCLUSIVE", "OUTCOMES", "MIN_SEEDS", "TENTH_DECADE", "DECADE", "NEAR_ZERO", "ON_PAR_POINTS",
    "Verdict", "PairResult", "Rule", "t_quantile", "interval", "decide", "over_stages", "pair_over_seeds", "summary",
    "RULES", "E1_RULES", "E3_RULES", "BLOCK_RULES", "E2_RULES", "DECIDED", "WHY_T", "E1_AGGREGATION", "e1_batches",
    "sweep_batches", "loss_rises", "disagreements", "RISE_WINDOWS", "PRACTICAL_RULES", "SIGN_LEVEL",
    "binomial_resolution", "seeds_needed", "stats", "over_stages_holm", "sign_test", "n_test_examples", "pairs_needs",
    "RISE_MIN_UPDATES",
]
