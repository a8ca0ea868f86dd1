"""companion.experiments.verdict_table (every verdict as data) and the per-example test predictions it reads: a run's
``test_predictions.csv`` (companion.experiments.store) gathered by the aggregate step."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from companion.experiments.verdict_table import COLUMNS, rows_of
from companion.experiments import store
from companion.experiments import verdicts as V
from companion.experiments.aggregate import collect_predictions, read_predictions


def test_a_runs_test_predictions_round_trip(tmp_path):
    results = {"test": {"pred": torch.tensor([1, 0, 2]), "gold": torch.tensor([1, 1, 2]), "idx": [4, 5, 6]}}
    (tmp_path / store.TEST_PREDICTIONS).write_text(store.test_predictions_csv(results))
    assert store.read_test_predictions(tmp_path) == [("test", 4, 1, 1), ("test", 5, 0, 1), ("test", 6, 2, 2)]
    assert store.read_test_predictions(tmp_path / "missing") is None


def test_the_aggregate_step_gathers_every_runs_per_example_outcomes(tmp_path):
    for opt, preds in (("ief", [1, 1, 0]), ("sgd", [0, 1, 0])):
        root = tmp_path / "smoke" / "digits-mlp" / opt / "seed-0"
        root.mkdir(parents=True)
        store.write_json(root / "config.json", {})
        store.write_json(root / "summary.json", {"setup": "digits-mlp", "optimizer": opt, "seed": 0})
        results = {"test": {"pred": torch.tensor(preds), "gold": torch.tensor([1, 1, 1]), "idx": [0, 1, 2]}}
        (root / store.TEST_PREDICTIONS).write_text(store.test_predictions_csv(results))
    got = collect_predictions(tmp_path, "smoke")
    assert list(got.columns) == ["setup", "optimizer", "seed", "example", "correct"]
    assert got[got.optimizer == "ief"].correct.tolist() == [1, 1, 0] and got.example.iloc[0] == "test:0"
    got.to_csv(tmp_path / "e2_test_predictions.csv", index=False)
    assert read_predictions(tmp_path).equals(got) and read_predictions(tmp_path / "none") is None


def test_every_verdict_becomes_a_row_with_its_statistic_interval_and_what_would_decide_it():
    table = pd.DataFrame([{"setup": "s", "optimizer": o, "seed": k, "final_train_loss": v * f[k],
                           "test_score": math.nan, "wall_time_s": 30.0}
                          for o, v, f in (("ief", 0.1, (1.0, 1.3, 0.9)), ("sgd", 0.105, (1.2, 1.0, 1.1)))
                          for k in range(3)])
    verdicts = V.RULES["e2_ief_lowest"].evaluate(table, None, {"s": ["sgd", "ief"]})
    rows = rows_of("e2_ief_lowest", verdicts)
    assert len(rows) == 1 and set(rows[0]) == set(COLUMNS)
    row = rows[0]
    assert row["verdict"] == V.INCONCLUSIVE and row["label"] == "sec:opt-exp"
    assert row["statistic"].startswith("iEF < SGD: -") and " to " in row["interval"]
    assert "80 % power" in row["would_decide"] and "core-minutes" in row["would_decide"]
    assert np.isfinite(float(row["statistic"].split(": ")[1]))
