"""The optimisers' settings: :class:`Settings`, their checks, and the ``Args`` text the classes share.

:class:`ief.optim.IEF`, ``EF``, ``SF`` and :class:`ief.optim.KFAC` show explicit keyword signatures (what ``help()``
and an IDE show, and what :func:`ief.arguments.suggest_keywords` checks a misspelled keyword against); each passes the
settings they share to :class:`ief.optim.base.PreconditionedOptimizer` as one :class:`Settings`. Their docstrings
share the descriptions of those settings: a line ``{shared args: name name ...}`` in a class docstring is replaced by
:func:`shared_args` with the descriptions below, so each is written once.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..jacobian import CHECKS
from ..losses import IGNORE_INDEX, Loss

REDUCTIONS = ("sum", "mean")
DEFAULT_DAMPING = {"sum": 1e-4, "mean": 1e-7}  # see "Defaults" in ief.optim.exact


@dataclass
class Settings:
    """The constructor settings every preconditioned optimiser takes (the class's own signature shows them).

    Attributes:
        params: what to train (``None``: every trainable parameter), or weight-decay groups.
        loss: ``"cross_entropy"``, ``"mse"`` or a :class:`ief.losses.Loss`.
        reduction: ``"sum"`` or ``"mean"``.
        normalize: rescale each update to norm ``lr``.
        total_steps: ``T`` of the linear decay, or ``None``.
        momentum: heavy-ball momentum in ``[0, 1)``.
        dampening: in ``[0, 1]``.
        weight_decay: decoupled weight decay ``>= 0``.
        process_group: the ``torch.distributed`` group to step across, or ``None``.
    """

    params: Iterable | None = None
    loss: str | Loss = "cross_entropy"
    reduction: str = "sum"
    normalize: bool = False
    total_steps: int | None = None
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    process_group: Any = None


class _NoBatch:
    """step()'s default batch: no batch given (``help(IEF.step)`` shows it as ``<required>``)."""

    def __repr__(self) -> str:
        return "<required>"


MISSING: Any = _NoBatch()  # step()'s default batch: no batch given (also ief.hf's)


def how_to_step(name: str) -> str:
    """The ``TypeError`` message of ``step()`` / ``step(closure)``: how these optimisers are driven."""
    return (f"{name}.step needs the batch: call opt.step(inputs, targets) in your own loop, which runs the forward "
            f"and the per-sample backward itself (no loss.backward() and no closure), so a loop that calls step() or "
            f"step(closure) after its own backward cannot drive it, and transformers.Trainer(optimizers=(opt, None)) "
            f"is not supported (its training loop calls step() without the batch; ief.hf.IEFTrainer(model, args, "
            f"optimizer='ief') is)")


def check_positive(name: str, value: float) -> float:
    """``value`` as a finite float ``> 0`` (``ValueError`` naming ``name`` otherwise)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return out


def check_check(check: Any) -> bool | str | int:
    """``check`` as the exact optimisers take it: :func:`ief.per_sample`'s ``True``, ``False`` or ``"exact"``, or a
    whole number ``N >= 1`` of steps: the exact check every ``N`` steps (steps 0, N, 2N, ...), the structural one
    between (refused at construction rather than at the first step)."""
    if check is True or check is False or (isinstance(check, str) and check == "exact"):
        return check
    if isinstance(check, int) and not isinstance(check, bool) and check >= 1:
        return int(check)
    raise ValueError(f"check must be one of {', '.join(map(repr, CHECKS))} or a whole number N >= 1 of steps (the "
                     f"exact check every N steps), got {check!r}")


def check_total_steps(total_steps: Any) -> int | None:
    """``total_steps`` as a positive integer or ``None``."""
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise ValueError(f"total_steps must be a positive integer or None (no decay), got {total_steps!r}")
    return total_steps


def check_reduction(reduction: Any) -> str:
    """``reduction`` as one of :data:`REDUCTIONS`."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))} (the loss whose lr and damping "
                         f"these are: sum_n l_n, or its mean over the counted target positions), got {reduction!r}")
    return reduction


# The descriptions of the shared settings, for the classes' ``Args:`` sections (:func:`shared_args`).
ARGS = {
    "params": """params: what to train (default ``None``: every trainable parameter of ``model``): an iterable of
    parameters, or groups ``[{"params": [...], "weight_decay": w}, ...]`` that differ in ``weight_decay`` only (the
    direction is joint; ``add_param_group`` later is a ``ValueError``).""",
    "loss": """loss: ``"cross_entropy"`` (default; class-index targets, ``-100`` ignored) or ``"mse"`` (float targets
    shaped like the logits).""",
    "reduction": """reduction: ``"sum"`` (default: ``lr`` and ``damping`` for ``L = sum_n l_n``) or ``"mean"`` (values
    for the mean over the batch's ``K`` counted target tokens, Hugging Face's ``outputs.loss`` and the paper's code,
    converted every step; ``step`` then returns ``L / K``). See :mod:`ief.optim.exact`.""",
    "total_steps": """total_steps: ``T``: multiply the step size by ``1 - t/T`` (the paper's linear decay to 0); default
    ``None`` (constant).""",
    "momentum": """momentum: heavy-ball momentum in ``[0, 1)`` on the preconditioned step (default ``0.0``: no buffer,
    the exact update bit for bit).""",
    "dampening": """dampening: in ``[0, 1]``, the buffer's ``1 - dampening`` weight on the new step (default ``0.0``;
    ``dampening=momentum`` keeps the momentum-free step scale).""",
    "weight_decay": """weight_decay: AdamW's decoupled decay ``theta <- (1 - lr_t wd) theta``, ``>= 0`` with ``lr *
    weight_decay < 1`` (default ``0.0``).""",
    "check": """check: the per-sample guard of :func:`ief.per_sample`: ``True`` (default: the thorough ``"exact"`` check
    on the first step, the ~free structural one after), ``"exact"`` (every step), a whole number ``N >= 1`` (exact every
    N steps, structural between: the guarantee throughout at 1/N of its cost) or ``False`` (off).""",
    "form": """form: the per-sample Jacobian's form (:func:`ief.per_sample`): ``"auto"`` (default: never forms ``[M,
    P]``; a weight's rows kept while they fit ``memory_budget``, else streamed, :mod:`ief.streamed`), ``"dense"``,
    ``"ghost"``, ``"rows"`` or ``"streamed"``.""",
    "memory_budget": """memory_budget: with ``form="auto"``, the bytes of per-sample rows a step may keep from its
    backward to its update (the columns without factors first, then the weights' rows, smallest first; the rest are
    streamed); default ``None``: twice the bytes of the model's parameters (what AdamW's moments would hold;
    :data:`ief.streamed.MODEL_MULTIPLE`), at least 8 MiB; ``math.inf`` keeps every weight's rows.""",
    "process_group": """process_group: step across the processes of this ``torch.distributed`` group, exactly as one
    process on the union batch (:mod:`ief.optim.exact`); default: a ``DistributedDataParallel`` model's group, an
    FSDP2 model's (:mod:`ief.sharded`), else none.""",
    "generator": """generator: the ``torch.Generator`` the labels are drawn with (default ``None``: the global RNG);
    ``state_dict`` carries its state.""",
}
RAISES = """ValueError: a bad argument, named with its value and the accepted values: a ``model`` that is not an
    ``nn.Module``, no trainable parameters, a ``params`` tensor not in the model, ``lr`` neither
    ``"auto"`` nor finite and ``> 0``, a negative or non-finite ``damping``, ``momentum`` outside ``[0, 1)``,
    ``dampening`` outside ``[0, 1]``, a negative ``weight_decay`` or ``lr * weight_decay >= 1``,
    ``total_steps`` not a positive integer, an unknown ``reduction``, ``check`` or ``form``, a ``memory_budget``
    not a number ``>= 0`` or given with a form other than ``"auto"``; an initialised
    ``torch.distributed`` of world size > 1 with neither ``process_group`` nor a
    ``DistributedDataParallel`` model.
TypeError: an unknown keyword (the message names the closest accepted ones)."""
_MARKER = re.compile(r"^( *)\{shared (args|raises): ?([\w ]*)\}$", flags=re.MULTILINE)


def shared_args(cls: type) -> type:
    """Expand the ``{shared args: name ...}`` and ``{shared raises:}`` lines of ``cls``'s docstring (a decorator).

    Args:
        cls: the optimiser class.

    Returns:
        ``cls``, its docstring expanded with :data:`ARGS` / :data:`RAISES` at the marker's indentation.
    """
    def expand(match: re.Match) -> str:
        indent, what, names = match.group(1), match.group(2), match.group(3).split()
        texts = [ARGS[name] for name in names] if what == "args" else [RAISES]
        return "\n".join(indent + text.replace("\n", "\n" + indent) for text in texts)

    cls.__doc__ = _MARKER.sub(expand, cls.__doc__ or "")
    return cls


def looks_unshifted(inputs: Any, targets: torch.Tensor) -> bool:
    """Whether ``targets`` equal ``inputs["input_ids"]`` at every counted position of a sequence (Hugging Face's
    causal-LM ``labels``, which the model shifts itself)."""
    ids = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if not isinstance(ids, torch.Tensor) or targets.dtype.is_floating_point or targets.dim() < 2 \
            or tuple(ids.shape) != tuple(targets.shape) or targets.shape[-1] < 2:
        return False
    kept = targets != IGNORE_INDEX
    return bool(kept.any()) and bool((targets[kept] == ids.to(targets.device)[kept]).all())


__all__ = ["ARGS", "DEFAULT_DAMPING", "MISSING", "REDUCTIONS", "Settings", "check_check", "check_positive",
           "check_reduction", "check_total_steps", "how_to_step", "looks_unshifted", "shared_args"]
