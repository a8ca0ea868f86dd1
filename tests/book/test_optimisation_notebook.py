"""notebooks/optimisation.ipynb (E2) at smoke scale: it reads the workflow's tables (the aggregated runs and the
early-spike job's), writes the tables (ours beside the paper's) and the three curve figures, and its numbers are the
aggregated runs'; without the tables it stops, naming the jobs that make them."""
from __future__ import annotations

import pandas as pd
import pytest
from nbrun import glued_text, run_notebook, train_grid, unresolved_glue

from companion.__main__ import main
from companion.experiments.aggregate import aggregate, collect, mean_sd
from companion.experiments.setups import CPU_SETUPS, e2_optimizers
from companion.chapters.optimisation import label

SEEDS = [0, 1]


def test_optimisation_notebook_smoke(tmp_path, run_cache):
    figures, runs, results = tmp_path / "fig", tmp_path / "runs", tmp_path / "results"
    # the workflow's jobs: the runs, their tables, the early spike's first updates
    train_grid(runs, "smoke", [(s, o, k) for s in CPU_SETUPS for o in e2_optimizers(s) for k in SEEDS], run_cache)
    aggregate(runs, "smoke", results)
    assert main(["early-spike", "--scale", "smoke", "--runs", str(runs), "--results", str(results), "--out",
                 str(results / "early_spike.csv")]) == 0
    nb = run_notebook("optimisation.ipynb", tmp_path, scale="smoke", out_dir=str(figures), results_dir=str(results),
                      seeds=SEEDS)
    table, _ = collect(runs, "smoke")
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
    # the first step the chapter shows is the early-spike job's table, number for number
    assert pd.read_csv(figures / "ief_first_step.csv").equals(pd.read_csv(results / "early_spike.csv"))
    # every code cell but the parameters cell is folded; the notebook is stored without outputs
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert tags[0] == ["parameters"] or "parameters" in tags[0]
    assert all({"hide-input", "remove-input", "injected-parameters"} & set(t) for t in tags[1:])
    # every table and figure has its provenance line right after it: the workflow's tables, and for the tables
    # beside the paper, the committed transcription of its numbers
    assert _provenance_after_each_output(nb, "computed by this build's workflow (scale `smoke`;")

    # every rule and verdict the prose names is glued; two seeds: the intervals have one degree of freedom, and every
    # pair they leave undecided says what would decide it
    assert not unresolved_glue(nb)
    assert glued_text(nb, "v_e2_loss_ranking").startswith(("undecidable at smoke for ", "holds for ",
                                                           "does not hold for "))
    pairs = pd.read_csv(figures / "e2_seed_pairs.csv", keep_default_na=False)
    assert set(pairs.seeds) == {"0, 1"} and set(pairs.verdict) <= {"holds", "does not hold", "inconclusive"}
    undecided = pairs[pairs.verdict == "inconclusive"]
    assert len(undecided) and (undecided["would be decided by"] != "").all()

    # the training chapter compares its seed-0 search with these runs' verdicts over seeds, and says so
    train_nb = run_notebook("train.ipynb", tmp_path / "train", scale="smoke", setup="digits-mlp", optimizer="sgd",
                            runs_dir=str(runs), out_dir=str(tmp_path / "train-fig"),
                            results_dir=str(tmp_path / "results"))
    assert not unresolved_glue(train_nb)
    assert glued_text(train_nb, "e2_disagreement").startswith("Chapter E2's verdicts over seeds ")


def _provenance_after_each_output(nb, computed: str) -> bool:
    """Each table (HTML) and figure (PNG) output is followed by a markdown provenance line naming ``computed``; a
    table with the paper's numbers also names the committed record they are read from."""
    seen = 0
    for cell in (c for c in nb.cells if c.cell_type == "code"):
        outputs = cell.get("outputs", [])
        for i, out in enumerate(outputs):
            data = out.get("data", {})
            if "image/png" not in data and "text/html" not in data:
                continue
            line = next((o["data"]["text/markdown"] for o in outputs[i + 1:] if "text/markdown" in o.get("data", {})
                         and o["data"]["text/markdown"].startswith("*Provenance:")), "")
            assert computed in line, (cell.source[:60], line)
            if "paper" in str(data.get("text/html", "")):
                assert "`companion/experiments/paper_results/e2.csv` (last committed" in line, line
            seen += 1
    return seen >= 8


def test_missing_runs_name_the_command_that_makes_them(tmp_path):
    import papermill

    with pytest.raises(papermill.PapermillExecutionError, match="make book SCALE=cpu.*python -m companion aggregate"):
        run_notebook("optimisation.ipynb", tmp_path, scale="cpu", out_dir=str(tmp_path / "fig"),
                     results_dir=str(tmp_path / "no-results"))
