"""``torchrun -m companion train`` (companion.experiments.processes): a run on 2 gloo processes takes the one-process
run's updates (each rank half of every batch), validates and tests to the same numbers, and only rank 0 writes.

iEF and a mean loss are invariant to repeating the batch, so equal numbers alone would not show that each rank took
its own half: the ranks' parts of every batch are recorded too."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run as run_ranks

from companion.experiments import processes, store, train

SETUP = "digits-mlp"  # no dropout: the union batch's updates are the one-process updates, to float32 rounding


def _numbers(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "wall_time_s"}


def _run_on_rank(rank: int, world: int, store_file: str, optimizer: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    split, seen = processes.shard, []

    def recording_shard(items, procs):  # which part of each update's batch this rank stepped on
        part = split(items, procs)
        seen.append((len(items), [i for i, item in enumerate(items) if any(item is p for p in part)]))
        return part

    processes.shard = recording_shard
    try:
        summary = train(SETUP, optimizer, 0, "smoke", out, device="cpu", progress=False, verbose=False)
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps((summary, seen)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", ["ief", "iekfac", "adam"])
def test_two_processes_train_as_one_on_the_union_batch(optimizer, tmp_path):
    one = train(SETUP, optimizer, 0, "smoke", tmp_path / "one", device="cpu", progress=False, verbose=False)
    two_out = tmp_path / "two"
    two_out.mkdir()
    run_ranks(_run_on_rank, (2, str(tmp_path / "store"), optimizer, str(two_out)), 2)
    (summary0, seen0), (summary1, seen1) = [pickle.loads((two_out / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    assert summary0 == summary1  # every rank returns rank 0's summary.json
    summaries = [summary0]
    assert len(seen0) == len(seen1) == one["steps"]  # each update: rank 0 the first half of the batch, rank 1 the rest
    assert all(a == (8, [0, 1, 2, 3]) and b == (8, [4, 5, 6, 7]) for a, b in zip(seen0, seen1))
    got, want = _numbers(summaries[0]), _numbers(one)
    assert got["final_train_loss"] == pytest.approx(want["final_train_loss"], rel=1e-4)
    # the full training-set loss: each rank's float32 forwards over its share, summed in float64 (batches of another
    # composition than one process's: float32 rounding, not training, differs)
    assert got["final_train_loss_full"] == pytest.approx(want["final_train_loss_full"], rel=1e-6)
    approximate = ("final_train_loss", "final_train_loss_full")
    assert {k: v for k, v in got.items() if k not in approximate} == \
        {k: v for k, v in want.items() if k not in approximate}
    root_one = tmp_path / "one" / "smoke" / SETUP / optimizer / "seed-0"
    store_root = two_out / "smoke" / SETUP / optimizer / "seed-0"
    files = sorted(str(p.relative_to(store_root)) for p in store_root.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(root_one)) for p in root_one.rglob("*") if p.is_file())
    assert json.loads((store_root / "config.json").read_text())["processes"] == 2
    losses = [[float(x) for x in line.split(",")[1:]] for line in (store_root / "train_loss.csv").read_text()
              .splitlines()[1:]]
    reference = [[float(x) for x in line.split(",")[1:]] for line in (root_one / "train_loss.csv").read_text()
                 .splitlines()[1:]]
    assert torch.allclose(torch.tensor(losses), torch.tensor(reference), rtol=1e-4, atol=1e-6)
    best, best_one = (store.read_torch(r / "checkpoints" / "best.pt") for r in (store_root, root_one))
    for name, value in best_one.items():
        assert torch.allclose(best[name], value, rtol=1e-4, atol=1e-5 * float(value.abs().max())), name


@pytest.mark.parametrize("size, world, parts", [(8, 2, [4, 4]), (7, 3, [3, 2, 2]), (2, 3, [1, 1, 0])])
def test_shard_splits_a_batch_in_rank_order(size, world, parts):
    items = list(range(size))
    shards = [processes.shard(items, processes.Processes(r, world, None, torch.device("cpu"), False))
              for r in range(world)]
    assert [len(s) for s in shards] == parts and sum(shards, []) == items
    assert processes.shard(items, None) == items


def test_torchrun_runs_the_command_line_on_two_processes(tmp_path):
    """The workflow's command with gpus_per_train_job=2 (``python -m torch.distributed.run --standalone
    --nproc_per_node 2 -m companion train ...``): the group comes from torchrun's environment, one log, and the
    one-process run's summary."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    args = ["-m", "companion", "train", "--setup", SETUP, "--optimizer", "ief", "--seed", "0", "--scale", "smoke",
            "--device", "cpu", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *args, "--out", str(tmp_path / "two")], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("final_train_loss=") == 1, done.stdout  # rank 0 alone prints
    one = train(SETUP, "ief", 0, "smoke", tmp_path / "one", device="cpu", progress=False, verbose=False)
    two = store.read_json(tmp_path / "two" / "smoke" / SETUP / "ief" / "seed-0" / "summary.json")
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)
    assert two["best_validation"] == one["best_validation"] and two["test"] == one["test"]


def _stopped_on_one_rank_then_resumed(rank: int, world: int, store_file: str, out: str) -> None:
    import datetime

    from companion.experiments import runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a rank left waiting fails the test, not hangs
    original = runner.TrainingLoop._stopping
    runner.TrainingLoop._stopping = lambda self: rank == 1 and self.state["done"] == 3  # a signal on rank 1 only
    try:
        try:
            train(SETUP, "ief", 0, "smoke", out, device="cpu", progress=False, verbose=False)
            stopped = None
        except runner.RunInterrupted as err:
            stopped = str(err)
        runner.TrainingLoop._stopping = original
        dist.barrier()  # rank 0 has written resume.pt
        resume = store.read_torch(Path(out, "smoke", SETUP, "ief", "seed-0", "resume.pt"))["state"]["done"]
        dist.barrier()
        summary = train(SETUP, "ief", 0, "smoke", out, device="cpu", progress=False, verbose=False)
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps((stopped, resume, summary)))
        dist.barrier()
    finally:
        runner.TrainingLoop._stopping = original
        dist.destroy_process_group()


def test_a_stop_on_one_rank_stops_every_rank_and_the_run_resumes_on_two(tmp_path):
    """A stop signal seen by rank 1 alone stops both ranks after the same update (agreed), rank 0 saves resume.pt
    there, and the same command on two processes resumes to the uninterrupted run's summary."""
    one = train(SETUP, "ief", 0, "smoke", tmp_path / "one", device="cpu", progress=False, verbose=False)
    out = tmp_path / "two"
    out.mkdir()
    run_ranks(_stopped_on_one_rank_then_resumed, (2, str(tmp_path / "store"), str(out)), 2)
    results = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    for stopped, resume, summary in results:
        assert stopped is not None and "after step 3" in stopped and resume == 3
        assert summary["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)
        assert summary["final_train_loss_full"] == pytest.approx(one["final_train_loss_full"], rel=1e-6)
        approximate = {"final_train_loss": None, "final_train_loss_full": None}
        assert _numbers({**summary, **approximate}) == _numbers({**one, **approximate})


def _train_and_report(rank: int, world: int, store_file: str, out: str) -> None:
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        try:
            train(SETUP, "ief", 0, "smoke", out, device="cpu", progress=False, verbose=False)
            outcome = "trained"
        except Exception as err:  # noqa: BLE001 - the test reads what each rank raised
            outcome = f"{type(err).__name__}: {err}"
        Path(out, f"rank{rank}.txt").write_text(outcome)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_run_locked_elsewhere_is_refused_on_every_rank(tmp_path):
    """Rank 0 alone takes the run folder's lock; when another process holds it, rank 0 raises RunLocked (Locked) and
    rank 1 a RuntimeError with its message (no rank left waiting in a collective)."""
    out = tmp_path / "runs"
    root = out / "smoke" / SETUP / "ief" / "seed-0"
    with store.lock(root):
        run_ranks(_train_and_report, (2, str(tmp_path / "store"), str(out)), 2)
    first, second = ((out / f"rank{r}.txt").read_text() for r in range(2))
    assert first.startswith("Locked: ") and "this run is already running" in first, first
    assert second == f"RuntimeError: rank 0 failed: {first}"
