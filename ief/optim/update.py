"""The update of a preconditioned step, as a function: :func:`preconditioned_update`.

The analogue of ``torch.optim.adamw.adamw``: :class:`ief.optim.IEF`, ``EF``, ``SF`` and :class:`ief.optim.KFAC`
validate their settings and compute a direction ``d_t`` (the exact or block-diagonal solve of batch ``t``), and this
function turns it into the parameters' change: the batch factor ``c_t``, heavy-ball momentum, the schedule, the
normalised update, decoupled weight decay and the in-place apply, one ``torch._foreach`` operator per weight-decay
value. The update (derivation: :mod:`ief.optim.momentum`), with ``eta_t = lr (1 - t/T)`` (the factor only with
``total_steps=T``)::

    u_t   = c_t d_t                       # c_t = batch_factor, divided by ||d_t|| with normalize=True
    b_t   = u_t  (first step),  b_t = momentum b_{t-1} + (1 - dampening) u_t  (after)
    theta <- (1 - eta_t weight_decay) theta - eta_t b_t

With ``momentum = 0`` no buffer is kept and the step is ``theta <- (1 - eta_t wd) theta - eta_t' d_t`` with
``eta_t' = batch_lr (1 - t/T) / ||d_t||^{[normalize]}`` and ``batch_lr = lr * batch_factor`` (the same step, with
the batch's rate formed once). A 16-bit parameter's update is computed in float32 and rounded once
(:mod:`ief.precision`). On an FSDP2 model (``sharded``: :class:`ief.sharded.ShardedModel`) every parameter's piece of
``d_t`` that its local shard holds updates that shard in place, the momentum buffers are kept as shards, and their
finiteness and norm are the union's over the ranks. Nothing changes until every check passed: the direction's and the
new buffers' finiteness are read with the caller's checks (:class:`ief.optim.checks.StepChecks`, one host read), then
the buffers are stored and the parameters updated.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..sharded import local_tensor
from .checks import Message, StepChecks, finite

Rates = float | Callable[[], tuple[float, float]]


@dataclass
class Update:
    """What :func:`preconditioned_update` did.

    Attributes:
        size: the scalar the applied steps were multiplied by (``eta_t``, or ``eta_t'`` without momentum).
        lr: the rate used (``lr``, or the first value a rates function returned).
        norm: ``eta_t ||b_t||`` (the change without the decay's shrink), a float or a function of no argument that
            reads it from the device when called (no host round-trip of the step's own).
        change: with ``keep_change=True``, ``theta_t - theta_{t+1}`` per parameter (float32 for a 16-bit one),
            else ``None``.
    """

    size: float
    lr: float
    norm: float | Callable[[], float]
    change: list[torch.Tensor] | None = None


def scheduled_rate(lr: float, step: int, total_steps: int | None) -> float:
    """``eta_t = lr (1 - t/T)``, clamped at 0 after ``T`` steps; ``lr`` itself without ``total_steps``.

    Args:
        lr: the rate.
        step: ``t``, the number of steps taken before this one.
        total_steps: ``T``, or ``None`` (no decay).

    Returns:
        The scheduled rate.
    """
    if total_steps is not None:
        lr *= max(0.0, 1.0 - step / total_steps)
    return lr


def decay_factors(lr: float, step: int, total_steps: int | None, weight_decay: Sequence[float]) -> list[float]:
    """Decoupled weight decay's factor ``1 - eta_t wd`` of every parameter (``1.0`` where ``wd = 0``).

    Args:
        lr: the rate the decay scales with (never the batch's token conversion: the decay regularises ``theta``).
        step: ``t``.
        total_steps: ``T`` or ``None``.
        weight_decay: one value per parameter.

    Returns:
        One factor per parameter.
    """
    return [1.0 - scheduled_rate(lr, step, total_steps) * wd if wd else 1.0 for wd in weight_decay]


@torch.no_grad()
def momentum_buffers(state: dict, params: list[torch.Tensor], steps: list[torch.Tensor], momentum: float,
                     dampening: float) -> list[torch.Tensor]:
    """The new ``momentum_buffer`` of every parameter, computed out of place (stored only once all are finite).

    Args:
        state: per-parameter state (``state[p]["momentum_buffer"]``; absent before the first step).
        params: the parameters.
        steps: ``u_t`` of each, shaped as its parameter.
        momentum: ``mu``.
        dampening: ``tau``.

    Returns:
        ``b = u`` on the first step, ``mu b + (1 - tau) u`` after.
    """
    out = []
    for p, u in zip(params, steps):
        old = state.get(p, {}).get("momentum_buffer")
        if old is None:
            out.append(u.clone())
        else:
            out.append(old.mul(momentum).add_(u, alpha=1.0 - dampening))
    return out


@torch.no_grad()
def apply_steps(params: list[torch.Tensor], steps: list[torch.Tensor], size: float, shrinks: list[float],
                state: dict, tensors: list[torch.Tensor] | None = None) -> None:
    """``p <- shrink p - size step`` for every parameter, in place, and its ``state[p]["step"]`` counted.

    The parameters of one decay factor are updated together (one foreach operator each for the shrink and the add);
    a 16-bit parameter's update is computed in float32 and rounded to its dtype once (:mod:`ief.precision`).

    Args:
        params: the parameters.
        steps: one tensor per parameter, with its number of elements.
        size: the scalar the steps are multiplied by.
        shrinks: one decay factor per parameter (:func:`decay_factors`).
        state: the per-parameter state whose ``"step"`` counts the updates.
        tensors: what is updated in place, one per parameter (default: the parameters; an FSDP2 parameter's local
            shard, :func:`ief.sharded.local_tensor`); ``state`` stays keyed by the parameters.
    """
    wide: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for param, p, step, shrink in zip(params, params if tensors is None else tensors, steps, shrinks):
        if p.dtype.itemsize < 4:  # a 16-bit parameter: the update in float32, rounded once (ief.precision)
            p.copy_(p.float().mul_(shrink).add_(step.view(p.shape).float(), alpha=-size))
        else:
            together = wide.setdefault(shrink, ([], []))
            together[0].append(p)
            together[1].append(step.view(p.shape))
        entry = state.setdefault(param, {})
        entry["step"] = entry.get("step", 0) + 1
    for shrink, (tensors, tensor_steps) in wide.items():
        if shrink != 1.0:
            torch._foreach_mul_(tensors, shrink)
        torch._foreach_add_(tensors, tensor_steps, alpha=-size)  # p.add_(step, alpha=-size), each p
    # autocast caches each parameter's bfloat16 cast until its outermost region exits: steps in a loop inside one
    # torch.autocast would otherwise run every later forward with the first step's weights (ief.precision)
    torch.clear_autocast_cache()


@torch.no_grad()
def _change(params: list[torch.Tensor], steps: list[torch.Tensor], size: float,
            shrinks: list[float]) -> list[torch.Tensor]:
    """``theta_t - theta_{t+1} = size step + (1 - shrink) theta_t`` per parameter, before the apply."""
    out = []
    for p, step, shrink in zip(params, steps, shrinks):
        d = step.view(p.shape).to(torch.float32 if p.dtype.itemsize < 4 else p.dtype) * size
        if shrink != 1.0:
            d.add_(p, alpha=1.0 - shrink)
        out.append(d)
    return out


def preconditioned_update(
    params: list[torch.Tensor],
    direction: torch.Tensor,
    state: dict,
    *,
    lr: Rates,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float | Sequence[float] = 0.0,
    normalize: bool = False,
    total_steps: int | None = None,
    batch_factor: float = 1.0,
    batch_lr: float | None = None,
    checks: StepChecks | None = None,
    direction_message: Message = "non-finite update direction",
    keep_change: bool = False,
    sharded: Any = None,
    local_direction: bool = False,
) -> Update:
    """Apply a preconditioned direction to the parameters in place (module docstring), after one host read.

    The step number ``t`` is ``state[params[0]]["step"]`` (0 before the first step); every parameter's count is
    incremented. The direction's finiteness, the new buffers' and, for a momentum-free normalised update, the
    direction's norm are read together with the caller's ``checks`` (one round-trip); a failed check raises before
    any parameter or buffer changes.

    Args:
        params: the parameters, in the direction's order (``direction`` is their flattened concatenation).
        direction: ``d_t`` ``[P]``.
        state: per-parameter state (``torch.optim.Optimizer.state``, or any dict): ``"step"`` and
            ``"momentum_buffer"``, created where absent.
        lr: ``lr`` (before the schedule), or a function of no argument called after the read that returns
            ``(lr, batch_lr)`` (a rate set from values read with the checks: ``lr="auto"``, :mod:`ief.optim.auto_lr`).
        momentum: ``mu`` in ``[0, 1)``; 0: no buffer is kept.
        dampening: ``tau`` in ``[0, 1]``.
        weight_decay: ``wd >= 0``, one value or one per parameter.
        normalize: divide the step by ``||d_t||`` (a zero direction is a zero step).
        total_steps: ``T`` of the linear decay, or ``None``.
        batch_factor: ``c_t`` before the normalisation (the token-mean conversion of the rate; 1 otherwise).
        batch_lr: the rate of a momentum-free step (default ``lr * batch_factor``).
        checks: the caller's checks, read with this update's (default: a fresh :class:`StepChecks`).
        direction_message: what a non-finite direction is called in the ``FloatingPointError``.
        keep_change: return the change of every parameter (:attr:`Update.change`).
        sharded: an FSDP2 model's :class:`ief.sharded.ShardedModel` whose ``params`` these are (``direction`` whole
            on every rank, the same bits): the local shards are updated (module docstring); ``None`` otherwise.
        local_direction: (with ``sharded``) ``direction`` is this rank's shards only, ``[P_local]`` in the local
            shards' layout (:meth:`ief.sharded.ShardedModel.combine`): its norm and finiteness are the union's.

    Returns:
        The :class:`Update`.

    Raises:
        FloatingPointError: a check (the caller's, the direction's, a buffer's) failed; nothing changed.
        ValueError: a ``DTensor`` parameter (FSDP2's, tensor parallel's) without ``sharded``; nothing changed.
    """
    if sharded is None and any(hasattr(p, "to_local") for p in params):
        raise ValueError("preconditioned_update was given DTensor parameters (a model sharded with FSDP2 or tensor "
                         "parallel) without sharded=, and the whole direction cannot be added to their shards; pass "
                         "sharded=ief.sharded.inspect(...) for an FSDP2 model, or step it with IEF, EF or SF")
    step = int(state.get(params[0], {}).get("step", 0))
    if checks is None:
        checks = StepChecks(step)
    decays = [float(weight_decay)] * len(params) if isinstance(weight_decay, (int, float)) else list(weight_decay)
    tensors = params
    if sharded is not None:  # each parameter's piece that this rank's shard holds, and the shards themselves
        tensors = [local_tensor(p) for p in params]
    if local_direction:  # this rank's shards already: the norm and finiteness over every rank's
        chunks = list(torch.split(direction, [t.numel() for t in tensors]))
        # a bfloat16 direction (FSDP2's bfloat16 compute) updates float32 shards, and keeps float32 buffers
        chunks = [c if c.dtype == t.dtype else c.to(t.dtype) for c, t in zip(chunks, tensors)]
        norm_t = sharded.union_sqnorm(direction.norm().to(torch.float64).square()).sqrt()
        checks.add(sharded.union_flag(finite(direction)), direction_message)
    else:
        chunks = list(torch.split(direction, [p.numel() for p in params]))
        if sharded is not None:
            chunks = [sharded.local_piece(i, c).to(t.dtype) for i, (c, t) in enumerate(zip(chunks, tensors))]
        norm_t = direction.norm()
        checks.add(finite(direction), direction_message)
    buffers = None
    if momentum != 0:
        factor: Any = batch_factor  # c_t: the batch's own factor, inside the buffer
        if normalize:  # factor / ||d|| (0 when d = 0), on the device
            norm64 = norm_t.to(torch.float64)
            factor = torch.where(norm64 > 0, factor / norm64, torch.zeros_like(norm64))
        steps = [c.view(p.shape).mul(factor) for p, c in zip(tensors, chunks)]  # shaped as their parameter (shard)
        buffers = momentum_buffers(state, params, steps, momentum, dampening)
        flag = finite(*buffers)
        checks.add(flag if sharded is None else sharded.union_flag(flag), "non-finite momentum buffer")
    read_norm = checks.also_read(norm_t.to(torch.float64)) if momentum == 0 and normalize else None
    checks.read()  # the step's one host round-trip
    if callable(lr):
        lr, batch_lr = lr()
    elif batch_lr is None:
        batch_lr = lr * batch_factor
    shrinks = decay_factors(lr, step, total_steps, decays)
    if buffers is None:  # no buffer: the batch's step itself
        norm = checks.values(read_norm)[0] if read_norm is not None else None
        size = scheduled_rate(batch_lr, step, total_steps)
        if norm is not None:
            size = size / norm if norm > 0 else 0.0
        change = _change(tensors, chunks, size, shrinks) if keep_change else None
        apply_steps(params, chunks, size, shrinks, state, tensors)
        return Update(size, lr, abs(size) * norm if norm is not None else lambda: abs(size) * float(norm_t), change)
    for p, b in zip(params, buffers):
        state.setdefault(p, {})["momentum_buffer"] = b
    size = scheduled_rate(lr, step, total_steps)  # eta_t = lr (1 - t/T)
    change = _change(tensors, buffers, size, shrinks) if keep_change else None
    apply_steps(params, buffers, size, shrinks, state, tensors)
    norms = torch.stack([b.norm() for b in buffers])
    if sharded is not None:  # the whole update's norm, over every rank's shards
        total = sharded.union_sqnorm(norms.to(torch.float64).square().sum())
        return Update(size, lr, lambda: abs(size) * math.sqrt(float(total)), change)
    return Update(size, lr, lambda: abs(size) * math.sqrt(sum(x ** 2 for x in norms.tolist())), change)


__all__ = ["Update", "apply_steps", "decay_factors", "momentum_buffers", "preconditioned_update", "scheduled_rate"]
