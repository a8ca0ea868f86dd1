"""Tests that start several processes: each rank forked from one server that imported the heavy modules once in the
session (a spawned rank imports torch, ief and the Hugging Face stack again, seconds each and most of a small
multi-process test's time on two cores), and a deadline past which every rank is killed and the test fails as hung:
ranks that wait on each other for ever fail their test, they never hang the suite."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch.multiprocessing as mp

DEADLINE = 900.0  # seconds a multi-process test may run before it fails as hung (every rank killed)
PRELOAD = ["torch", "torch.distributed.fsdp", "ief", "ief.hf", "peft", "datasets", "companion.experiments"]


def start(entry, args: tuple, world: int):
    """``torch.multiprocessing.start_processes(entry, args, world, join=False)``, each rank forked from the session's
    fork server (:data:`PRELOAD` imported once, no thread started: safe to fork); wait with :func:`join`."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # (kept by a server already running)
    return mp.start_processes(entry, args=args, nprocs=world, join=False, start_method="forkserver")


def join(context, world: int, deadline: float = DEADLINE) -> None:
    """Wait for ``context``'s processes (:func:`start`), re-raising a rank's exception; past ``deadline`` seconds
    every rank still running is killed and the test fails as hung."""
    end = time.monotonic() + deadline
    while not context.join(timeout=max(0.1, min(5.0, end - time.monotonic()))):
        if time.monotonic() > end:
            alive = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(timeout=30.0)
            pytest.fail(f"hung: ranks {alive} of {world} still running after {deadline:.0f} s (killed)")


def run(entry, args: tuple, world: int, deadline: float = DEADLINE) -> None:
    """:func:`start` then :func:`join`: ``entry(rank, *args)`` on ``world`` processes."""
    join(start(entry, args, world), world, deadline)
