"""Heavy-ball momentum and decoupled weight decay for the exact optimisers (beyond the paper's "Limitations").

The paper's Limitations (Appendix G) say the exact iEF update "means momentum and weight decay cannot be
directly applied" and leave their integration to further work. :class:`ief.optim.IEF` / ``EF`` / ``SF`` add both in
the form torch users know, applied *outside* the exact direction so that the direction itself stays
the paper's Algorithm 1 (iEF; Algorithms 2 and 3 for EF and SF) and ``momentum=0, weight_decay=0`` is the paper's
update, bit for bit. The update itself is :func:`ief.optim.update.preconditioned_update`; this module holds its
derivation and the checks of its settings.

**The update.** At step ``t`` on batch ``B_t`` the optimiser computes the exact direction ``d_t`` (e.g.
``J^T (J J^T + lambda I)^{-1} s`` for iEF, the paper's Eq. (8)) and the batch's own factor ``c_t``: ``1 / ||d_t||`` with
``normalize=True`` (0 when ``d_t = 0``), times the token-mean conversion of the rate with ``reduction="mean"``
(``1/K_t`` for iEF, ``K_t`` for un-normalised EF/SF, 1 for a normalised update; :mod:`ief.optim.convention`), else
1. With the schedule ``eta_t = lr_t * (1 - t/T)`` (``lr_t``: ``param_groups``' ``lr``, which a scheduler sets; the
factor ``1 - t/T`` only with ``total_steps=T``)::

    u_t   = c_t d_t                                       # the batch's step per unit rate
    b_t   = u_t                          (t = first step) # torch SGD's buffer: momentum_buffer
    b_t   = mu b_{t-1} + (1 - tau) u_t   (later steps)
    theta <- (1 - eta_t wd) theta - eta_t b_t             # wd: the group's weight_decay

with ``mu`` = ``momentum`` in ``[0, 1)``, ``tau`` = ``dampening`` in ``[0, 1]``. With ``mu = 0`` there is no buffer
and the step is ``theta <- (1 - eta_t wd) theta - eta_t c_t d_t``, today's update when ``wd = 0``. The buffers are
``state[p]["momentum_buffer"]`` (``state_dict`` round-trips them); ``last_update_norm`` is ``eta_t ||b_t||`` (the
decay's shrink not included); a buffer that is not finite raises ``FloatingPointError`` before anything changes.

**Why this form.**

- *Momentum on the preconditioned step, not on the gradient.* iEF's direction is the solution of a per-batch least
  squares problem (the paper's Eq. (8): ``J d = s``), not a linear function of the gradient, so a gradient buffer cannot
  be preconditioned afterwards; averaging the directions is heavy-ball on the natural-gradient step, as in K-FAC's
  and Shampoo's practical implementations, and each ``d_t`` stays the exact update of its own batch.
- *The batch factor inside the buffer, the rate outside.* ``c_t`` belongs to the batch: a normalised EF/SF update
  exists because EF's raw norms vary by orders of magnitude (the paper's Appendix H.2, "Optimisation Experimental Setup"), so the buffer averages unit
  steps, and ``reduction="mean"`` converts each batch's rate by its own ``K_t``. The rate ``eta_t`` stays outside, as
  in ``torch.optim.SGD`` (``p -= lr * buf``), so a scheduler rescales the whole step at once.
- *torch's conventions.* The buffer's first value is ``u_1`` undamped and later values are
  ``mu b + (1 - tau) u``, exactly ``torch.optim.SGD``'s ``momentum_buffer`` (``dampening`` defaults to 0 as there).
  With ``tau = 0`` a constant direction is eventually stepped ``eta / (1 - mu)`` far: momentum 0.9 makes iEF's
  ``lr = 1`` (every sample's logits moved by its loss gradient to first order, Eq. (8)) act like ``lr = 10``.
  ``dampening = momentum`` is the exponential average (Adam's first moment without its bias correction, which the
  undamped first value makes unnecessary): the step keeps the scale of the momentum-free rate, so a rate tuned
  without momentum keeps its meaning. Nesterov's variant is not offered.
- *Decoupled weight decay* (Loshchilov and Hutter, as ``torch.optim.AdamW``: ``p *= 1 - lr * weight_decay``). An
  L2 term ``wd/2 ||theta||^2`` added to the loss is not a per-sample loss: it has no row in ``J`` and no entry in
  iEF's ``s``, so it cannot enter Eq. (8) without changing what iEF is, and its gradient preconditioned by
  ``(J J^T + lambda I)^{-1}``-type curvature would decay each direction by its curvature instead of uniformly (the
  AdamW argument). Shrinking ``theta`` by ``1 - eta_t wd`` beside the exact step decays every weight at the same rate
  and scales with the schedule. ``eta_t`` here is the *given* rate (never the per-batch token conversion: the decay
  regularises ``theta``, not the batch's loss), so ``wd`` is chosen relative to ``lr``: the shrink per step is
  ``lr * wd``, e.g. ``1e-4`` for iEF's ``lr = 1`` with ``weight_decay = 1e-4``. ``lr * wd >= 1`` (a factor ``<= 0``)
  is refused.

**Groups.** The direction is joint over every parameter, so ``lr``, ``damping``, ``normalize``, ``total_steps``,
``momentum`` and ``dampening`` must agree across ``param_groups``; ``weight_decay`` may differ (e.g. none on biases
and LayerNorm weights: ``params=[{"params": decayed, "weight_decay": 0.01}, {"params": others,
"weight_decay": 0.0}]``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..model_call import resolve_params

SHARED_KEYS = ("lr", "damping", "normalize", "total_steps", "momentum", "dampening")
GROUP_KEYS = ("params", "weight_decay")  # what a params=[{...}] group may set


def _real(name: str, value: Any) -> float:
    if isinstance(value, (bool, str)):  # a ValueError, as every bad argument of the constructors
        raise ValueError(f"{name} must be a real number, got {value!r}")  # noqa: TRY004
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None


def check_momentum(value: Any) -> float:
    """``momentum`` as a float in ``[0, 1)`` (``ValueError`` naming the value and the range otherwise)."""
    out = _real("momentum", value)
    if not (0.0 <= out < 1.0):  # also refuses NaN
        raise ValueError(f"momentum must be a number in [0, 1) (0: no momentum; 1 or more never forgets a step and "
                         f"diverges), got {value!r}")
    return out


def check_dampening(value: Any) -> float:
    """``dampening`` as a float in ``[0, 1]``."""
    out = _real("dampening", value)
    if not (0.0 <= out <= 1.0):
        raise ValueError(f"dampening must be a number in [0, 1] (0: torch SGD's default; = momentum: an "
                         f"exponential average), got {value!r}")
    return out


def check_weight_decay(value: Any) -> float:
    """``weight_decay`` as a finite float ``>= 0``."""
    out = _real("weight_decay", value)
    if not (math.isfinite(out) and out >= 0.0):
        raise ValueError(f"weight_decay must be a finite number >= 0 (0: none), got {value!r}")
    return out


def check_group_extras(group: dict) -> None:
    """The momentum and weight-decay values of one ``param_groups`` entry (``ValueError`` as the checks above),
    and the shrink factor ``1 - lr * weight_decay > 0`` (with ``lr="auto"`` the step keeps it so:
    :mod:`ief.optim.auto_lr`)."""
    check_momentum(group.get("momentum"))
    check_dampening(group.get("dampening"))
    wd = check_weight_decay(group.get("weight_decay"))
    if wd and group["lr"] != "auto" and float(group["lr"]) * wd >= 1.0:  # "auto": the rate is kept below 1 / wd
        raise ValueError(f"lr * weight_decay must be < 1 (the per-step shrink factor 1 - lr * weight_decay would be "
                         f"<= 0), got lr={group['lr']!r}, weight_decay={group['weight_decay']!r}")


def check_shared(groups: list[dict]) -> None:
    """The values of the joint direction must agree across groups (``ValueError`` naming the first that does not)."""
    for index, group in enumerate(groups[1:], start=1):
        for key in SHARED_KEYS:
            if group.get(key) != groups[0].get(key):
                raise ValueError(
                    f"param_groups[{index}][{key!r}] is {group.get(key)!r} but param_groups[0][{key!r}] is "
                    f"{groups[0].get(key)!r}: the update is one joint direction over every group, so "
                    f"{', '.join(SHARED_KEYS)} must agree (only weight_decay may differ per group)")


def resolve_groups(model: torch.nn.Module, params: Iterable | None) -> list[dict]:
    """``params`` as torch ``param_groups`` input: one group of tensors, or the given ``[{"params": ...,
    "weight_decay": ...}, ...]`` (each group's tensors resolved as :func:`ief.model_call.resolve_params` does)."""
    if params is None or isinstance(params, torch.Tensor):
        return [{"params": resolve_params(model, params)}]
    items = list(params)
    dicts = [isinstance(item, dict) for item in items]
    if not any(dicts):  # (a list or tuple as given, so that an empty one is named as what it was)
        return [{"params": resolve_params(model, params if isinstance(params, (list, tuple)) else items)}]
    if not all(dicts):
        raise ValueError("params must be tensors or dicts (parameter groups), not a mix of both")
    groups = []
    for index, item in enumerate(items):
        unknown = sorted(set(item) - set(GROUP_KEYS))
        if unknown or "params" not in item:
            raise ValueError(
                f"params[{index}] has keys {sorted(item)}; a group takes 'params' and optionally 'weight_decay' "
                f"(the other settings, {', '.join(SHARED_KEYS)}, are the optimiser's: the direction is joint)")
        group = {"params": resolve_params(model, item["params"])}
        if "weight_decay" in item:
            try:
                group["weight_decay"] = check_weight_decay(item["weight_decay"])
            except ValueError as err:
                raise ValueError(f"params[{index}]: {err}") from None
        groups.append(group)
    return groups
