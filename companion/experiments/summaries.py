"""Numbers that summarise a training run, defined once.

:func:`final_train_loss` is *the* final training loss of the book: the mean loss over the last 10 % of the update
steps (at least one step). The paper reports "the final training loss" without a window; a fixed window (the runner's
``summary.json`` averages the last 100 updates) means "the whole run" for a 64-update cpu run and "the last 0.2 %" for
a 42,100-update full run, so the window here scales with the run.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FINAL_FRACTION = 0.1  # the last 10 % of the update steps


def final_window(n_steps: int, fraction: float = FINAL_FRACTION) -> int:
    """How many of the last updates the final training loss averages: ``ceil(fraction * n_steps)``, at least 1."""
    if n_steps < 1:
        raise ValueError(f"a run needs at least one update step to have a final loss, got n_steps={n_steps}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return max(1, math.ceil(fraction * n_steps))


def final_train_loss(losses: Sequence[float], fraction: float = FINAL_FRACTION) -> float:
    """Mean of the per-update training losses over the last ``final_window(len(losses))`` updates.

    ``ValueError`` for an empty run or a non-finite loss in the window (a diverged run has no final loss)."""
    values = np.asarray(losses, dtype=float)
    window = values[-final_window(len(values), fraction):]
    if not np.isfinite(window).all():
        raise ValueError(f"non-finite training loss in the last {len(window)} updates: the run diverged")
    return float(window.mean())
