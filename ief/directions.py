"""Exact EF / iEF / SF directions in Woodbury form: one ``M x M`` Gram solve instead of a ``P x P`` inverse.

A *direction* ``d`` is the preconditioned gradient; the update is ``theta <- theta - eta * d``.

- iEF (Eq. (8)): ``d = J^T (J J^T + lambda I)^{-1} s_iEF``
- EF (Eq. (5), the Woodbury form of Eq. (4)): ``d = J^T (J J^T + lambda I)^{-1} 1``
- SF (Eq. (49)): ``d = (1/lambda) [g - A^T (A A^T + lambda I)^{-1} A g]`` with ``A`` the sampled Jacobian.

The Gram system is solved in float64: a Cholesky factorisation when ``J J^T + lambda I`` is safely positive
definite, otherwise (duplicate samples, samples with zero gradient, ``lambda = 0``) an eigen-decomposition whose
negligible eigenvalues are dropped, which returns the minimum-norm solution. The result is never NaN or inf for
finite input.

``J`` is an ``[M, P]`` tensor or any :class:`ief.rows.Rows` (e.g. the ``ief.rows.FactoredJacobian`` of
``ief.per_sample(..., form="auto")``); a tensor is wrapped once (:func:`ief.rows.as_rows`), and the solves below use
only the rows' interface (``gram``, ``combine_rows``, ``times``, ``max_abs``), whatever form they are in.

Two layers: :func:`ief_direction`, :func:`ef_direction` and :func:`sf_direction` check their input and call
:func:`ief_solve`, :func:`ef_solve` and :func:`sf_solve`, which take it as checked. A caller that has checked it
already (the optimisers of :mod:`ief.optim` check ``damping`` at the start of a step and take finite rows from
:func:`ief.per_sample`) calls the solves directly, so every value is checked once per step.
"""
from __future__ import annotations

import math

import torch

from .losses import check_damping
from .model_call import all_finite
from .rows import Rows, as_rows


def _checked_rows(jacobian: torch.Tensor | Rows, name: str) -> Rows:
    """``jacobian`` as :class:`~ief.rows.Rows`; ``ValueError`` for one that is not a finite floating ``[M, P]``
    (its ``max|J|``, the one pass that checks a tensor's finiteness, is kept for the solve's scale)."""
    rows = as_rows(jacobian, name)
    if not rows.is_finite():
        raise ValueError(f"{name} contains non-finite values")
    return rows


def _check_vector(v: torch.Tensor, size: int, name: str, what: str) -> None:
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.shape[0] != size:
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"{name} must be a vector of length {size} ({what}), got {shape}")
    if not all_finite(v):
        raise ValueError(f"{name} contains non-finite values")


def unrepresentable(what: str, dtype: torch.dtype) -> str:
    """The message of a direction that overflowed ``dtype`` (also the optimisers' when their one check finds it)."""
    return (f"the {what} direction is not representable in {dtype} (its entries exceed the dtype's range): the "
            "per-sample gradients are too close to zero for this damping; use a larger damping")


def _as_dtype(direction: torch.Tensor, dtype: torch.dtype, what: str, check: bool = True) -> torch.Tensor:
    """``direction`` in ``dtype``; with ``check``, ``FloatingPointError`` (:func:`unrepresentable`) when it is not
    finite there. ``check=False`` leaves that to the caller (no host round-trip here: the optimisers fold it into
    their one finiteness check of the step)."""
    out = direction.to(dtype)
    if check and not all_finite(out):
        raise FloatingPointError(unrepresentable(what, dtype))
    return out


def rounding_floor(dtype: torch.dtype, gram_matrix: torch.Tensor) -> float:
    """The eigenvalue of ``G = J J^T`` below which ``J``'s own rounding in ``dtype`` decides it: ``(10 eps)^2 tr G``
    (``u^2 tr G / 8`` for a 16-bit ``J``).

    A per-sample gradient computed in float32 carries a relative error of a few ``eps`` per entry, i.e.
    ``||dJ||_2 <= ||dJ||_F ~ 10 eps ||J||_F``, so a singular value of ``J`` below that (an eigenvalue of ``G`` below
    ``(10 eps)^2 ||J||_F^2 = (10 eps)^2 tr G``) is rounding, not gradient: e.g. ``Linear(4, 3)`` with 32 samples has
    rank 10 in exact arithmetic (the softmax residuals sum to zero over classes) and 15 in float32, with 5 singular
    values ~``eps ||J||``. A damped solve weights them by ``1 / lambda``: at ``lambda = 1e-8`` the float32 iEF direction
    came out 10x too long, at ``1e-6`` 10 % off (against the same model in float64). :func:`solve_gram` drops them, as
    ``torch.linalg.pinv`` drops singular values below its tolerance. 0 for float64: ``J``'s rounding is then far below
    the float64 Gram's own, which :func:`solve_gram` already handles. The solves take ``J``'s dtype, also for a
    float32 ``J`` of a bfloat16 forward (:mod:`ief.precision` says why).

    A 16-bit ``J`` (bfloat16 parameters) takes ``u^2 tr G / 8`` instead, ``u = eps / 2`` its unit roundoff
    (``1.9e-6 tr`` for bfloat16). Storing ``J`` moves it by ``dJ``, each entry by at most ``u |J_ij|``
    (``||dJ||_2 <= ||dJ||_F <= u ||J||_F``), and the Gram by ``E = J dJ^T + dJ J^T + dJ dJ^T``. The first-order
    terms move a real eigenvalue ``sigma^2`` by at most ``2 sigma ||dJ||_2`` (``||E||_2 <= (2u + u^2) tr G``: a
    ``u``-scaled floor, ``7.8e-3 tr``, is above the ``6e-3 tr`` that dropped real eigenvalues and stalled training,
    :mod:`ief.precision`); on ``G``'s null space they vanish (``J^T v = 0``), so the eigenvalues that rounding creates
    are second order, ``||dJ^T v||^2`` for a unit ``v`` with ``J^T v = 0``. That part of the spectrum is the noise,
    and the floor is ``u^2``-scaled. Its worst case is ``u^2 tr G`` (the previous floor, by Weyl's inequality on the
    singular values): every entry rounded by its full ``u |J_ij|`` in one direction. Round-to-nearest errors are
    spread over ``[-u 2^e, u 2^e]`` (``2^e <= |J_ij| < 2^(e+1)``) and independent between entries, so
    ``E ||dJ^T v||^2 = rho^2 u^2 sum_n v_n^2 ||J_n||^2`` with ``rho^2 = sum 4^e / (3 sum J_ij^2)``, ``1 / (3 m^2)``
    for mantissas ``m in [1, 2)`` (``2 ln 2 / 9 = 0.15`` for logarithmically spread ones, ``1/3`` at most; measured
    on rows of the route matrix's models: 0.09 - 0.45, their norm sits in a few entries); and
    ``sum_n v_n^2 ||J_n||^2 <= tr G / 2``, as ``sum_n v_n J_n = 0`` lets no ``|v_n| ||J_n||`` exceed the sum of the
    others (equality: two proportional rows). The expected spurious eigenvalue is thus at most ``0.077 u^2 tr G`` for
    logarithmic mantissas, and the floor ``u^2 tr G / 8`` is 1.6 times that (``u^2 tr G / 6`` for the worst ones).
    Measured (largest spurious eigenvalue): rows exact in float64 stored in bfloat16, ``0.021 u^2 tr`` for
    ``Linear(4, 3)`` with 32 samples (rank 10 in exact arithmetic), ``0.028`` and ``0.076 u^2 tr`` for a sample of
    digits-mlp and of a tiny Llama added to its batch again as ``1.1`` times its row; ``0.006 u^2 tr`` for two
    bfloat16 MLPs with ``P < M`` (rows computed in bfloat16). A batch of only two proportional rows (half the trace
    on the null direction) crosses the floor in up to 9 % of draws (``0.29 u^2 tr`` at most: rows whose norm sits in
    a few entries, so that their rounding is far from its mean). The floor ``u^2 tr`` dropped real eigenvalues of
    bfloat16 MLPs at ``0.1 - 0.9 u^2 tr`` (a 4-8-3 MLP with 32 samples: its iEF direction 33 % off the float64 solve
    of the same rows at ``lambda = 1e-4 tr``, 0.17 % now). Real eigenvalues below ``u^2 tr / 8`` exist (small MLPs
    from ``0.01 u^2 tr``; minilm-lora in pure bfloat16 at ``0.02 - 0.05 u^2 tr``), as small as the rounding's, and
    are still dropped (minilm-lora's iEF direction 99.7 % off the float64 oracle's at ``lambda = 1e-4 tr``, 13 % at
    ``1e-2 tr``; 52 % and 7 % were they kept): such a problem needs a damping far above ``u^2 tr``, or float32
    parameters.

    Args:
        dtype: the dtype ``J`` is stored in.
        gram_matrix: ``[M, M]`` ``J J^T`` (any common scaling of ``J``).

    Returns:
        The floor, in the Gram matrix's units.
    """
    floor = _rounding_floor(dtype, gram_matrix)
    return floor if isinstance(floor, float) else float(floor)


def _rounding_floor(dtype: torch.dtype, gram_matrix: torch.Tensor) -> float | torch.Tensor:
    """:func:`rounding_floor` without the host round-trip: ``0.0`` (a float) for float64 or an empty Gram, else a
    0-d float64 tensor on the Gram's device."""
    if dtype == torch.float64 or not gram_matrix.numel():
        return 0.0
    if dtype.itemsize < 4:  # J stored in 16 bits: its storage rounding's expected spurious eigenvalues, with margin
        return (torch.finfo(dtype).eps / 2) ** 2 / 8 * gram_matrix.diagonal().sum()
    return (10 * torch.finfo(dtype).eps) ** 2 * gram_matrix.diagonal().sum()


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

    Raises:
        ValueError: a negative or non-finite ``damping``.
    """
    return _solve_gram(gram_matrix, rhs, check_damping(damping), noise_floor)


def _solve_gram(gram_matrix: torch.Tensor, rhs: torch.Tensor, damping: float,
                noise_floor: float | torch.Tensor) -> torch.Tensor:
    """:func:`solve_gram` with ``damping`` already checked; ``noise_floor`` may be a 0-d tensor
    (:func:`_rounding_floor`), which is positive by construction for a narrower ``J`` and sends the solve to ``eigh``
    with no host round-trip (no Cholesky attempt, no pivot read)."""
    # a non-finite Gram (rows whose finiteness the optimiser reads with its step's checks, after the solve) is
    # solved as zero, so that eigh does not fail on it; the caller refuses the step (identity for a finite Gram)
    g = torch.nan_to_num(gram_matrix.to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    b = rhs.to(torch.float64)
    m = g.shape[0]
    # eigenvalues below rounding error of the largest entry are not trusted (the same bound for Cholesky's pivots)
    tiny = m * torch.finfo(torch.float64).eps * (g.diagonal().amax().clamp_min(1e-300) if m else
                                                 torch.tensor(1e-300, dtype=torch.float64, device=g.device))
    if isinstance(noise_floor, float) and noise_floor <= 0.0:
        # Cholesky is trusted only when the smallest pivot is well above rounding error of the largest entry
        eye = torch.eye(m, dtype=torch.float64, device=g.device)
        chol, info = torch.linalg.cholesky_ex(g + damping * eye)
        if int(info) == 0 and float(chol.diagonal().min()) ** 2 > 1e3 * float(tiny):
            column = b.unsqueeze(-1) if b.dim() == 1 else b
            x = torch.cholesky_solve(column, chol)
            return x.squeeze(-1) if b.dim() == 1 else x
    evals, evecs = torch.linalg.eigh(g)
    shifted = evals.clamp_min(0) + damping
    keep = (shifted > tiny * 1e3) & (evals > noise_floor)
    inv = torch.where(keep, 1.0 / torch.where(keep, shifted, torch.ones_like(shifted)), torch.zeros_like(shifted))
    coeff = evecs.T @ b
    coeff = coeff * (inv if b.dim() == 1 else inv.unsqueeze(-1))
    return evecs @ coeff


def _woodbury(rows: Rows, weights: torch.Tensor, damping: float, what: str, check: bool = True) -> torch.Tensor:
    """``J^T (J J^T + lambda I)^{-1} weights`` in the Jacobian's dtype (``check``: see :func:`_as_dtype`).

    Computed on ``J' = J / c`` with ``c = max|J|`` where the Gram matrix would otherwise overflow or underflow
    (``c = 1`` in the ordinary range): ``J^T (J J^T + lambda I)^{-1} w = (1/c) J'^T (J' J'^T + lambda/c^2 I)^{-1} w``.
    """
    c = rows.gram_scale()
    if c == 0.0:
        return torch.zeros(rows.direction_size, dtype=rows.dtype, device=rows.device)
    weights = weights.to(torch.float64)
    scaled_damping = damping / c / c
    if math.isinf(scaled_damping):  # lambda swamps J J^T: (J J^T + lambda I)^{-1} = I / lambda to float64 precision
        return _as_dtype(rows.combine_rows(weights, final=True).div_(damping), rows.dtype, what, check)
    g = rows.gram(c)
    coeff = _solve_gram(g, weights, scaled_damping, _rounding_floor(rows.dtype, g))
    direction = rows.combine_rows(coeff, c, final=True)
    return _as_dtype(direction if c == 1.0 else direction.div_(c), rows.dtype, what, check)


def ief_solve(rows: Rows, logit_sqnorm: torch.Tensor, damping: float, check: bool = True) -> torch.Tensor:
    """:func:`ief_direction` of checked input: finite ``rows``, ``logit_sqnorm`` ``[M]`` finite, ``damping`` from
    :func:`ief.losses.check_damping`.

    Args:
        rows: ``J`` (:func:`ief.rows.as_rows`).
        logit_sqnorm: ``[M]`` ``s_iEF`` (the unnumbered equation after Eq. (8)).
        damping: ``lambda >= 0``.
        check: raise when the direction is not finite in ``rows.dtype`` (default); ``False`` returns it as it is,
            for a caller that checks it itself (the optimisers: one host round-trip for the whole step).

    Returns:
        The iEF direction ``[P]`` in ``rows.dtype`` (Eq. (8)).

    Raises:
        FloatingPointError: (``check``) the direction is not representable in ``rows.dtype``.
    """
    return _woodbury(rows, logit_sqnorm, damping, "iEF", check)


def ef_solve(rows: Rows, damping: float, check: bool = True) -> torch.Tensor:
    """:func:`ef_direction` of checked input: finite ``rows``, ``damping`` from :func:`ief.losses.check_damping`.

    Args:
        rows: ``J`` (:func:`ief.rows.as_rows`).
        damping: ``lambda >= 0``.
        check: as :func:`ief_solve`.

    Returns:
        The EF direction ``[P]`` in ``rows.dtype`` (Eq. (5)).

    Raises:
        FloatingPointError: (``check``) the direction is not representable in ``rows.dtype``.
    """
    ones = torch.ones(rows.shape[0], dtype=torch.float64, device=rows.device)
    return _woodbury(rows, ones, damping, "EF", check)


def sf_solve(rows: Rows, grad: torch.Tensor, damping: float, check: bool = True) -> torch.Tensor:
    """:func:`sf_direction` of checked input (the formula and its rounding are described there): finite ``rows``,
    ``grad`` a finite floating ``[P]``, ``damping`` from :func:`ief.losses.check_damping` with ``allow_zero=False``.

    Args:
        rows: the sampled Jacobian ``A`` (:func:`ief.rows.as_rows`).
        grad: ``[P]`` the batch gradient ``g``.
        damping: ``lambda > 0``.
        check: as :func:`ief_solve`.

    Returns:
        The SF direction ``[P]`` in ``rows.dtype`` (Eq. (49)).

    Raises:
        FloatingPointError: (``check``) the direction is not representable in ``rows.dtype``.
    """
    # With A' = A / c and lambda' = lambda / c^2: (A^T A + lambda I)^{-1} g = (A'^T A' + lambda' I)^{-1} g / c^2.
    a, g = rows, grad.to(torch.float64)
    c = a.gram_scale()
    scaled_damping = damping / c / c if c > 0 else math.inf
    if math.isinf(scaled_damping):  # lambda swamps A^T A (or A = 0): the direction is g / lambda
        return _as_dtype(g / damping, a.dtype, "SF", check)
    ag = a.times(g, c)
    g_a = torch.nan_to_num(a.gram(c), nan=0.0, posinf=0.0, neginf=0.0)  # as _solve_gram: eigh must not fail on it
    evals, evecs = torch.linalg.eigh(g_a)
    m = evals.shape[0]
    tiny = m * torch.finfo(torch.float64).eps * g_a.diagonal().amax().clamp_min(1e-300)
    keep = (evals > 1e3 * tiny) & (evals > _rounding_floor(a.dtype, g_a))
    e = torch.where(keep, evals, torch.ones_like(evals))
    qag = torch.where(keep, evecs.T @ ag, torch.zeros_like(evals))
    in_range = a.combine_rows(evecs @ (qag / (e * (e + scaled_damping))), c)  # A'^T Q diag(1/(e(e+l'))) Q^T A' g
    g_perp = g - a.combine_rows(evecs @ (qag / e), c)
    eps = max(torch.finfo(a.dtype).eps, torch.finfo(grad.dtype).eps)
    # a g_perp within g's rounding is taken as 0 (on the device: no host round-trip)
    g_perp = g_perp * (g_perp.norm() > 10 * eps * g.norm())
    direction = g_perp.div_(damping).add_(in_range.div_(c * c))
    return _as_dtype(direction, a.dtype, "SF", check)


def ief_direction(jacobian: torch.Tensor | Rows, logit_sqnorm: torch.Tensor, damping: float) -> torch.Tensor:
    """iEF direction ``J^T (J J^T + lambda I)^{-1} s_iEF``, ``[P]`` (Eq. (8)).

    The least-squares step that asks each sample's loss to fall by its logit-gradient norm ``||grad_{z_n} l_n||^2``
    (Eq. (8)): ``J d = s_iEF`` to first order when ``lambda = 0``. The ``M x M`` Gram system ``J J^T`` is
    accumulated and solved in float64 (Cholesky, or the minimum-norm eigen-solution when it is singular); cost
    ``O(M^2 P)`` for the Gram matrix and ``O(M^3)`` for the solve, no ``P x P`` matrix.

    Args:
        jacobian: ``[M, P]`` per-sample gradients (row ``n`` = ``grad_theta l_n``), a tensor or any
            :class:`ief.rows.Rows` (``ief.per_sample(..., form="auto").jacobian``).
        logit_sqnorm: ``[M]`` ``||grad_{z_n} l_n||^2`` (the unnumbered equation after the paper's Eq. (8);
            :attr:`PerSample.logit_sqnorm`).
        damping: ``lambda >= 0`` (``0`` gives the minimum-norm solution).

    Returns:
        The direction ``d`` ``[P]`` in the Jacobian's dtype (the update is ``theta <- theta - eta d``).

    Raises:
        ValueError: ``jacobian`` not ``[M, P]`` with ``M >= 1``, ``logit_sqnorm`` not ``[M]``, or a negative or
            non-finite ``damping``, each named with its value.
    """
    rows = _checked_rows(jacobian, "jacobian")
    _check_vector(logit_sqnorm, rows.shape[0], "logit_sqnorm", "one entry per sample")
    return ief_solve(rows, logit_sqnorm, check_damping(damping))


def ef_direction(jacobian: torch.Tensor | Rows, damping: float) -> torch.Tensor:
    """EF direction ``J^T (J J^T + lambda I)^{-1} 1``, ``[P]`` (Eq. (5)).

    The least-squares step that asks every sample's loss for the same reduction (the inversely-scaled projection of
    Sec. 4: its projection on sample ``n``'s gradient is ``1/||grad l_n||``).
    Same float64 Gram solve and cost as :func:`ief_direction`.

    Args:
        jacobian: ``[M, P]`` per-sample gradients, a tensor or any :class:`ief.rows.Rows`.
        damping: ``lambda >= 0``.

    Returns:
        The direction ``d`` ``[P]`` in the Jacobian's dtype.

    Raises:
        ValueError: ``jacobian`` not ``[M, P]`` with ``M >= 1``, or a negative or non-finite ``damping``.
    """
    rows = _checked_rows(jacobian, "jacobian")
    return ef_solve(rows, check_damping(damping))


def sf_direction(sampled_jacobian: torch.Tensor | Rows, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """SF direction ``(A^T A + lambda I)^{-1} g = (1/lambda) [g - A^T (A A^T + lambda I)^{-1} A g]``, ``[P]``.

    Eq. (49); ``damping`` must be > 0. Formed in float64 from the eigen-decomposition ``A A^T = Q diag(e) Q^T``
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
        sampled_jacobian: ``[M, P]`` per-sample gradients at labels sampled from the model (a tensor or any
            :class:`ief.rows.Rows`).
        grad: ``[P]`` the batch gradient ``g``.
        damping: ``lambda > 0``.

    Returns:
        ``[P]`` in ``sampled_jacobian``'s dtype.

    Raises:
        ValueError: bad shapes, non-finite or integer input, or a damping that is not > 0.
        FloatingPointError: the direction is not representable in the Jacobian's dtype.
    """
    rows = _checked_rows(sampled_jacobian, "sampled_jacobian")
    _check_vector(grad, rows.shape[1], "grad", "one entry per parameter")
    if not grad.dtype.is_floating_point:
        raise ValueError(f"grad must be floating point, got {grad.dtype}")
    return sf_solve(rows, grad, check_damping(damping, allow_zero=False))
