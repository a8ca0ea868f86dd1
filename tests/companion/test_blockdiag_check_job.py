"""The evaluation chapter's dense check as a workflow job (python -m companion blockdiag-check;
companion.experiments.blockdiag_check.write_chapter_check): on the block-diagonal figure's setups of the registry, it
writes the table and the glue the chapter's cell computed, number for number; without its inputs it names what makes
them; a scale without an MLP among those setups has no check."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from companion.__main__ import main
from companion.experiments import evaluate_runs as er
from companion.experiments.blockdiag_check import CHECK_FILES, CHECK_KEYS, chapter_check, read_chapter_check
from companion.experiments.setups import BLOCKDIAG_SETUPS, blockdiag_check_setup, blockdiag_setups


def test_the_block_diagonal_setups_have_one_home():
    from companion.chapters.evaluation import figure_setups

    for scale in ("smoke", "cpu", "full"):
        assert figure_setups(scale)[0]["blockdiag"] == list(BLOCKDIAG_SETUPS[scale]) == list(blockdiag_setups(scale))
    assert blockdiag_check_setup("smoke") == blockdiag_check_setup("cpu") == "digits-mlp"
    assert blockdiag_check_setup("full") is None  # the paper's T5 setups: no dense check, no job
    with pytest.raises(ValueError, match="scale"):
        blockdiag_setups("gpu")


@pytest.mark.slow
def test_cli_writes_the_chapters_table_and_glue(tmp_path, capsys, run_cache):
    from nbrun import train_grid

    runs, results = tmp_path / "runs", tmp_path / "results" / "smoke"
    out = results / CHECK_FILES[0]
    args = ["blockdiag-check", "--scale", "smoke", "--runs", str(runs), "--results", str(results), "--out", str(out)]
    assert main(args) == 1  # no evaluation tables yet: it says which job makes them
    assert "`evaluate` jobs" in capsys.readouterr().err
    setups = list(BLOCKDIAG_SETUPS["smoke"])
    for setup in setups:
        train_grid(runs, "smoke", [(setup, er.baseline_optimizer(setup, "smoke"), 0)], run_cache)
        er.evaluate_run(setup, "smoke", 0, runs, results / "eval" / f"{setup}.csv", progress=False)
    assert main(args) == 0
    assert capsys.readouterr().out.split() == ["wrote", str(out), "wrote", str(results / CHECK_FILES[1])]
    meta, table = read_chapter_check(out, "smoke")
    assert meta["setups"] == setups and meta["seed"] == 0 and meta["stage"] == 50 and set(meta["glue"]) == set(
        CHECK_KEYS)
    assert json.loads((results / CHECK_FILES[1]).read_text())["glue"]["kc_setup"] == "digits-mlp"
    # what the chapter's cell computed (chapter_check on the same records and runs), number for number
    records = [r for s in setups for r in er.read_records(results / "eval" / f"{s}.csv")]
    glue, expected = chapter_check(records, runs, setups, "smoke", seed=0, stage=50)
    assert meta["glue"] == glue
    exact = pd.read_csv(pd.io.common.StringIO(expected.to_csv(index=False)))
    span = exact["method"] == "span_best"  # its lstsq varies run to run in the last bits (1e-16)
    assert exact[~span].reset_index(drop=True).equals(table[~span].reset_index(drop=True))
    pd.testing.assert_frame_equal(exact[span], table[span], rtol=1e-12)
    assert main(["blockdiag-check", "--scale", "huge", "--runs", str(runs), "--results", str(results), "--out",
                 str(out)]) == 2
    assert "unknown scale 'huge'" in capsys.readouterr().err


def test_without_the_table_the_reader_names_the_job(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m companion blockdiag-check --scale smoke"):
        read_chapter_check(tmp_path / CHECK_FILES[0], "smoke")
