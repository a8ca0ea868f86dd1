"""The runner (ief.experiments.runner): run files, determinism, resuming after SIGTERM/SIGINT or a crash with the
same summary as an uninterrupted run, skipping finished runs, atomic writes, divergence."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ief.experiments import RunConflict, run_dir, train
from ief.experiments import runner, store

ROOT = Path(__file__).resolve().parents[1]
SETUP, OPT = "tweets-minilm-lora", "sf"  # dropout, LoRA dropout and SF's label sampling all draw random numbers
LONGER = {"epochs": 3}  # 12 steps of 8 examples, validation every 2


def _numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "wall_time_s"}


def _files(root: Path) -> dict[str, str]:
    return {name: (root / name).read_text() for name in ("train_loss.csv", "validation.jsonl")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run (the numbers every resumed run must reproduce)."""
    out = tmp_path_factory.mktemp("reference")
    summary = train(SETUP, OPT, 3, "smoke", out, overrides=LONGER, progress=False, verbose=False)
    return summary, run_dir(out, "smoke", SETUP, OPT, 3)


def test_run_files(reference):
    summary, root = reference
    assert summary["steps"] == 12 and summary["steps_per_epoch"] == 4
    config = json.loads((root / "config.json").read_text())
    assert config["setup"]["epochs"] == 3 and config["optimizer"]["name"] == "sf" and config["seed"] == 3
    rows = (root / "train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,epoch,loss" and len(rows) == 13
    losses = [float(r.split(",")[2]) for r in rows[1:]]
    assert summary["final_train_loss"] == pytest.approx(sum(losses[-100:]) / len(losses[-100:]), rel=1e-12)
    evals = [json.loads(line) for line in (root / "validation.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10, 12]
    best = max(evals, key=lambda e: e["score"])  # the first of the best scores
    assert summary["best_validation"]["step"] == best["step"]
    ckpts = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert ckpts == ["best.pt", "epoch-001.pt", "epoch-002.pt", "epoch-003.pt"]
    state = torch.load(root / "checkpoints" / "epoch-003.pt")
    assert state and all("lora" in k or "classifier" in k for k in state)
    assert not (root / "resume.pt").exists() and not list(root.rglob(".*.tmp-*"))
    assert set(summary) >= {"final_train_loss", "best_validation", "test", "wall_time_s", "trainable_parameters"}


def test_same_seed_same_summary_other_seed_differs(reference, tmp_path):
    again = train(SETUP, OPT, 3, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False)
    assert _numbers(again) == _numbers(reference[0])
    other = train(SETUP, OPT, 4, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False)
    assert other["final_train_loss"] != again["final_train_loss"]


_CHILD = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
import ief.experiments.runner as r
inner = r.train_step
def slow(*a, **k):
    out = inner(*a, **k)
    print("STEP", flush=True)
    time.sleep(0.2)
    return out
r.train_step = slow
from ief.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def _interrupt(out: Path, signum: int, after_steps: int) -> int:
    """Run the CLI in a subprocess (slowed down), send ``signum`` after ``after_steps`` steps; its exit code."""
    args = ["train", "--setup", SETUP, "--optimizer", OPT, "--seed", "3", "--scale", "smoke", "--out", str(out),
            "--set", "epochs=3", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(torch.get_num_threads()), *args], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = 0
    for line in child.stdout:
        seen += line.startswith("STEP")
        if seen == after_steps:
            child.send_signal(signum)
            break
    child.stdout.read()
    return child.wait(timeout=60)


def test_resume_after_sigterm_and_sigint_gives_the_same_summary(reference, tmp_path):
    summary, ref_root = reference
    root = run_dir(tmp_path, "smoke", SETUP, OPT, 3)
    assert _interrupt(tmp_path, signal.SIGTERM, 3) == 128 + signal.SIGTERM
    assert (root / "resume.pt").exists() and not (root / "summary.json").exists()
    assert torch.load(root / "resume.pt", weights_only=False)["state"]["done"] == 3
    assert _interrupt(tmp_path, signal.SIGINT, 4) == 128 + signal.SIGINT  # resumed at 3, stopped at 7
    assert torch.load(root / "resume.pt", weights_only=False)["state"]["done"] == 7
    resumed = train(SETUP, OPT, 3, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False)
    assert _numbers(resumed) == _numbers(summary)
    assert _files(root) == _files(ref_root)
    for name in ("best.pt", "epoch-003.pt"):
        a, b = torch.load(root / "checkpoints" / name), torch.load(ref_root / "checkpoints" / name)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_a_crash_from_the_periodic_checkpoint(reference, tmp_path, monkeypatch):
    inner, calls = runner.train_step, []

    def crash_at_step_6(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("simulated crash (power cut)")
        return inner(*args, **kwargs)

    monkeypatch.setattr(runner, "train_step", crash_at_step_6)
    with pytest.raises(RuntimeError, match="simulated crash"):  # resume.pt after every step
        train(SETUP, OPT, 3, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False, checkpoint_every_s=0)
    monkeypatch.setattr(runner, "train_step", inner)
    resumed = train(SETUP, OPT, 3, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False)
    assert _numbers(resumed) == _numbers(reference[0])


def test_finished_run_is_skipped_and_conflicts_refused(reference, monkeypatch, capsys):
    summary, root = reference
    out = root.parents[3]
    monkeypatch.setattr(runner, "load_data", lambda cfg: pytest.fail("a finished run must not rebuild anything"))
    assert train(SETUP, OPT, 3, "smoke", out, overrides=LONGER, progress=False) == summary
    assert "skipped (finished)" in capsys.readouterr().out
    with pytest.raises(RunConflict, match="different configuration"):
        train(SETUP, OPT, 3, "smoke", out, lr=0.5, overrides=LONGER, progress=False, verbose=False)


def test_atomic_writes_leave_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    store.write_json(path, {"a": 1})

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(store.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        store.write_json(path, {"a": 2})
    with pytest.raises(OSError, match="disk full"):
        store.write_torch(tmp_path / "resume.pt", {"x": torch.ones(3)})
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temporary left behind
    monkeypatch.undo()
    store.write_json(path, {"nan": float("nan")})  # strict JSON: non-finite numbers become null
    assert json.loads(path.read_text()) == {"nan": None}


def test_divergence_ends_the_run_with_a_summary(tmp_path):
    s = train("digits-mlp", "ief", 0, "smoke", tmp_path, lr=1e30, progress=False, verbose=False)
    assert s["diverged"] is not None and s["steps"] < 8
    assert s["best_validation"]["metrics"] and (run_dir(tmp_path, "smoke", "digits-mlp", "ief", 0) / "summary.json"
                                                ).exists()
