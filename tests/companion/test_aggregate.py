"""companion.experiments.aggregate: the E2 tables (one row per finished run, the curves) from real smoke-scale runs."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from companion.__main__ import main
from companion.experiments import run_dir, store, train
from companion.experiments.aggregate import (CURVES_FILE, RUNS_FILE, aggregate, curve_bands, final_loss, mean_sd,
                                       read_tables, summarise)

SETUP = "digits-mlp"
GRID = [("sgd", 0), ("sgd", 1), ("ief", 0), ("ief", 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    summaries = {(o, s): train(SETUP, o, s, "smoke", out, progress=False, verbose=False) for o, s in GRID}
    # an unfinished run: config.json but no summary.json (must be left out)
    store.write_json(run_dir(out, "smoke", SETUP, "ef", 0) / "config.json", {"seed": 0})
    return out, summaries


def test_final_loss_is_the_mean_of_the_last_tenth_and_at_least_one_step():
    assert final_loss([5.0, 1.0, 2.0]) == 2.0  # ceil(0.3) = 1 step
    assert final_loss(list(range(20))) == pytest.approx(18.5)  # last 2 of 20
    assert final_loss(list(range(64))) == pytest.approx(np.mean(range(57, 64)))  # ceil(6.4) = 7 of 64
    assert final_loss(list(range(1000))) == pytest.approx(np.mean(range(900, 1000)))
    assert math.isnan(final_loss([]))
    assert math.isnan(final_loss([1.0, float("nan")]))  # a non-finite loss is never hidden
    with pytest.raises(ValueError, match="fraction"):
        final_loss([1.0], fraction=0.0)


def test_aggregate_one_row_per_finished_run(runs, tmp_path):
    out, summaries = runs
    paths = aggregate(out, "smoke", tmp_path)
    assert paths == (tmp_path / RUNS_FILE, tmp_path / CURVES_FILE)
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left behind
    table, curves = read_tables(tmp_path)
    assert list(zip(table["optimizer"], table["seed"])) == sorted(GRID)  # the unfinished ef run is left out
    for _, row in table.iterrows():
        s = summaries[(row["optimizer"], row["seed"])]
        root = run_dir(out, "smoke", SETUP, row["optimizer"], row["seed"])
        losses = store.read_run(root)["losses"]
        assert row["final_train_loss"] == pytest.approx(final_loss(losses), rel=1e-12)
        assert row["final_train_loss"] == pytest.approx(s["final_train_loss"], rel=1e-12)  # one definition: the
        # runner's summary (and its CLI line) and the E2 table agree
        assert row["steps"] == s["steps"] == len(losses)
        assert row["best_step"] == s["best_validation"]["step"]
        assert row["val_accuracy"] == pytest.approx(s["best_validation"]["metrics"]["accuracy"])
        assert row["test_accuracy"] == pytest.approx(s["test"]["accuracy"])
        assert row["wall_time_s"] == pytest.approx(s["wall_time_s"])
        config = json.loads((root / "config.json").read_text())
        assert row["lr"] == config["optimizer"]["lr"] and row["schedule"] == config["optimizer"]["schedule"]
        run_curves = curves[(curves.optimizer == row["optimizer"]) & (curves.seed == row["seed"])]
        loss_curve = run_curves[run_curves.quantity == "train_loss"]
        assert list(loss_curve.step) == list(range(1, len(losses) + 1))
        np.testing.assert_allclose(loss_curve.value, losses, rtol=1e-12)
        evals = store.read_run(root)["evals"]
        val = run_curves[run_curves.quantity == "val_accuracy"]
        assert list(val.step) == [e["step"] for e in evals]
        np.testing.assert_allclose(val.value, [e["metrics"]["accuracy"] for e in evals])
        assert row["val_accuracy"] == pytest.approx(val.value.max())  # the best validation is the curve's max


def test_summarise_gives_mean_and_sd_over_seeds(runs, tmp_path):
    out, _ = runs
    aggregate(out, "smoke", tmp_path)
    table, _ = read_tables(tmp_path)
    summary = summarise(table)
    assert list(summary["optimizer"]) == ["ief", "sgd"] and list(summary["n"]) == [2, 2]
    for _, row in summary.iterrows():
        v = table[table.optimizer == row["optimizer"]]["test_accuracy"].to_numpy()
        assert row["test_accuracy_mean"] == pytest.approx(v.mean())
        assert row["test_accuracy_sd"] == pytest.approx(v.std(ddof=1))
    one = summarise(table[table.seed == 0], ["final_train_loss"])
    assert one["final_train_loss_sd"].isna().all()  # one seed: no sd (not 0)
    with pytest.raises(ValueError, match="unknown column"):
        summarise(table, ["no_such_column"])
    assert mean_sd([0.5, 0.7], scale=100, digits=1) == "60.0 ± 14.1"
    assert mean_sd([0.5]) == "0.50" and mean_sd([]) == "–"


def test_curve_bands_average_windows_then_seeds(runs, tmp_path):
    out, _ = runs
    aggregate(out, "smoke", tmp_path)
    _, curves = read_tables(tmp_path)
    raw = curve_bands(curves, "train_loss")
    sgd = curves[(curves.optimizer == "sgd") & (curves.quantity == "train_loss")]
    first = sgd[sgd.step == 1].value.to_numpy()
    row = raw[(raw.optimizer == "sgd") & (raw.step == 1)].iloc[0]
    assert row["mean"] == pytest.approx(first.mean()) and row["sd"] == pytest.approx(first.std(ddof=1))
    assert row["n"] == 2
    binned = curve_bands(curves, "train_loss", points=4)  # 8 steps -> 4 windows of 2
    b = binned[binned.optimizer == "sgd"]
    assert list(b.step) == [2, 4, 6, 8]
    per_seed = [sgd[(sgd.seed == s) & sgd.step.isin([1, 2])].value.mean() for s in (0, 1)]
    assert b.iloc[0]["mean"] == pytest.approx(np.mean(per_seed))
    with pytest.raises(ValueError, match="quantities present"):
        curve_bands(curves, "val_nothing")


def test_cli(runs, tmp_path, capsys):
    out, _ = runs
    assert main(["aggregate", "--scale", "smoke", "--runs", str(out), "--out", str(tmp_path / "r")]) == 0
    text = capsys.readouterr().out
    assert "4 finished runs; 1 unfinished (left out)" in text
    assert len(pd.read_csv(tmp_path / "r" / RUNS_FILE)) == 4
    assert main(["aggregate", "--scale", "cpu", "--runs", str(out), "--out", str(tmp_path / "x")]) == 1
    assert "no finished run" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["aggregate", "--scale", "huge", "--runs", str(out), "--out", str(tmp_path / "x")]) == 2
    assert "valid scales" in capsys.readouterr().err


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=3000), st.floats(0.001, 1.0))
def test_final_loss_window_property(losses, fraction):
    """Always the mean of the last ceil(fraction * n) >= 1 values, whatever the run's length."""
    k = max(1, math.ceil(fraction * len(losses)))
    assert 1 <= k <= len(losses)
    assert final_loss(losses, fraction) == pytest.approx(float(np.mean(losses[-k:])), rel=1e-9, abs=1e-9)


def test_a_diverged_run_is_a_row_with_its_step(tmp_path):
    train(SETUP, "sgd", 0, "smoke", tmp_path / "runs", lr=1e30, progress=False, verbose=False)  # NaN at step 2
    aggregate(tmp_path / "runs", "smoke", tmp_path)
    table, curves = read_tables(tmp_path)
    (row,) = table.itertuples()
    assert row.diverged_step == 2 and row.steps == 1  # the failed update is not applied
    assert math.isfinite(row.final_train_loss) and len(curves[curves.quantity == "train_loss"]) == 1


def test_load_e2_reads_the_workflow_tables_or_says_how_to_make_the_runs(runs, tmp_path):
    from companion.experiments.aggregate import load_e2

    runs, _ = runs
    with pytest.raises(ValueError, match="scale must be one of"):
        load_e2("gpu")
    with pytest.raises(FileNotFoundError, match="make book"):
        load_e2("cpu", tmp_path / "no-results", tmp_path / "no-runs")
    aggregate(runs, "smoke", tmp_path / "results")
    from_tables = load_e2("smoke", tmp_path / "results", tmp_path / "no-runs", setups=[SETUP])
    from_runs = load_e2("smoke", tmp_path / "no-results", runs, setups=[SETUP])
    assert from_tables.source.startswith("the aggregated tables") and from_runs.source.startswith("the runs in")
    cols = ["setup", "optimizer", "seed", "steps", "final_train_loss"]
    pd.testing.assert_frame_equal(from_tables.table[cols].reset_index(drop=True),
                                  from_runs.table[cols].reset_index(drop=True), check_dtype=False)
    assert from_runs.seeds == sorted(int(k) for k in from_runs.table.seed.unique())
    assert set(from_runs.missing) == set(from_runs.expected) - set(
        zip(from_runs.table.setup, from_runs.table.optimizer, from_runs.table.seed))


def test_load_e2_only_reads_and_names_what_trains_a_missing_grid(runs, tmp_path, monkeypatch):
    """Loading never trains: with nothing on disk it says how to make the runs; with part of the grid it lists the
    missing runs."""
    from companion.experiments import runner
    from companion.experiments.aggregate import load_e2

    runs, _ = runs
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail(f"load_e2 trained a run: {a}"))
    with pytest.raises(FileNotFoundError, match="python -m companion aggregate"):
        load_e2("smoke", tmp_path / "no-results", tmp_path / "no-runs")
    assert not (tmp_path / "no-runs").exists()
    partial = load_e2("smoke", tmp_path / "no-results", runs, setups=[SETUP])
    assert set(GRID) == {(o, k) for _, o, k in partial.expected if (SETUP, o, k) not in partial.missing}
    assert partial.missing and all(o not in {"sgd", "ief"} for _, o, _ in partial.missing)
