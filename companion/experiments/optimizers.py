"""Optimisers of the experiments (``sec:app-optimiser``, ``sec:app-mlp-cifar10``) and one training step.

- ``ief`` / ``ef`` / ``sf``: :mod:`ief.optim` (``alg:iEF``, ``alg:EF``, ``alg:SF``), which run the forward and the
  per-sample backward themselves and minimise ``L = sum_n l_n``. ``normalised-linear`` (EF, SF): every update
  rescaled to norm ``lr`` times ``1 - t/T``. With ``options["convention"] == "token-mean"`` (the paper's setups)
  ``lr`` and ``damping`` are the paper's values, for the mean loss over the batch's target tokens as in its released
  code: the optimiser is built with ``reduction="mean"``, which converts them to the sum convention for every batch
  of ``K = ief.count_targets(targets)`` (derivation: :mod:`.convention`); ``param_groups`` keep the given values.
- ``ief-momentum`` (beyond the paper, ``sec:app-limitations``): :class:`ief.optim.IEF` with ``momentum``,
  ``dampening`` (from ``options``) and decoupled ``weight_decay`` (:mod:`ief.optim.momentum`), in the loss convention
  of its ``ief`` row (``reduction="mean"`` for the token mean: the momentum buffer holds per-batch converted steps).
- ``kfac``, ``ekfac``, ``iekfac`` (beyond the paper, ``sec:app-iEF-eNGDopt``): :class:`ief.optim.KFAC` of that kind
  with ``factor_decay`` and ``inverse_every`` from ``options`` (sum convention only).
- ``adamw``, ``adam``, ``sgd`` (no momentum): torch; ``adafactor``: ``transformers.optimization.Adafactor``. They
  minimise the mean cross-entropy over the batch's target tokens (Hugging Face's loss, for which the paper's
  baseline learning rates were tuned). ``multistep``: ``lr`` times ``gamma`` at the milestone epochs.

Every step reports the same quantity, the mean cross-entropy per counted target token of the batch (``L / K``, with
``K = ief.count_targets(targets)``; Hugging Face's ``outputs.loss`` for its models), so training curves of all
optimisers compare (for one-token targets it is the mean per-sample loss). :func:`train_step` takes it from the
optimiser, which knows its own ``reduction``: ``L / K`` as returned with ``"mean"``, ``L`` divided by ``K`` once with
``"sum"``.

Across processes (``torchrun``, :mod:`.processes`): the :mod:`ief.optim` optimisers take ``process_group=`` and step
on the union of the ranks' batches; the torch optimisers' loss is each rank's summed cross-entropy over the union's
``K``, their gradients summed over the ranks; the reported loss is the union batch's ``L / K``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ief import IGNORE_INDEX, call_model, count_targets
from ief.optim import EF, IEF, KFAC, SF
from . import processes
from .convention import CONVENTIONS, REDUCTION
from .processes import Processes
from .optimizer_tables import OptimizerConfig

EXACT = ("ief", "ef", "sf")
KFAC_KINDS = ("kfac", "ekfac", "iekfac")


class Diverged(RuntimeError):
    """The loss or the update is not finite: training stops here (the run still finishes and reports it)."""


def _reduction(name: str, cfg: OptimizerConfig) -> str:
    """``ief.optim``'s ``reduction`` for ``options["convention"]`` (``"sum"`` when not given)."""
    convention = cfg.options.get("convention", "sum")
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown loss convention {convention!r} for {name}; valid: {', '.join(CONVENTIONS)}")
    return REDUCTION[convention]


def make_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, total_steps: int, process_group: Any = None
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    """``(optimizer, epoch scheduler or None)``; the scheduler, if any, is stepped at the end of every epoch.

    ``process_group`` (several processes): given to the :mod:`ief.optim` optimisers (``ief``, ``ef``, ``sf``,
    ``ief-momentum``, the K-FAC kinds); the torch optimisers sum their gradients in :func:`train_step`."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = cfg.name
    if name in EXACT:
        kwargs: dict[str, Any] = dict(lr=cfg.lr, damping=cfg.damping)
        if name != "ief" or cfg.schedule == "normalised-linear":
            normalised = cfg.schedule == "normalised-linear"
            kwargs.update(normalize=normalised, total_steps=total_steps if normalised else None)
        classes = {"ief": IEF, "ef": EF, "sf": SF}
        opt: torch.optim.Optimizer = classes[name](model, reduction=_reduction(name, cfg), process_group=process_group,
                                                   **kwargs)
    elif name == "ief-momentum":
        opt = IEF(model, lr=cfg.lr, damping=cfg.damping, momentum=float(cfg.options["momentum"]),
                  dampening=float(cfg.options.get("dampening", 0.0)), weight_decay=cfg.weight_decay,
                  reduction=_reduction(name, cfg), process_group=process_group)
    elif name in KFAC_KINDS:
        if cfg.options.get("convention", "sum") != "sum":
            raise ValueError(f"{name} runs in the sum convention only (ief.optim.KFAC), got options "
                             f"convention={cfg.options['convention']!r}")
        opt = KFAC(model, name, lr=cfg.lr, damping=cfg.damping,
                   factor_decay=float(cfg.options.get("factor_decay", 0.95)),
                   inverse_every=int(cfg.options.get("inverse_every", 10)), weight_decay=cfg.weight_decay,
                   kl_clip=cfg.options.get("kl_clip"), process_group=process_group)  # the setups' runs: unclipped
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    elif name == "adam":
        opt = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    elif name == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    elif name == "adafactor":
        from transformers.optimization import Adafactor

        opt = Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **cfg.options)
    else:
        raise ValueError(f"unknown optimizer {name!r}")
    scheduler = None
    if cfg.schedule == "multistep":
        scheduler = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(cfg.milestones), gamma=cfg.gamma)
    elif cfg.schedule not in ("constant", "normalised-linear"):
        raise ValueError(f"unknown schedule {cfg.schedule!r} (constant, normalised-linear, multistep)")
    return opt, scheduler


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: Any, targets: torch.Tensor,
               procs: Processes | None = None) -> float:
    """One update; returns the batch's mean cross-entropy per counted target token, ``L / K`` with
    ``K = ief.count_targets(targets)``, whatever the optimiser: an :mod:`ief.optim` optimiser's own loss (``L / K``
    with ``reduction="mean"``, ``L`` divided by ``K`` once with ``"sum"``), torch's mean cross-entropy for the others.
    With ``procs`` (several processes) the batch is the union of the ranks' batches, ``L`` and ``K`` the union's.
    Raises :class:`Diverged`."""
    if isinstance(opt, (IEF, EF, SF, KFAC)):  # they run the forward and backward themselves
        try:
            value = float(opt.step(inputs, targets))  # across processes: the union batch's loss on every rank
        except FloatingPointError as err:
            raise Diverged(str(err)) from err
        loss = value if opt.reduction == "mean" else value / processes.total(float(count_targets(targets)), procs)
    elif procs is not None:
        logits = call_model(model, inputs)
        local = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX,
            reduction="sum")
        count = processes.total(float(count_targets(targets)), procs)
        loss = processes.total(float(local.detach()), procs) / count  # the same on every rank: they agree on it
        if not math.isfinite(loss):
            raise Diverged(f"non-finite loss {loss}")
        opt.zero_grad(set_to_none=True)
        (local / count).backward()
        processes.union_gradients([p for g in opt.param_groups for p in g["params"]], procs)
        opt.step()
    else:
        logits = call_model(model, inputs)
        value = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)
        if not torch.isfinite(value):
            raise Diverged(f"non-finite loss {float(value)}")
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        loss = float(value.detach())
    if not math.isfinite(loss):
        raise Diverged(f"non-finite loss {loss}")
    return loss
