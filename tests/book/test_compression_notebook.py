"""notebooks/compression.ipynb at smoke scale: it trains the baseline, prunes it with every method over the draws,
writes its tables and figures, glues every number its prose names, and its tables are the pruning results'."""
from __future__ import annotations

import pandas as pd
from nbrun import glued_text, run_notebook, unresolved_glue

from companion.chapters import compression as plots


def test_compression_notebook_smoke(tmp_path):
    out = tmp_path / "fig"
    nb = run_notebook("compression.ipynb", tmp_path, scale="smoke", out_dir=str(out))
    assert not unresolved_glue(nb)
    results = pd.read_csv(out / "pruning_results.csv")
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
    # code folded except the parameters cell and the one cell that teaches the API
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in tags[0]
    unfolded = [t for t in tags[1:] if not {"hide-input", "remove-input", "injected-parameters"} & set(t)]
    assert len(unfolded) == 1
