"""Exact EF / iEF / SF directions in Woodbury form: one ``M x M`` Gram solve instead of a ``P x P`` inverse.

A *direction* ``d`` is the preconditioned gradient; the update is ``theta <- theta - eta * d``.

- iEF (``eqn:iEF_lsq``): ``d = J^T (J J^T + lambda I)^{-1} s_iEF``
- EF (``eqn:EF_lsq``, the Woodbury form of ``eqn:EF_update``): ``d = J^T (J J^T + lambda I)^{-1} 1``
- SF (``eqn:SF-smw``): ``d = (1/lambda) [g - A^T (A A^T + lambda I)^{-1} A g]`` with ``A`` the sampled Jacobian.

The Gram system is solved in float64: a Cholesky factorisation when ``J J^T + lambda I`` is safely positive
definite, otherwise (duplicate samples, samples with zero gradient, ``lambda = 0``) an eigen-decomposition whose
negligible eigenvalues are dropped, which returns the minimum-norm solution. The result is never NaN or inf for
finite input.

Every function here takes ``J`` either as an ``[M, P]`` tensor or as a :class:`FactoredRows` (e.g. the
``ief.jacobian.FactoredJacobian`` of ``ief.per_sample(..., form="auto")``), which provides the Gram matrix ``J J^T``
and the products ``J^T c`` and ``J v`` without an ``[M, P]`` tensor; the Gram solve is the same code for both.
"""
from __future__ import annotations

import math

import torch

from .losses import check_damping
from .model_call import all_finite, column_chunks


class FactoredRows:
    """``J [M, P]`` held in a form other than a tensor; what the Gram solve needs of it (all float64 results).

    ``shape``, ``dtype``, ``device`` as a tensor's; ``gram(scale) [M, M]`` = ``(J/scale)(J/scale)^T``;
    ``combine_rows(coeff, scale) [P]`` = ``(J/scale)^T coeff``; ``times(v, scale) [M]`` = ``(J/scale) v``;
    ``max_abs()``: an upper bound of ``max|J|`` within a factor ``T`` (any positive scale is exact: it only keeps the
    float64 Gram clear of overflow); ``is_finite()``.
    """

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def gram(self, scale: float = 1.0) -> torch.Tensor:
        raise NotImplementedError

    def combine_rows(self, coeff: torch.Tensor, scale: float = 1.0, final: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        raise NotImplementedError

    def max_abs(self) -> float:
        raise NotImplementedError

    def is_finite(self) -> bool:
        raise NotImplementedError


def _check_jacobian(jacobian: torch.Tensor | FactoredRows, name: str = "jacobian") -> None:
    if isinstance(jacobian, FactoredRows):
        if not jacobian.is_finite():
            raise ValueError(f"{name} contains non-finite values")
        return
    if not isinstance(jacobian, torch.Tensor) or jacobian.dim() != 2:
        shape = tuple(jacobian.shape) if isinstance(jacobian, torch.Tensor) else type(jacobian).__name__
        raise ValueError(f"{name} must be a [M, P] tensor, got {shape}")
    if not jacobian.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point, got {jacobian.dtype}")
    if not all_finite(jacobian):
        raise ValueError(f"{name} contains non-finite values")


def _check_vector(v: torch.Tensor, size: int, name: str, what: str) -> None:
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.shape[0] != size:
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"{name} must be a vector of length {size} ({what}), got {shape}")
    if not all_finite(v):
        raise ValueError(f"{name} contains non-finite values")


def _column_chunks(jacobian: torch.Tensor, scale: float = 1.0):
    """Column blocks of ``J / scale`` in float64."""
    for lo, block in column_chunks(jacobian):
        if scale == 1.0:
            yield lo, block.to(torch.float64)
        else:  # a private copy (``to`` returns the caller's tensor itself when it is already float64)
            yield lo, block.to(torch.float64, copy=True).div_(scale)


def max_abs(jacobian: torch.Tensor | FactoredRows) -> float:
    """Largest magnitude in ``J``: the scale that keeps ``J J^T`` clear of float64 overflow and underflow."""
    if isinstance(jacobian, FactoredRows):
        return jacobian.max_abs()
    if not jacobian.numel():
        return 0.0
    extremes = [torch.stack([block.max(), -block.min()]).max() for _, block in column_chunks(jacobian)]
    return float(torch.stack(extremes).max())


def gram_scale(jacobian: torch.Tensor | FactoredRows) -> float:
    """1, or ``max|J|`` when ``J J^T`` would overflow or underflow float64 (entries beyond ~1e+-100)."""
    c = max_abs(jacobian)
    return 1.0 if 1e-100 <= c <= 1e100 else c


def gram(jacobian: torch.Tensor | FactoredRows, scale: float = 1.0) -> torch.Tensor:
    """``(J/scale)(J/scale)^T`` accumulated in float64, ``[M, M]``, without a float64 copy of the whole ``J``."""
    if isinstance(jacobian, FactoredRows):
        return jacobian.gram(scale)
    m = jacobian.shape[0]
    g = torch.zeros(m, m, dtype=torch.float64, device=jacobian.device)
    for _, block in _column_chunks(jacobian, scale):
        g += block @ block.T
    return 0.5 * (g + g.T)


def combine_rows(
    coeff: torch.Tensor, jacobian: torch.Tensor | FactoredRows, scale: float = 1.0, final: bool = False
) -> torch.Tensor:
    """``(J/scale)^T coeff`` accumulated in float64 (solve coefficients can cancel), ``[P]`` float64. ``final``: the
    result is the direction itself (see :class:`FactoredRows`)."""
    if isinstance(jacobian, FactoredRows):
        return jacobian.combine_rows(coeff.to(torch.float64), scale, final)
    coeff = coeff.to(torch.float64)
    out = torch.empty(jacobian.shape[1], dtype=torch.float64, device=jacobian.device)
    for lo, block in _column_chunks(jacobian, scale):
        out[lo : lo + block.shape[1]] = coeff @ block
    return out


def _as_dtype(direction: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    out = direction.to(dtype)
    if not all_finite(out):
        raise FloatingPointError(
            f"the {what} direction is not representable in {dtype} (its entries exceed the dtype's range): the "
            "per-sample gradients are too close to zero for this damping; use a larger damping"
        )
    return out


def solve_gram(gram_matrix: torch.Tensor, rhs: torch.Tensor, damping: float) -> torch.Tensor:
    """``(G + lambda I)^{-1} rhs`` (minimum-norm least-squares solution where singular), float64.

    ``gram_matrix`` is symmetric positive semi-definite ``[M, M]``; ``rhs`` is ``[M]`` or ``[M, K]``.
    """
    damping = check_damping(damping)
    g = gram_matrix.to(torch.float64)
    b = rhs.to(torch.float64)
    m = g.shape[0]
    eye = torch.eye(m, dtype=torch.float64, device=g.device)
    scale = float(g.diagonal().max()) if m else 0.0
    # Cholesky is trusted only when the smallest pivot is well above rounding error of the largest entry.
    tiny = m * torch.finfo(torch.float64).eps * max(scale, 1e-300)
    chol, info = torch.linalg.cholesky_ex(g + damping * eye)
    if int(info) == 0 and float(chol.diagonal().min()) ** 2 > 1e3 * tiny:
        column = b.unsqueeze(-1) if b.dim() == 1 else b
        x = torch.cholesky_solve(column, chol)
        return x.squeeze(-1) if b.dim() == 1 else x
    evals, evecs = torch.linalg.eigh(g)
    shifted = evals.clamp_min(0) + damping
    keep = shifted > max(tiny, 0.0) * 1e3
    inv = torch.where(keep, 1.0 / torch.where(keep, shifted, torch.ones_like(shifted)), torch.zeros_like(shifted))
    coeff = evecs.T @ b
    coeff = coeff * (inv if b.dim() == 1 else inv.unsqueeze(-1))
    return evecs @ coeff


def _woodbury(jacobian: torch.Tensor | FactoredRows, weights: torch.Tensor, damping: float, what: str) -> torch.Tensor:
    """``J^T (J J^T + lambda I)^{-1} weights`` in the Jacobian's dtype.

    Computed on ``J' = J / c`` with ``c = max|J|`` where the Gram matrix would otherwise overflow or underflow
    (``c = 1`` in the ordinary range): ``J^T (J J^T + lambda I)^{-1} w = (1/c) J'^T (J' J'^T + lambda/c^2 I)^{-1} w``.
    """
    c = gram_scale(jacobian)
    if c == 0.0:
        return torch.zeros(jacobian.shape[1], dtype=jacobian.dtype, device=jacobian.device)
    weights = weights.to(torch.float64)
    scaled_damping = damping / c / c
    if math.isinf(scaled_damping):  # lambda swamps J J^T: (J J^T + lambda I)^{-1} = I / lambda to float64 precision
        return _as_dtype(combine_rows(weights, jacobian, final=True).div_(damping), jacobian.dtype, what)
    coeff = solve_gram(gram(jacobian, c), weights, scaled_damping)
    direction = combine_rows(coeff, jacobian, c, final=True)
    return _as_dtype(direction if c == 1.0 else direction.div_(c), jacobian.dtype, what)


def ief_direction(jacobian: torch.Tensor | FactoredRows, logit_sqnorm: torch.Tensor, damping: float) -> torch.Tensor:
    """iEF direction ``J^T (J J^T + lambda I)^{-1} s_iEF``, ``[P]`` (``eqn:iEF_lsq``).

    Args:
        jacobian: ``[M, P]`` per-sample gradients (row ``n`` = ``grad_theta l_n``), a tensor or a :class:`FactoredRows`.
        logit_sqnorm: ``[M]`` ``||grad_{z_n} l_n||^2`` (``eqn:s_ief``).
        damping: ``lambda >= 0``.
    """
    _check_jacobian(jacobian)
    _check_vector(logit_sqnorm, jacobian.shape[0], "logit_sqnorm", "one entry per sample")
    damping = check_damping(damping)
    return _woodbury(jacobian, logit_sqnorm, damping, "iEF")


def ef_direction(jacobian: torch.Tensor | FactoredRows, damping: float) -> torch.Tensor:
    """EF direction ``J^T (J J^T + lambda I)^{-1} 1``, ``[P]`` (``eqn:EF_lsq``)."""
    _check_jacobian(jacobian)
    damping = check_damping(damping)
    ones = torch.ones(jacobian.shape[0], dtype=torch.float64, device=jacobian.device)
    return _woodbury(jacobian, ones, damping, "EF")


def sf_direction(sampled_jacobian: torch.Tensor | FactoredRows, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """SF direction ``(A^T A + lambda I)^{-1} g = (1/lambda) [g - A^T (A A^T + lambda I)^{-1} A g]``, ``[P]``.

    ``eqn:SF-smw``; ``damping`` must be > 0 (the formula divides by it). The bracket is formed in float64.
    """
    _check_jacobian(sampled_jacobian, "sampled_jacobian")
    _check_vector(grad, sampled_jacobian.shape[1], "grad", "one entry per parameter")
    damping = check_damping(damping, allow_zero=False)
    # With A' = A / c: (A^T A + lambda I)^{-1} g = (1/lambda) [g - A'^T (A' A'^T + lambda/c^2 I)^{-1} A' g].
    a, g = sampled_jacobian, grad.to(torch.float64)
    c = gram_scale(a)
    scaled_damping = damping / c / c if c > 0 else math.inf
    direction = g.clone()
    if not math.isinf(scaled_damping):
        if isinstance(a, FactoredRows):
            ag = a.times(g, c)
        else:
            ag = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
            for lo, block in _column_chunks(a, c):
                ag += block @ g[lo : lo + block.shape[1]]
        direction -= combine_rows(solve_gram(gram(a, c), ag, scaled_damping), a, c)
    direction /= damping
    return _as_dtype(direction, sampled_jacobian.dtype, "SF")
