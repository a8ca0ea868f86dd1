"""The final training loss the verdicts compare: the full training-set loss of a run's final checkpoint.

The per-update losses a run records are each the loss of one minibatch before its update, drawn in a different
order by every seed; their mean over the last 10 % of the updates (:func:`.summaries.final_train_loss`) is as noisy
as the seeds' spread of the log ratios it is compared by. The paper's "final training loss" is a property of the
trained model: :func:`training_set_loss` evaluates it once, on every training example, with the parameters after the
last update (``checkpoints/stage-100.pt``), in evaluation mode (no dropout) and at the run's precision. The runner
records it as ``final_train_loss_full`` in ``summary.json`` (``None`` for a run that diverged: it has no final
checkpoint and ranks as the worst loss); :func:`.backfill.backfill_final_loss` adds it to a finished run that
lacks it.

Cost: one forward pass over the training set without gradients. For tweets at cpu scale that is 1,024 example
forwards in 8 batches of 128: as many as the run's four validations of 256 together, and half the examples its 64
updates of 32 carry forward. An evaluation forward is not cheap beside those updates: LoRA's and prompt tuning's
backward reaches few parameters, and dropout's masks are drawn in training mode only. So the pass adds about a sixth
to a tweets run, not a few seconds; the evaluation passes together (validations, this pass, the test) are about a
third of it. The pass cannot shrink without changing the number it records: other batches pad differently.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ief import IGNORE_INDEX, call_model, count_targets
from .tasks import to_device

FIELD = "final_train_loss_full"  # summary.json's key and e2_runs.csv's column
FINAL_STAGE = "stage-100.pt"  # the parameters after the last update (:func:`.store.stage_name` of 1)


class Aborted(Exception):
    """``abort()`` returned True between two batches: nothing was measured."""


@torch.no_grad()
def training_set_loss(model: torch.nn.Module, task: Any, examples: Sequence[Any], device: torch.device | str,
                      batch_size: int, *, abort: Callable[[], bool] = lambda: False) -> float:
    """The mean cross-entropy per counted target token over every example of ``examples``: ``sum L / sum K`` with
    ``K = ief.count_targets(targets)`` (for one-token targets, the mean per-example loss), the quantity each update
    reports for its batch (:func:`.optimizers.train_step`), here over the whole set with the parameters fixed.

    The model runs in evaluation mode (its training mode is restored after); precision is the caller's
    (:func:`.precision.forward_precision`); the cross-entropy accumulates in float64.

    Args:
        model: the model with the checkpoint's parameters loaded.
        task: the setup's task (:func:`.tasks.make_task`): ``collate`` gives inputs and targets.
        examples: the training examples.
        device: where the model is.
        batch_size: examples per forward pass (the setup's ``eval_batch_size``).
        abort: polled between batches; True raises :class:`Aborted`.

    Returns:
        The loss (``inf`` when a batch's loss is not finite: the model has diverged).

    Raises:
        ValueError: no examples, or no counted target among them.
        Aborted: ``abort()`` returned True.
    """
    if not len(examples):
        raise ValueError("the full training-set loss needs at least one training example, got none")
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    try:
        for lo in range(0, len(examples), batch_size):
            if abort():
                raise Aborted
            inputs, targets = task.collate([examples[i] for i in range(lo, min(lo + batch_size, len(examples)))])
            logits = call_model(model, to_device(inputs, device))
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).double(), targets.to(logits.device).reshape(-1),
                ignore_index=IGNORE_INDEX, reduction="sum").cpu()
            count += int(count_targets(targets))
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("the training examples hold no counted target (every target is ignored)")
    value = float(total) / count
    return value if math.isfinite(value) else float("inf")


def recorded(summary: dict[str, Any]) -> float:
    """A run's ``final_train_loss_full`` as its ``summary.json`` records it: ``inf`` for a run that diverged (no
    final checkpoint: the worst loss) or whose loss was not finite (recorded as ``None``), NaN for a summary written
    before the field existed (:func:`.backfill.backfill_final_loss` adds it), else the loss.

    Args:
        summary: the run's ``summary.json``.

    Returns:
        The loss.
    """
    if summary.get("diverged"):
        return float("inf")
    if FIELD not in summary:
        return float("nan")
    value = summary[FIELD]
    return float("inf") if value is None else float(value)
