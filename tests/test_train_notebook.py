"""notebooks/train.ipynb at smoke scale: the same run as ``python -m ief train``, its figure and table, and the
recorded learning-rate search it reads."""
from __future__ import annotations

import csv
import json

from nbrun import run_notebook

from ief.experiments import CPU_SETUPS, run_dir


def test_train_notebook_runs_the_cli_run_and_reads_the_search(tmp_path):
    figures, runs = tmp_path / "fig", tmp_path / "runs"
    run_notebook("train.ipynb", tmp_path, scale="smoke", setup="digits-mlp", optimizer="sgd", seed=1,
                 out=str(runs), out_dir=str(figures))
    summary = json.loads((run_dir(runs, "smoke", "digits-mlp", "sgd", 1) / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["seed"] == 1
    (row,) = list(csv.DictReader((figures / "run.csv").open()))
    assert row["setup"] == "digits-mlp" and float(row["final train loss"]) == summary["final_train_loss"]
    assert (figures / "run-digits-mlp-sgd-seed1.png").stat().st_size > 10_000
    assert (figures / "lr_search.png").stat().st_size > 10_000
    trials = list(csv.DictReader((figures / "lr_search_trials.csv").open()))
    assert {t["setup"] for t in trials} == set(CPU_SETUPS)
    chosen = [t for t in trials if t["chosen"] == "*"]
    results = list(csv.DictReader((figures / "cpu_results_seed0.csv").open()))
    assert len(chosen) == len(results) and {(r["setup"], r["optimizer"]) for r in results} == {
        (t["setup"], t["optimizer"]) for t in chosen}
