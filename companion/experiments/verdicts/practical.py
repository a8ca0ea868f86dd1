"""The practical optimisers' rules (beyond the paper): what momentum and weight decay do for iEF, and
whether ieKFAC improves on K-FAC and eKFAC as an optimiser. Decided over seeds as E2's rankings
(:func:`~.core.pair_over_seeds`: the paired 95 % interval of the per-seed differences on one side of 0 or the
other, else inconclusive)."""
from __future__ import annotations

from .core import TENTH_DECADE, Rule
from .training import MARGIN, OVER_SEEDS, _ranking

_WHY = OVER_SEEDS  # how every pair over seeds is decided (the practical chapter glues it once)


def _momentum_vs_ief(present: list[str]) -> list[tuple[str, str]]:
    return [("ief-momentum", "ief")] if {"ief-momentum", "ief"} <= set(present) else []


def _momentum_vs_baseline(present: list[str]) -> list[tuple[str, str]]:
    return [("ief-momentum", present[0])] if present and "ief-momentum" in present[1:] else []


def _iekfac_first(present: list[str]) -> list[tuple[str, str]]:
    return [("iekfac", o) for o in ("kfac", "ekfac") if o in present] if "iekfac" in present else []


PRACTICAL_RULES_LIST = (
    Rule("practical_momentum_loss", "the exact iEF's lack of momentum and weight decay affects its optimisation "
         "performance on certain setups", "sec:app-limitations",
         "iEF with momentum and weight decay (iEF+M) helps training where its final training loss is decided below "
         f"iEF's by more than ×{TENTH_DECADE:.2f}, and does not where it is decided above that (a decided tie "
         "included).", _WHY, _ranking(_momentum_vs_ief, "final_train_loss", margin=MARGIN)),
    Rule("practical_momentum_test", "LoRA's stronger reliance on regularisation and momentum is why iEF only ties "
         "AdamW there", "sec:opt-exp",
         "iEF+M generalises better than iEF where its test score is decided above iEF's, and does not where "
         "it is decided below.", _WHY,
         _ranking(_momentum_vs_ief, "test_score", higher_better=True)),
    Rule("practical_momentum_vs_baseline", "with momentum and weight decay integrated, iEF would be a stronger "
         "optimiser than the well-tuned baselines", "sec:opt-exp",
         "iEF+M beats the setup's baseline (AdamW, Adafactor or Adam) where its test score is above the baseline's "
         "(decided), and does not where it is decided below.", _WHY,
         _ranking(_momentum_vs_baseline, "test_score", higher_better=True)),
    Rule("practical_iekfac_loss", "ieKFAC has the potential of further improving existing K-FAC-based methods",
         "sec:app-iEF-eNGDopt",
         "As optimisers, ieKFAC improves on K-FAC and eKFAC where its final training loss is below each of theirs "
         f"by more than ×{TENTH_DECADE:.2f} (decided; both pairs hold), and does not where either pair is decided "
         "above that.", _WHY, _ranking(_iekfac_first, "final_train_loss", margin=MARGIN)),
    Rule("practical_iekfac_test", "ieKFAC has the potential of further improving existing K-FAC-based methods",
         "sec:app-iEF-eNGDopt",
         "On test, ieKFAC improves on K-FAC and eKFAC where its test score is above each of theirs "
         "(decided; both pairs hold), and does not where either pair does not hold.", _WHY,
         _ranking(_iekfac_first, "test_score", higher_better=True)),
)
PRACTICAL_RULES = tuple(r.name for r in PRACTICAL_RULES_LIST)
