"""notebooks/train.ipynb at smoke scale: the run ``python -m companion train`` made (the workflow's job), read with its
figure and table, and the recorded learning-rate search it reads; the chapter never trains."""
from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
from nbrun import glued_text, run_notebook, train_grid, unresolved_glue

from companion.experiments import CPU_SETUPS, run_dir
from companion.experiments.store import read_run
from companion.experiments.summaries import final_train_loss, final_window


@pytest.fixture(scope="module")
def chapter(tmp_path_factory, run_cache):
    """The chapter run once, as the workflow runs it, on the run ``python -m companion train`` made (digits-mlp, SGD,
    seed 1, in a runs folder; no E2 tables): the two tests below read this one execution, the second also the run's
    files' times from before it (the chapter touches none)."""
    tmp = tmp_path_factory.mktemp("train-chapter")
    runs, figures = tmp / "runs", tmp / "fig"
    train_grid(runs, "smoke", [("digits-mlp", "sgd", 1)], run_cache)
    folder = run_dir(runs, "smoke", "digits-mlp", "sgd", 1)
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    nb = run_notebook("train.ipynb", tmp, scale="smoke", setup="digits-mlp", optimizer="sgd", seed=1,
                      runs_dir=str(runs), out_dir=str(figures))
    return SimpleNamespace(nb=nb, runs=runs, figures=figures, folder=folder, before=before, tmp=tmp)


def test_train_notebook_reads_the_cli_run_and_the_search(chapter):
    nb, runs, figures = chapter.nb, chapter.runs, chapter.figures
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


def test_the_train_command_warns_before_a_full_scale_run():
    """At full scale `python -m companion train` prints the steps and the paper's hours before anything starts."""
    from companion.experiments.cost import cost_warning

    warning = cost_warning("sst2-t5-lora", "full", "ief")
    assert "42,100 update steps" in warning and "10 hours" in warning and "Appendix H.3" in warning
    assert cost_warning("sst2-t5-lora", "smoke", "ief") is None
    import nbformat

    from nbrun import ROOT

    source = (ROOT / "companion" / "__main__.py").read_text()
    assert source.index("cost_warning(args.setup, args.scale, args.optimizer)") < source.index("train(args.setup,")
    notebook = "\n".join(c.source for c in nbformat.read(ROOT / "notebooks" / "train.ipynb", as_version=4).cells
                         if c.cell_type == "code")
    assert "train(" not in notebook  # the chapter reads the run; it never trains


def test_the_chapter_run_is_a_grid_run_and_the_notebooks_default():
    """The run the workflow hands chapter "Training runs" (TRAIN_CHAPTER_RUN) is one the grid trains anyway, and the
    one the notebook's parameters name by default, so the chapter reads it instead of training it a second time."""
    import papermill

    from nbrun import ROOT
    from companion.experiments.setups import TRAIN_CHAPTER_RUN, grid_runs

    declared = papermill.inspect_notebook(str(ROOT / "notebooks" / "train.ipynb"))
    defaults = (eval(declared["optimizer"]["default"]), eval(declared["seed"]["default"]))
    for scale, (setup, optimizer, seed) in TRAIN_CHAPTER_RUN.items():
        assert (setup, optimizer, seed) in grid_runs(scale), scale
        assert (optimizer, seed) == defaults
    assert "runs_dir" in declared


def test_train_notebook_reads_a_run_the_workflow_trained(chapter):
    """Given the workflow's runs folder (runs_dir) holding the finished run, the chapter shows that run and touches
    nothing in it; without the run it stops, naming the command that trains it."""
    import papermill

    nb, workflow_runs, figures, folder = chapter.nb, chapter.runs, chapter.figures, chapter.folder
    trained = json.loads((folder / "summary.json").read_text())
    assert not unresolved_glue(nb)
    assert "read here" in glued_text(nb, "train_source")
    assert not (figures / "runs").exists()
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()} == chapter.before
    assert glued_text(nb, "train_wall") == f"{trained['wall_time_s']:.0f} s"
    with pytest.raises(papermill.PapermillExecutionError,
                       match="python -m companion train --setup digits-mlp --optimizer sgd --seed 0 --scale smoke"):
        run_notebook("train.ipynb", chapter.tmp / "none", scale="smoke", setup="digits-mlp", optimizer="sgd", seed=0,
                     runs_dir=str(workflow_runs), out_dir=str(figures))
