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
- **training runs** (E2): a ranking ``a < b`` is decided over seeds (:func:`pair_over_seeds`): the per-seed
  differences, ``holds`` iff all agree in favour of the claim on at least :data:`MIN_SEEDS` seeds, ``does not hold``
  iff all agree against, else ``inconclusive`` (a tie counts for neither side).

No plotting here: :mod:`companion.chapters.evaluation`, :mod:`companion.chapters.optimisation` and :mod:`companion.chapters.train` format
these verdicts for their chapters.
"""
from __future__ import annotations

from .core import (DECADE, FAILS, HOLDS, INCONCLUSIVE, MIN_SEEDS, NEAR_ZERO, ON_PAR_POINTS, OUTCOMES, TENTH_DECADE,
                   PairResult, Rule, Verdict, decide, interval, over_stages, pair_over_seeds, summary, t_quantile)
from .evaluation import (BLOCK_RULES, DECIDED, E1_AGGREGATION, E1_RULES, E3_RULES, EVALUATION_RULES, WHY_T,
                         e1_batches, sweep_batches)
from .practical import PRACTICAL_RULES, PRACTICAL_RULES_LIST
from .training import E2_RULES, E2_RULES_LIST, RISE_WINDOWS, SEED0_RULES_LIST, disagreements, loss_rises

RULES: dict[str, Rule] = {**EVALUATION_RULES,
                          **{r.name: r for r in E2_RULES_LIST + SEED0_RULES_LIST + PRACTICAL_RULES_LIST}}

__all__ = [
    "HOLDS", "FAILS", "INCONCLUSIVE", "OUTCOMES", "MIN_SEEDS", "TENTH_DECADE", "DECADE", "NEAR_ZERO", "ON_PAR_POINTS",
    "Verdict", "PairResult", "Rule", "t_quantile", "interval", "decide", "over_stages", "pair_over_seeds", "summary",
    "RULES", "E1_RULES", "E3_RULES", "BLOCK_RULES", "E2_RULES", "DECIDED", "WHY_T", "E1_AGGREGATION", "e1_batches",
    "sweep_batches", "loss_rises", "disagreements", "RISE_WINDOWS", "PRACTICAL_RULES",
]
