"""Optimisers of the experiments (``sec:app-optimiser``, ``sec:app-mlp-cifar10``) and one training step.

- ``ief`` / ``ef`` / ``sf``: :mod:`ief.optim` (``alg:iEF``, ``alg:EF``, ``alg:SF``), which run the forward and the
  per-sample backward themselves and minimise ``L = sum_n l_n``. ``normalised-linear`` (EF, SF): every update
  rescaled to norm ``lr`` times ``1 - t/T``. With ``options["convention"] == "token-mean"`` (the paper's setups)
  ``lr`` and ``damping`` are the paper's values, for the mean loss over the batch's target tokens as in its released
  code, and :class:`TokenMeanRates` converts them to the sum convention for every batch (:mod:`.convention`).
- ``ief-momentum`` (beyond the paper, ``sec:app-limitations``): :class:`ief.optim.IEF` with ``momentum``,
  ``dampening`` (from ``options``) and decoupled ``weight_decay`` (:mod:`ief.optim.momentum`); with the token-mean
  convention, ``IEF(reduction="mean")`` converts each batch's rate and damping inside the optimiser, so the momentum
  buffer holds per-batch converted steps and ``param_groups``' ``lr`` stays the given rate.
- ``kfac``, ``ekfac``, ``iekfac`` (beyond the paper, ``sec:app-iEF-eNGDopt``): :class:`ief.optim.KFAC` of that kind
  with ``factor_decay`` and ``inverse_every`` from ``options`` (sum convention only).
- ``adamw``, ``adam``, ``sgd`` (no momentum): torch; ``adafactor``: ``transformers.optimization.Adafactor``. They
  minimise the mean cross-entropy over the batch's target tokens (Hugging Face's loss, for which the paper's
  baseline learning rates were tuned). ``multistep``: ``lr`` times ``gamma`` at the milestone epochs.

Every step reports the same quantity, the mean cross-entropy per target token of the batch, so training curves of
all optimisers compare (for one-token targets it is the mean per-sample loss).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ief import call_model
from ief.optim import EF, IEF, KFAC, SF
from ief.optim import PreconditionedOptimizer
from .convention import CONVENTIONS, target_tokens, to_sum_convention
from .setups import OptimizerConfig

EXACT = ("ief", "ef", "sf")
KFAC_KINDS = ("kfac", "ekfac", "iekfac")
IGNORE = -100


class Diverged(RuntimeError):
    """The loss or the update is not finite: training stops here (the run still finishes and reports it)."""


class TokenMeanRates:
    """Mixin for :class:`ief.optim.IEF` / ``EF`` / ``SF`` whose ``lr`` and ``damping`` are given in the paper's
    token-mean convention: before every step they are set to :func:`.convention.to_sum_convention` of the batch's
    ``K`` target tokens. ``paper_lr`` / ``paper_damping`` keep the given values; ``last_tokens`` the last batch's
    ``K`` and ``last_sum_rates`` the ``(lr, damping)`` it ran with (for a runner to log)."""

    method = ""

    def __init__(self, model: torch.nn.Module, lr: float, damping: float, **kwargs: Any):
        super().__init__(model, lr=lr, damping=damping, **kwargs)  # type: ignore[call-arg]
        self.paper_lr, self.paper_damping = float(lr), float(damping)
        self.last_tokens: int | None = None
        self.last_sum_rates: tuple[float, float] | None = None

    def step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        group = self.param_groups[0]  # type: ignore[attr-defined]
        self.last_tokens = target_tokens(targets)
        group["lr"], group["damping"] = to_sum_convention(self.method, self.paper_lr, self.paper_damping,
                                                          self.last_tokens, normalized=group["normalize"])
        self.last_sum_rates = (group["lr"], group["damping"])
        return super().step(inputs, targets)  # type: ignore[misc]


class TokenMeanIEF(TokenMeanRates, IEF):
    method = "ief"


class TokenMeanEF(TokenMeanRates, EF):
    method = "ef"


class TokenMeanSF(TokenMeanRates, SF):
    method = "sf"


def make_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, total_steps: int
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    """``(optimizer, epoch scheduler or None)``; the scheduler, if any, is stepped at the end of every epoch."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = cfg.name
    if name in EXACT:
        kwargs: dict[str, Any] = dict(lr=cfg.lr, damping=cfg.damping)
        if name != "ief" or cfg.schedule == "normalised-linear":
            normalised = cfg.schedule == "normalised-linear"
            kwargs.update(normalize=normalised, total_steps=total_steps if normalised else None)
        convention = cfg.options.get("convention", "sum")
        if convention not in CONVENTIONS:
            raise ValueError(f"unknown loss convention {convention!r} for {name}; valid: {', '.join(CONVENTIONS)}")
        classes = {"ief": IEF, "ef": EF, "sf": SF} if convention == "sum" else \
            {"ief": TokenMeanIEF, "ef": TokenMeanEF, "sf": TokenMeanSF}
        opt: torch.optim.Optimizer = classes[name](model, **kwargs)
    elif name == "ief-momentum":
        convention = cfg.options.get("convention", "sum")
        if convention not in CONVENTIONS:
            raise ValueError(f"unknown loss convention {convention!r} for {name}; valid: {', '.join(CONVENTIONS)}")
        opt = IEF(model, lr=cfg.lr, damping=cfg.damping, momentum=float(cfg.options["momentum"]),
                  dampening=float(cfg.options.get("dampening", 0.0)), weight_decay=cfg.weight_decay,
                  reduction="mean" if convention == "token-mean" else "sum")
    elif name in KFAC_KINDS:
        if cfg.options.get("convention", "sum") != "sum":
            raise ValueError(f"{name} runs in the sum convention only (ief.optim.KFAC), got options "
                             f"convention={cfg.options['convention']!r}")
        opt = KFAC(model, name, lr=cfg.lr, damping=cfg.damping,
                   factor_decay=float(cfg.options.get("factor_decay", 0.95)),
                   inverse_every=int(cfg.options.get("inverse_every", 10)), weight_decay=cfg.weight_decay)
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


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: Any, targets: torch.Tensor) -> float:
    """One update; returns the batch's mean cross-entropy per target token. Raises :class:`Diverged`."""
    tokens = int((targets != IGNORE).sum())
    if isinstance(opt, PreconditionedOptimizer):
        try:
            total = float(opt.step(inputs, targets))
        except FloatingPointError as err:
            raise Diverged(str(err)) from err
        loss = total / tokens
    else:
        logits = call_model(model, inputs)
        value = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE)
        if not torch.isfinite(value):
            raise Diverged(f"non-finite loss {float(value)}")
        opt.zero_grad(set_to_none=True)
        value.backward()
        opt.step()
        loss = float(value.detach())
    if not math.isfinite(loss):
        raise Diverged(f"non-finite loss {loss}")
    return loss
