"""notebooks/compression.ipynb at smoke scale: the workflow's compression job (python -m companion compression) trains
the baseline and prunes it with every method over the draws; the chapter reads its tables, writes its own tables and
figures, glues every number its prose names, and its tables are the job's pruning results'. Without them it stops,
naming the job."""
from __future__ import annotations

import pandas as pd
import pytest
from nbrun import glued_text, run_notebook, unresolved_glue

from companion.__main__ import main
from companion.chapters import compression as plots


def test_compression_notebook_smoke(tmp_path):
    out, results_dir = tmp_path / "fig", tmp_path / "results" / "smoke"
    assert main(["compression", "--scale", "smoke", "--runs", str(tmp_path / "runs"), "--out",
                 str(results_dir / "compression")]) == 0
    nb = run_notebook("compression.ipynb", tmp_path, scale="smoke", out_dir=str(out), results_dir=str(results_dir))
    assert not unresolved_glue(nb)
    results = pd.read_csv(out / "pruning_results.csv")
    # the chapter's table is the job's, number for number
    assert results.equals(pd.read_csv(results_dir / "compression" / "pruning_results.csv"))
    sparsities, dampings = plots.DEFAULTS["smoke"]["sparsities"], plots.DEFAULTS["smoke"]["dampings"]
    assert set(results.method) == set(plots.METHODS)
    assert set(results.draw) == {0, 1, 2}
    curv = results[results.method != "magnitude"]
    assert len(curv) == 4 * 3 * len(dampings) * len(sparsities) * 2  # methods x draws x dampings x sparsities x splits
    assert set(curv.damping) == set(dampings)
    # the accuracy table is the results' mean +- sd over the draws at each method's chosen damping
    chosen = plots.chosen_dampings(results, 0.9)
    table = pd.read_csv(out / "pruning_accuracy.csv", index_col=0)
    ief = results[(results.method == "ief") & (results.damping == chosen["ief"]) & (results.split == "test")
                  & (results.sparsity == 0.9)].accuracy
    assert table.loc["90 %", f"iEF-WoodFisher (λ={chosen['ief']:g})"] == \
        f"{100 * ief.mean():.1f} ± {100 * ief.std():.1f}"
    for name in ("pruning_sparsity", "pruning_damping"):
        assert (out / f"{name}.png").stat().st_size > 10_000
    verdict = glued_text(nb, "wf_verdict")
    assert verdict in ("iEF-WoodFisher beats EF-WoodFisher here", "EF-WoodFisher beats iEF-WoodFisher here",
                       "neither beats the other here")
    assert glued_text(nb, "wf_robust_verdict") in ("it carries over", "it does not carry over")
    assert glued_text(nb, "wf_samples") == "32"  # N stated: the smoke setup's 32 training examples
    # code folded except the parameters cell; the API is taught by the code the job ran, shown with what it printed
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in tags[0]
    assert all({"hide-input", "remove-input", "injected-parameters"} & set(t) for t in tags[1:])
    assert any("obs_saliency(model, batches" in c.source for c in nb.cells if c.cell_type == "markdown")
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "kept 10.0% of the weights; test accuracy" in printed


def test_compression_notebook_without_the_jobs_table_names_the_job(tmp_path):
    import papermill

    with pytest.raises(papermill.PapermillExecutionError, match="python -m companion compression --scale smoke"):
        run_notebook("compression.ipynb", tmp_path, scale="smoke", out_dir=str(tmp_path / "fig"),
                     results_dir=str(tmp_path / "no-results"))


def test_the_api_code_the_chapter_shows_is_the_code_the_job_runs():
    import inspect
    import re

    import nbformat
    from nbrun import ROOT

    from companion.experiments.compression import api_example

    cells = nbformat.read(ROOT / "notebooks" / "compression.ipynb", as_version=4).cells
    (shown,) = [re.search(r"```python\n(.*?)```", c.source, re.S).group(1) for c in cells
                if c.cell_type == "markdown" and "```python" in c.source]
    body = [line.strip() for line in inspect.getsource(api_example).splitlines()]
    for line in (s.strip() for s in shown.splitlines() if s.strip() and not s.startswith("from ")):
        if line.startswith("print("):  # the function collects what the chapter's code prints
            line = line.removeprefix("print(").removesuffix(")")
        assert any(line in b for b in body), line
