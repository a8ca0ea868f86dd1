"""iEF's default rate and damping in the sum convention, set per batch from its counted targets per sample.

**Why the sum convention's rate cannot be one number.** iEF's direction solves ``(J J^T + lambda I) c = s``,
``d = J^T c`` (the paper's iEF update, its least-squares form ``J d = s`` in the section on the improved empirical
Fisher), with ``J`` the per-sample loss gradients and ``s_n = ||d l_n / d z_n||^2`` each sample's logit-gradient
norm. Scale every sample's loss by ``a`` (``l_n -> a l_n``): ``J -> a J``, ``s -> a^2 s``, so the undamped ``d -> a d``
and the Gram matrix ``J J^T -> a^2 J J^T``. The sum convention's ``l_n`` sums ``T_n`` target tokens: a sample of
``T`` tokens is, to iEF, ``T`` times the loss of one token's mean, so its step is about ``T`` times the step of a
one-label sample at the same ``lr``, and the same ``lambda`` damps its Gram ``T^2`` times less. (The first-order
request ``J d = lr s`` asks each sample's loss to fall by ``lr s_n``, about ``lr T`` nats for ``T`` tokens; a step's
second-order error grows as ``T ||d||^2``, faster than that request, so the linear model the step relies on breaks
down as ``T`` grows: the trainable parameters' norm balloons while the loss stays near ``log V``.) A rate of 1 that
suits a classifier (one label per sample) is then ~10x too large for a causal LM of ten target tokens per sample,
and ``lambda = 1e-4`` damps nothing there. The paper's token-mean convention hides the effect in its ``1/K``
(``K`` the batch's tokens), which also shrinks the step with the batch size.

**The default.** ``lr=None`` and ``damping=None`` (with ``reduction="sum"``) are set for each batch from
``T = K / M``, its counted targets per sample (:func:`ief.count_targets` over the batch's ``M`` samples):
``lr = RATE / T`` and ``lambda = DAMPING * T^2``: iEF's step for each sample's loss divided by ``T``, the mean
per-target loss of a typical sample, so the step no longer grows with the tokens per sample. For one label per sample
(a classifier, an MLP) ``T = 1``. :data:`RATE` and :data:`DAMPING` were chosen on four tasks (a BERT-LoRA
classifier, a Llama-LoRA causal LM with ``-100`` padding, a T5-LoRA seq2seq task, an MLP) and checked on three held
out from that choice (GPT-2 and Qwen2 causal LMs, a RoBERTa classifier) by ``benchmarks/defaults.py``; its table,
beside AdamW at ``1e-3``, is in ``benchmarks/README.md``.

Cost: no host read of its own: ``K`` is read with the loss's range check of the targets, which every step makes
before its loss (:attr:`ief.jacobian.PerSample.counted`), and the rate and damping are set after the forward, before
the solve that needs the damping; a batch whose every target is ``-100`` has ``K = 0``: it is said
(:func:`no_target_message`) and takes no update.
"""
from __future__ import annotations

from typing import Any

import torch

from ..losses import count_targets

RATE = 0.3  # the default rate for the loss per counted target of a typical sample (lr = RATE / T)
DAMPING = 1e-4  # the default damping for that loss (lambda = DAMPING * T^2)


def targets_per_sample(targets: torch.Tensor, process_group: Any = None, counted: int | None = None) -> float:
    """``T = K / M``: the batch's counted targets (:func:`ief.count_targets`: not ``-100``; every entry of a float
    target) per sample, of the union batch across ``process_group``'s ranks (one all-reduce of two integers), so that
    every rank takes the same rate; ``0.0`` when every target is ignored. ``counted``: this rank's ``K`` when already
    read (:attr:`ief.jacobian.PerSample.counted`); else it is counted here, one host read."""
    samples = targets.shape[0] if targets.dim() else 1
    if counted is None:
        counted = count_targets(targets)
    if process_group is not None:
        from ..distributed import all_reduce, collective_device

        both = torch.tensor([counted, samples], dtype=torch.int64, device=collective_device(process_group))
        counted, samples = all_reduce(both, process_group).tolist()
    return counted / max(samples, 1)


def per_target(rate: float, damping: float, per_sample: float) -> tuple[float, float]:
    """``(rate / T, damping * T^2)``: a rate and damping for the per-target loss ``l_n / T`` as the sum convention's
    (module docstring); ``T = per_sample > 0``."""
    if not per_sample > 0:
        raise ValueError(f"targets per sample must be > 0, got {per_sample!r}")
    return rate / per_sample, damping * per_sample ** 2


def no_target_message(name: str, step: int) -> str:
    """What a batch without a counted target means (every target ``-100``), and what to check."""
    return (f"{name} step {step}: every target of this batch is -100 (ignored), so its loss is 0 and there is nothing "
            f"to fit; no update was taken. Check the labels' masking (a prompt masked to the whole max_length, "
            f"labels built from padding only) or drop such batches")


def per_target_group(group: dict, targets: torch.Tensor, rate: bool, damping: bool, name: str, step: int,
                     process_group: Any = None, counted: int | None = None, stacklevel: int = 4) -> dict:
    """``group`` (a step's ``param_groups`` values, sum convention) with the per-target default applied for this
    batch: ``lr / T`` where ``rate`` (the rate was left to its default; ``"auto"`` is left alone) and
    ``damping T^2`` where ``damping`` (module docstring); ``counted`` as :func:`targets_per_sample`. A batch without
    a counted target is said (``UserWarning``, ``stacklevel`` naming the caller's line) and taken with ``T = 1`` (its
    direction is 0: no update but the weight decay)."""
    import warnings

    per_sample = targets_per_sample(targets, process_group, counted)
    if per_sample == 0:
        warnings.warn(no_target_message(name, step), UserWarning, stacklevel=stacklevel)
        per_sample = 1.0
    out = dict(group)
    if rate and not isinstance(group["lr"], str):
        out["lr"] = group["lr"] / per_sample
    if damping:
        out["damping"] = group["damping"] * per_sample ** 2
    return out
