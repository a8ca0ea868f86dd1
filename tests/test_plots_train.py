"""ief.plots.train: the E2 observations and the verdict sentences the train chapter glues, from the results table
(one row per setup x optimiser at the chosen rates)."""
from __future__ import annotations

import pandas as pd
import pytest

from ief.plots.train import e2_observations, e2_statements


def _results(winners: dict[str, tuple[str, str]]) -> pd.DataFrame:
    """``winners[setup] = (lowest-loss optimiser, best-test optimiser)``; EF is always the worst loss."""
    rows = []
    for setup, (low, best) in winners.items():
        for k, opt in enumerate(["SGD", "EF", "iEF", "AdamW"]):
            loss = 0.1 if opt == low else 2.0 if opt == "EF" else 0.5 + 0.01 * k
            test = 90.0 if opt == best else 60.0 + k
            rows.append({"setup": setup, "optimizer": opt, "final train loss": loss, "test (%)": test})
    return pd.DataFrame(rows).set_index(["setup", "optimizer"])


@pytest.mark.parametrize("winners, verdict, detail", [
    ({"a": ("iEF", "iEF"), "b": ("iEF", "iEF"), "c": ("SGD", "AdamW")}, "holds for the majority of the setups",
     "iEF has the lowest final training loss on 2 of 3 setups; the best test score on 2 of 3: both hold"),
    ({"a": ("iEF", "SGD"), "b": ("iEF", "AdamW"), "c": ("SGD", "iEF")}, "holds only in part",
     "only the training loss holds"),
    ({"a": ("SGD", "iEF"), "b": ("AdamW", "AdamW"), "c": ("SGD", "SGD")}, "mostly does not hold",
     "neither holds"),
])
def test_the_e2_verdict_follows_the_results(winners, verdict, detail):
    glued = e2_statements(e2_observations(_results(winners)))
    assert glued["e2_verdict"] == verdict
    assert detail in glued["e2_verdict_detail"]
    assert glued["e2_ef_worst"].startswith("3 of 3 setups")
