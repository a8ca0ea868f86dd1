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


def _check_jacobian(jacobian: torch.Tensor | FactoredRows, name: str = "jacobian") -> float | None:
    """``ValueError`` for a ``J`` that is not a finite floating ``[M, P]``; returns ``max|J|`` of a tensor (the one pass
    that checks it, reused as :func:`gram_scale`'s), ``None`` for a :class:`FactoredRows`."""
    if isinstance(jacobian, FactoredRows):
        if not jacobian.is_finite():
            raise ValueError(f"{name} contains non-finite values")
        return None
    if not isinstance(jacobian, torch.Tensor) or jacobian.dim() != 2:
        shape = tuple(jacobian.shape) if isinstance(jacobian, torch.Tensor) else type(jacobian).__name__
        raise ValueError(f"{name} must be a [M, P] tensor, got {shape}")
    if not jacobian.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point, got {jacobian.dtype}")
    magnitude = max_abs(jacobian)
    if not math.isfinite(magnitude):
        raise ValueError(f"{name} contains non-finite values")
    return magnitude


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


def gram_scale(jacobian: torch.Tensor | FactoredRows, magnitude: float | None = None) -> float:
    """1, or ``max|J|`` when ``J J^T`` would overflow or underflow float64 (entries beyond ~1e+-100); ``magnitude``:
    ``max|J|`` when already known."""
    c = max_abs(jacobian) if magnitude is None else magnitude
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


def rounding_floor(dtype: torch.dtype, gram_matrix: torch.Tensor) -> float:
    """The eigenvalue of ``G = J J^T`` below which ``J``'s own rounding in ``dtype`` decides it: ``(10 eps)^2 tr G``.

    A per-sample gradient computed in float32 carries a relative error of a few ``eps`` per entry, i.e.
    ``||dJ||_2 <= ||dJ||_F ~ 10 eps ||J||_F``, so a singular value of ``J`` below that (an eigenvalue of ``G`` below
    ``(10 eps)^2 ||J||_F^2 = (10 eps)^2 tr G``) is rounding, not gradient: e.g. ``Linear(4, 3)`` with 32 samples has
    rank 10 in exact arithmetic (the softmax residuals sum to zero over classes) and 15 in float32, with 5 singular
    values ~``eps ||J||``. A damped solve weights them by ``1 / lambda``: at ``lambda = 1e-8`` the float32 iEF direction
    came out 10x too long, at ``1e-6`` 10 % off (against the same model in float64). :func:`solve_gram` drops them, as
    ``torch.linalg.pinv`` drops singular values below its tolerance. 0 for float64: ``J``'s rounding is then far below
    the float64 Gram's own, which :func:`solve_gram` already handles.

    Args:
        dtype: the dtype ``J`` was computed in.
        gram_matrix: ``[M, M]`` ``J J^T`` (any common scaling of ``J``).

    Returns:
        The floor, in the Gram matrix's units.
    """
    if dtype == torch.float64 or not gram_matrix.numel():
        return 0.0
    return (10 * torch.finfo(dtype).eps) ** 2 * float(gram_matrix.diagonal().sum())


def solve_gram(gram_matrix: torch.Tensor, rhs: torch.Tensor, damping: float, noise_floor: float = 0.0) -> torch.Tensor:
    """``(G + lambda I)^{-1} rhs`` (minimum-norm least-squares solution where singular), float64.

    Args:
        gram_matrix: symmetric positive semi-definite ``[M, M]``.
        rhs: ``[M]`` or ``[M, K]``.
        damping: ``lambda >= 0``.
        noise_floor: eigen-directions of ``G`` with eigenvalue ``<= noise_floor`` are dropped (treated as ``G``'s null
            space), see :func:`rounding_floor`; with a positive floor the solve always goes through ``eigh``.

    Returns:
        ``[M]`` or ``[M, K]`` float64.
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
    if noise_floor <= 0.0 and int(info) == 0 and float(chol.diagonal().min()) ** 2 > 1e3 * tiny:
        column = b.unsqueeze(-1) if b.dim() == 1 else b
        x = torch.cholesky_solve(column, chol)
        return x.squeeze(-1) if b.dim() == 1 else x
    evals, evecs = torch.linalg.eigh(g)
    shifted = evals.clamp_min(0) + damping
    keep = (shifted > max(tiny, 0.0) * 1e3) & (evals > noise_floor)
    inv = torch.where(keep, 1.0 / torch.where(keep, shifted, torch.ones_like(shifted)), torch.zeros_like(shifted))
    coeff = evecs.T @ b
    coeff = coeff * (inv if b.dim() == 1 else inv.unsqueeze(-1))
    return evecs @ coeff


def _woodbury(jacobian: torch.Tensor | FactoredRows, weights: torch.Tensor, damping: float, what: str,
              magnitude: float | None = None) -> torch.Tensor:
    """``J^T (J J^T + lambda I)^{-1} weights`` in the Jacobian's dtype.

    Computed on ``J' = J / c`` with ``c = max|J|`` where the Gram matrix would otherwise overflow or underflow
    (``c = 1`` in the ordinary range): ``J^T (J J^T + lambda I)^{-1} w = (1/c) J'^T (J' J'^T + lambda/c^2 I)^{-1} w``.
    """
    c = gram_scale(jacobian, magnitude)
    if c == 0.0:
        return torch.zeros(jacobian.shape[1], dtype=jacobian.dtype, device=jacobian.device)
    weights = weights.to(torch.float64)
    scaled_damping = damping / c / c
    if math.isinf(scaled_damping):  # lambda swamps J J^T: (J J^T + lambda I)^{-1} = I / lambda to float64 precision
        return _as_dtype(combine_rows(weights, jacobian, final=True).div_(damping), jacobian.dtype, what)
    g = gram(jacobian, c)
    coeff = solve_gram(g, weights, scaled_damping, rounding_floor(jacobian.dtype, g))
    direction = combine_rows(coeff, jacobian, c, final=True)
    return _as_dtype(direction if c == 1.0 else direction.div_(c), jacobian.dtype, what)


def ief_direction(jacobian: torch.Tensor | FactoredRows, logit_sqnorm: torch.Tensor, damping: float) -> torch.Tensor:
    """iEF direction ``J^T (J J^T + lambda I)^{-1} s_iEF``, ``[P]`` (``eqn:iEF_lsq``).

    The least-squares step that asks each sample's loss to fall by its logit-gradient norm ``||grad_{z_n} l_n||^2``
    (``eqn:iEF_lsq``): ``J d = s_iEF`` to first order when ``lambda = 0``. The ``M x M`` Gram system ``J J^T`` is
    accumulated and solved in float64 (Cholesky, or the minimum-norm eigen-solution when it is singular); cost
    ``O(M^2 P)`` for the Gram matrix and ``O(M^3)`` for the solve, no ``P x P`` matrix.

    Args:
        jacobian: ``[M, P]`` per-sample gradients (row ``n`` = ``grad_theta l_n``), a tensor or a :class:`FactoredRows`
            (``ief.per_sample(..., form="auto").jacobian``).
        logit_sqnorm: ``[M]`` ``||grad_{z_n} l_n||^2`` (``eqn:s_ief``; :attr:`PerSample.logit_sqnorm`).
        damping: ``lambda >= 0`` (``0`` gives the minimum-norm solution).

    Returns:
        The direction ``d`` ``[P]`` in the Jacobian's dtype (the update is ``theta <- theta - eta d``).

    Raises:
        ValueError: ``jacobian`` not ``[M, P]`` with ``M >= 1``, ``logit_sqnorm`` not ``[M]``, or a negative or
            non-finite ``damping``, each named with its value.
    """
    magnitude = _check_jacobian(jacobian)
    _check_vector(logit_sqnorm, jacobian.shape[0], "logit_sqnorm", "one entry per sample")
    damping = check_damping(damping)
    return _woodbury(jacobian, logit_sqnorm, damping, "iEF", magnitude)


def ef_direction(jacobian: torch.Tensor | FactoredRows, damping: float) -> torch.Tensor:
    """EF direction ``J^T (J J^T + lambda I)^{-1} 1``, ``[P]`` (``eqn:EF_lsq``).

    The least-squares step that asks every sample's loss for the same reduction (the inversely-scaled projection of
    ``sec:inversely-scaled-projection-issue``: its projection on sample ``n``'s gradient is ``1/||grad l_n||``).
    Same float64 Gram solve and cost as :func:`ief_direction`.

    Args:
        jacobian: ``[M, P]`` per-sample gradients, a tensor or a :class:`FactoredRows`.
        damping: ``lambda >= 0``.

    Returns:
        The direction ``d`` ``[P]`` in the Jacobian's dtype.

    Raises:
        ValueError: ``jacobian`` not ``[M, P]`` with ``M >= 1``, or a negative or non-finite ``damping``.
    """
    magnitude = _check_jacobian(jacobian)
    damping = check_damping(damping)
    ones = torch.ones(jacobian.shape[0], dtype=torch.float64, device=jacobian.device)
    return _woodbury(jacobian, ones, damping, "EF", magnitude)


def sf_direction(sampled_jacobian: torch.Tensor | FactoredRows, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """SF direction ``(A^T A + lambda I)^{-1} g = (1/lambda) [g - A^T (A A^T + lambda I)^{-1} A g]``, ``[P]``.

    ``eqn:SF-smw``; ``damping`` must be > 0. Formed in float64 from the eigen-decomposition ``A A^T = Q diag(e) Q^T``
    without the bracket's cancellation: with ``g_perp = g - A^T Q diag(1/e) Q^T A g`` (``g`` less its part in ``A``'s
    row space),

        ``(A^T A + lambda I)^{-1} g = g_perp / lambda + A^T Q diag(1 / (e (e + lambda))) Q^T A g``,

    which is the bracket divided by ``lambda`` term by term (``1/e - 1/(e + lambda) = lambda / (e (e + lambda))``), so
    nothing of size ``|g|`` is subtracted and then divided by a small ``lambda`` (that lost ``eps / lambda``: 5e-6 at
    ``lambda = 1e-10`` in float64). Eigenvalues at or below the Gram's rounding (:func:`rounding_floor` for a float32
    ``A``) count as ``A``'s null space, and a ``g_perp`` no larger than ``10 eps |g|`` (``eps`` of ``A``'s and ``g``'s
    dtypes) is rounding of ``g`` and taken as 0: divided by ``lambda = 1e-8`` it made float32 SF directions 40x too
    long on a rank-deficient ``A`` (a linear classifier with more samples than parameters).

    Args:
        sampled_jacobian: ``[M, P]`` per-sample gradients at labels sampled from the model (a tensor or a
            :class:`FactoredRows`).
        grad: ``[P]`` the batch gradient ``g``.
        damping: ``lambda > 0``.

    Returns:
        ``[P]`` in ``sampled_jacobian``'s dtype.

    Raises:
        ValueError: bad shapes, non-finite or integer input, or a damping that is not > 0.
        FloatingPointError: the direction is not representable in the Jacobian's dtype.
    """
    magnitude = _check_jacobian(sampled_jacobian, "sampled_jacobian")
    _check_vector(grad, sampled_jacobian.shape[1], "grad", "one entry per parameter")
    if not grad.dtype.is_floating_point:
        raise ValueError(f"grad must be floating point, got {grad.dtype}")
    damping = check_damping(damping, allow_zero=False)
    # With A' = A / c and lambda' = lambda / c^2: (A^T A + lambda I)^{-1} g = (A'^T A' + lambda' I)^{-1} g / c^2.
    a, g = sampled_jacobian, grad.to(torch.float64)
    c = gram_scale(a, magnitude)
    scaled_damping = damping / c / c if c > 0 else math.inf
    if math.isinf(scaled_damping):  # lambda swamps A^T A (or A = 0): the direction is g / lambda
        return _as_dtype(g / damping, sampled_jacobian.dtype, "SF")
    if isinstance(a, FactoredRows):
        ag = a.times(g, c)
    else:
        ag = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
        for lo, block in _column_chunks(a, c):
            ag += block @ g[lo : lo + block.shape[1]]
    g_a = gram(a, c)
    evals, evecs = torch.linalg.eigh(g_a)
    m = evals.shape[0]
    tiny = m * torch.finfo(torch.float64).eps * max(float(g_a.diagonal().max()), 1e-300)
    keep = evals > max(1e3 * tiny, rounding_floor(a.dtype, g_a))
    e = torch.where(keep, evals, torch.ones_like(evals))
    qag = torch.where(keep, evecs.T @ ag, torch.zeros_like(evals))
    in_range = combine_rows(evecs @ (qag / (e * (e + scaled_damping))), a, c)  # A'^T Q diag(1/(e(e+l'))) Q^T A' g
    g_perp = g - combine_rows(evecs @ (qag / e), a, c)
    eps = max(torch.finfo(a.dtype).eps, torch.finfo(grad.dtype).eps)
    if float(g_perp.norm()) <= 10 * eps * float(g.norm()):
        g_perp.zero_()
    direction = g_perp.div_(damping).add_(in_range.div_(c * c))
    return _as_dtype(direction, sampled_jacobian.dtype, "SF")
