"""EF / iEF / SF indicators for many dampings from one factorisation per Gram and no model pass per damping
(experiment E3, ``sec:exp-damping``, ``fig:damping_gamma_cola-t5-lora``).

Derivation. Let ``J [M, P]`` hold the per-sample gradients, ``A [M, P]`` those for sampled labels (SF), ``g = J^T 1``
the batch gradient (``L = sum_n l_n``). Every direction is a combination of the rows of ``J`` and ``A``:

- EF:  ``d = J^T c``,  ``c = (J J^T + lambda I)^{-1} 1 = Q diag(1/(e + lambda)) Q^T 1``  (``J J^T = Q diag(e) Q^T``)
- iEF: ``d = J^T c``,  ``c = Q diag(1/(e + lambda)) Q^T s_iEF``
- SF:  ``d = (1/lambda) [g - A^T c_A] = J^T (1/lambda) - A^T (c_A / lambda)``,
  ``c_A = Q_A diag(1/(e_A + lambda)) Q_A^T (A J^T) 1``  (``A A^T = Q_A diag(e_A) Q_A^T``)

so one ``eigh`` of each ``M x M`` Gram gives the coefficients for every ``lambda``. For the indicator, write
``B = [J; A]`` (``2M`` rows) and ``d = B^T w``. The logit JVP is ``J_z d = Z w`` with ``Z = J_z B^T``, whose ``2M``
columns are the logit JVPs along the rows of ``B`` (one forward-mode pass each, computed once). With ``H`` the loss's
logit Hessian (``diag(p) - p p^T`` per kept position) and ``r = grad_z L``:

    d^T F d = w^T (Z^T H Z) w,      d^T grad L = w^T (Z^T r),

so after the ``2M`` passes every ``(method, lambda)`` costs ``O(M^2)``: ``gamma = sqrt(w^T C w) / |w^T v|`` with
``C = Z^T H Z`` and ``v = Z^T r`` (``2M x 2M`` and ``2M``). SGD is ``w = [1; 0]``.

Cost against ``K`` separate evaluations (per damping: a per-sample backward, a sampled backward, three directions
and four ``gamma`` passes): one per-sample and one sampled backward plus ``2M`` JVP forwards (``M`` without SF),
whatever ``K``; with the batch's logit Jacobian (``logit_space``, :mod:`ief.logit_space`: one per-sample backward
per class, shared with :func:`ief.evaluation.evaluate_batch`) not even the ``2M`` passes: ``Z = J_z B^T`` is one
matrix product.
Memory: ``Z`` holds ``2M`` logit tensors, ``2M x M x (kept positions) x C`` floats (ignored
positions are dropped): fine for classifiers, large for a big vocabulary (use :func:`ief.evaluate` per damping there).
The curvature is exact up to rounding: tested against ``K`` separate ``ief.gamma`` calls to ~1e-10 in float64.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .curvature import gamma_from, logits_and_jvp
from .directions import gram
from .jacobian import per_sample, sampled_jacobian
from .logit_space import LogitJacobian, logit_route
from .losses import IGNORE_INDEX, Loss, check_damping, get_loss
from .model_call import Inputs, ReplayableForward, param_names, resolve_params, split_vector

SWEEP_METHODS = ("ef", "ief", "sf")


def _kept_positions(logits: torch.Tensor, targets: torch.Tensor, loss: Loss) -> torch.Tensor:
    """Boolean mask over the logits' leading dims of positions that enter the loss."""
    if loss.name == "cross_entropy":
        return targets != IGNORE_INDEX
    return torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)


def _logit_jvps(forward: ReplayableForward, params, names, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[R, kept, C]`` float64: the logit JVP along every row of ``rows [R, P]`` at the kept positions."""
    out = []
    for r in range(rows.shape[0]):
        with torch.no_grad():
            _, jv = logits_and_jvp(forward, params, names, split_vector(rows[r], params))
        out.append(jv.to(torch.float64)[keep])
    return torch.stack(out)


def _eig_coefficients(evals: torch.Tensor, evecs: torch.Tensor, rhs: torch.Tensor, damping: float) -> torch.Tensor:
    """``(G + lambda I)^{-1} rhs`` from ``G = Q diag(e) Q^T`` (minimum-norm where singular, as ``solve_gram``)."""
    m = evals.shape[0]
    scale = float(evals.max()) if m else 0.0
    tiny = m * torch.finfo(torch.float64).eps * max(scale, 1e-300)
    shifted = evals.clamp_min(0) + damping
    keep = shifted > 1e3 * tiny
    inv = torch.where(keep, 1.0 / torch.where(keep, shifted, torch.ones_like(shifted)), torch.zeros_like(shifted))
    return evecs @ (inv * (evecs.T @ rhs))


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
    """``gamma`` and ``gamma / gamma_SGD`` of EF / iEF / SF for every damping, on one batch.

    Returns tidy records ``{"method", "damping", "gamma", "ratio"}`` (plus one ``sgd`` record, ``damping=None``).
    SF needs dampings > 0. Equal to calling :func:`ief.gamma` on each direction (see the module docstring).
    ``logit_space`` (as in :func:`ief.evaluation.directions`; a :class:`~ief.logit_space.LogitJacobian` of this
    batch is reused): ``J``, the sampled ``A`` and ``Z`` come from the batch's logit Jacobian, no pass per row.
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
    names = param_names(model, params)
    lj = logit_route(model, inputs, targets, params, loss_fn, logit_space)
    if lj is not None:
        jac, s_ief = lj.per_sample_gradients(targets).to(lj.dtype), lj.logit_sqnorm(targets)
        rows = [jac]
        if "sf" in methods:
            rows.append(lj.per_sample_gradients(lj.sample_targets(generator)).to(lj.dtype))
        z = lj.logits
        keep = _kept_positions(z, targets, loss_fn)
        Z = lj.jvp(torch.cat(rows))[:, keep]  # [R, kept, C]
    else:
        ps = per_sample(model, inputs, targets, params, loss=loss)
        jac, s_ief = ps.jacobian, ps.logit_sqnorm
        rows = [jac]
        if "sf" in methods:
            rows.append(sampled_jacobian(model, inputs, targets, generator, params, loss=loss))
        forward = ReplayableForward(model, inputs)
        with torch.no_grad():
            logits, _ = logits_and_jvp(forward, params, names, [torch.zeros_like(p) for p in params])
        z = logits.detach().to(torch.float64)
        keep = _kept_positions(z, targets, loss_fn)
        Z = _logit_jvps(forward, params, names, torch.cat(rows), keep)  # [R, kept, C]
    m = jac.shape[0]
    # C = Z^T H Z, v = Z^T r (H and r at the kept positions)
    hz = torch.stack([loss_fn.hessian_vp(z, targets, _scatter(Z[i], keep, z))[keep] for i in range(Z.shape[0])])
    flat_z, flat_hz = Z.reshape(Z.shape[0], -1), hz.reshape(Z.shape[0], -1)
    curv = 0.5 * (flat_z @ flat_hz.T + flat_hz @ flat_z.T)  # [R, R]
    r = loss_fn.logit_grad(z, targets)[keep].reshape(-1)
    slope = flat_z @ r  # [R]

    def gamma_of(w: torch.Tensor) -> float:
        return gamma_from(float(w @ curv @ w), float(w @ slope))

    ones = torch.ones(m, dtype=torch.float64)
    zeros = torch.zeros(m, dtype=torch.float64) if "sf" in methods else torch.zeros(0, dtype=torch.float64)
    gamma_sgd = gamma_of(torch.cat([ones, zeros]))
    records: list[dict[str, Any]] = [{"method": "sgd", "damping": None, "gamma": gamma_sgd, "ratio": 1.0}]
    gram_j = gram(jac)
    e_j, q_j = torch.linalg.eigh(gram_j)
    rhs = {"ef": ones, "ief": s_ief.to(torch.float64)}
    if "sf" in methods:
        a = rows[1].to(torch.float64)
        ag = a @ jac.to(torch.float64).T @ ones  # A g with g = J^T 1
        e_a, q_a = torch.linalg.eigh(gram(rows[1]))
    for lam in lams:
        for method in methods:
            if method == "sf":
                c_a = _eig_coefficients(e_a, q_a, ag, lam)
                w = torch.cat([ones / lam, -c_a / lam])
            else:
                c = _eig_coefficients(e_j, q_j, rhs[method], lam)
                w = torch.cat([c, zeros])
            g_m = gamma_of(w) if bool(w.ne(0).any()) else math.nan
            records.append({"method": method, "damping": lam, "gamma": g_m, "ratio": g_m / gamma_sgd})
    return records


def _scatter(values: torch.Tensor, keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[keep] = values
    return out


__all__ = ["damping_sweep", "SWEEP_METHODS"]
