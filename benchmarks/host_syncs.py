"""Host round-trips and dispatched operators of one call, counted on any device (the CPU proxies of a GPU step).

On a GPU every read of a tensor's value by the host (``bool(t)``, ``float(t)``, ``t.item()``, ``t.tolist()``,
``t.cpu()``, ``t.nonzero()``, ``t.numpy()``) waits until the device has drained its queue, and every dispatched aten
operator is at least one kernel launch. Both can be counted on the CPU, where no stall is visible:

- :class:`RoundTripCounter`: a ``TorchFunctionMode`` that counts the tensor methods above (and ``torch.nonzero``,
  ``Tensor.to("cpu")`` of a tensor not already there ... as the method of the same name), with the stack of the first
  few so that a test failure says where they come from;
- :class:`OperatorCounter`: a ``TorchDispatchMode`` that counts every aten operator dispatched (after autograd, so the
  backward's operators count too), and apart the operators that synchronise inside a CUDA kernel call although no
  Python code reads a value (:data:`IMPLICIT_SYNCS`: ``linalg.eigh``'s and ``linalg.cholesky``'s error checks read
  their ``info`` on the host, ``nonzero``-based ops size their output from the device, indexing with a boolean
  mask), which the function mode cannot see;
- :func:`count_call`: both around one call, as a :class:`Counts`.

``steady_counts`` builds the steady state of an optimiser step (warm-up calls first: the exact per-sample check of
step 0, first-shape caches) and counts one more call. Used by ``tests/companion/test_host_syncs.py`` and by
``python -m benchmarks step`` / ``paper_mlp``.
"""
from __future__ import annotations

import collections
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that hand a value to the host (torch's own ``Tensor.__bool__`` etc. go through ``__torch_function__``)
ROUND_TRIPS = {
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__index__: "int",
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.__array__: "numpy",
}


def _is_to_cpu(func, args, kwargs) -> bool:
    """``t.to("cpu")`` / ``t.to(torch.device("cpu"))`` / ``t.to(other_cpu_tensor)`` of a tensor not on the CPU."""
    if func is not torch.Tensor.to or not args or not isinstance(args[0], torch.Tensor):
        return False
    if args[0].device.type == "cpu":
        return False
    target = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)) or isinstance(a, torch.Tensor):
            target = a
            break
    if isinstance(target, torch.Tensor):
        target = target.device
    return target is not None and torch.device(target).type == "cpu"


class RoundTripCounter(TorchFunctionMode):
    """Counts the host round-trips of the calls made while it is active (by kind), keeping the first
    ``keep_stacks`` stacks (the library's frames) to say where they come from.

    Attributes:
        counts: kind -> number (``bool``, ``float``, ``int``, ``item``, ``tolist``, ``cpu``, ``numpy``,
            ``nonzero``).
        stacks: ``[(kind, formatted frames)]`` of the first ones.
    """

    def __init__(self, keep_stacks: int = 64):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.stacks: list[tuple[str, str]] = []
        self.keep_stacks = keep_stacks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = ROUND_TRIPS.get(func)
        if kind is None and _is_to_cpu(func, args, kwargs):
            kind = "cpu"
        if kind is not None:
            self.counts[kind] += 1
            if len(self.stacks) < self.keep_stacks:
                # the caller's frames: not torch's, the standard library's or this module's
                frames = [f for f in traceback.extract_stack()[:-1]
                          if "/torch/" not in f.filename and "/lib/python" not in f.filename
                          and not f.filename.endswith("host_syncs.py")]
                self.stacks.append((kind, " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                                                      for f in reversed(frames[-4:]))))
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """Every round-trip counted."""
        return sum(self.counts.values())


# aten operators whose CUDA implementation reads a device value on the host (their error checks, or an output
# whose size depends on the data); ``aten._local_scalar_dense`` (item/float/bool) is the function mode's already
IMPLICIT_SYNCS = frozenset({
    "aten._linalg_eigh.default", "aten.linalg_eigh.default", "aten._linalg_check_errors.default",
    "aten.linalg_cholesky.default", "aten._linalg_svd.default", "aten.linalg_inv_ex.default",
    "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default", "aten.unique_dim.default",
    "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor",
})


def _boolean_index(func, args) -> bool:
    """``aten.index`` with a boolean mask among its indices (its output size is the mask's count: a sync)."""
    if str(func) != "aten.index.Tensor" or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)


class OperatorCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active (forward and backward alike), and those that
    synchronise inside their CUDA implementation (:data:`IMPLICIT_SYNCS`, boolean-mask indexing).

    Attributes:
        counts: operator name (``aten.mm.default``) -> number.
        implicit_syncs: operator name -> number, of the synchronising ones.
    """

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.implicit_syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts[name] += 1
        if name in IMPLICIT_SYNCS or _boolean_index(func, args):
            self.implicit_syncs[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Every operator counted."""
        return sum(self.counts.values())


@dataclass
class Counts:
    """Round-trips and operators of one call.

    Attributes:
        round_trips: the number of host round-trips.
        operators: the number of dispatched aten operators.
        kinds: round-trips by kind.
        where: ``[(kind, frames)]`` of the first round-trips.
        by_operator: operators by name.
        implicit_syncs: the operators that synchronise inside their CUDA call (by name): not in ``round_trips``.
    """

    round_trips: int
    operators: int
    kinds: dict = field(default_factory=dict)
    where: list = field(default_factory=list)
    by_operator: dict = field(default_factory=dict)
    implicit_syncs: dict = field(default_factory=dict)


def count_call(fn: Callable[[], Any]) -> Counts:
    """Run ``fn()`` once under both counters.

    Args:
        fn: the call (e.g. one optimiser step on a fixed batch).

    Returns:
        Its :class:`Counts`.
    """
    trips, ops = RoundTripCounter(), OperatorCounter()
    with trips, ops:
        fn()
    return Counts(trips.total, ops.total, dict(trips.counts), list(trips.stacks), dict(ops.counts),
                  dict(ops.implicit_syncs))


def steady_counts(fn: Callable[[], Any], warmup: int = 3) -> Counts:
    """Counts of ``fn()`` in its steady state: ``warmup`` uncounted calls first (step 0's exact check, first-shape
    caches, lazily built state), then one counted call.

    Args:
        fn: the call.
        warmup: calls before the counted one (``>= 1``).

    Returns:
        The counted call's :class:`Counts`.
    """
    for _ in range(max(1, warmup)):
        fn()
    return count_call(fn)


def adamw_step_fn(model: torch.nn.Module, forward_loss: Callable[[], torch.Tensor], lr: float = 1e-4):
    """One AdamW step as a first-order user writes it (forward, ``backward``, ``step``, ``zero_grad``), the reference
    the budgets are counted against.

    Args:
        model: the model (its trainable parameters are stepped).
        forward_loss: the forward, returning the summed loss.
        lr: AdamW's rate.

    Returns:
        The step, a function of no argument.
    """
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def step():
        loss = forward_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def first_cuda_sync(fn: Callable[[], Any]) -> str | None:
    """Run ``fn()`` once inside ``torch.cuda.set_sync_debug_mode("error")``: ``None`` when it made no
    synchronising call, else the error torch raised at the first one (its message, which names the operation).
    Only meaningful on a CUDA device; the mode is restored afterwards.

    Args:
        fn: one steady-state step on CUDA tensors.

    Returns:
        ``None``, or the first sync's error message.
    """
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as err:
        return f"{err}\n{traceback.format_exc(limit=-6)}"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
    return None
