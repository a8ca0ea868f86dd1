"""companion.experiments.evaluate_runs: the evaluation job on a real (smoke) baseline run; checkpoints, resume, CLI."""
from __future__ import annotations

import json
import math
import shutil
import threading

import pytest

from companion.__main__ import main
from companion.experiments import evaluate_runs as er
from companion.experiments import store
from companion.experiments.runner import run_dir, train
from companion.experiments.setups import EVALUATION_KNOBS

SETUP, SCALE = "digits-mlp", "smoke"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    train(SETUP, "adam", 0, SCALE, root, progress=False, verbose=False)
    return root


def _run_root(runs):
    return run_dir(runs, SCALE, SETUP, "adam", 0)


def _copy_without_stage_files(runs, dest):
    """A copy of the runs as a runner without stage checkpoints leaves them (epoch checkpoints only)."""
    shutil.copytree(runs, dest)
    for path in (_run_root(dest) / "checkpoints").glob("stage-*.pt"):
        path.unlink()
    return dest


def test_epoch_checkpoints_and_rebuilt_initial_model(runs, tmp_path):
    root = _copy_without_stage_files(runs, tmp_path / "copy")
    out = er.evaluate_run(SETUP, SCALE, 0, root, tmp_path / "e.csv", batches=2, progress=False)
    records = er.read_records(out)
    assert {(r["stage"], r["source"]) for r in records} == {(0, "initial"), (50, "epoch"), (100, "epoch")}
    e1 = [r for r in records if r["kind"] == "e1"]
    assert {r["method"] for r in e1} == {"sgd", "ef", "ief", "sf", "hf", "kfac", "ekfac", "iekfac"}
    assert len(e1) == 3 * 2 * 8
    assert all(r["ratio"] == 1.0 for r in e1 if r["method"] == "sgd")
    assert all(math.isfinite(r["gamma"]) and r["gamma"] > 0 and r["imbalance"] >= 1 for r in e1)
    assert all(r["damping"] == 1e-7 for r in e1 if r["method"] not in ("sgd", "hf"))
    sweep = [r for r in records if r["kind"] == "sweep"]
    assert {r["stage"] for r in sweep} == set(er.sweep_stages([0, 50, 100])) == {50, 100}
    grid = er.sweep_grid(EVALUATION_KNOBS[SCALE]["sweep_dampings"])
    assert {r["damping"] for r in sweep if r["method"] != "sgd"} == set(grid)
    assert all(r["target_tokens"] == 8 for r in records)  # one target per sample, batch size 8


def test_stage_files_are_preferred_and_stage_zero_is_the_runs_initial_model(runs, tmp_path):
    src = _run_root(runs)
    root = _copy_without_stage_files(runs, tmp_path / "copy")
    run = _run_root(root)
    rebuilt = er.evaluate_run(SETUP, SCALE, 0, root, tmp_path / "a.csv", batches=1, sweep=False, progress=False)
    # the runner's contract: stage-PPP.pt with the trainable state; stage-000 the initial model
    er_initial = [r for r in er.read_records(rebuilt) if r["stage"] == 0]
    from companion.experiments.data import load_data
    from companion.experiments.models import build_model
    from companion.experiments.runner import seed_everything
    from companion.experiments.setups import resolve

    seed_everything(0)
    cfg = resolve(SETUP, SCALE)
    model, _ = build_model(cfg, load_data(cfg))
    store.write_torch(run / "checkpoints" / "stage-000.pt", store.trainable_state(model))
    for pct, epoch in [(25, 1), (50, 1), (75, 2), (100, 2)]:
        shutil.copy(src / "checkpoints" / f"epoch-{epoch:03d}.pt", run / "checkpoints" / f"stage-{pct:03d}.pt")
    assert sorted(er.stage_checkpoints(run)) == [0, 25, 50, 75, 100]
    out = er.evaluate_run(SETUP, SCALE, 0, root, tmp_path / "b.csv", batches=1, sweep=False, progress=False)
    records = er.read_records(out)
    assert {r["stage"] for r in records} == {0, 25, 50, 75, 100} and {r["source"] for r in records} == {"stage"}
    from_file = {r["method"]: r["gamma"] for r in records if r["stage"] == 0}
    for r in er_initial:
        assert from_file[r["method"]] == pytest.approx(r["gamma"], rel=1e-6), r["method"]


def _counting(monkeypatch) -> list[int]:
    """The stages evaluate_batch is called for from now on (one entry per batch)."""
    calls = []
    real = er.evaluate_batch

    def counting(model, inputs, targets, *args, **kwargs):
        calls.append(kwargs["extra"]["stage"])
        return real(model, inputs, targets, *args, **kwargs)

    monkeypatch.setattr(er, "evaluate_batch", counting)
    return calls


def test_a_part_is_reused_only_by_the_same_job(runs, tmp_path, monkeypatch):
    """The resume guard: the same job (an interrupted one run again) reuses its parts; a job with other parameters,
    or over a checkpoint written since, computes them again. No cache beside Snakemake's: no package version or
    checkpoint hash in a part's record, no manifest that skips a finished OUT."""
    root = _copy_without_stage_files(runs, tmp_path / "copy")
    out = tmp_path / "c.csv"
    er.evaluate_run(SETUP, SCALE, 0, root, out, batches=1, sweep=False, progress=False)
    first = out.read_text()
    calls = _counting(monkeypatch)
    out.unlink()  # as if interrupted before the final write: every stage part is this job's
    er.evaluate_run(SETUP, SCALE, 0, root, out, batches=1, sweep=False, progress=False)
    assert calls == [] and out.read_text() == first
    (out.with_name(out.name + ".parts") / "stage-050.csv").unlink()  # what Snakemake does before it reruns a job
    er.evaluate_run(SETUP, SCALE, 0, root, out, batches=1, sweep=False, progress=False)
    assert calls == [50] and out.read_text() == first
    ck = _run_root(root) / "checkpoints" / "epoch-002.pt"
    state = store.read_torch(ck)
    store.write_torch(ck, {k: v * 0.5 for k, v in state.items()})  # the run trained again: another job's part
    er.evaluate_run(SETUP, SCALE, 0, root, out, batches=1, sweep=False, progress=False)
    assert calls == [50, 100] and out.read_text() != first
    er.evaluate_run(SETUP, SCALE, 0, root, out, batches=2, sweep=False, progress=False)
    assert sorted(set(calls[2:])) == [0, 50, 100] and len(calls[2:]) == 3 * 2  # other knobs: every stage again
    record = json.loads((out.with_name(out.name + ".parts") / "stage-100.json").read_text())
    assert record["job"] == er.job_key({"setup": SETUP, "scale": SCALE, "seed": 0, "optimizer": "adam", "batches": 2,
                                        "batch_size": 8, "damping": 1e-7, "sweep_dampings": None, "cg": 5},
                                       100, "epoch", ck, False)
    assert not {"version", "algebra", "fingerprint"} & (set(record["job"]) | set(record))
    assert not out.with_name(out.name + ".json").exists()


def test_a_duplicate_waits_for_the_stage_then_resumes_from_it(runs, tmp_path, monkeypatch):
    """Two copies of one job (a SLURM requeue while the first still runs): the second waits on the stage's lock and,
    once the first has written the part, reuses it instead of computing the stage again."""
    out = tmp_path / "d.csv"
    parts = er.evaluate_run(SETUP, SCALE, 0, runs, out, batches=1, stages=[0], progress=False)
    part = parts / "stage-000.csv"
    written = part.read_text()
    part.unlink()  # the first copy has not written it yet ...
    calls = _counting(monkeypatch)
    with store.lock(parts, name="stage-000.lock"):  # ... and holds the stage
        duplicate = threading.Thread(target=er.evaluate_run, args=(SETUP, SCALE, 0, runs, out),
                                     kwargs={"batches": 1, "stages": [0], "progress": False})
        duplicate.start()
        duplicate.join(timeout=2)
        assert duplicate.is_alive() and calls == []  # waiting, computing nothing
        part.write_text(written)  # the first copy finishes the stage
    duplicate.join(timeout=120)
    assert not duplicate.is_alive() and calls == [] and part.read_text() == written


def test_one_job_per_stage_then_assembly_equals_one_job(runs, tmp_path, monkeypatch):
    """The workflow's evaluate_stage jobs (stages=[p]) fill the parts; the assembling call computes nothing and writes
    the same table as one job over every stage."""
    whole = er.evaluate_run(SETUP, SCALE, 0, runs, tmp_path / "whole.csv", batches=1, progress=False)
    out = tmp_path / "staged.csv"
    stages = sorted({r["stage"] for r in er.read_records(whole)})
    for stage in stages:
        parts = er.evaluate_run(SETUP, SCALE, 0, runs, out, batches=1, stages=[stage], progress=False)
        assert (parts / f"stage-{stage:03d}.csv").exists() and not out.exists()
    calls = []
    monkeypatch.setattr(er, "_evaluation_inputs", lambda *a, **k: calls.append(a) or pytest.fail("model built"))
    er.evaluate_run(SETUP, SCALE, 0, runs, out, batches=1, progress=False)
    assert calls == [] and er.read_records(out) == er.read_records(whole)
    with pytest.raises(ValueError, match=r"stages \[37\] not among the run's checkpoints; choose from \[0, "):
        er.evaluate_run(SETUP, SCALE, 0, runs, out, batches=1, stages=[37], progress=False)


def test_missing_run_says_which_optimiser_is_read_and_how_to_train_it(tmp_path, capsys):
    train = "python -m companion train --setup digits-mlp --scale smoke --optimizer adam"
    with pytest.raises(FileNotFoundError, match=train) as err:
        er.evaluate_run(SETUP, SCALE, 0, tmp_path / "nothing", tmp_path / "x.csv")
    assert "the checkpoints of the setup's baseline optimiser, adam" in str(err.value)
    assert "not those of an ief/ef/sf run" in str(err.value)
    from companion.__main__ import main

    assert main(["evaluate", "--help"]) == 0
    assert "BASELINE run" in " ".join(capsys.readouterr().out.split())


def test_cli(runs, tmp_path, capsys):
    out = tmp_path / "cli.csv"
    assert main(["evaluate", "--setup", SETUP, "--scale", SCALE, "--runs", str(runs), "--out", str(out),
                 "--batches", "1", "--batch-size", "4", "--no-sweep"]) == 0
    records = er.read_records(out)
    assert {r["target_tokens"] for r in records} == {4}
    assert main(["evaluate", "--setup", SETUP, "--scale", SCALE, "--runs", str(runs), "--out", str(out),
                 "--batches", "1", "--cg-iterations", "2", "--sweep-dampings", "3"]) == 0
    sweep = [r for r in er.read_records(out) if r["kind"] == "sweep" and r["method"] == "ef"]
    assert sorted({r["damping"] for r in sweep}) == pytest.approx([1e-10, 1e-4, 1e2])
    assert main(["evaluate", "--setup", SETUP, "--scale", "huge", "--runs", str(runs), "--out", str(out)]) == 2
    assert "unknown scale 'huge'" in capsys.readouterr().err
    assert main(["evaluate", "--setup", SETUP, "--scale", SCALE, "--runs", str(tmp_path), "--out", str(out)]) == 1
    assert main(["evaluate", "--setup", SETUP, "--scale", SCALE, "--runs", str(runs), "--out", str(out),
                 "--stages", "fifty"]) == 2
    assert "argument --stages: invalid value 'fifty': comma-separated integer percentages" in capsys.readouterr().err


def test_baselines_are_the_papers():
    assert er.baseline_optimizer("cola-t5-lora", "full") == "adamw"
    assert er.baseline_optimizer("sst2-t5-pt", "full") == "adafactor"
    assert er.baseline_optimizer("cifar10-mlp", "full") == "adam"
    assert er.baseline_optimizer("tweets-minilm-pt", "cpu") == "adafactor"
    assert er.sweep_stages([0, 25, 50, 75, 100]) == [25, 50, 100]


def test_summary_is_mean_and_sd_over_batches():
    recs = [{"kind": "e1", "setup": "s", "stage": 0, "method": "ef", "ratio": x} for x in (1.0, 3.0)]
    recs.append({"kind": "e1", "setup": "s", "stage": 0, "method": "ef", "ratio": float("inf")})
    assert er.summarise(recs)[("s", 0, "ef")] == {"mean": 2.0, "sd": 1.0, "n": 2}


@pytest.mark.slow
def test_notebook_at_smoke_scale(tmp_path, run_cache):
    """notebooks/evaluation.ipynb end to end at smoke scale, on what the workflow's jobs make: the three baseline
    runs trained and evaluated (python -m companion train / evaluate) and the dense check (python -m companion
    blockdiag-check); the chapter reads the tables and plots. Without the check's table it stops, naming the job."""
    import pandas as pd
    import papermill
    from nbrun import glued_text, run_notebook, train_grid, unresolved_glue

    from companion.experiments.blockdiag_check import CHECK_FILES, read_chapter_check, write_chapter_check

    out, runs, results = tmp_path / "fig", tmp_path / "runs", tmp_path / "results" / "smoke"
    for setup in ("digits-mlp", "tweets-minilm-lora", "tweets-minilm-pt"):
        train_grid(runs, "smoke", [(setup, er.baseline_optimizer(setup, "smoke"), 0)], run_cache)
        er.evaluate_run(setup, "smoke", 0, runs, results / "eval" / f"{setup}.csv", progress=False)
    with pytest.raises(papermill.PapermillExecutionError, match="python -m companion blockdiag-check --scale smoke"):
        run_notebook("evaluation.ipynb", tmp_path / "without", scale="smoke", out_dir=str(out), runs_dir=str(runs),
                     results_dir=str(results))
    write_chapter_check("smoke", runs, results, results / CHECK_FILES[0])  # the blockdiag_check job
    nb = run_notebook("evaluation.ipynb", tmp_path, scale="smoke", out_dir=str(out), runs_dir=str(runs),
                      results_dir=str(results))
    assert not unresolved_glue(nb)  # every rule and verdict the prose names is glued
    for name in ("sample_gamma", "lora_gamma", "pt_gamma", "sample_blockdiag_gamma", "damping_gamma_digits-mlp",
                 "damping_gamma_tweets-minilm-lora", "damping_gamma_tweets-minilm-pt"):
        assert (out / f"{name}.png").stat().st_size > 10_000, name
    records = er.read_records(results / "eval" / "tweets-minilm-pt.csv")
    assert "iekfac" not in {r["method"] for r in records}  # prompt tuning: no K-FAC factors for the prompt
    # the chapter's dense-check table and glue are the job's, number for number
    meta, table = read_chapter_check(results / CHECK_FILES[0], "smoke")
    assert pd.read_csv(out / "blockdiag_dense_check.csv").equals(table)
    assert all(glued_text(nb, key) == value for key, value in meta["glue"].items())


def test_summary_rows_per_setup_stage_and_method():
    recs = [{"kind": "e1", "setup": "s", "stage": 50, "method": m, "ratio": r, "imbalance": i}
            for m, r, i in (("sgd", 1.0, 2.0), ("ef", 1.0, 2.0), ("sgd", 1.0, 4.0), ("ef", 3.0, 4.0))]
    recs.append({"kind": "sweep", "setup": "s", "stage": 50, "method": "ef", "ratio": 9.0, "imbalance": None})
    rows = er.summary_rows(recs)
    assert [(r["method"], r["mean"], r["sd"], r["n"]) for r in rows] == [("sgd", 1.0, 0.0, 2), ("ef", 2.0, 1.0, 2)]
    assert rows[1]["imbalance_mean"] == 3.0 and rows[1]["imbalance_sd"] == 1.0


def test_notebook_parameters_parse():
    """papermill reads every parameter of the chapter (a comment it cannot parse drops the parameter's help)."""
    import nbformat
    from pathlib import Path
    from papermill.translators import PythonTranslator

    nb = nbformat.read(Path(__file__).resolve().parents[2] / "notebooks" / "evaluation.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = [p.name for p in PythonTranslator.inspect(cell)]
    assigned = [line.split("=")[0].strip() for line in cell.source.splitlines() if "=" in line.split("#")[0]]
    assert names == assigned and {"scale", "out_dir", "runs_dir", "results_dir"} <= set(names)


def _sweep_records(sf_ratios, ief_ratios=(0.5, 0.5, 0.6)):
    recs = [{"setup": "s", "stage": 50, "kind": "e1", "batch": 0, "method": m, "damping": None, "gamma": 1.0,
             "ratio": r, "imbalance": 2.0} for m, r in (("sgd", 1.0), ("ef", 1.2), ("ief", 0.5), ("sf", 0.8))]
    for method, ratios in (("sf", sf_ratios), ("ief", ief_ratios), ("ef", (2.0, 1.5, 1.0))):
        for lam, r in zip((1e-10, 1e-8, 1.0), ratios):
            recs.append({"setup": "s", "stage": 50, "kind": "sweep", "batch": 0, "method": method, "damping": lam,
                         "gamma": r, "ratio": r, "imbalance": None})
    return recs


def test_findings_never_divide_by_an_unchecked_value():
    """A recorded gamma = 0 (the old sweep's rounding) made findings divide by zero; records that are
    0, inf or NaN are not usable and never enter a finding."""
    assert er.findings(_sweep_records((0.0, 0.0, 0.7)))["s"]["ief_over_best_sf"] == [pytest.approx(0.5 / 0.7)]
    assert er.findings(_sweep_records((0.0, math.nan, math.inf)))["s"]["ief_over_best_sf"] == [None]
    f = er.findings(_sweep_records((0.9, 0.8, 0.7), ief_ratios=(0.0, 0.5, 0.6)))["s"]
    assert f["ief_near_zero_spread"] == 1.0 and f["ief_over_best_sf"] == [pytest.approx(0.5 / 0.7)]
    assert not er.usable(0.0) and not er.usable(math.inf) and not er.usable(None) and er.usable(1e-300)
    recs = _sweep_records((0.9, 0.8, 0.7))
    recs.append({"kind": "e1", "setup": "s", "stage": 50, "method": "ief", "ratio": 0.0, "batch": 1,
                 "imbalance": 2.0})
    assert er.summarise(recs)[("s", 50, "ief")]["n"] == 1
