"""Shared, cached dense references for the curvature tests (test_curvature, test_hessian_free, test_identities).

The dense oracle Fisher of a case is expensive (t5-lora: ~10 s), so it is computed once per session and per case
name; the cases are seeded, so a freshly built case has exactly the same parameters and batch. Everything here is
built from ``oracle`` (brute force), never from the package, except :func:`directions`, which produces the
approximate-NGD directions (gradient, iEF, EF, SF, random) whose quality the indicator ``gamma`` is meant to rank.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

import ief
import oracle
from tiny_models import ALL_CASES, Case


def rtol(name: str) -> float:
    """Relative tolerance: float64 rounding, except T5, whose T5LayerNorm computes its variance in float32."""
    return 1e-6 if name.startswith("t5") else 1e-10


@dataclasses.dataclass(frozen=True)
class Reference:
    fisher: torch.Tensor  # [P, P] (eqn:FIM), explicit sum over samples, positions and classes
    gradient: torch.Tensor  # [P] grad L = sum_n grad l_n
    jacobian: torch.Tensor  # [M, P] per-sample gradients (explicit per-sample loop)
    logit_sqnorm: torch.Tensor  # [M] s_iEF
    pinv: torch.Tensor  # [P, P] F^+ (eigen-decomposition, negligible eigenvalues dropped)
    rank: int
    natural_gradient: torch.Tensor  # [P] F^+ grad L, the minimum-norm NG direction
    gamma_star: float  # min_d gamma(d) = 1 / sqrt(g^T F^+ g)  (eqn:natural_gradient_alt)
    null_basis: torch.Tensor  # [P, P - rank] orthonormal basis of null(F)

    def gamma(self, d: torch.Tensor) -> float:
        """``sqrt(d^T F d) / |d^T g|`` from the dense oracle (sec:eval_framework)."""
        d = d.to(torch.float64)
        return math.sqrt(max(float(d @ self.fisher @ d), 0.0)) / abs(float(d @ self.gradient))


@functools.lru_cache(maxsize=None)
def reference(name: str) -> Reference:
    case = ALL_CASES[name]()
    fisher = oracle.fisher(case.model, case.inputs, case.targets, case.loss)
    _, jac, sq = oracle.per_sample(case.model, case.inputs, case.targets, case.loss)
    jac, sq = jac.detach().to(torch.float64), sq.detach().to(torch.float64)
    grad = jac.sum(0)
    evals, evecs = torch.linalg.eigh(0.5 * (fisher + fisher.T))
    keep = evals > 1e-10 * evals.max()
    pinv = (evecs[:, keep] / evals[keep]) @ evecs[:, keep].T
    ng = pinv @ grad
    return Reference(
        fisher=fisher,
        gradient=grad,
        jacobian=jac,
        logit_sqnorm=sq,
        pinv=pinv,
        rank=int(keep.sum()),
        natural_gradient=ng,
        gamma_star=1.0 / math.sqrt(float(grad @ ng)),
        null_basis=evecs[:, ~keep],
    )


def num_params(case: Case) -> int:
    return sum(p.numel() for p in case.model.parameters() if p.requires_grad)


def model_dtype(case: Case) -> torch.dtype:
    return next(p for p in case.model.parameters() if p.requires_grad).dtype


def directions(case: Case, seed: int = 0) -> dict[str, torch.Tensor]:
    """The update directions compared in sec:eval_exp: SGD (gradient), iEF (eqn:iEF_lsq), EF (eqn:EF_lsq),
    SF (eqn:SF-smw), plus a random direction, all computed with the package at the case's point."""
    gen = torch.Generator().manual_seed(seed)
    ps = ief.per_sample(case.model, case.inputs, case.targets, loss=case.loss)
    sampled = ief.sampled_jacobian(case.model, case.inputs, case.targets, gen, loss=case.loss)
    dtype = model_dtype(case)
    return {
        "grad": ps.gradient.detach(),
        "iEF": ief.ief_direction(ps.jacobian, ps.logit_sqnorm, 0.0),
        "EF": ief.ef_direction(ps.jacobian, 1e-3),
        "SF": ief.sf_direction(sampled, ps.gradient, 1e-3),
        "random": torch.randn(num_params(case), generator=gen, dtype=torch.float64).to(dtype),
    }
