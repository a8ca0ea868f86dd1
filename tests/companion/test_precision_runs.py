"""The chapter-level bfloat16 check (``python -m companion train --precision bf16``, :mod:`.experiments.precision`):
a setup trained under bfloat16 autocast ends within a stated distance of its float32 run, the precision is in the run
record and its own folder, a bad value is refused in one sentence, and every optimiser of the CPU setups runs under it.

The distance, stated before measuring. :mod:`ief.precision` bounds the relative error of every quantity a bfloat16
forward and backward compute (the loss, the rows of ``J``, hence the update directions) by ``16 u`` with bfloat16's
unit roundoff ``u = 2^-8`` (:func:`ief.precision.mismatch_tolerance`, ``0.0625``). Each update of the bfloat16 run is
then the float32 run's within ``16 u`` of its size, so along a trajectory that does not amplify perturbations (one
that trains: the loss falls) its parameters stay within ``16 u`` of the float32 run's displacement, and its losses
within ``16 u`` of the scale of the loss, the first loss ``L0``: ``|F_bf16 - F_f32| <= 16 u L0`` for the final
training losses ``F`` (``companion.experiments.summaries.final_train_loss``). The test has the power to see a broken
bfloat16 path: the float32 run lowers the loss by more than twice that distance (a run whose updates are dropped ends
near ``L0``), and the bfloat16 run's losses are not the float32 run's (autocast ran). Checked by mutation: a bfloat16
run that drops its updates, one that does not autocast, and one that autocasts to float16 (refused by ief for iEF)
fail here. The cpu scale's tweets-minilm-lora is not trained here: cut to 6 updates its iEF run takes 100 s under
bfloat16 autocast on one core, and its float32 run lowers the loss by less than twice the distance in so few.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from companion.__main__ import main
from companion.experiments import RunConflict, resolve, run_dir, runner, store, train
from companion.experiments.aggregate import find_runs
from companion.experiments.precision import check_precision
from companion.experiments.setups import CPU_SETUPS
from ief.precision import mismatch_tolerance

SETUP, SCALE = "digits-mlp", "smoke"  # trains in 8 updates (the tweets setups barely move at smoke scale)
ROOT = Path(__file__).resolve().parents[2]
DISTANCE = mismatch_tolerance(torch.bfloat16, torch.float32)  # 16 u = 0.0625 of the first loss (module docstring)


def _losses(out, setup: str, optimizer: str, precision: str) -> list[float]:
    return store.read_run(run_dir(out, SCALE, setup, optimizer, 0, precision))["losses"]


@pytest.mark.parametrize("optimizer", ["ief", "adamw"])
def test_bfloat16_smoke_run_ends_within_16u_of_the_first_loss_of_float32(optimizer, tmp_path):
    runs = {p: train(SETUP, optimizer, 0, SCALE, tmp_path, progress=False, verbose=False, precision=p)
            for p in ("float32", "bfloat16")}
    f32, bf16 = (_losses(tmp_path, SETUP, optimizer, p) for p in ("float32", "bfloat16"))
    first = f32[0]
    final32, final16 = runs["float32"]["final_train_loss"], runs["bfloat16"]["final_train_loss"]
    assert runs["bfloat16"]["diverged"] is None and len(bf16) == len(f32)
    assert first - final32 > 2 * DISTANCE * first, "the float32 run must train for the check to see a broken path"
    assert bf16 != f32, "the bfloat16 run computed the float32 run's losses: autocast did not run"
    assert abs(final16 - final32) <= DISTANCE * first, (optimizer, first, final32, final16)


@pytest.mark.parametrize("setup", CPU_SETUPS)
def test_every_optimizer_of_the_cpu_setups_trains_under_bfloat16(setup, tmp_path):
    for optimizer in resolve(setup, SCALE).optimizers:
        summary = train(setup, optimizer, 0, SCALE, tmp_path, progress=False, verbose=False, precision="bf16")
        assert summary["precision"] == "bfloat16" and summary["diverged"] is None, (setup, optimizer)
        assert all(map(torch.isfinite, torch.tensor(_losses(tmp_path, setup, optimizer, "bfloat16"))))


def test_the_precision_is_in_the_run_record_and_its_own_folder(tmp_path):
    f32 = train(SETUP, "ief", 0, SCALE, tmp_path, progress=False, verbose=False)
    bf16 = train(SETUP, "ief", 0, SCALE, tmp_path, progress=False, verbose=False, precision="bf16")
    root32, root16 = run_dir(tmp_path, SCALE, SETUP, "ief", 0), run_dir(tmp_path, SCALE, SETUP, "ief", 0, "bf16")
    assert root16 == tmp_path / "bfloat16" / SCALE / SETUP / "ief" / "seed-0" and root32 != root16
    for root, name, summary in ((root32, "float32", f32), (root16, "bfloat16", bf16)):
        assert store.read_json(root / "config.json")["precision"] == name and summary["precision"] == name
        assert store.read_json(root / "summary.json")["precision"] == name
    assert "[smoke, bfloat16]" in runner.format_summary(bf16) and "bfloat16" not in runner.format_summary(f32)
    assert find_runs(tmp_path, SCALE) == ([root32], [])  # the float32 E2 aggregate never takes a bfloat16 run
    assert find_runs(tmp_path / "bfloat16", SCALE) == ([root16], [])


def test_a_run_from_before_the_option_is_a_float32_run(tmp_path):
    summary = train(SETUP, "sgd", 0, SCALE, tmp_path, progress=False, verbose=False)
    root = run_dir(tmp_path, SCALE, SETUP, "sgd", 0)
    config = store.read_json(root / "config.json")
    del config["precision"]
    store.write_json(root / "config.json", config)
    assert train(SETUP, "sgd", 0, SCALE, tmp_path, progress=False, verbose=False) == summary  # skipped, no conflict
    with pytest.raises(RunConflict, match="different configuration"):  # a bfloat16 record in the float32 folder
        store.write_json(root / "config.json", {**config, "precision": "bfloat16"})
        train(SETUP, "sgd", 0, SCALE, tmp_path, progress=False, verbose=False)


def _crash_at(step: int, monkeypatch) -> None:
    inner, calls = runner.train_step, []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError("simulated crash")
        return inner(*args, **kwargs)

    monkeypatch.setattr(runner, "train_step", crashing)


def test_a_bfloat16_run_resumes_itself_and_never_a_float32_run(tmp_path, monkeypatch):
    inner = runner.train_step
    reference = train(SETUP, "ief", 0, SCALE, tmp_path / "ref", progress=False, verbose=False, precision="bfloat16")
    out = tmp_path / "runs"
    _crash_at(4, monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):  # a float32 run left resume.pt after 3 updates
        train(SETUP, "ief", 0, SCALE, out, progress=False, verbose=False, checkpoint_every_s=1e-9)
    root32 = run_dir(out, SCALE, SETUP, "ief", 0)
    resume32 = (root32 / "resume.pt").read_bytes()
    _crash_at(4, monkeypatch)
    with pytest.raises(RuntimeError, match="simulated crash"):  # the bfloat16 run starts at 0: 3 updates done
        train(SETUP, "ief", 0, SCALE, out, progress=False, verbose=False, checkpoint_every_s=1e-9, precision="bf16")
    root16 = run_dir(out, SCALE, SETUP, "ief", 0, "bfloat16")
    assert store.read_torch(root16 / "resume.pt")["state"]["done"] == 3
    monkeypatch.setattr(runner, "train_step", inner)
    resumed = train(SETUP, "ief", 0, SCALE, out, progress=False, verbose=False, precision="bf16")
    assert {k: v for k, v in resumed.items() if k != "wall_time_s"} == \
        {k: v for k, v in reference.items() if k != "wall_time_s"}
    assert (root32 / "resume.pt").read_bytes() == resume32 and not (root32 / "summary.json").exists()


@pytest.mark.parametrize("value,name", [("float32", "float32"), ("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
                                        ("BF16", "bfloat16")])
def test_accepted_names(value, name):
    assert check_precision(value) == name


@pytest.mark.parametrize("value", ["float64", "fp8", "", None, 16])
def test_a_bad_precision_is_refused_naming_it_and_the_accepted_ones(value, tmp_path):
    with pytest.raises(ValueError, match=r"unknown precision .*; accepted: float32 \(the default\), bfloat16 or bf16"):
        train(SETUP, "ief", 0, SCALE, tmp_path, progress=False, verbose=False, precision=value)
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("value", ["float16", "fp16", "half"])
def test_float16_is_refused_with_the_library_reason(value, tmp_path):
    with pytest.raises(ValueError, match=r"float16 is refused .*underflow.*use bfloat16"):
        train(SETUP, "ief", 0, SCALE, tmp_path, progress=False, verbose=False, precision=value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value,says", [
    ("float64", "invalid value 'float64': float32 (the default), bfloat16 or bf16 expected"),
    ("float16", "precision 'float16': float16 is refused"),
])
def test_the_command_line_refuses_a_bad_precision_in_one_line(value, says, tmp_path):
    done = subprocess.run([sys.executable, "-m", "companion", "train", "--setup", SETUP, "--scale", SCALE,
                           "--optimizer", "ief", "--out", str(tmp_path / "runs"), "--precision", value],
                          cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert errors[0].startswith("python -m companion train: error: argument --precision: ") and says in errors[0]
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists()


def test_the_command_line_trains_in_bfloat16(tmp_path, capsys):
    assert main(["train", "--setup", SETUP, "--scale", SCALE, "--optimizer", "adamw", "--out", str(tmp_path),
                 "--precision", "bf16", "--no-progress"]) == 0
    assert "[smoke, bfloat16]" in capsys.readouterr().out
    assert json.loads((run_dir(tmp_path, SCALE, SETUP, "adamw", 0, "bf16") / "config.json").read_text())[
        "precision"] == "bfloat16"
