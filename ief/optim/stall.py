"""The stall watch of the optimisers: a warning when the loss has not fallen while updates are taken.

A rate that suits one task can leave another's loss where it started: iEF asks each sample's loss to fall by
``lr * s_n`` to first order, a request whose linear model of the loss breaks down on long sequences at a rate that
suits one label per sample (the step then wanders without lowering the loss), and a rate far too small moves nothing
measurable. Both look alike from outside: the loss stays at its initial value, often ``log V`` for a language model
from scratch, and without a warning the run looks merely slow.

:class:`StallWatch` is fed the batch's mean per-sample loss that the step already reads with its finiteness checks
(the divergence watch's value), so it costs no host round-trip. It compares windows of ``window`` steps that took an
update (``lr > 0``) with the first such window: once the mean loss of a later full window is not *significantly*
below the first window's (its fall is less than :data:`STALL_Z` standard errors of the difference of the two means,
each window's batch-to-batch spread giving its error), it warns once, naming the steps, the losses, the rate and what
to try. A loss that falls slowly but steadily is not a stall (a small fall, repeated over 50 batches, is significant);
a loss that fell and then levelled off is not one either (its later windows stay far below the first); a warm-up at
``lr = 0`` does not count.
"""
from __future__ import annotations

import math
import warnings

STALL_WINDOW = 50  # steps per window (the first window is the baseline; a stall is said after two full windows)
STALL_Z = 2.0  # a later window whose mean loss is less than 2 standard errors below the first window's is a stall


def _mean_and_squared_error(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its squared standard error (sample variance over ``n``; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, sum((v - mean) ** 2 for v in values) / (n - 1) / n


class StallWatch:
    """Watches the mean per-sample loss of the steps that took an update and warns once on a stall.

    Args:
        owner: the optimiser's class name, for the message.
        window: steps per window (``>= 1``); ``None``: :data:`STALL_WINDOW`; ``0`` turns the watch off.
    """

    def __init__(self, owner: str, window: int | None = None):
        window = STALL_WINDOW if window is None else window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"the stall window must be a whole number of steps >= 0 (0: no watch), got {window!r}")
        self.owner = owner
        self.window = window
        self.baseline: float | None = None  # the first window's mean loss
        self._baseline_error2 = 0.0  # the squared standard error of that mean
        self._current: list[float] = []  # losses of the window being filled
        self._first_step: int | None = None  # the step that opened the window being filled
        self.warned = False

    def observe(self, mean_loss: float, step: int, lr: float, hint: str = "") -> bool:
        """Record one step's mean per-sample loss (before its update) taken with rate ``lr``; returns whether it
        warned now. A non-finite loss (the divergence checks' business) or ``lr == 0`` (no update) is skipped.

        Args:
            mean_loss: the batch's mean per-sample loss, as the step read it.
            step: the step's number (for the message).
            lr: the rate of the update this step takes (the reduction's convention; ``0``: none).
            hint: what else to try, appended to the message (the optimiser's own advice).
        """
        if self.warned or not self.window or not math.isfinite(mean_loss) or not lr > 0:
            return False
        if not self._current:
            self._first_step = step
        self._current.append(mean_loss)
        if len(self._current) < self.window:
            return False
        mean, error2 = _mean_and_squared_error(self._current)
        first, self._current = self._first_step, []
        if self.baseline is None:
            self.baseline, self._baseline_error2 = mean, error2
            return False
        if self.baseline - mean > STALL_Z * math.sqrt(error2 + self._baseline_error2):
            return False
        self.warned = True
        warnings.warn(
            f"{self.owner}: the loss has not fallen while updates were taken: the mean per-sample loss of steps "
            f"{first}-{step} is {mean:.4g}, against {self.baseline:.4g} over the first {self.window} updated steps "
            f"(not a fall beyond the batches' spread)"
            f"(lr={lr:g}). The rate may be too large for the method's linear model of the loss (long sequences: the "
            f"step then wanders without lowering it) or too small to move it; try lr='auto', a rate 10x smaller and "
            f"10x larger on a few hundred steps{hint} (said once)", UserWarning, stacklevel=5)
        return True
