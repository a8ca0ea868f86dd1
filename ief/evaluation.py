"""The paper's evaluation framework as a function (``alg:eval``, ``sec:eval_framework``,
``sec:app-imp_eval_framework``).

For every batch: the batch gradient (the SGD direction), the direction of every requested method, and its exact
indicator ``gamma(d) = sqrt(d^T F d) / |d^T grad L|`` (:func:`ief.gamma`: one forward-mode pass, no ``P x P``
matrix). The ratio ``gamma / gamma_SGD`` is the paper's "relative approximation quality w.r.t. SGD" (below 1: better
than SGD). Every record also carries the batch's *gradient-norm imbalance*, ``max_n ||grad l_n|| / min_n ||grad
l_n||`` over the per-sample gradients (the fourth plot of ``fig:sample_gamma``; ``inf`` when a sample has a zero
gradient).

Methods (``METHODS``): ``sgd`` (``grad L``), ``ef`` / ``ief`` / ``sf`` (exact Woodbury directions, ``eqn:EF_lsq``,
``eqn:iEF_lsq``, ``eqn:SF-smw``), ``kfac`` / ``ekfac`` / ``iekfac`` (block-diagonal, :func:`ief.kfac_direction`,
``sec:app-iEF-eNGDopt``) and ``hf``: Hessian-free, ``cg_iterations`` conjugate-gradient steps on ``F x = grad L``
(:func:`ief.hessian_free`), the reference closest to the natural gradient (CG minimises ``gamma`` step by step,
``sec:app-CG-gamma``).

Cost (the evaluation jobs' algebra): with ``logit_space=None`` (default) a model in eval mode whose samples have few
logit entries (a classifier) gets its logit Jacobian ``J_z`` formed once per batch (:mod:`ief.logit_space`, one
per-sample backward per class); the true-label and sampled per-sample gradients, every ``gamma`` and every CG product
are then matrix products with it, and :func:`ief.damping_sweep` can reuse it (:func:`evaluate_batch` returns it). The
three K-FAC kinds share one forward (:func:`ief.kfac.kfac_directions`). Otherwise every quantity takes its own model
pass (one forward-mode pass per ``gamma``, two per CG step). Both routes compute the same numbers.

Damping is in the package's convention (sum loss ``L = sum_n l_n``): one float for every method, or a dict per
method. SF needs ``damping > 0``. Randomness (SF's and KFAC's sampled labels) comes from a generator seeded with
``(seed, batch index)``, so a record is reproducible on its own. The model is used in the mode it is in; with
dropout active every call draws its own masks, so evaluate in ``eval()`` mode unless that is what you study.

Undefined indicators are never recorded: a zero direction (a saturated batch, ``J = 0`` or ``grad L = 0``: ``gamma =
0/0``) or a ``gamma`` that is 0, ``inf`` or NaN (``d^T F d`` or ``d^T grad L`` rounded or underflowed to zero, e.g.
``gamma_SGD`` of a classifier with weights x 1e4) raises :class:`ief.curvature.DegenerateIndicator` naming the batch
and the method (:func:`rate`, :func:`ief.curvature.check_gamma`), here and in :func:`ief.damping_sweep` alike; so every
recorded ``gamma`` is finite and positive and ``ratio = gamma / gamma_SGD`` never divides by an unchecked value.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .curvature import DegenerateIndicator, check_gamma, gamma, gamma_from
from .directions import ef_direction, ief_direction, sf_direction
from .hessian_free import conjugate_gradient, hessian_free
from .jacobian import per_sample, sampled_jacobian
from .kfac import check_linear_only, kfac_directions
from .logit_space import LogitJacobian, logit_route
from .losses import Loss, check_damping
from .model_call import Inputs, check_batch, resolve_params

METHODS = ("sgd", "ef", "ief", "sf", "kfac", "ekfac", "iekfac", "hf")


def imbalance(jacobian: torch.Tensor) -> float:
    """``max_n ||J_n|| / min_n ||J_n||``: the per-sample gradient-norm imbalance of a batch (``fig:sample_gamma``)."""
    norms = jacobian.to(torch.float64).norm(dim=1)
    low, high = float(norms.min()), float(norms.max())
    if low == 0.0:
        return math.inf if high > 0 else 1.0
    return high / low


def _check_methods(methods: Sequence[str]) -> list[str]:
    if isinstance(methods, str):
        methods = [methods]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"unknown method(s) {bad or methods!r}; accepted: {', '.join(METHODS)}")
    return list(dict.fromkeys(methods))


def _dampings(methods: Sequence[str], damping: float | Mapping[str, float]) -> dict[str, float]:
    if isinstance(damping, Mapping):
        missing = [m for m in methods if m not in ("sgd", "hf") and m not in damping]
        if missing:
            raise ValueError(f"damping has no value for method(s) {missing}; give one per method or a single float")
        out = {m: check_damping(damping[m]) for m in methods if m in damping}
    else:
        value = check_damping(damping)
        out = {m: value for m in methods}
    if "sf" in methods and out.get("sf", 0.0) == 0.0:
        raise ValueError("the SF direction (eqn:SF-smw) divides by the damping: give sf a damping > 0")
    return out


def batch_generator(seed: int, index: int) -> torch.Generator:
    """The generator of batch ``index``: SF's and KFAC's label draws, reproducible per record (``alg:eval``).

    Args:
        seed: the evaluation's seed.
        index: the batch's index within the evaluation.

    Returns:
        A CPU ``torch.Generator`` seeded with ``seed * 1_000_003 + index``.
    """
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(index))


def directions(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    methods: Sequence[str],
    damping: float | Mapping[str, float],
    *,
    params: Iterable[torch.nn.Parameter] | None = None,
    loss: str | Loss = "cross_entropy",
    cg_iterations: int = 50,
    generator: torch.Generator | None = None,
    logit_space: bool | LogitJacobian | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """``({method: direction [P]}, imbalance)`` for one batch (one per-sample backward shared by sgd/ef/ief/sf).

    SF and KFAC each start from ``generator``'s state at the call, so they draw the same labels: KFAC is then the
    block-diagonal K-FAC of the very sampled Fisher that SF inverts.

    ``logit_space``: ``None`` (default) forms the batch's logit Jacobian ``J_z`` (:mod:`ief.logit_space`) when the
    model is in eval mode and ``J_z`` is small (a classifier), and then takes the per-sample gradients (true and
    sampled labels) and the CG products from it; ``True`` insists, ``False`` uses one model pass per quantity. Both
    routes compute the same directions.
    """
    dirs, imb, _ = _directions(model, inputs, targets, methods, damping, params=params, loss=loss,
                               cg_iterations=cg_iterations, generator=generator, logit_space=logit_space)
    return dirs, imb


def fresh_generator(generator: torch.Generator | None) -> Callable[[], torch.Generator]:
    """A factory of generators that all start from ``generator``'s state now (seed 0 when ``None``): SF and KFAC
    (and :func:`ief.damping_sweep`) each draw from it, so they see the same labels.

    Args:
        generator: the state to start from; ``None``: a generator seeded with 0.

    Returns:
        A function of no argument returning a new ``torch.Generator`` in that state at each call.
    """
    start = (generator if generator is not None else torch.Generator().manual_seed(0)).get_state()

    def fresh() -> torch.Generator:
        g = torch.Generator()
        g.set_state(start)
        return g

    return fresh


def batch_rows(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    loss: str | Loss,
    logit_space: bool | LogitJacobian | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LogitJacobian | None]:
    """``(J [M, P], s_iEF [M], grad L [P], J_z or None)`` of one batch, by the route :func:`directions` takes: from
    the batch's logit Jacobian (``logit_space``, :func:`ief.logit_space.logit_route`) or one per-sample backward.
    ``J`` and ``grad L`` in the parameters' dtype. Shared with :func:`ief.damping_sweep`."""
    lj = logit_route(model, inputs, targets, params, loss, logit_space)
    if lj is not None:
        jac64 = lj.per_sample_gradients(targets)
        return jac64.to(lj.dtype), lj.logit_sqnorm(targets), jac64.sum(0).to(lj.dtype), lj
    ps = per_sample(model, inputs, targets, params, loss=loss)
    return ps.jacobian, ps.logit_sqnorm, ps.gradient, None


def sampled_rows(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    loss: str | Loss,
    lj: LogitJacobian | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """SF's sampled Jacobian ``A [M, P]`` (labels drawn with ``generator``), from ``J_z`` when given."""
    if lj is not None:
        return lj.per_sample_gradients(lj.sample_targets(generator)).to(lj.dtype)
    return sampled_jacobian(model, inputs, targets, generator, params, loss=loss)


def _directions(model, inputs, targets, methods, damping, *, params, loss, cg_iterations, generator, logit_space):
    methods = _check_methods(methods)
    fresh = fresh_generator(generator)
    lam = _dampings(methods, damping)
    params = resolve_params(model, params)
    for m in methods:
        if m in ("kfac", "ekfac", "iekfac"):
            check_linear_only(model, params, m)  # before any expensive pass
    jacobian, s_ief, gradient, lj = batch_rows(model, inputs, targets, params, loss, logit_space)
    out: dict[str, torch.Tensor] = {}
    block = {m: lam[m] for m in methods if m in ("kfac", "ekfac", "iekfac")}
    block_dirs = kfac_directions(model, inputs, targets, block, params, fresh(), loss=loss) if block else {}
    for m in methods:
        if m == "sgd":
            out[m] = gradient
        elif m == "ef":
            out[m] = ef_direction(jacobian, lam[m])
        elif m == "ief":
            out[m] = ief_direction(jacobian, s_ief, lam[m])
        elif m == "sf":
            out[m] = sf_direction(sampled_rows(model, inputs, targets, params, loss, lj, fresh()), gradient, lam[m])
        elif m in ("kfac", "ekfac", "iekfac"):
            out[m] = block_dirs[m]  # one forward for the three (ief.kfac_directions)
        elif lj is not None:  # hf from J_z: the same CG on the same (exact) Fisher products
            out[m] = conjugate_gradient(lj.fisher_vp, gradient, cg_iterations)
        else:
            out[m] = hessian_free(model, inputs, targets, cg_iterations, params, loss=loss)
    return out, imbalance(jacobian), lj


def rate(
    dirs: Mapping[str, torch.Tensor],
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    loss: str | Loss,
    lj: LogitJacobian | None,
    where: str = "",
) -> dict[str, float]:
    """``{method: gamma}`` of every direction, each checked (:func:`ief.curvature.check_gamma`): the one place the
    evaluation and :func:`ief.damping_sweep` turn directions into indicators.

    With ``lj`` every ``gamma`` is a product with ``J_z``; otherwise one forward-mode pass per direction
    (:func:`ief.gamma`). ``where`` names the batch in the error message.

    Raises:
        DegenerateIndicator: a zero direction (a saturated batch: ``J = 0`` or ``grad L = 0``) or a ``gamma`` that is
            0, ``inf`` or NaN (``d^T F d`` or ``d^T grad L`` rounded to zero), naming ``where`` and the method.
    """
    nonzero = [m for m, d in dirs.items() if bool(d.ne(0).any())]
    values: dict[str, float] = {}
    if nonzero and lj is not None:
        curv, slope = lj.curvature_and_slope(torch.stack([dirs[m] for m in nonzero]))
        values = {m: gamma_from(float(c), float(s)) for m, c, s in zip(nonzero, curv, slope)}
    elif nonzero:
        values = {m: gamma(model, inputs, targets, dirs[m], params, loss=loss) for m in nonzero}
    for m in dirs:  # the first bad one, in the callers' order (sgd first)
        if m not in values:
            raise DegenerateIndicator(
                f"{where or 'batch'}: the {m} direction is zero, so gamma = 0/0 is undefined; the batch is saturated "
                "(every per-sample gradient is zero, or the batch gradient is): evaluate other batches")
        check_gamma(values[m], m, where or "batch")
    return values


def _where(extra: Mapping[str, Any] | None) -> str:
    """The batch's name in error messages, from the identifying keys of a record's ``extra``."""
    keys = [k for k in ("setup", "scale", "stage", "batch") if extra and k in extra]
    return ", ".join(f"{k} {extra[k]}" for k in keys) if keys else "batch"


def evaluate_batch(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    methods: Sequence[str] = METHODS,
    damping: float | Mapping[str, float] = 1e-7,
    *,
    params: Iterable[torch.nn.Parameter] | None = None,
    loss: str | Loss = "cross_entropy",
    cg_iterations: int = 50,
    generator: torch.Generator | None = None,
    logit_space: bool | LogitJacobian | None = None,
    extra: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], LogitJacobian | None]:
    """``alg:eval`` on one batch: ``(records, J_z or None)``; records as :func:`evaluate` (``batch`` not set).

    With the logit-space route (``logit_space``, see :func:`directions`) every ``gamma`` is a product with ``J_z``
    instead of a forward-mode pass; the returned ``J_z`` can be handed on (e.g. to :func:`ief.damping_sweep`).

    Args:
        model: the model, used in the mode it is in.
        inputs: what the model takes (a tensor, a tuple, or a dict of keyword arguments), sample dimension first.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored, or float targets (``loss="mse"``).
        methods: the directions to rate, as :func:`evaluate` (``"sgd"`` is always added: the ratios' reference).
        damping: one ``lambda`` for every method, or ``{method: lambda}``.
        params: the parameters (default: the model's trainable ones).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        cg_iterations: conjugate-gradient iterations of the exact-NGD reference.
        generator: the state SF's and K-FAC's label draws start from (:func:`fresh_generator`).
        logit_space: ``None`` (automatic), ``True``, ``False``, or a ``J_z`` already formed for this batch.
        extra: fields copied into every record (e.g. the checkpoint's step).

    Returns:
        ``(records, J_z)``: one dict per method with its ``gamma`` and the ratios to SGD's, as :func:`evaluate`
        writes them; ``J_z`` the batch's logit Jacobian when the logit-space route was taken, else ``None``.

    Raises:
        ValueError: an unknown method, a bad damping, or what :func:`ief.per_sample` refuses.
        DegenerateIndicator: a direction whose indicator is undefined (e.g. a zero direction).
    """
    methods = _check_methods(methods)
    if "sgd" not in methods:
        methods = ["sgd", *methods]
    lam = _dampings(methods, damping)
    params = resolve_params(model, params)
    dirs, imb, lj = _directions(model, inputs, targets, methods, lam, params=params, loss=loss,
                                cg_iterations=cg_iterations, generator=generator, logit_space=logit_space)
    gammas = rate(dirs, model, inputs, targets, params, loss, lj, _where(extra))
    records = [{**(extra or {}), "method": m, "damping": None if m in ("sgd", "hf") else lam[m],
                "gamma": gammas[m], "ratio": gammas[m] / gammas["sgd"], "imbalance": imb} for m in methods]
    return records, lj


def evaluate(
    model: torch.nn.Module,
    batches: Iterable[tuple[Inputs, torch.Tensor]],
    methods: Sequence[str] = METHODS,
    damping: float | Mapping[str, float] = 1e-7,
    *,
    params: Iterable[torch.nn.Parameter] | None = None,
    loss: str | Loss = "cross_entropy",
    cg_iterations: int = 50,
    seed: int = 0,
    extra: Mapping[str, Any] | None = None,
    logit_space: bool | None = None,
) -> list[dict[str, Any]]:
    """``alg:eval`` over ``batches`` of ``(inputs, targets)``: one tidy record per (batch, method).

    Each record: ``batch`` (its index), ``method``, ``damping`` (``None`` for sgd and hf), ``gamma``, ``ratio``
    (``gamma / gamma_SGD`` of the same batch), ``imbalance`` (the batch's), plus the keys of ``extra`` (e.g. the
    checkpoint's training stage). ``sgd`` is always evaluated (the ratios need it) and recorded. Cost per batch: one
    per-sample backward shared by sgd/ef/ief/sf (plus one for SF's sampled labels), one forward shared by the K-FAC
    kinds, ``cg_iterations`` Fisher products for hf, and one batched forward-mode pass rating every direction.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (the package's conventions, :mod:`ief`); used in the mode it
            is in (``eval()`` unless dropout is what you study).
        batches: an iterable (a list, a generator, a ``DataLoader``) of ``(inputs, targets)`` pairs, each what
            :func:`ief.per_sample` takes: ``inputs`` a tensor, a tuple, or a dict of keyword arguments for
            ``model``; ``targets`` class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored. Batches may differ
            in size.
        methods: a subset of :data:`METHODS` (default: all of them, ``sgd ef ief sf kfac ekfac iekfac hf``).
        damping: ``lambda`` in the package's sum-loss convention, one float for every method or a mapping
            ``{method: lambda}`` with a value for every method but sgd and hf (default ``1e-7``; SF needs ``> 0``).
        params: the parameters (default ``None``: the model's trainable ones; the K-FAC kinds need ``nn.Linear``
            parameters only).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        cg_iterations: hf's conjugate-gradient steps (default ``50``, the paper's).
        seed: seeds SF's and K-FAC's label draws per batch (``(seed, batch index)``; default ``0``).
        extra: keys copied into every record, e.g. ``{"stage": 25}`` (default ``None``).
        logit_space: ``None`` (default) picks the cheaper exact route per batch (the logit Jacobian for a model in
            eval mode with few logits, :mod:`ief.logit_space`); ``True`` / ``False`` force one.

    Returns:
        A list of dicts, one per (batch, method), in batch then method order, with keys ``batch``, ``method``,
        ``damping``, ``gamma``, ``ratio``, ``imbalance`` and those of ``extra``: ready for ``pandas.DataFrame``.

    Raises:
        ValueError: an unknown method (naming the accepted ones), a bad or missing damping, or K-FAC kinds with
            parameters outside an ``nn.Linear`` (before the first batch).
        DegenerateIndicator: a batch whose direction is zero or whose ``gamma`` is 0, ``inf`` or NaN, naming the
            batch index and the method (see the module docstring).
    """
    methods = _check_methods(methods)
    if "sgd" not in methods:
        methods = ["sgd", *methods]
    lam = _dampings(methods, damping)
    params = resolve_params(model, params)
    for m in methods:
        if m in ("kfac", "ekfac", "iekfac"):
            check_linear_only(model, params, m)  # fail before the first batch, not after hours
    records: list[dict[str, Any]] = []
    for b, batch in enumerate(batches):
        inputs, targets = check_batch(batch, b)
        batch_records, _ = evaluate_batch(model, inputs, targets, methods, lam, params=params, loss=loss,
                                          cg_iterations=cg_iterations, generator=batch_generator(seed, b),
                                          logit_space=logit_space, extra={**(extra or {}), "batch": b})
        records += batch_records
    return records
