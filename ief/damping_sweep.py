"""EF / iEF / SF indicators for many dampings on one batch (experiment E3, Sec. 7 (E3),
Fig. 3): exactly the numbers of one :func:`ief.evaluate` per damping, for one
per-sample backward and one Gram matrix per batch.

What is shared and what is not. The expensive part of an evaluation is the batch's per-sample gradients ``J [M, P]``
(and SF's sampled ``A``): they do not depend on the damping, so they are formed once (from the batch's logit
Jacobian ``J_z`` when :func:`ief.logit_space.logit_route` takes it, as the evaluation does), and so are the float64
Gram matrices ``J J^T`` and ``A A^T`` (``M x M``, the ``M^2 P`` part of a Woodbury solve). Per ``(method, lambda)``
the direction is then computed by the very functions of :mod:`ief.directions` (Eq. (5), Eq. (8),
Eq. (49): an ``M x M`` solve, the combination ``J^T c`` in float64 parameter space, the cast to the model's
dtype) and rated by :func:`ief.evaluation.rate`, the evaluation's own ``gamma`` (a product with ``J_z``, or one
forward-mode pass). Every record is therefore the value :func:`ief.evaluate` computes at that damping (the tests
check it, and both against a dense float64 oracle, on singular and near-singular Grams and ``lambda = 0``).

Why not the cheaper algebra this module used before. It wrote every direction as ``d = B^T w``,
``B = [J; A]``, formed ``Z = J_z B^T`` once (``2M`` logit JVPs along the *rows* of ``B``) and rated each
``(method, lambda)`` by the quadratic form ``w^T (Z^T H Z) w / |w^T Z^T r|`` in ``O(M^2)``. That is exact in exact
arithmetic but not in floating point whenever ``J J^T`` is singular or ill-conditioned (``P < M``, repeated samples,
samples whose every position is ignored, ``lambda`` near 0): on a null eigenvector ``q`` of the Gram the coefficient
``w`` carries ``q / lambda``, and ``J^T q = 0`` holds only through the cancellation ``sum_n q_n Z_n``, which then
happens in ``Z``'s rounding (each column its own JVP, in the model's dtype: ``6e-8 x 1e10`` in float32) and inside
a ``2M x 2M`` quadratic form whose terms are ``|w|^2 |C| ~ 1e20 |C|`` (float64 too). The curvature came out as
rounding noise: ``gamma = 0`` (clamped negative curvature) or values off by factors of 2 at ``lambda <= 1e-8``
(the cases measured are in ``benchmarks/README.md``, "Measurements behind the library's choices"), the very region E3's
"iEF is insensitive to near-zero damping" is read from. The direct route cancels in float64 in parameter space on the
exact ``J`` (:meth:`ief.rows.Rows.combine_rows`) *before* any JVP, so nothing large is ever subtracted afterwards: it is
exact by construction, and no fast route with a guard is kept.

Cost (E3's grids: 7 dampings at smoke, 13 at cpu and full; ``K`` dampings, ``k`` methods): one per-sample (and one
sampled) backward or the shared ``J_z``, two Gram matrices, then per ``(method, lambda)`` an ``M x M`` solve and one
``J^T c`` (``M P``); all ``k K`` directions are then rated together: one product of them with ``J_z`` on the
logit-space route, or one forward-mode pass each on the per-pass route: ``k K`` passes (39 for the full grid) where
the old algebra took ``2M`` (64 at ``M = 32``, 320 at the paper's ``M = 160``). ``benchmarks/damping_sweep.py``
measures it against ``K`` separate evaluations (its table and the old algebra's time: ``benchmarks/README.md``).

Undefined indicators: a saturated batch (``J = 0`` or ``grad L = 0``) or a ``gamma`` that is 0, ``inf`` or NaN
raises :class:`ief.curvature.DegenerateIndicator` naming the method, exactly as :func:`ief.evaluate` does
(:func:`ief.curvature.check_gamma`).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .directions import ef_direction, ief_direction, sf_direction
from .evaluation import batch_rows, fresh_generator, rate, sampled_rows
from .logit_space import LogitJacobian
from .losses import Loss, check_damping, get_loss
from .model_call import Inputs, resolve_params
from .rows import Rows, as_rows

SWEEP_METHODS = ("ef", "ief", "sf")


class SharedGram(Rows):
    """Rows whose float64 Gram matrix is computed once per scale and reused by every damping's Woodbury solve;
    everything else (``max|J|``, finiteness, ``J^T c``, ``J v``) is the wrapped rows' own.

    Args:
        rows: ``J`` ``[M, P]``, a tensor (wrapped by :func:`ief.rows.as_rows`) or any :class:`ief.rows.Rows`.

    Raises:
        ValueError: ``rows`` not a floating ``[M, P]`` tensor nor :class:`ief.rows.Rows`.
    """

    def __init__(self, rows: torch.Tensor | Rows):
        self.rows = as_rows(rows)
        self.shape, self.dtype, self.device = self.rows.shape, self.rows.dtype, self.rows.device
        self._grams: dict[float, torch.Tensor] = {}

    def gram(self, scale: float = 1.0) -> torch.Tensor:
        if scale not in self._grams:
            self._grams[scale] = self.rows.gram(scale)
        return self._grams[scale]

    def combine_rows(self, coeff: torch.Tensor, scale: float = 1.0, final: bool = False) -> torch.Tensor:
        return self.rows.combine_rows(coeff, scale, final)

    def times(self, v: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.rows.times(v, scale)

    def max_abs(self) -> float:
        return self.rows.max_abs()

    def is_finite(self) -> bool:
        return self.rows.is_finite()


def damping_sweep(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    dampings: Sequence[float],
    methods: Sequence[str] = SWEEP_METHODS,
    *,
    params: Iterable[torch.nn.Parameter] | None = None,
    loss: str | Loss = "cross_entropy",
    generator: torch.Generator | None = None,
    logit_space: bool | LogitJacobian | None = None,
) -> list[dict[str, Any]]:
    """``gamma`` and ``gamma / gamma_SGD`` of EF / iEF / SF for every damping, on one batch (Sec. 7 (E3)).

    Every value equals :func:`ief.evaluate` of the same batch at that damping (same route, same sampled labels for
    the same ``generator``): see the module docstring for how the work is shared and why no faster algebra is used.

    Args:
        model: returns logits, as :func:`ief.evaluate`.
        inputs: one batch's inputs (a tensor, a tuple, or a dict of keyword arguments for ``model``).
        targets: its targets, class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored.
        params: the parameters (default ``None``: the model's trainable ones).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        dampings: ``lambda`` values in the package's sum-loss convention; ``0`` allowed unless SF is swept
            (Eq. (49) divides by it).
        methods: a subset of ``("ef", "ief", "sf")`` (default: all three).
        generator: SF's label draws (its state at the call, as :func:`ief.evaluation.directions`; default ``None``:
            the global RNG).
        logit_space: as in :func:`ief.evaluation.directions`; a :class:`~ief.logit_space.LogitJacobian` of this
            batch (e.g. from :func:`ief.evaluation.evaluate_batch`) is reused.

    Returns:
        Tidy records ``{"method", "damping", "gamma", "ratio"}``: first ``sgd`` (``damping=None``, ratio 1), then one
        per damping and method, in the given orders. Every ``gamma`` is finite and positive.

    Raises:
        ValueError: an unknown method, no dampings, or a damping that is not a finite number >= 0 (> 0 with SF).
        DegenerateIndicator: a saturated batch (zero gradient or zero direction) or a ``gamma`` that is 0, ``inf``
            or NaN, naming the method and damping (:func:`ief.curvature.check_gamma`).
    """
    methods = list(dict.fromkeys([methods] if isinstance(methods, str) else methods))
    bad = [m for m in methods if m not in SWEEP_METHODS]
    if bad or not methods:
        raise ValueError(f"unknown sweep method(s) {bad or methods!r}; accepted: {', '.join(SWEEP_METHODS)}")
    lams = [check_damping(x, allow_zero="sf" not in methods) for x in dampings]
    if not lams:
        raise ValueError("dampings is empty: give at least one damping")
    loss_fn = get_loss(loss)
    params = resolve_params(model, params)
    fresh = fresh_generator(generator)
    jacobian, s_ief, gradient, lj = batch_rows(model, inputs, targets, params, loss_fn, logit_space)
    jac = SharedGram(jacobian)
    sampled = SharedGram(sampled_rows(model, inputs, targets, params, loss_fn, lj, fresh())) \
        if "sf" in methods else None

    # every direction first, then one rating of them all (on the logit-space route one product with J_z for all)
    dirs = {"sgd": gradient}
    for lam in lams:
        for method in methods:
            label = f"{method} at lambda = {lam!r}"
            if method == "ef":
                dirs[label] = ef_direction(jac, lam)
            elif method == "ief":
                dirs[label] = ief_direction(jac, s_ief, lam)
            else:
                dirs[label] = sf_direction(sampled, gradient, lam)
    gammas = rate(dirs, model, inputs, targets, params, loss_fn, lj, "damping sweep")
    records: list[dict[str, Any]] = [{"method": "sgd", "damping": None, "gamma": gammas["sgd"], "ratio": 1.0}]
    for lam in lams:
        for method in methods:
            g = gammas[f"{method} at lambda = {lam!r}"]
            records.append({"method": method, "damping": lam, "gamma": g, "ratio": g / gammas["sgd"]})
    return records


__all__ = ["damping_sweep", "SWEEP_METHODS"]
