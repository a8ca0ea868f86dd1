"""The full training-set loss of a run's final checkpoint (companion.experiments.final_loss): the runner records it,
the back-fill adds it to a finished run that lacks it, the E2 table carries it and the loss rankings compare it."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from ief import call_model
from companion.experiments import run_dir, runner, store, train
from companion.experiments.aggregate import run_row
from companion.experiments.backfill import backfill, backfill_final_loss, backfill_run
from companion.experiments.final_loss import FIELD, recorded, training_set_loss
from companion.experiments.verdicts.training import loss_column


def _smoke_model(setup: str = "digits-mlp"):
    runner.seed_everything(0)
    cfg = runner.resolve(setup, "smoke")
    data = runner.load_data(cfg)
    model, preprocessor = runner.build_model(cfg, data)
    return cfg, data, model, runner.make_task(cfg, model, preprocessor)


@pytest.mark.parametrize("setup", ["digits-mlp", "tweets-minilm-lora"])
def test_the_loss_is_the_float64_mean_cross_entropy_over_every_example(setup):
    """Against a float64 brute force, one example at a time: sum of per-example cross-entropies over the count,
    whatever the batch size (one that does not divide the set included); evaluation mode during, training mode
    restored after."""
    cfg, data, model, task = _smoke_model(setup)
    model.train()
    want = []
    with torch.no_grad():
        model.eval()
        for e in data.train:
            inputs, targets = task.collate([e])
            logits = call_model(model, inputs)
            want.append(float(torch.nn.functional.cross_entropy(logits.double().reshape(-1, logits.shape[-1]),
                                                                targets.reshape(-1), reduction="sum")))
        model.train()
    for batch_size in (len(data.train), 3):
        got = training_set_loss(model, task, data.train, "cpu", batch_size)
        assert got == pytest.approx(sum(want) / len(want), rel=1e-6)
        assert model.training


def test_bad_input_and_a_non_finite_model():
    cfg, data, model, task = _smoke_model()
    with pytest.raises(ValueError, match="at least one training example"):
        training_set_loss(model, task, [], "cpu", 4)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    assert training_set_loss(model, task, data.train, "cpu", 4) == math.inf  # diverged: the worst loss, not NaN


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    summary = train("digits-mlp", "ief", 0, "smoke", out, progress=False, verbose=False)
    return out, summary, run_dir(out, "smoke", "digits-mlp", "ief", 0)


def test_the_runner_records_the_final_checkpoints_loss(finished):
    """summary.json's final_train_loss_full is the loss of stage-100.pt (the parameters after the last update),
    not of best.pt, measured after training and before the test evaluation."""
    out, summary, root = finished
    cfg, data, model, task = _smoke_model()
    store.load_trainable(model, store.read_trainable(root / "checkpoints" / "stage-100.pt"))
    assert summary[FIELD] == pytest.approx(training_set_loss(model, task, data.train, "cpu", 7), rel=1e-6)
    store.load_trainable(model, store.read_trainable(root / "checkpoints" / "best.pt"))
    best = training_set_loss(model, task, data.train, "cpu", 7)
    assert summary["best_validation"]["step"] == summary["steps"] or summary[FIELD] != best
    assert run_row(store.read_run(root))[FIELD] == summary[FIELD]


def test_backfill_adds_what_an_old_run_lacks_and_nothing_else(finished, tmp_path):
    out, summary, root = finished
    old = tmp_path / "runs"
    copy = run_dir(old, "smoke", "digits-mlp", "ief", 0)
    copy.parent.mkdir(parents=True)
    shutil.copytree(root, copy)
    before = {k: v for k, v in store.read_json(copy / "summary.json").items() if k != FIELD}
    store.write_json(copy / "summary.json", before)  # a summary written before the field existed
    (copy / store.TEST_PREDICTIONS).unlink()
    assert math.isnan(recorded(before)) and math.isnan(run_row(store.read_run(copy))[FIELD])
    assert backfill(old, "smoke") == {copy: {"test predictions": "written", "final loss": "written"}}
    after = store.read_json(copy / "summary.json")
    assert after[FIELD] == pytest.approx(summary[FIELD], rel=1e-9)
    assert {k: v for k, v in after.items() if k != FIELD} == before
    assert (copy / store.TEST_PREDICTIONS).read_text() == (root / store.TEST_PREDICTIONS).read_text()
    assert backfill_run(copy) == {"test predictions": "present", "final loss": "present"}


def test_backfill_of_a_diverged_run_and_of_a_run_without_its_final_checkpoint(tmp_path):
    train("digits-mlp", "ief", 0, "smoke", tmp_path, lr=1e30, progress=False, verbose=False)
    root = run_dir(tmp_path, "smoke", "digits-mlp", "ief", 0)
    s = store.read_json(root / "summary.json")
    assert s["diverged"] is not None and s[FIELD] is None and recorded(s) == math.inf
    store.write_json(root / "summary.json", {k: v for k, v in s.items() if k != FIELD})
    assert backfill_final_loss(root).startswith("written (the run diverged")
    assert store.read_json(root / "summary.json")[FIELD] is None
    other = tmp_path / "other"
    train("digits-mlp", "sgd", 0, "smoke", other, progress=False, verbose=False)
    root = run_dir(other, "smoke", "digits-mlp", "sgd", 0)
    store.write_json(root / "summary.json", {k: v for k, v in store.read_json(root / "summary.json").items()
                                             if k != FIELD})
    (root / "checkpoints" / "stage-100.pt").unlink()
    assert backfill_final_loss(root).startswith("not written:")
    assert FIELD not in store.read_json(root / "summary.json")


def test_recorded_values():
    assert recorded({FIELD: 0.25, "diverged": None}) == 0.25
    assert recorded({FIELD: None, "diverged": None}) == math.inf  # measured, not finite
    assert recorded({"diverged": {"step": 3}}) == math.inf  # no final checkpoint, recorded or not
    assert math.isnan(recorded({"diverged": None}))  # written before the field existed


def test_the_rankings_compare_the_full_loss_per_setup_where_every_run_has_it():
    """A setup whose every run has the full loss (a diverged run's inf included) is ranked on it; a setup with
    one run without it falls back to the minibatch mean, for that setup alone."""
    rows = []
    for setup, full in (("a", [0.1, 0.2, math.inf]), ("b", [0.1, float("nan"), 0.3])):
        rows += [{"setup": setup, "optimizer": "ief", "seed": k, "final_train_loss": 1.0, FIELD: v}
                 for k, v in enumerate(full)]
    table = pd.DataFrame(rows)
    assert loss_column(table[table.setup == "a"]) == FIELD
    assert loss_column(table[table.setup == "b"]) == "final_train_loss"
    assert loss_column(table.drop(columns=[FIELD])) == "final_train_loss"
    assert np.isinf(table[FIELD]).sum() == 1
