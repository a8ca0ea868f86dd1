"""One training run over several processes: ``torchrun --nproc_per_node N -m companion train ...``.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every process runs the same run
(:func:`companion.experiments.runner.train`), and together they take the one-process run's updates:

- the batch of each update (the epoch order's next ``batch_size`` examples) is split in rank order into contiguous
  parts (:func:`shard`; the first ``M mod R`` ranks take one example more), so that the ranks' batches concatenated in
  rank order are the one-process batch;
- ``ief``, ``ef``, ``sf``, ``ief-momentum`` and the K-FAC kinds take the world group (``process_group=``):
  :mod:`ief.optim`'s step on the union batch; AdamW, Adam, SGD and Adafactor step on the union batch's mean
  cross-entropy (each rank's summed loss over the union's target count, the gradients all-reduced:
  :func:`union_gradients`);
- the replicas stay identical, so every rank validates and tests on the whole split itself (the same numbers, no
  collective), and only rank 0 takes the run folder's lock and writes its files (:attr:`Processes.writer`);
- a stop signal (SIGTERM, SIGINT, SIGHUP) is agreed at every update (:func:`any_rank`), so every rank stops after the
  same update and rank 0 saves ``resume.pt``; an evaluation is not aborted half-way (each rank would stop elsewhere).

With dropout, SF's or K-FAC's sampled labels, each rank draws its own random numbers (the same seed on every rank,
so the masks of rank ``r``'s samples are not those one process would draw): the same method, not the same bits. A
process that dies or hangs is caught by the process group's timeout (gloo 30 min, NCCL 10 min by default).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class Processes:
    """The processes of one run.

    Attributes:
        rank: this process's rank.
        world: the number of processes.
        group: the process group (``torch.distributed.group.WORLD``).
        device: this process's device (``cuda:LOCAL_RANK`` on GPUs).
        owned: whether :func:`from_environment` initialised the group (and :func:`close` ends it).
    """

    rank: int
    world: int
    group: Any
    device: torch.device
    owned: bool

    @property
    def writer(self) -> bool:
        """Whether this process writes the run's files (rank 0)."""
        return self.rank == 0


def from_environment(device: torch.device) -> Processes | None:
    """The run's processes: an initialised ``torch.distributed`` of several processes, or ``torchrun``'s environment.

    Args:
        device: the device asked for (``cuda`` becomes ``cuda:LOCAL_RANK``).

    Returns:
        ``None`` for one process, else :class:`Processes` (the group initialised from the environment, NCCL on CUDA
        and gloo on the CPU, when it was not already).

    Raises:
        ValueError: ``WORLD_SIZE`` or ``LOCAL_RANK`` is not an integer, or a CUDA run has fewer GPUs than ranks on
            this node.
    """
    owned = False
    if not (dist.is_available() and dist.is_initialized()):
        world = _int_variable("WORLD_SIZE", "1")
        if world <= 1:
            return None
        if device.type == "cuda":
            device = _local_cuda(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
        owned = True
    elif dist.get_world_size() <= 1:
        return None
    elif device.type == "cuda":
        device = _local_cuda(device)
    return Processes(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, device, owned)


def _int_variable(name: str, default: str) -> int:
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the environment variable {name}={text!r} is not an integer (torchrun sets it)") from None


def _local_cuda(device: torch.device) -> torch.device:
    local = _int_variable("LOCAL_RANK", "0")
    if local >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} CUDA device(s): run "
                         f"torchrun with --nproc_per_node at most that")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def close(procs: Processes | None) -> None:
    """End the process group if :func:`from_environment` started it."""
    if procs is not None and procs.owned and dist.is_initialized():
        dist.destroy_process_group()


def shard(items: Sequence[T], procs: Processes | None) -> list[T]:
    """This rank's contiguous part of one update's batch, in rank order (the first ``M mod R`` ranks one more).

    Args:
        items: the whole batch's examples.
        procs: the processes, or ``None`` (the whole batch).

    Returns:
        The examples of this rank.
    """
    if procs is None:
        return list(items)
    base, extra = divmod(len(items), procs.world)
    lo = procs.rank * base + min(procs.rank, extra)
    return list(items[lo:lo + base + (procs.rank < extra)])


def any_rank(flag: bool, procs: Processes | None) -> bool:
    """Whether ``flag`` holds on any rank (one all-reduce; ``flag`` itself for one process)."""
    if procs is None:
        return flag
    value = torch.tensor([float(flag)], device=_collective_device(procs))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=procs.group)
    return bool(value.item() > 0)


def total(value: float, procs: Processes | None) -> float:
    """The sum of ``value`` over the ranks, in float64 (``value`` for one process)."""
    if procs is None:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=_collective_device(procs))
    dist.all_reduce(tensor, group=procs.group)
    return float(tensor.item())


def union_gradients(params: Sequence[torch.Tensor], procs: Processes | None) -> None:
    """Sum every parameter's ``.grad`` over the ranks, in place.

    Args:
        params: the trainable parameters (the same list, in the same order, on every rank).
        procs: the processes (nothing to do for ``None``).

    Raises:
        RuntimeError: the ranks disagree on which parameters have a gradient (their all-reduces would not match).
    """
    if procs is None:
        return
    has = [p.grad is not None for p in params]
    mask = torch.tensor(has, dtype=torch.float64, device=_collective_device(procs))
    both = torch.cat([mask, -mask])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=procs.group)
    if not torch.equal(both[:len(has)], -both[len(has):]):
        raise RuntimeError("the ranks disagree on which parameters have a gradient: cannot sum them")
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=procs.group)


def first_rank(procs: Processes | None, work: Callable[[], None]) -> None:
    """Run ``work`` on rank 0 only; its failure raises on every rank (the others with rank 0's message).

    Args:
        procs: the processes, or ``None`` (``work`` runs here).
        work: what rank 0 does (taking the run's lock, say).

    Raises:
        Exception: on rank 0 ``work``'s own; on the others a ``RuntimeError`` naming it.
    """
    if procs is None:
        work()
        return
    failure, message = None, [None]
    if procs.writer:
        try:
            work()
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, then it is raised again
            failure, message = err, [f"{type(err).__name__}: {err}"]
    dist.broadcast_object_list(message, src=0, group=procs.group)
    if failure is not None:
        raise failure
    if message[0] is not None:
        raise RuntimeError(f"rank 0 failed: {message[0]}")


def barrier(procs: Processes | None) -> None:
    """Wait for every rank (nothing for one process)."""
    if procs is not None:
        dist.barrier(group=procs.group)


def _collective_device(procs: Processes) -> torch.device:
    return procs.device if dist.get_backend(procs.group) == "nccl" else torch.device("cpu")
