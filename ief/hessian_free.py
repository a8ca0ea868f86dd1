"""Hessian-free: linear conjugate gradients on ``F x = grad L`` with exact Fisher-vector products (Algorithm 5).

Appendix F.2 shows that every CG step is an exact line search on ``gamma(x)^2``, so the indicator of the
iterates never increases. The gammas are free: with ``x_0 = 0`` the residual is ``r_m = b - F x_m``, hence
``x_m^T F x_m = x_m^T (b - r_m)``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .curvature import FisherOperator, gamma_from
from .losses import Loss
from .model_call import Inputs


@dataclass
class CGResult:
    """What :func:`hessian_free` returns with ``return_gammas=True``.

    Attributes:
        solution: the final iterate ``x_m`` ``[P]``, the approximate ``F^{-1} grad L``.
        gammas: ``gamma(x_1) .. gamma(x_m)``, non-increasing (Appendix F.2).
        residual_norms: ``||r_0|| .. ||r_m||``.
    """

    solution: torch.Tensor
    gammas: list[float] = field(default_factory=list)
    residual_norms: list[float] = field(default_factory=list)


def hessian_free(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    iterations: int,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    return_gammas: bool = False,
    tolerance: float = 0.0,
    method: str = "double_backward",
) -> torch.Tensor | CGResult:
    """Approximate natural-gradient direction ``F^{-1} grad L`` after ``iterations`` CG steps from ``x_0 = 0``.

    Algorithm 5. Cost: one :class:`ief.FisherOperator` (a forward and a backward with graph), then one Fisher-vector
    product per iteration (two backward-type passes with the default method). Stops early when the residual norm
    falls to ``tolerance * ||grad L||``, or to rounding level
    (``100 eps ||grad L||`` in the model's dtype: past it CG iterates on noise, which leaks into the null space of
    the only positive semi-definite ``F`` with huge steps), or when the curvature along the search direction is at
    rounding level of the largest curvature seen. Every Fisher product sees the same dropout masks, so the solve
    sees one fixed matrix; with the default ``method="double_backward"`` the forward graph is built once and reused
    by every product (see :class:`ief.curvature.FisherOperator`).

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (the package's conventions, :mod:`ief`).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored, or float targets (``loss="mse"``).
        iterations: the number of CG steps ``m >= 0`` (``0`` returns the zero vector).
        params: the parameters (default ``None``: the model's trainable ones).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        return_gammas: return a :class:`CGResult` with every iterate's ``gamma`` (free: Appendix F.2)
            instead of the direction alone (default ``False``).
        tolerance: stop when ``||r|| <= tolerance * ||grad L||`` (default ``0.0``: only the rounding-level rules).
        method: the Fisher products' route, ``"double_backward"`` (default) or ``"forward"``
            (:class:`ief.FisherOperator`).

    Returns:
        The direction ``x_m`` ``[P]`` in the parameters' dtype, or a :class:`CGResult` with ``return_gammas=True``.

    Raises:
        ValueError: ``iterations`` not an integer ``>= 0``, a negative ``tolerance``, or a bad batch.
        FloatingPointError: as :class:`ief.FisherOperator`.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations must be an integer >= 0, got {iterations!r}")
    if not (tolerance >= 0):
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    fisher = FisherOperator(model, inputs, targets, params, loss=loss, method=method)
    return conjugate_gradient(fisher.matvec, fisher.gradient, iterations, tolerance=tolerance,
                              return_gammas=return_gammas)


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    b: torch.Tensor,
    iterations: int,
    *,
    tolerance: float = 0.0,
    return_gammas: bool = False,
) -> torch.Tensor | CGResult:
    """Algorithm 5 on ``F x = b`` from ``x_0 = 0`` for any product ``matvec(v) = F v`` (``v`` in ``b``'s dtype),
    with the stopping rules of :func:`hessian_free`; float64 recurrences, the solution in ``b``'s dtype. Used by
    :func:`hessian_free` and by the evaluation's logit-space route (:mod:`ief.logit_space`)."""
    b64 = b.to(torch.float64)
    x = torch.zeros_like(b64)
    r = b64.clone()
    v = r.clone()
    rr = float(r @ r)
    result = CGResult(solution=x, residual_norms=[rr**0.5])
    eps = torch.finfo(b.dtype).eps
    stop = max(tolerance, 100 * eps) * rr**0.5
    largest_rayleigh = 0.0
    for _ in range(iterations):
        if rr**0.5 <= stop or rr == 0.0:
            break
        fv = matvec(v.to(b.dtype)).to(torch.float64)
        curvature = float(v @ fv)
        rayleigh = curvature / float(v @ v)
        largest_rayleigh = max(largest_rayleigh, rayleigh)
        if not rayleigh > 100 * eps * largest_rayleigh:
            break
        alpha = rr / curvature
        x.add_(v, alpha=alpha)  # in place: on a small model the [P] float64 updates cost as much as a product
        r.add_(fv, alpha=-alpha)
        rr_next = float(r @ r)
        v.mul_(rr_next / rr).add_(r)
        rr = rr_next
        result.residual_norms.append(rr**0.5)
        if return_gammas:
            slope = float(x @ b64)
            result.gammas.append(gamma_from(slope - float(x @ r), slope))
    result.solution = x.to(b.dtype)
    return result if return_gammas else result.solution
