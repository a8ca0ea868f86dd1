"""companion.experiments.verdict_table (every verdict as data) and the per-example test predictions it reads: a run's
``test_predictions.csv`` (companion.experiments.store) gathered by the aggregate step."""
from __future__ import annotations

import math

import pytest

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


def _written(tmp_path, table, curves, opts, method):
    """verdicts.csv and verdict_pairs.csv of the E2 rules on ``table``, as the workflow's verdicts job writes them,
    beside an e2_runs.csv written first."""
    from companion.experiments.verdict_table import PAIR_COLUMNS, pair_rows

    table.to_csv(tmp_path / "e2_runs.csv", index=False)
    rows, pairs = [], []
    for name in V.E2_RULES:
        found = V.RULES[name].evaluate(*(table, curves, opts) + ((method,) if name == "e2_ief_vs_baseline" else ()))
        rows, pairs = rows + rows_of(name, found), pairs + pair_rows(name, found)
    verdicts, pairs = pd.DataFrame(rows, columns=COLUMNS), pd.DataFrame(pairs, columns=PAIR_COLUMNS)
    pairs.to_csv(tmp_path / "verdict_pairs.csv", index=False)
    verdicts.to_csv(tmp_path / "verdicts.csv", index=False)
    return verdicts


def test_verdicts_read_back_are_the_verdicts_written(tmp_path):
    """Every field a chapter prints survives the tables: subject, verdict, failures, what would decide it, and each
    pair's per-seed differences, interval, verdict and p-values (a diverged run's inf included)."""
    from test_chapters_optimisation import _grid

    from companion.experiments.verdict_table import as_verdicts, read_pairs, read_verdicts

    table, curves, opts = _grid(ef_rises=False)
    table.loc[(table.optimizer == "sgd") & (table.seed == 2), "final_train_loss"] = math.inf  # a diverged run
    method = {"tweets-minilm-lora": "lora"}
    _written(tmp_path, table, curves, opts, method)
    for name in V.E2_RULES:
        want = V.RULES[name].evaluate(*(table, curves, opts) + ((method,) if name == "e2_ief_vs_baseline" else ()))
        got = as_verdicts(read_verdicts(tmp_path), read_pairs(tmp_path), name)
        assert [(v.subject, v.verdict, v.failures, v.needs) for v in got] == \
            [(v.subject, v.verdict, v.failures, v.needs) for v in want]
        for g, w in zip((p for v in got for p in v.pairs), (p for v in want for p in v.pairs)):
            assert (g.pair, g.metric, g.verdict, g.agreement, g.needs, g.band) == \
                (w.pair, w.metric, w.verdict, w.agreement, w.needs, w.band)
            assert list(g.diffs) == list(w.diffs)
            np.testing.assert_allclose([*g.diffs.values(), g.mean, g.low, g.high, g.p_for, g.p_against],
                                       [*w.diffs.values(), w.mean, w.low, w.high, w.p_for, w.p_against], rtol=1e-12)


def test_the_chapter_prints_the_workflows_verdicts_not_its_own(tmp_path):
    """A table read from the workflow's folder (load_e2 records it in table.attrs): the glued verdicts and the
    pairs table are verdicts.csv's (here altered, so that a verdict of the chapter's own would differ); without the
    folder, the chapter decides on its table; a verdicts.csv older than the runs table it decides is refused."""
    import os

    from test_chapters_optimisation import _grid

    from companion.chapters.optimisation import e2_findings, seed_table

    table, curves, opts = _grid()
    method, setups = {"tweets-minilm-lora": "lora"}, ["tweets-minilm-lora"]
    own = e2_findings(table, curves, setups, opts, method)
    assert own["v_e2_loss_ranking"] == "holds for tweets-minilm-lora"
    verdicts = _written(tmp_path, table, curves, opts, method)
    verdicts.loc[verdicts.claim == "e2_loss_ranking", ["verdict", "would_decide"]] = [V.INCONCLUSIVE, "needs 7 seeds"]
    verdicts.to_csv(tmp_path / "verdicts.csv", index=False)
    pairs = pd.read_csv(tmp_path / "verdict_pairs.csv", keep_default_na=False)
    pairs.loc[pairs.pair == "iEF < AdamW", "verdict"] = "does not hold"
    pairs.to_csv(tmp_path / "verdict_pairs.csv", index=False)
    table.attrs.update(results_dir=str(tmp_path), scale="cpu")
    read = e2_findings(table, curves, setups, opts, method)
    assert read["v_e2_loss_ranking"] == "inconclusive for tweets-minilm-lora (needs 7 seeds)"
    assert {k: v for k, v in read.items() if k != "v_e2_loss_ranking"} == \
        {k: v for k, v in own.items() if k != "v_e2_loss_ranking"}
    shown = seed_table(table, curves, setups, opts, method).reset_index()
    assert shown[shown.pair == "iEF < AdamW"].verdict.tolist() == ["does not hold"]
    old = (tmp_path / "e2_runs.csv").stat().st_mtime
    os.utime(tmp_path / "verdicts.csv", (old - 10, old - 10))
    with pytest.raises(ValueError, match="older than .*e2_runs.csv.*python -m companion verdicts"):
        e2_findings(table, curves, setups, opts, method)


def test_load_e2_names_the_folder_only_for_the_whole_grid(tmp_path):
    from test_chapters_optimisation import _grid

    from companion.experiments.aggregate import load_e2

    table, curves, _ = _grid()
    table.assign(scale="smoke").to_csv(tmp_path / "e2_runs.csv", index=False)
    curves.assign(scale="smoke").to_csv(tmp_path / "e2_curves.csv", index=False)
    assert load_e2("smoke", tmp_path, setups=["tweets-minilm-lora"]).table.attrs["results_dir"] == str(tmp_path)
    assert "results_dir" not in load_e2("smoke", tmp_path, setups=["tweets-minilm-lora"], seeds=[0, 1]).table.attrs
