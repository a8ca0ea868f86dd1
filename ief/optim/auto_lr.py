"""``lr="auto"``: the exact optimisers' step size set every step from the loss along the previous step.

iEF's first-order model of a step (the paper's Eq. (8): ``J d = s``) asks every sample's loss to fall by ``lr * s_n``
(``s_n = ||grad_z l_n||^2``, defined after Eq. (8)); where that model is wrong the step overshoots (the paper's
``lr=100`` taken in the sum convention, or ``lr=1`` on a GPT-2 + LoRA). ``lr="auto"`` measures the loss along the
step just taken on the *next* batch, which the step did not see (a Levenberg-Marquardt ratio of achieved to predicted
reduction, taken where it is unbiased). With ``delta = theta_t - theta_{t+1}`` the change the previous step applied
(schedule, momentum buffer and decoupled weight decay included) and ``L`` the new batch's summed loss (the union
batch's across processes), the step measures::

    D = L(theta_t) - L(theta_{t+1})          # achieved: one forward without gradients at theta_t
    E = grad L(theta_{t+1}) . delta          # the slope at theta_{t+1} (the step's own gradient)

fits ``f(a) = L(theta_t - a delta) = f(0) - g a + c a^2 / 2`` through them (``g = 2D - E``, ``c = 2(D - E)``) and
multiplies the rate by the fit's minimiser ``a* = g / c`` (by :data:`GROW` when ``c <= 0`` and ``g > 0``, by
:data:`SHRINK` when ``c <= 0`` and ``g <= 0`` or a value is not finite), the factor kept in ``[SHRINK, GROW]`` and the
rate in ``[FLOOR, CEILING]`` times the first rate (the ceiling, 10 times iEF's ``lr=1``, because at a near-zero training
loss the fit is noise and would keep doubling the rate). The previous batch's direction is independent of the new
batch, so ``f`` is an unbiased sample of the expected loss along it: the rate follows the step size that the data, not
the batch that made the step, prefers. The first step uses :data:`INITIAL` (iEF's sum-convention ``lr=1``, every
sample's logits moved by its logit gradient to first order; EF/SF's normalised ``0.01``); the new batch's forward
replays the step's RNG state (the same dropout masks as the step's own forward).

Why this rule and not another (the candidates' measurements: ``benchmarks/README.md``, "The optimisers' defaults"):

- *A per-step cap* ``lr <= c min_n l_n / s_n`` (the linearised reduction ``lr s_n`` at most a fraction ``c`` of the
  loss) costs nothing but cannot see curvature: for cross-entropy ``l_n / s_n >= 1.2277`` at every prediction
  (``s_n = (1 - p_y)^2 + sum_{j != y} p_j^2 <= 2 (1 - p_y)^2`` and ``-ln q / (2 (1 - q)^2) >= 1.2277``), so with
  ``c = 1`` it never binds below ``lr = 1.23``, where iEF can already overshoot; for MSE ``l_n / s_n = 1/2`` exactly,
  a constant.
- *The exact minimiser along iEF's logit move* ``z_n - eta grad_z l_n`` does not exist for cross-entropy: the move
  raises the target's margin over every other class (by ``eta (1 - p_y + p_j) > 0``), so every sample's loss falls
  monotonically to 0 and the minimiser is ``eta = inf``; for MSE it is ``eta = 1`` whatever the model.
- *The ratio on the step's own batch* (the classic trust region: an extra forward after the update on the same
  batch) rewards fitting that batch: the ratio stays high up to ``lr ~ 4 L / (3 sum_n s_n)`` (a loss cannot fall
  below 0), so it grows the rate past what held-out data tolerates.
- *The new batch's loss along the previous step* (this rule) measures what the step did to data it did not fit. It
  is not the default: a one-step greedy choice, it tends to settle below the best constant rate.

Cost: one forward without gradients per step (from the second step; no backward, no per-sample work), a copy of
the trainable parameters' size (``delta``), and two all-reduces of one scalar across processes. No host round-trip
of its own: ``D`` and ``E`` stay on the device and are read with the step's checks (its one read), before the rate is
used. The rate lives in the sum convention (with ``normalize=True``: the update's norm, the same in both), so
``reduction="mean"`` with its damping converted by ``K^2`` steps exactly as ``"sum"``; ``last_lr`` reports it in the
optimiser's convention. ``state_dict`` carries the rate and ``delta``.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

AUTO = "auto"
INITIAL = {"ief": 1.0, "ef": 0.01, "sf": 0.01}  # the first rate: the sum-convention defaults (ief.optim.exact)
SHRINK, GROW = 0.5, 2.0  # the factor's range per step
FLOOR, CEILING = 1e-6, 10.0  # the rate is kept in [FLOOR, CEILING] times its first value


def check_auto(lr: Any, name: str, allowed: bool) -> bool:
    """Whether ``lr`` asks for the adapted rate: ``True`` for ``"auto"``, ``False`` for anything else (checked as a
    number later).

    Raises:
        ValueError: a string other than ``"auto"`` (naming the accepted values), or ``"auto"`` for an optimiser
            without the rule (``allowed=False``).
    """
    if not isinstance(lr, str) or (lr != AUTO and not allowed):  # a number, or refused as one is
        return False
    if lr != AUTO:
        raise ValueError(f"lr must be a finite number > 0 or {AUTO!r} (the rate set from the loss along the previous "
                         f"step: ief.optim.auto_lr), got {lr!r}")
    if not allowed:
        raise ValueError(f"{name} does not take lr={AUTO!r} (its rule exists for IEF, EF and SF): give a finite "
                         f"number > 0")
    return True


def next_rate(rate: float, achieved: float, slope: float, first: float = 1.0) -> float:
    """The rate after the new batch's loss along the previous step was measured (the module docstring's rule).

    Args:
        rate: the previous step's rate.
        achieved: ``D = L(theta_t) - L(theta_{t+1})`` on the new batch (not finite: treated as a failed step).
        slope: ``E = grad L(theta_{t+1}) . (theta_t - theta_{t+1})`` on the new batch.
        first: the first rate (:data:`INITIAL`), which the bounds are relative to.

    Returns:
        The next step's rate, in ``[FLOOR first, CEILING first]``.
    """
    low, high = FLOOR * first, CEILING * first
    if not (math.isfinite(achieved) and math.isfinite(slope)):
        return min(high, max(low, rate * SHRINK))
    curvature, gain = 2.0 * (achieved - slope), 2.0 * achieved - slope  # f(a) = f(0) - gain a + curvature a^2 / 2
    if curvature > 0:
        factor = gain / curvature  # the minimiser of the quadratic along the step, as a fraction of it
    else:
        factor = GROW if gain > 0 else SHRINK
    factor = min(GROW, max(SHRINK, factor))
    return min(high, max(low, rate * factor))


class AutoRate:
    """The adapted rate's state: ``rate`` (sum convention, or the update's norm), the last step ``delta`` (the
    parameters' change) and the new batch's ``pending`` ``(achieved, slope)`` on the device until the step reads it.

    Args:
        rate: the first rate (:data:`INITIAL`).
    """

    def __init__(self, rate: float):
        self.rate = self.first = float(rate)
        self.delta: list[torch.Tensor] | None = None
        self.pending: torch.Tensor | None = None  # [2] float64: achieved, slope

    def settle(self, values: list[float] | None) -> float:
        """Apply the pending ``(achieved, slope)`` (read on the host) to the rate; returns the rate."""
        if values is not None:
            self.rate = next_rate(self.rate, values[0], values[1], self.first)
        self.pending = None
        return self.rate

    def state(self) -> dict:
        """What ``state_dict`` saves: the rate and the last step's change."""
        return {"rate": self.rate, "delta": self.delta}

    def load(self, state: dict) -> None:
        """Restore :meth:`state` (``ValueError`` for a rate that is not a finite number > 0)."""
        rate = state.get("rate") if isinstance(state, dict) else None
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"the state_dict's auto_lr rate must be a finite number > 0, got {rate!r}")
        self.rate, self.delta, self.pending = float(rate), state.get("delta"), None


def rng_states(devices: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The CPU and the given CUDA devices' RNG states (before the step's forward)."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


@contextlib.contextmanager
def replayed(states: tuple[torch.Tensor, list[torch.Tensor]], devices: list[int]) -> Iterator[None]:
    """Run with the RNG states ``states`` (the step's forward's: the same dropout masks), restoring the current
    ones after."""
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(states[0])
        for d, s in zip(devices, states[1]):
            torch.cuda.set_rng_state(s, d)
        yield
