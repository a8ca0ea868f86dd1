"""notebooks/train.ipynb at smoke scale: the same run as ``python -m ief train``, its figure and table, and the
recorded learning-rate search it reads."""
from __future__ import annotations

import csv
import json

from nbrun import glued_text, run_notebook, unresolved_glue

from ief.experiments import CPU_SETUPS, run_dir
from ief.experiments.store import read_run
from ief.experiments.summaries import final_train_loss, final_window


def test_train_notebook_runs_the_cli_run_and_reads_the_search(tmp_path):
    figures, runs = tmp_path / "fig", tmp_path / "runs"
    nb = run_notebook("train.ipynb", tmp_path, scale="smoke", setup="digits-mlp", optimizer="sgd", seed=1,
                      out=str(runs), out_dir=str(figures))
    assert not unresolved_glue(nb)
    assert "not available" in glued_text(nb, "e2_disagreement")  # no results_dir: no E2 runs to compare with
    summary = json.loads((run_dir(runs, "smoke", "digits-mlp", "sgd", 1) / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["seed"] == 1
    (row,) = list(csv.DictReader((figures / "run.csv").open()))
    losses = read_run(run_dir(runs, "smoke", "digits-mlp", "sgd", 1))["losses"]
    column = f"final train loss (last {final_window(len(losses))} updates)"  # the book's definition, not the runner's
    assert row["setup"] == "digits-mlp" and float(row[column]) == final_train_loss(losses)
    assert (figures / "run-digits-mlp-sgd-seed1.png").stat().st_size > 10_000
    assert (figures / "lr_search.png").stat().st_size > 10_000
    trials = list(csv.DictReader((figures / "lr_search_trials.csv").open()))
    assert {t["setup"] for t in trials} == set(CPU_SETUPS)
    chosen = [t for t in trials if t["chosen"] == "*"]
    assert {(t["setup"], t["optimizer"]) for t in trials} >= {(s, "iEF") for s in CPU_SETUPS}
    results = list(csv.DictReader((figures / "cpu_results_seed0.csv").open()))
    assert len(chosen) == len(results) and {(r["setup"], r["optimizer"]) for r in results} == {
        (t["setup"], t["optimizer"]) for t in chosen}


def test_train_notebook_warns_before_a_full_scale_run():
    """At full scale the notebook's first cell prints the steps and the paper's hours before anything starts."""
    from ief.experiments.cost import cost_warning

    warning = cost_warning("sst2-t5-lora", "full", "ief")
    assert "42,100 update steps" in warning and "10 hours" in warning and "Appendix H.3" in warning
    assert cost_warning("sst2-t5-lora", "smoke", "ief") is None
    import nbformat

    from nbrun import ROOT

    source = "\n".join(c.source for c in nbformat.read(ROOT / "notebooks" / "train.ipynb", as_version=4).cells)
    assert source.index("cost_warning(setup, scale, optimizer)") < source.index("train(setup, optimizer")
