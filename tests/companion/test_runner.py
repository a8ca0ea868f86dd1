"""The runner (companion.experiments.runner): run files, determinism, resuming after SIGTERM/SIGINT or a crash with the
same summary as an uninterrupted run, skipping finished runs, atomic writes, divergence."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from companion.experiments import RunConflict, run_dir, train
from companion.__main__ import main
from companion.experiments import format_summary, runner, store
from companion.experiments.aggregate import run_row
from companion.experiments.summaries import final_train_loss

ROOT = Path(__file__).resolve().parents[2]
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


def test_several_seeds_in_one_process_equal_a_process_each(tmp_path):
    """``train --seeds`` (the workflow's one job for an MLP's seeds) trains each run as its own process would: the
    same summaries, apart from the wall time; a finished run among them is skipped, not trained again."""
    args = ["train", "--setup", "digits-mlp", "--scale", "smoke", "--optimizer", "adam", "--no-progress"]
    assert main([*args, "--seed", "1", "--out", str(tmp_path / "alone")]) == 0
    alone = json.loads((run_dir(tmp_path / "alone", "smoke", "digits-mlp", "adam", 1) / "summary.json").read_text())
    together_out = ["--seeds", "0-1", "--out", str(tmp_path / "together")]
    done = subprocess.run([sys.executable, "-m", "companion", *args, *together_out], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    together = [json.loads((run_dir(tmp_path / "together", "smoke", "digits-mlp", "adam", k) / "summary.json")
                           .read_text()) for k in (0, 1)]
    assert _numbers(together[1]) == _numbers(alone) and _numbers(together[0]) != _numbers(alone)
    finished = run_dir(tmp_path / "together", "smoke", "digits-mlp", "adam", 0) / "summary.json"
    stamp = finished.stat().st_mtime_ns
    assert main([*args, "--seeds", "0,2", "--out", str(tmp_path / "together")]) == 0
    assert finished.stat().st_mtime_ns == stamp
    assert (run_dir(tmp_path / "together", "smoke", "digits-mlp", "adam", 2) / "summary.json").exists()


def test_run_files(reference):
    summary, root = reference
    assert summary["steps"] == 12 and summary["steps_per_epoch"] == 4
    config = json.loads((root / "config.json").read_text())
    assert config["setup"]["epochs"] == 3 and config["optimizer"]["name"] == "sf" and config["seed"] == 3
    rows = (root / "train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,epoch,loss" and len(rows) == 13
    losses = [float(r.split(",")[2]) for r in rows[1:]]
    # the book's one definition (companion.experiments.summaries): the last 10 % of the 12 updates, ceil(1.2) = 2 of
    # them
    assert summary["final_train_loss_updates"] == 2
    assert summary["final_train_loss"] == pytest.approx(sum(losses[-2:]) / 2, rel=1e-12)
    assert summary["final_train_loss"] == final_train_loss(losses) == run_row(store.read_run(root))["final_train_loss"]
    assert "final_train_loss=%.4f (last 2 of 12 updates)" % summary["final_train_loss"] in format_summary(summary)
    evals = [json.loads(line) for line in (root / "validation.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4, 6, 8, 10, 12]
    best = max(evals, key=lambda e: e["score"])  # the first of the best scores
    assert summary["best_validation"]["step"] == best["step"]
    ckpts = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert ckpts == ["best.pt", "epoch-001.pt", "epoch-002.pt", "epoch-003.pt", "stage-000.pt", "stage-025.pt",
                     "stage-050.pt", "stage-075.pt", "stage-100.pt"]
    state = torch.load(root / "checkpoints" / "epoch-003.pt")
    assert state and all("lora" in k or "classifier" in k for k in state)
    assert not (root / "resume.pt").exists() and not (root / "resume.prev.pt").exists()
    assert not list(root.rglob(".*.tmp-*"))
    assert set(summary) >= {"final_train_loss", "best_validation", "test", "wall_time_s", "trainable_parameters"}


def test_same_seed_same_summary_other_seed_differs(reference, tmp_path):
    again = train(SETUP, OPT, 3, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False)
    assert _numbers(again) == _numbers(reference[0])
    other = train(SETUP, OPT, 4, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False)
    assert other["final_train_loss"] != again["final_train_loss"]


_CHILD = """
import os, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
import companion.experiments.runner as r
inner = r.train_step
gate = os.environ.get("IEF_TEST_GATE")  # if set: hold after the first step until this file exists
def slow(*a, **k):
    out = inner(*a, **k)
    print("STEP", flush=True)
    time.sleep(0.2)
    while gate and not os.path.exists(gate):
        time.sleep(0.05)
    return out
r.train_step = slow
from companion.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def _interrupt(out: Path, signum: int, after_steps: int, output: list[str] | None = None) -> int:
    """Run the CLI in a subprocess (slowed down), send ``signum`` after ``after_steps`` steps; its exit code (its
    stdout lines appended to ``output``)."""
    args = ["train", "--setup", SETUP, "--optimizer", OPT, "--seed", "3", "--scale", "smoke", "--out", str(out),
            "--set", "epochs=3", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(torch.get_num_threads()), *args], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen, lines = 0, []
    for line in child.stdout:
        lines.append(line)
        seen += line.startswith("STEP")
        if seen == after_steps:
            child.send_signal(signum)
            break
    lines += child.stdout.read().splitlines(keepends=True)
    if output is not None:
        output += lines
    return child.wait(timeout=60)


def test_resume_after_sigterm_and_sigint_gives_the_same_summary(reference, tmp_path):
    summary, ref_root = reference
    root = run_dir(tmp_path, "smoke", SETUP, OPT, 3)
    assert _interrupt(tmp_path, signal.SIGTERM, 3) == 128 + signal.SIGTERM
    assert (root / "resume.pt").exists() and not (root / "summary.json").exists()
    assert store.read_torch(root / "resume.pt")["state"]["done"] == 3
    assert _interrupt(tmp_path, signal.SIGINT, 4) == 128 + signal.SIGINT  # resumed at 3, stopped at 7
    assert store.read_torch(root / "resume.pt")["state"]["done"] == 7
    resumed = train(SETUP, OPT, 3, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=False)
    assert _numbers(resumed) == _numbers(summary)
    assert _files(root) == _files(ref_root)
    names = ["best.pt", "epoch-003.pt", *(p.name for p in store.stage_checkpoints(ref_root).values())]
    assert sorted(store.stage_checkpoints(root)) == [0, 25, 50, 75, 100]  # none lost, none added by resuming
    for name in names:  # stage-000 and stage-025 were written before the interruption, the others after
        a, b = torch.load(root / "checkpoints" / name), torch.load(ref_root / "checkpoints" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def _crash_at_step(step: int):
    """``runner.train_step`` that raises at its ``step``-th call (a power cut), and the original to restore."""
    inner, calls = runner.train_step, []

    def crashing(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError("simulated crash (power cut)")
        return inner(*args, **kwargs)

    return crashing, inner


def test_resume_after_a_crash_from_the_periodic_checkpoint(reference, tmp_path, monkeypatch):
    crashing, inner = _crash_at_step(6)
    monkeypatch.setattr(runner, "train_step", crashing)
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
    registered = runner.resolve(SETUP, "smoke").optimizers[OPT]  # the registered values are no override
    assert train(SETUP, OPT, 3, "smoke", out, lr=registered.lr, schedule=registered.schedule, overrides=LONGER,
                 progress=False, verbose=False) == summary


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


# ------------------------------------------------------------------- the hardened runner: faults, duplicates, bad input
FAST = ["train", "--setup", "digits-mlp", "--optimizer", "ief", "--scale", "smoke", "--no-progress"]  # 8 steps, <1 s


def _fast_root(out: Path) -> Path:
    return run_dir(out, "smoke", "digits-mlp", "ief", 0)


@pytest.fixture(scope="module")
def fast_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("fast")
    return train("digits-mlp", "ief", 0, "smoke", out, progress=False, verbose=False), _fast_root(out)


@pytest.mark.parametrize("extra,shown", [
    (["--set", "batch_size=0"], "batch_size must be a positive integer, got 0"),
    (["--set", "batch_size=-4"], "got -4"), (["--set", "epochs=0"], "epochs must be a positive integer, got 0"),
    (["--set", "epochs=1.5"], "got 1.5"), (["--set", "eval_every=0"], "eval_every"),
    (["--set", "eval_batch_size=0"], "eval_batch_size"), (["--set", 'sizes={"train": 0}'], "sizes['train']"),
    (["--set", "stage_fractions=[0, 1.5]"], "stage_fractions"), (["--set", "stage_fractions=[0.5, 0.501]"], "twice"),
    (["--device", "bogus"], "unknown device 'bogus'; valid devices: cpu, cuda"),
    (["--device", "cuda"], "device 'cuda': no CUDA GPU"), (["--device", "meta"], "device 'meta' is not supported"),
    (["--schedule", "cosine"], "unknown schedule 'cosine'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_input_is_an_error_line_and_writes_nothing(extra, shown, tmp_path, capsys, monkeypatch):
    """Every rejected invocation: exit code 2, one ``error:`` line naming the value, no traceback, and nothing
    written, so that the corrected command then runs in the same folder (before: config.json written first, then
    'holds a run with a different configuration'; batch_size=0, epochs=0, bogus devices, cuda: tracebacks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*FAST, "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and shown in err and "Traceback" not in err
    assert not list(tmp_path.rglob("*"))


def test_unwritable_out_is_an_error_line(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    assert main([*FAST, "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the run folder") and str(tmp_path / "file") in err


def test_a_rejected_invocation_leaves_the_folder_usable_and_registered_lr_is_no_conflict(fast_reference, tmp_path,
                                                                                          capsys):
    assert main([*FAST, "--out", str(tmp_path), "--set", "batch_size=0"]) == 2
    registered = runner.resolve("digits-mlp", "smoke").optimizers["ief"].lr
    assert main([*FAST, "--out", str(tmp_path), "--lr", repr(registered)]) == 0
    assert main([*FAST, "--out", str(tmp_path)]) == 0  # the same run: skipped, no conflict
    assert "skipped (finished)" in capsys.readouterr().out
    assert _numbers(store.read_json(_fast_root(tmp_path) / "summary.json")) == _numbers(fast_reference[0])


def test_a_locked_run_folder_refuses_a_second_process(tmp_path, capsys):
    root = _fast_root(tmp_path)
    with store.lock(root):  # another owner (a separate open file description: flock excludes it like a process)
        (root / "run.lock").write_text("PID 4242 on node7 since now\n")
        with pytest.raises(runner.RunLocked, match="PID 4242 on node7.*--wait-lock"):
            train("digits-mlp", "ief", 0, "smoke", tmp_path, progress=False, verbose=False)
        assert main([*FAST, "--out", str(tmp_path)]) == 75
        assert capsys.readouterr().err.startswith(f"error: {root} is in use by PID 4242")
    assert not (root / "config.json").exists()
    train("digits-mlp", "ief", 0, "smoke", tmp_path, progress=False, verbose=False)  # released: runs


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name != "run.lock"}


def test_a_lagging_duplicate_cannot_corrupt_a_run(fast_reference, tmp_path, capsys):
    """A fault seen in practice: the same run started twice (a SLURM requeue, a second terminal), the second lagging
    behind the first. Before: the first to finish loaded the other's best.pt (test accuracy 0.54 instead of 0.97),
    the folder kept a truncated train_loss.csv and a stray resume.pt. Now the first (a child process, held after
    its first update) owns the folder: a duplicate without --wait-lock stops at once (exit 75), one with
    --wait-lock (this process) waits and then skips the finished run; the folder is exactly an uninterrupted run's
    and is not written again."""
    summary, ref_root = fast_reference
    root, args = _fast_root(tmp_path), [*FAST, "--out", str(tmp_path)]
    gate = tmp_path / "gate"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               IEF_TEST_GATE=str(gate))
    first = subprocess.Popen([sys.executable, "-c", _CHILD, str(torch.get_num_threads()), *args], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert first.stdout.readline().startswith("STEP")  # the first owns the folder and is training
        assert main(args) == 75  # an impatient duplicate
        err = capsys.readouterr().err
        assert err.startswith(f"error: {root} is in use by PID {first.pid}") and "--wait-lock" in err
        result: dict = {}
        lagging = threading.Thread(target=lambda: result.update(rc=main([*args, "--wait-lock"])))
        lagging.start()
        seen, deadline = "", time.time() + 60
        while "waiting for PID" not in seen and time.time() < deadline:
            time.sleep(0.05)
            seen += capsys.readouterr().err
        assert f"waiting for PID {first.pid}" in seen
        gate.touch()  # let the first finish while the duplicate waits
        first.stdout.read()
        assert first.wait(timeout=120) == 0
        lagging.join(timeout=120)
    finally:
        gate.touch()
        first.kill()
    assert result == {"rc": 0} and capsys.readouterr().out.startswith("skipped (finished)")
    done = _snapshot(root)
    assert main(args) == 0 and _snapshot(root) == done  # a finished run is never written again
    assert _numbers(store.read_json(root / "summary.json")) == _numbers(summary)
    assert _files(root) == _files(ref_root) and not (root / "resume.pt").exists()


def _crash_at(monkeypatch, step: int | None = None, *, in_test_evaluation: bool = False):
    """Make the next run crash (a RuntimeError) before update ``step`` or in the final test evaluation."""
    inner_step, inner_eval, calls = runner.train_step, runner.evaluate, []

    def crash_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError("simulated crash")
        return inner_step(*args, **kwargs)

    def crash_eval(model, task, sets, *args, **kwargs):
        if "test" in sets:
            raise RuntimeError("simulated crash")
        return inner_eval(model, task, sets, *args, **kwargs)

    if step is not None:
        monkeypatch.setattr(runner, "train_step", crash_step)
    if in_test_evaluation:
        monkeypatch.setattr(runner, "evaluate", crash_eval)


def _crashed_run(out: Path, monkeypatch, **kwargs) -> Path:
    with monkeypatch.context() as m:
        _crash_at(m, **kwargs)
        with pytest.raises(RuntimeError, match="simulated crash"):
            train("digits-mlp", "ief", 0, "smoke", out, progress=False, verbose=False, checkpoint_every_s=0)
    return _fast_root(out)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_resume_falls_back_to_the_previous_one(damage, fast_reference, tmp_path, monkeypatch):
    root = _crashed_run(tmp_path, monkeypatch, step=5)
    data = (root / "resume.pt").read_bytes()
    (root / "resume.pt").write_bytes(data[: len(data) // 2] if damage == "truncated" else b"garbage" * 9)
    with pytest.warns(RuntimeWarning, match=r"resume.pt is truncated or not a torch checkpoint.*resume.prev.pt"):
        resumed = train("digits-mlp", "ief", 0, "smoke", tmp_path, progress=False, verbose=False)
    assert _numbers(resumed) == _numbers(fast_reference[0])
    assert (root / "resume.pt.corrupt").exists() and not (root / "resume.prev.pt").exists()


def test_unreadable_resume_without_a_fallback_is_an_error_naming_the_file(tmp_path, monkeypatch, capsys):
    root = _crashed_run(tmp_path, monkeypatch, step=5)
    (root / "resume.prev.pt").unlink()
    (root / "resume.pt").write_bytes((root / "resume.pt").read_bytes()[:200])
    for _ in range(2):  # every re-run says the same, no traceback
        assert main([*FAST, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {root / 'resume.pt'} is truncated") and "to restart this run from step 0" in err
    (root / "resume.pt").unlink()  # the remedy
    assert main([*FAST, "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("best_step,damage,outcome", [
    (8, "missing", "the parameters after update 8"),  # the best is the last update: the model holds it
    (4, "truncated", "checkpoints/epoch-001.pt"),  # a checkpoint of the same step
    (6, "garbage", "checkpoints/stage-075.pt"),
    (3, "missing", None),  # nothing else holds step 3: stop, name the file and the remedy
])
def test_unreadable_best_checkpoint(best_step, damage, outcome, fast_reference, tmp_path, monkeypatch, capsys):
    root = _crashed_run(tmp_path, monkeypatch, in_test_evaluation=True)  # training done, crash before the test set
    ck = store.read_torch(root / "resume.pt")
    assert ck["state"]["training_done"] and ck["state"]["done"] == 8
    recorded_best = ck["state"]["best"]["step"]  # depends on the registered rate: the cases below do not
    ck["state"]["best"]["step"] = best_step
    store.write_torch(root / "resume.pt", ck)
    best = root / "checkpoints" / "best.pt"
    source = {8: root / "checkpoints" / "epoch-002.pt", 4: root / "checkpoints" / "epoch-001.pt",
              6: root / "checkpoints" / "stage-075.pt"}
    expected = torch.load(source.get(best_step, best))
    {"missing": best.unlink, "truncated": lambda: best.write_bytes(best.read_bytes()[:150]),
     "garbage": lambda: best.write_bytes(b"\x00" * 64)}[damage]()
    if outcome is None:
        assert main([*FAST, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {best} does not exist") and "step 3" in err and f"remove {root}" in err
        return
    with pytest.warns(RuntimeWarning, match=f"taken from {outcome}"):
        summary = train("digits-mlp", "ief", 0, "smoke", tmp_path, progress=False, verbose=False)
    rewritten = torch.load(best)
    assert all(torch.equal(rewritten[k], expected[k]) for k in expected)
    if best_step == recorded_best:
        assert _numbers(summary) == _numbers(fast_reference[0])


def test_checkpoints_are_verified_when_written(tmp_path, monkeypatch):
    """A short write (here: the file cut after fsync) is detected by reading it back: OSError, the previous file
    intact, no temporary left."""
    path = tmp_path / "resume.pt"
    store.write_torch(path, {"x": torch.ones(3)})
    real_fsync = store.os.fsync

    def short_write(fd):
        real_fsync(fd)
        os.ftruncate(fd, 10)

    monkeypatch.setattr(store.os, "fsync", short_write)
    with pytest.raises(OSError, match="differ from the bytes written"):
        store.write_torch(path, {"x": torch.zeros(3)})
    monkeypatch.undo()
    assert torch.equal(store.read_torch(path)["x"], torch.ones(3)) and [p.name for p in tmp_path.iterdir()] == [
        "resume.pt"]


def test_stale_temporaries_are_removed_by_the_next_run(fast_reference, tmp_path, monkeypatch):
    """``.NAME.tmp-PID`` files of a writer killed mid-write (before: kept forever) are removed by the next owner of
    the folder; outside a locked folder only those of dead processes go."""
    root = _crashed_run(tmp_path, monkeypatch, step=3)
    left = [root / ".resume.pt.tmp-999999999", root / "checkpoints" / f".best.pt.tmp-{os.getpid()}",
            root / f".train_loss.csv.tmp-{os.getpid()}"]
    for p in left:
        p.write_bytes(b"half a file")
    assert _numbers(train("digits-mlp", "ief", 0, "smoke", tmp_path, progress=False, verbose=False)) == _numbers(
        fast_reference[0])
    assert not list(root.rglob(".*.tmp-*"))
    alive, dead = tmp_path / f".x.json.tmp-{os.getpid()}", tmp_path / ".x.json.tmp-999999999"
    alive.write_text("{"), dead.write_text("{")
    assert store.remove_stale_temporaries(tmp_path, owned=False) == [dead] and alive.exists()


def test_stage_checkpoints(fast_reference, tmp_path):
    """The contract with the evaluation code: stage-PPP.pt after update round(f * total) for the setup's
    stage_fractions (recorded in config.json); stage-000 the initial model, stage-100 the final one; five stages
    even for a one-epoch run; other fractions through --set."""
    summary, root = fast_reference
    stages = store.stage_checkpoints(root)
    assert list(stages) == [0, 25, 50, 75, 100] and all(p.parent.name == "checkpoints" for p in stages.values())
    assert summary["stages"] == {"000": 0, "025": 2, "050": 4, "075": 6, "100": 8}
    assert store.read_json(root / "config.json")["setup"]["stage_fractions"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    final, epoch1 = torch.load(root / "checkpoints" / "epoch-002.pt"), torch.load(root / "checkpoints" / "epoch-001.pt")
    state = {k: torch.load(p) for k, p in stages.items()}
    assert all(torch.equal(state[100][k], final[k]) and torch.equal(state[50][k], epoch1[k]) for k in final)
    runner.seed_everything(0)
    cfg = runner.resolve("digits-mlp", "smoke")
    initial = store.trainable_state(runner.build_model(cfg, runner.load_data(cfg))[0])
    assert all(torch.equal(state[0][k], initial[k]) for k in initial)
    assert not torch.equal(state[0]["net.0.weight" if "net.0.weight" in final else next(iter(final))],
                           final["net.0.weight" if "net.0.weight" in final else next(iter(final))])
    s = train("digits-mlp", "ief", 0, "smoke", tmp_path, overrides={"epochs": 1}, progress=False, verbose=False)
    assert s["stages"] == {"000": 0, "025": 1, "050": 2, "075": 3, "100": 4}
    assert list(store.stage_checkpoints(_fast_root(tmp_path))) == [0, 25, 50, 75, 100]
    s = train("digits-mlp", "ief", 0, "smoke", tmp_path / "custom", overrides={"stage_fractions": [1, 0, 0.5]},
              progress=False, verbose=False)
    assert s["stages"] == {"000": 0, "050": 4, "100": 8}
    assert list(store.stage_checkpoints(_fast_root(tmp_path / "custom"))) == [0, 50, 100]


def test_sighup_is_handled_like_sigterm_and_the_resumed_run_says_where_it_resumed(reference, tmp_path, capsys):
    """A dropped SSH session (SIGHUP): resume.pt saved after the current update, exit 128 + 1; the same command
    resumes, says "resuming from step 3 of 12" and ends with the numbers of an uninterrupted run."""
    summary, _ = reference
    root = run_dir(tmp_path, "smoke", SETUP, OPT, 3)
    output: list[str] = []
    assert _interrupt(tmp_path, signal.SIGHUP, 3, output) == 128 + signal.SIGHUP
    assert store.read_torch(root / "resume.pt")["state"]["done"] == 3
    assert any(line.startswith(f"{SETUP}/{OPT}/seed-3 [smoke]: step 2/12 (epoch 0.50)") for line in output)  # a
    # progress line without a progress bar (the CLI's --no-progress), before the signal
    resumed = train(SETUP, OPT, 3, "smoke", tmp_path, overrides=LONGER, progress=False, verbose=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{SETUP}/{OPT}/seed-3 [smoke]: resuming from step 3 of 12 (")
    assert lines[0].endswith("trained before; next: update 4)")
    assert _numbers(resumed) == _numbers(summary)


def test_a_line_at_every_validation_without_a_progress_bar(fast_reference, tmp_path, capsys):
    """``progress=False`` (the workflow's ``--no-progress``): one flushed line per validation, naming the step, the
    epoch, the mean training loss since the previous line and the validation score; none with the bar."""
    summary, _ = fast_reference
    train("digits-mlp", "ief", 0, "smoke", tmp_path, progress=False, verbose=True)
    lines = capsys.readouterr().out.splitlines()
    evals = [json.loads(x) for x in (_fast_root(tmp_path) / "validation.jsonl").read_text().splitlines()]
    total = summary["steps"]
    progress = [x for x in lines if ": step " in x]
    assert len(progress) == len(evals) >= 2 and len(lines) == len(progress) + 1  # + the summary line
    losses = store.read_run(_fast_root(tmp_path))["losses"]
    previous = 0
    for line, e in zip(progress, evals):
        step = e["step"]
        mean = sum(losses[previous:step]) / (step - previous)
        assert f"step {step}/{total} (epoch {step / summary['steps_per_epoch']:.2f}), train loss {mean:.4f} (mean " \
               f"of updates {previous + 1}-{step}), validation score {e['score']:.4f} at step {step}, " in line
        assert line.endswith(" left") and " elapsed, ~" in line
        previous = step
    train("digits-mlp", "ief", 0, "smoke", tmp_path / "bar", progress=True, verbose=True)
    assert not [x for x in capsys.readouterr().out.splitlines() if ": step " in x]


def test_a_line_every_log_every_seconds_between_validations(tmp_path, capsys):
    train("digits-mlp", "ief", 0, "smoke", tmp_path, progress=False, verbose=True, log_every_s=1e-9)
    summary = json.loads((_fast_root(tmp_path) / "summary.json").read_text())
    lines = [x for x in capsys.readouterr().out.splitlines() if ": step " in x]
    assert [int(x.split(": step ")[1].split("/")[0]) for x in lines] == list(range(1, summary["steps"] + 1))
    assert main(["train", "--setup", "digits-mlp", "--optimizer", "ief", "--scale", "smoke", "--out",
                 str(tmp_path / "bad"), "--log-every", "0"]) == 2
    assert "argument --log-every: invalid value '0': a finite number of seconds > 0 expected" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_new_rate_for_another_optimiser_is_no_conflict():
    """A run's identity is its own optimiser as it ran: re-registering another optimiser's rate (a new search) or
    its own registered rate (a run at an overridden one) leaves a finished run valid; its own values still count."""
    import dataclasses

    from companion.experiments.runner import _comparable, _run_record
    from companion.experiments.setups import resolve

    cfg = resolve("digits-mlp", "smoke")
    sgd = dataclasses.replace(cfg.optimizers["sgd"], lr=0.123)
    record = _run_record(cfg, sgd, 0)
    table = {**cfg.optimizers, "adam": dataclasses.replace(cfg.optimizers["adam"], lr=9.0),
             "sgd": dataclasses.replace(cfg.optimizers["sgd"], lr=7.0)}
    other = _run_record(dataclasses.replace(cfg, optimizers=table), sgd, 0)
    assert other != record and _comparable(other) == _comparable(record)
    assert _comparable(_run_record(cfg, dataclasses.replace(sgd, lr=0.5), 0)) != _comparable(record)
    assert _comparable(_run_record(dataclasses.replace(cfg, epochs=cfg.epochs + 1), sgd, 0)) != _comparable(record)


def test_resume_before_a_multistep_milestone_keeps_the_schedule(tmp_path, monkeypatch):
    """The epoch scheduler survives a resume: MultiStepLR keeps its milestones in a Counter, which the resume file
    once stored as a Counter of (milestone, count) pairs, so the resumed run never lowered its learning rate (seen on
    an H100 with cifar10-mlp + SGD; the same on the CPU)."""
    setup, opt = "cifar10-mlp", "sgd"  # smoke: 4 steps per epoch, lr x0.1 after epoch 1
    reference = train(setup, opt, 1, "smoke", tmp_path / "ref", progress=False, verbose=False)
    crashing, inner = _crash_at_step(2)
    monkeypatch.setattr(runner, "train_step", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(setup, opt, 1, "smoke", tmp_path / "res", progress=False, verbose=False, checkpoint_every_s=0)
    monkeypatch.setattr(runner, "train_step", inner)
    resumed = train(setup, opt, 1, "smoke", tmp_path / "res", progress=False, verbose=False)
    ref_losses = store.read_run(run_dir(tmp_path / "ref", "smoke", setup, opt, 1))["losses"]
    assert store.read_run(run_dir(tmp_path / "res", "smoke", setup, opt, 1))["losses"] == ref_losses
    assert _numbers(resumed) == _numbers(reference)


@pytest.mark.parametrize("stop, code, said", [
    ("once", 128 + signal.SIGINT, "interrupted: SIGINT received"),
    ("once-term", 128 + signal.SIGTERM, "interrupted: SIGTERM received"),
    ("twice", 3, "stopped at once (second signal)"),
])
def test_an_interrupted_run_and_one_stopped_at_once_exit_with_distinct_codes(stop, code, said, tmp_path, monkeypatch,
                                                                             capsys):
    """One signal: the run saves ``resume.pt`` and exits 128 + N (SIGINT 130, SIGTERM 143); a second signal stops it
    at once, through the runner's own handler, and exits 3, so that a script tells a saved stop from an unsaved one
    (both were 130 for SIGINT)."""
    from companion import experiments
    from companion.__main__ import EXIT_STOPPED_AT_ONCE

    def fake_train(*args, **kwargs):
        with runner._Signals() as signals:
            os.kill(os.getpid(), signal.SIGTERM if stop == "once-term" else signal.SIGINT)
            if stop == "twice":
                os.kill(os.getpid(), signal.SIGINT)  # the handler raises KeyboardInterrupt here
            time.sleep(0.05)
            raise runner.RunInterrupted(signals.pending, "at step 1")

    monkeypatch.setattr(experiments, "train", fake_train)
    assert main(["train", "--setup", SETUP, "--optimizer", OPT, "--scale", "smoke", "--out", str(tmp_path),
                 "--no-progress"]) == code
    assert said in capsys.readouterr().err
    assert EXIT_STOPPED_AT_ONCE == 3 and EXIT_STOPPED_AT_ONCE not in {128 + s for s in runner.STOP_SIGNALS}


def test_a_run_of_the_mlp_imports_neither_transformers_nor_peft(tmp_path):
    """The workflow starts a process per run: the MLP's runs, which use neither transformers nor peft, do not pay for
    importing them (about a third of a smoke run's process time; the versions a run records are read from the
    installed distributions)."""
    code = ("import sys\nfrom companion.experiments import train\n"
            f"train('digits-mlp', 'sgd', 0, 'smoke', {str(tmp_path)!r}, progress=False, verbose=False)\n"
            "print(sorted({'transformers', 'peft'} & set(sys.modules)))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
    config = json.loads((run_dir(tmp_path, "smoke", "digits-mlp", "sgd", 0) / "config.json").read_text())
    assert set(config["versions"]) == {"ief", "torch", "transformers", "peft"} and all(config["versions"].values())
