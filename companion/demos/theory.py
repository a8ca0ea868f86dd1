"""Numerical checks of the paper's convergence analysis and of the iEF / GN / NGD relations, on small real networks.

Everything here measures; nothing plots (``notebooks/convergence.ipynb`` draws the figures). The iEF flow is built
only from the package's own functions: :func:`ief.per_sample` (``J = grad_theta l``, ``s_iEF``) and
:func:`ief.ief_direction` with damping 0, i.e. Assumption ``ass:full_batch_iEF``::

    d theta / dt = -J^T (J J^T)^{-1} s_iEF.

What is checked, and where it is in the paper:

- :func:`lemma_check`: ``lemma:dln_dt``, ``d l_n / dt = -||grad_{z_n} l_n||^2`` for every sample, by finite
  differences along the flow direction (error ``O(h)`` forward, ``O(h^2)`` central) and by the exact identity
  ``J v = -s_iEF`` (the ``h -> 0`` limit).
- :func:`ief_flow` + :func:`sublinear_bound`: ``theorem:sublinear-convergence`` for softmax + cross-entropy,
  ``p_n(t) > 1 - 2 / (t + C_0 + 1)``.
- :func:`ief_flow` + :func:`linear_bound`: ``theorem:linear-convergence`` for the squared error (``m = 1``) on a
  non-convex network, ``l_n(t) - l_n* <= exp(-2 m t) (l_n(0) - l_n*)``. For ``1/2 ||z - y||^2`` the
  Polyak-Lojasiewicz inequality of ``ass:strong-convex-F`` holds with *equality* at ``m = 1``
  (``l_n - 0 = 1/2 ||grad_z l_n||^2``), so the flow attains the bound exactly: the margin is zero up to the
  integrator's error, which is therefore measured and reported alongside it.
- :func:`gn_equivalence`: ``sec:app-ief-gn-ngd`` -- iEF matrix (``eqn:iEF_mat``) = GN matrix for scalar-output
  models, = Fisher for least squares (``eqn:lls-F-equal``), and the contrast of a multi-class softmax model.

Assumption ``ass:full_rank_covariance`` (full-rank Gram ``J J^T``) is monitored along every flow: its smallest
eigenvalue, raw and after normalising the per-sample gradients to unit length, is recorded at every saved time.
All computations run in float64 on a private copy of the model; the caller's model is never modified.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ief import PerSample, ief_direction, per_sample

from .equivalence import EquivalenceRow, curvature_matrices, gn_equivalence
from .problems import (Problem, classification_problem, get_vector, private_copy, regression_problem, set_vector,
                       trainable_params)

__all__ = [
    "Problem",
    "classification_problem",
    "regression_problem",
    "FlowResult",
    "ief_flow",
    "LemmaResult",
    "lemma_check",
    "SublinearBound",
    "sublinear_bound",
    "LinearBound",
    "linear_bound",
    "curvature_matrices",
    "EquivalenceRow",
    "gn_equivalence",
]

LOSSES = ("cross_entropy", "mse")


# ------------------------------------------------------------------------------------------------------ helpers
def _velocity(model, inputs, targets, loss: str) -> tuple[torch.Tensor, PerSample]:
    """``d theta / dt = -d_iEF`` (damping 0, ``ass:full_batch_iEF``) and the per-sample quantities it came from."""
    ps = per_sample(model, inputs, targets, loss=loss)
    if not torch.isfinite(ps.losses).all():
        raise FloatingPointError("non-finite per-sample losses along the iEF flow")
    return -ief_direction(ps.jacobian, ps.logit_sqnorm, 0.0), ps


def _gram_min_eigs(jacobian: torch.Tensor) -> tuple[float, float]:
    """Smallest eigenvalue of ``J J^T`` and of the Gram of the unit-normalised per-sample gradients."""
    j = jacobian.detach().to(torch.float64)
    gram = j @ j.T
    raw = float(torch.linalg.eigvalsh(0.5 * (gram + gram.T))[0])
    norms = j.norm(dim=1).clamp_min(1e-300)
    unit = j / norms[:, None]
    cos = unit @ unit.T
    normalised = float(torch.linalg.eigvalsh(0.5 * (cos + cos.T))[0])
    return raw, normalised


def _target_prob_available(loss: str, targets: torch.Tensor) -> bool:
    """``p_n = exp(-l_n)`` is the target probability when each sample has exactly one (kept) position."""
    return loss == "cross_entropy" and targets.dim() == 1 and bool((targets >= 0).all())


def _fit_order(h: torch.Tensor, err: torch.Tensor) -> float:
    """Least-squares slope of ``log err`` against ``log h``."""
    x, y = h.log(), err.clamp_min(1e-300).log()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x * x).sum())


# --------------------------------------------------------------------------------------------------------- flow
@dataclass
class FlowResult:
    """The iEF gradient flow sampled at ``times``.

    ``losses``, ``logit_sqnorm`` (``s_iEF``) and ``target_prob`` (``p_n = exp(-l_n)``, cross-entropy with one label
    per sample; else ``None``) are ``[T, N]``. ``gram_min_eig`` / ``gram_min_eig_normalised`` are ``[T]``
    (``ass:full_rank_covariance``). ``loss_error`` (``[T, N]``, or ``None`` without ``error_estimate``) is
    the difference from a more accurate reference run (``dt/2`` for fixed steps, ``rtol/32`` for dopri5): an
    estimate of the integrator's error in ``losses`` (for fixed-step RK4 the reported run's own error is about
    16/15 of it).
    """

    times: torch.Tensor
    losses: torch.Tensor
    logit_sqnorm: torch.Tensor
    target_prob: torch.Tensor | None
    gram_min_eig: torch.Tensor
    gram_min_eig_normalised: torch.Tensor
    loss_error: torch.Tensor | None
    loss: str
    dt: float
    method: str
    rtol: float
    n_evals: int  # velocity evaluations (per_sample + ief_direction) of the reported run
    n_params: int

    @property
    def n_samples(self) -> int:
        return int(self.losses.shape[1])

    @property
    def prob_error(self) -> torch.Tensor | None:
        """Error estimate of ``target_prob``: ``|d p / d l| |dl| = p |dl|``."""
        if self.loss_error is None or self.target_prob is None:
            return None
        return self.target_prob * self.loss_error


class _Records:
    """Per-sample quantities saved at the recorded times."""

    def __init__(self):
        self.times, self.losses, self.sq, self.gmin, self.gmin_n = [], [], [], [], []

    def add(self, t: float, ps: PerSample) -> None:
        raw, normalised = _gram_min_eigs(ps.jacobian)
        self.times.append(float(t))
        self.losses.append(ps.losses.detach().to(torch.float64).clone())
        self.sq.append(ps.logit_sqnorm.detach().to(torch.float64).clone())
        self.gmin.append(raw)
        self.gmin_n.append(normalised)

    def tensors(self):
        return (
            torch.tensor(self.times, dtype=torch.float64),
            torch.stack(self.losses),
            torch.stack(self.sq),
            torch.tensor(self.gmin, dtype=torch.float64),
            torch.tensor(self.gmin_n, dtype=torch.float64),
        )


# Dormand-Prince 5(4) tableau (FSAL): stages 2-7, 5th-order weights (= stage 7's row) and the error weights b5 - b4.
_DP_A = (
    (1 / 5,),
    (3 / 40, 9 / 40),
    (44 / 45, -56 / 15, 32 / 9),
    (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
    (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
    (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84),
)
_DP_E = (
    35 / 384 - 5179 / 57600, 0.0, 500 / 1113 - 7571 / 16695, 125 / 192 - 393 / 640,
    -2187 / 6784 + 92097 / 339200, 11 / 84 - 187 / 2100, -1 / 40,
)


def _integrate(model, inputs, targets, loss: str, n_steps: int, dt: float, method: str, record_every: int,
               rtol: float):
    """Integrate from the model's parameters; returns the recorded tensors and the number of velocity evaluations.

    Fixed steps (``rk4``, ``euler``): ``n_steps`` steps of ``dt``, saved every ``record_every`` steps and at the
    end. Adaptive (``dopri5``): the same saved times; between them, steps of at most ``dt`` chosen so that the
    embedded error estimate ``||theta_5 - theta_4||`` stays below ``rtol`` times the step's displacement
    ``||theta_5 - theta||`` (the flow's velocity shrinks as the samples converge, so an error relative to the
    displacement, not to ``||theta||``, keeps the *relative* accuracy of the decaying losses uniform in time).
    """
    params = trainable_params(model)
    theta = get_vector(params)
    rec = _Records()
    evals = 0

    def velocity(vector: torch.Tensor):
        nonlocal evals
        evals += 1
        set_vector(params, vector)
        return _velocity(model, inputs, targets, loss)

    k1, ps = velocity(theta)
    rec.add(0.0, ps)
    if method in ("rk4", "euler"):
        for step in range(1, n_steps + 1):
            if method == "euler":
                theta = theta + dt * k1
            else:
                k2, _ = velocity(theta + 0.5 * dt * k1)
                k3, _ = velocity(theta + 0.5 * dt * k2)
                k4, _ = velocity(theta + dt * k3)
                theta = theta + (dt / 6.0) * (k1 + 2 * k2 + 2 * k3 + k4)
            k1, ps = velocity(theta)  # the next step's first stage, and the per-sample quantities at theta
            if step % record_every == 0 or step == n_steps:
                rec.add(step * dt, ps)
        return rec.tensors(), evals
    # dopri5
    marks = [k * dt for k in range(record_every, n_steps, record_every)] + [n_steps * dt]
    t, h = 0.0, dt / 8
    for mark in marks:
        while t < mark:
            last = t + h >= mark - 1e-12 * max(1.0, mark)
            h_try = mark - t if last else h
            if h_try < 1e-12 * max(1.0, t):
                raise FloatingPointError(
                    f"dopri5 step size underflow at t = {t:g}: the iEF flow is too stiff here (near-singular Gram "
                    "matrix?); use method='rk4' with a small dt, or a larger rtol"
                )
            ks = [k1]
            for row in _DP_A[:-1]:
                ks.append(velocity(theta + h_try * sum(a * k for a, k in zip(row, ks)))[0])
            new = theta + h_try * sum(a * k for a, k in zip(_DP_A[-1], ks))
            k7, ps_new = velocity(new)
            ks.append(k7)
            err = float((h_try * sum(e * k for e, k in zip(_DP_E, ks))).norm())
            scale = rtol * float((new - theta).norm()) + 1e-300
            ratio = err / scale
            if ratio <= 1.0:  # accept
                t = mark if last else t + h_try
                theta, k1, ps = new, k7, ps_new
            factor = 5.0 if ratio == 0 else min(5.0, max(0.2, 0.9 * ratio ** -0.2))
            h = min(dt, h_try * factor) if (ratio > 1.0 or not last) else h
        rec.add(mark, ps)
    return rec.tensors(), evals


METHODS = ("dopri5", "rk4", "euler")


def ief_flow(
    model: torch.nn.Module,
    inputs,
    targets: torch.Tensor,
    t_end: float,
    dt: float,
    *,
    loss: str = "cross_entropy",
    method: str = "dopri5",
    rtol: float = 1e-8,
    record_every: int = 1,
    error_estimate: bool = True,
) -> FlowResult:
    """Integrate the full-batch, un-damped iEF flow ``d theta/dt = -J^T (J J^T)^{-1} s_iEF`` (``ass:full_batch_iEF``)
    from the model's current parameters to ``t_end`` (float64, on a private copy of the model).

    Each velocity evaluation is one :func:`ief.per_sample` (forward + backward) and one :func:`ief.ief_direction`
    with damping 0 -- the package's own iEF update, nothing re-implemented.

    Integrator. The theorems bound the *continuous* flow, so the discrete trajectory must be closer to it than the
    margins being checked; for the squared error the linear bound is attained with equality (module docstring), so
    there the measured margin *is* the integration error. The flow is stiff where the normalised Gram matrix is
    close to singular (typically at initialisation: the min-norm velocity ``J^+ s`` is then large and turns fast),
    and gentle afterwards, so the default is adaptive: Dormand-Prince 5(4) (``"dopri5"``) with the local error kept
    below ``rtol`` times each step's displacement, steps of at most ``dt``, landing exactly on the recorded times
    ``k * record_every * dt``. Fixed-step classical RK4 (``"rk4"``, global error ``O(dt^4)``) and explicit Euler
    (``"euler"``, ``O(dt)``) are there for comparison: fixed RK4 with ``dt = 0.05`` leaves relative loss errors of
    ~1e-4 to ~1 on the regression problems of this module (made in the stiff first time unit), Euler far more.

    Discretisation error. With ``error_estimate=True`` (default) the flow is integrated a second time, with
    ``dt/2`` (fixed steps) or ``rtol/32`` (dopri5), and ``loss_error`` is the difference of the losses at the
    recorded times: an estimate of how far the reported trajectory is from the continuous flow.

    Args:
        t_end, dt: final time and step (``dopri5``: the largest step and the unit of the recorded times);
            ``t_end / dt`` must be an integer.
        loss: ``"cross_entropy"`` or ``"mse"`` (package convention, ``l_n = 1/2 ||z_n - y_n||^2``).
        method: ``"dopri5"`` (default), ``"rk4"`` or ``"euler"``.
        rtol: dopri5's local error tolerance, relative to the step's displacement.
        record_every: save every this many ``dt`` (the final time is always saved).
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not (dt > 0 and t_end > 0):
        raise ValueError(f"t_end and dt must be positive, got t_end={t_end}, dt={dt}")
    if not rtol > 0:
        raise ValueError(f"rtol must be positive, got {rtol}")
    n_steps = round(t_end / dt)
    if n_steps < 1 or abs(n_steps * dt - t_end) > 1e-9 * max(1.0, t_end):
        raise ValueError(f"t_end / dt must be a positive integer, got t_end={t_end}, dt={dt}")
    if record_every < 1:
        raise ValueError(f"record_every must be >= 1, got {record_every}")
    work, inputs, targets = private_copy(model, inputs, targets)
    n_params = sum(p.numel() for p in trainable_params(work))
    (times, losses, sq, gmin, gmin_n), evals = _integrate(
        work, inputs, targets, loss, n_steps, dt, method, record_every, rtol
    )
    loss_error = None
    if error_estimate:
        work, _, _ = private_copy(model, inputs, targets)
        if method == "dopri5":
            ref, _ = _integrate(work, inputs, targets, loss, n_steps, dt, method, record_every, rtol / 32)
        else:  # the dt/2 run records at the same times: every 2 * record_every of its steps, and its last one
            ref, _ = _integrate(work, inputs, targets, loss, 2 * n_steps, dt / 2, method, 2 * record_every, rtol)
        if not torch.allclose(ref[0], times, rtol=0, atol=1e-9 * max(1.0, t_end)):
            raise RuntimeError("the reference run recorded at different times")  # pragma: no cover
        loss_error = (losses - ref[1]).abs()
    target_prob = torch.exp(-losses) if _target_prob_available(loss, targets) else None
    return FlowResult(
        times=times, losses=losses, logit_sqnorm=sq, target_prob=target_prob, gram_min_eig=gmin,
        gram_min_eig_normalised=gmin_n, loss_error=loss_error, loss=loss, dt=float(dt), method=method,
        rtol=float(rtol), n_evals=evals, n_params=n_params,
    )


# -------------------------------------------------------------------------------------------------------- lemma
@dataclass
class LemmaResult:
    """``lemma:dln_dt`` measured at one point.

    ``forward_error[k]`` / ``central_error[k]``: ``max_n |D_h l_n + s_n| / s_n`` with ``D_h`` the forward /
    central difference of step ``h = dts[k]`` along the flow velocity ``v = -d_iEF``; ``*_order``: fitted slope of
    ``log error`` against ``log h`` (1 and 2 expected). ``identity_residual``: ``max_n |(J v)_n + s_n| / s_n``, the
    exact directional derivative (the ``h -> 0`` limit); rounding level when the Gram matrix is invertible.
    """

    dts: torch.Tensor
    forward_error: torch.Tensor
    central_error: torch.Tensor
    forward_order: float
    central_order: float
    identity_residual: float
    gram_min_eig: float
    gram_min_eig_normalised: float
    n_samples: int
    n_params: int


def lemma_check(
    model: torch.nn.Module,
    inputs,
    targets: torch.Tensor,
    dts: Sequence[float] = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4),
    *,
    loss: str = "cross_entropy",
) -> LemmaResult:
    """Finite-difference check of ``d l_n/dt = -||grad_{z_n} l_n||^2`` under the un-damped iEF flow.

    At the model's parameters ``theta``, with ``v = -ief_direction(J, s_iEF, 0)``: forward differences
    ``(l_n(theta + h v) - l_n(theta)) / h`` and central differences ``(l_n(theta + h v) - l_n(theta - h v)) / 2h``
    are compared with ``-s_n`` for every ``h`` in ``dts``. The lemma needs an invertible Gram matrix
    (``ass:full_rank_covariance``, so ``N <= P``); with ``N > P`` the minimum-norm solution gives ``J v != -s`` and
    the error stops falling at ``identity_residual``.
    """
    work, inputs, targets = private_copy(model, inputs, targets)
    params = trainable_params(work)
    theta = get_vector(params)
    v, ps = _velocity(work, inputs, targets, loss)
    s = ps.logit_sqnorm.detach().to(torch.float64)
    l0 = ps.losses.detach().to(torch.float64)
    scale = s.clamp_min(1e-300)
    identity = float(((ps.jacobian.detach().to(torch.float64) @ v.to(torch.float64)) + s).abs().div(scale).max())

    def losses_at(vector: torch.Tensor) -> torch.Tensor:
        set_vector(params, vector)
        return per_sample(work, inputs, targets, loss=loss).losses.detach().to(torch.float64)

    h = torch.tensor([float(x) for x in dts], dtype=torch.float64)
    if h.numel() < 2 or bool((h <= 0).any()):
        raise ValueError("dts must hold at least two positive step sizes")
    fwd, cen = [], []
    for step in h.tolist():
        plus, minus = losses_at(theta + step * v), losses_at(theta - step * v)
        fwd.append(float(((plus - l0) / step + s).abs().div(scale).max()))
        cen.append(float(((plus - minus) / (2 * step) + s).abs().div(scale).max()))
    raw, normalised = _gram_min_eigs(ps.jacobian)
    fwd_t, cen_t = torch.tensor(fwd, dtype=torch.float64), torch.tensor(cen, dtype=torch.float64)
    return LemmaResult(
        dts=h, forward_error=fwd_t, central_error=cen_t, forward_order=_fit_order(h, fwd_t),
        central_order=_fit_order(h, cen_t), identity_residual=identity, gram_min_eig=raw,
        gram_min_eig_normalised=normalised, n_samples=int(l0.shape[0]), n_params=len(theta),
    )


# ----------------------------------------------------------------------------------------------------- theorems
@dataclass
class SublinearBound:
    """``theorem:sublinear-convergence`` evaluated on a cross-entropy :class:`FlowResult`.

    ``c0 [N]``: ``C_0 = 1/(1 - p_n(0)) + log(p_n(0) / (1 - p_n(0)))``. ``valid [T, N]``: where the theorem applies,
    ``t > max(-1 - C_0, 0)``. ``bound``, ``margin = p_n(t) - bound`` and ``relative_margin = margin / (1 - bound)``
    (the share of the bound's distance to 1 that the flow beats it by) are ``[T, N]``, NaN where not valid.
    ``tight_margin [T, N]``: the integrated inequality before its relaxation, ``Phi(p_n(t)) - C_0 - t >= 0`` with
    ``Phi(p) = 1/(1-p) + log(p/(1-p))``. ``discretisation_error``: the largest step-doubling estimate of the error in
    ``p_n`` at valid times (``nan`` without an estimate).
    """

    times: torch.Tensor
    target_prob: torch.Tensor
    c0: torch.Tensor
    valid: torch.Tensor
    bound: torch.Tensor
    margin: torch.Tensor
    relative_margin: torch.Tensor
    tight_margin: torch.Tensor
    min_margin: float
    min_relative_margin: float
    min_tight_margin: float
    argmin: tuple[int, float]  # (sample, time) of the smallest margin
    discretisation_error: float

    @property
    def holds(self) -> bool:
        """The bound holds at every valid recorded time, by more than the integrator's error."""
        err = 0.0 if math.isnan(self.discretisation_error) else self.discretisation_error
        return self.min_margin > err and self.min_tight_margin > 0


def sublinear_bound(result: FlowResult) -> SublinearBound:
    """The bound ``p_n(t) > 1 - 2 / (t + C_0 + 1)`` of ``theorem:sublinear-convergence`` along a flow.

    Computed from the losses with ``1 - p = -expm1(-l)`` so that margins stay accurate as ``p_n -> 1``.
    """
    if result.target_prob is None:
        raise ValueError("the sublinear theorem needs a cross-entropy flow with one label per sample")
    t = result.times[:, None]
    q = -torch.expm1(-result.losses)  # 1 - p_n(t)
    log_odds = -result.losses - torch.log(q)  # log(p / (1 - p))
    c0 = 1.0 / q[0] + log_odds[0]
    denom = t + c0[None, :] + 1.0
    valid = (t > torch.clamp(-1.0 - c0, min=0.0)[None, :]) & (denom > 0)
    nan = torch.full_like(q, float("nan"))
    bound = torch.where(valid, 1.0 - 2.0 / denom, nan)
    margin = torch.where(valid, 2.0 / denom - q, nan)  # p - bound = (1 - q) - (1 - 2/denom)
    relative = torch.where(valid, margin * denom / 2.0, nan)
    tight = 1.0 / q + log_odds - c0[None, :] - t
    if not bool(valid.any()):
        raise ValueError("no recorded time lies where the theorem applies (t > max(-1 - C_0, 0)); integrate longer")
    masked = torch.where(valid, margin, torch.full_like(margin, math.inf))
    k = int(masked.argmin())
    row, col = divmod(k, masked.shape[1])
    perr = result.prob_error
    disc = float(torch.where(valid, perr, torch.zeros_like(perr)).max()) if perr is not None else float("nan")
    return SublinearBound(
        times=result.times, target_prob=result.target_prob, c0=c0, valid=valid, bound=bound, margin=margin,
        relative_margin=relative, tight_margin=tight, min_margin=float(masked.min()),
        min_relative_margin=float(torch.where(valid, relative, torch.full_like(relative, math.inf)).min()),
        min_tight_margin=float(tight[1:].min()) if tight.shape[0] > 1 else float("nan"),
        argmin=(col, float(result.times[row])), discretisation_error=disc,
    )


@dataclass
class LinearBound:
    """``theorem:linear-convergence`` evaluated on a :class:`FlowResult`.

    ``gap = l_n(t) - l_n*``, ``bound = exp(-2 m t) (l_n(0) - l_n*)``, ``margin = bound - gap`` and
    ``relative_margin = margin / bound`` are ``[T, N]``. ``tolerance``: twice the largest difference from the flow's
    reference run relative to the bound, ``2 max |l - l_ref| / bound`` (``nan`` without an estimate; twice because
    the reference run's own error is smaller but not zero), i.e. how far below zero ``relative_margin`` may go
    because the flow was discretised. ``attained``:
    ``max |relative_margin|``; for the squared error with ``m = 1`` the bound is an equality, so this is the
    distance to equality.
    """

    times: torch.Tensor
    gap: torch.Tensor
    bound: torch.Tensor
    margin: torch.Tensor
    relative_margin: torch.Tensor
    m: float
    l_star: torch.Tensor
    min_margin: float
    min_relative_margin: float
    tolerance: float
    attained: float

    @property
    def holds(self) -> bool:
        """``relative_margin >= -tolerance`` everywhere (plus a rounding floor of 1e-12)."""
        tol = 0.0 if math.isnan(self.tolerance) else self.tolerance
        return self.min_relative_margin >= -(tol + 1e-12)


def linear_bound(result: FlowResult, m: float = 1.0, l_star: float | torch.Tensor = 0.0) -> LinearBound:
    """The bound ``l_n(t) - l_n* <= exp(-2 m t) (l_n(0) - l_n*)`` of ``theorem:linear-convergence``.

    ``l_n*`` is the minimum of the per-sample objective over the output ``z_n`` (``ass:strong-convex-F``): 0 for the
    squared error ``1/2 ||z_n - y_n||^2``, which the network can reach here because it has ``P >= N`` parameters
    and the Gram matrix stays full rank along the flow (``gram_min_eig`` of the result), so the flow drives every
    ``z_n`` to ``y_n``. ``m = 1`` is the squared error's strong-convexity constant.
    """
    if m <= 0:
        raise ValueError(f"m must be positive, got {m}")
    star = torch.as_tensor(l_star, dtype=torch.float64).expand(result.losses.shape[1])
    gap = result.losses - star[None, :]
    bound = torch.exp(-2.0 * m * result.times)[:, None] * gap[0][None, :]
    margin = bound - gap
    relative = margin / bound.clamp_min(1e-300)
    tol = float("nan")
    if result.loss_error is not None:  # twice the difference: the reference run's own error is not zero
        tol = 2.0 * float((result.loss_error / bound.clamp_min(1e-300)).max())
    return LinearBound(
        times=result.times, gap=gap, bound=bound, margin=margin, relative_margin=relative, m=float(m), l_star=star,
        min_margin=float(margin.min()), min_relative_margin=float(relative.min()), tolerance=tol,
        attained=float(relative.abs().max()),
    )
