"""notebooks/optimisation.ipynb (E2) at smoke scale: it trains the tiny grid when no run exists, writes the tables
(ours beside the paper's) and the three curve figures, and its numbers are the aggregated runs'."""
from __future__ import annotations

import pandas as pd
import pytest
from nbrun import run_notebook

from ief.experiments.aggregate import aggregate, collect, mean_sd
from ief.experiments.setups import CPU_SETUPS, e2_optimizers
from ief.plots.optimisation import label

SEEDS = [0, 1]


def test_optimisation_notebook_smoke(tmp_path):
    figures, runs = tmp_path / "fig", tmp_path / "runs"
    nb = run_notebook("optimisation.ipynb", tmp_path, scale="smoke", out_dir=str(figures), runs_dir=str(runs),
                      results_dir=str(tmp_path / "no-results"), seeds=SEEDS)
    table, _ = collect(runs, "smoke")  # the grid the notebook trained
    assert len(table) == sum(len(e2_optimizers(s)) for s in CPU_SETUPS) * len(SEEDS)
    for name in ("curves-pt", "curves-lora", "mlp-curves"):
        assert (figures / f"{name}.png").stat().st_size > 10_000
    train = pd.read_csv(figures / "tab_train_lora.csv", header=[0, 1], index_col=0)
    ours = train[("ours (smoke)", "tweets-minilm-lora")]
    for opt in e2_optimizers("tweets-minilm-lora"):
        v = table[(table.setup == "tweets-minilm-lora") & (table.optimizer == opt)].final_train_loss
        assert ours[label(opt)] == mean_sd(v, 3)
    assert ("paper (its setups)", "cola") in train.columns and train.loc["iEF", ("paper (its setups)", "cola")] == \
        "0.160 ± 0.040"
    sum_test = pd.read_csv(figures / "tab_sum_test.csv", index_col=0)
    assert sum_test.loc["paper: GLUE + T5 + Prompt Tuning", "iEF"] == "79.3"
    assert "ours: digits-mlp (MLP from scratch)" in sum_test.index
    mlp = pd.read_csv(figures / "tab_test_mlp.csv", index_col=0)
    assert mlp.loc["paper: CIFAR10 + MLP, validation accuracy (%)", "iEF"] == "58.8 ± 0.87"
    # every code cell but the parameters cell is folded; the notebook is stored without outputs
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert tags[0] == ["parameters"] or "parameters" in tags[0]
    assert all({"hide-input", "remove-input", "injected-parameters"} & set(t) for t in tags[1:])

    # the workflow's path: the aggregated tables in results_dir, no runs at hand -> the same tables
    aggregate(runs, "smoke", tmp_path / "results")
    again = tmp_path / "fig2"
    run_notebook("optimisation.ipynb", tmp_path / "second", scale="smoke", out_dir=str(again),
                 runs_dir=str(tmp_path / "no-runs"), results_dir=str(tmp_path / "results"), seeds=SEEDS)
    for name in ("tab_sum_test.csv", "tab_train_lora.csv", "tab_test_mlp.csv", "tab_validation_pt.csv"):
        assert (again / name).read_text() == (figures / name).read_text()


def test_missing_runs_name_the_command_that_makes_them(tmp_path):
    import papermill

    with pytest.raises(papermill.PapermillExecutionError, match="make book"):
        run_notebook("optimisation.ipynb", tmp_path, scale="cpu", out_dir=str(tmp_path / "fig"),
                     runs_dir=str(tmp_path / "no-runs"), results_dir=str(tmp_path / "no-results"))
