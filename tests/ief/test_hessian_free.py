"""``ief.hessian_free``: linear CG on ``F x = grad L`` (eqn:HF, alg:CG) against the dense float64 oracle.

sec:app-CG-gamma: every CG step is an exact line search on ``gamma(x)^2`` (eqn:alpha-min), so the indicator of the
iterates never increases, and CG from ``x_0 = 0`` approaches the natural gradient ``F^+ grad L``, the minimiser of
``gamma`` (eqn:natural_gradient_alt), whose value ``gamma* = 1/sqrt(g^T F^+ g)`` no direction can beat.
"""
from __future__ import annotations

import math

import pytest
import torch

import ief
from curvature_reference import directions, model_dtype, num_params, reference, rtol
from tiny_models import mlp_case, mse_case


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _hf(case, iterations, **kw):
    return ief.hessian_free(case.model, case.inputs, case.targets, iterations, loss=case.loss, **kw)


def test_gammas_never_increase(any_case):
    """sec:app-CG-gamma: CG is a locally optimal minimiser of gamma^2, so gamma(x_1) >= gamma(x_2) >= ... >= gamma*.
    10 iterations stay within rank(F) for every case. The reported ("free") gammas are checked against the oracle
    gamma of the returned iterates, and the first against the exact line search along the gradient."""
    ref = reference(any_case.name)
    tol = rtol(any_case.name)
    iterations = 10
    assert iterations <= ref.rank
    res = _hf(any_case, iterations, return_gammas=True)
    assert isinstance(res, ief.CGResult)
    assert len(res.gammas) == iterations and len(res.residual_norms) == iterations + 1
    gammas = res.gammas
    assert all(b <= a * (1 + tol) for a, b in zip(gammas, gammas[1:])), gammas
    assert all(gm >= ref.gamma_star * (1 - tol) for gm in gammas)
    assert gammas[-1] < gammas[0]
    g = ref.gradient
    assert gammas[0] == pytest.approx(ref.gamma(g), rel=tol)  # x_1 is a multiple of the gradient
    assert gammas[-1] == pytest.approx(ref.gamma(res.solution), rel=tol)
    assert res.residual_norms[0] == pytest.approx(float(g.norm()), rel=tol)
    # x_1 = (g^T g / g^T F g) g: alpha_0 of alg:CG
    x1 = _hf(any_case, 1)
    assert _rel(x1, float(g @ g) / float(g @ ref.fisher @ g) * g) < tol


def test_every_iterate_gamma_matches_oracle():
    """The m-th reported gamma is the gamma of the m-th iterate (hessian_free with m iterations), for all m."""
    case = mlp_case()
    ref = reference("mlp")
    res = _hf(case, 8, return_gammas=True)
    for m in range(1, 9):
        x_m = _hf(case, m)
        assert res.gammas[m - 1] == pytest.approx(ref.gamma(x_m), rel=1e-10)
        assert res.gammas[m - 1] == pytest.approx(ief.gamma(case.model, case.inputs, case.targets, x_m), rel=1e-10)


def test_methods_agree(any_case):
    """The forward-mode and double-backward Fisher products give the same CG run."""
    a = _hf(any_case, 4, return_gammas=True, method="forward")
    b = _hf(any_case, 4, return_gammas=True, method="double_backward")
    assert _rel(a.solution, b.solution) < 10 * rtol(any_case.name)
    assert a.gammas == pytest.approx(b.gammas, rel=10 * rtol(any_case.name))


@pytest.mark.parametrize("name, make", [("mlp", mlp_case), ("mse-mlp", mse_case)])
def test_converges_to_natural_gradient(name, make):
    """With enough iterations (stopped by the tolerance once the residual is ~1e-10 ||g||), CG from x_0 = 0 reaches
    the minimum-norm natural gradient F^+ grad L (the Krylov space lies in range(F), and grad L is in range(F)), and
    its gamma reaches gamma* = 1/sqrt(g^T F^+ g) (eqn:natural_gradient_alt)."""
    case = make()
    ref = reference(name)
    g = ref.gradient
    assert _rel(ref.fisher @ ref.natural_gradient, g) < 1e-9  # consistent system: g in range(F)
    res = _hf(case, 4 * ref.rank, return_gammas=True, tolerance=1e-10)
    assert res.residual_norms[-1] <= 1e-10 * res.residual_norms[0]
    assert _rel(res.solution, ref.natural_gradient) < 1e-6
    assert res.gammas[-1] == pytest.approx(ref.gamma_star, rel=1e-10)
    assert ief.gamma(case.model, case.inputs, case.targets, res.solution, loss=case.loss) == pytest.approx(
        ref.gamma_star, rel=1e-10)
    assert all(b <= a * (1 + 1e-10) for a, b in zip(res.gammas, res.gammas[1:]))


def test_no_direction_beats_the_natural_gradient(any_case):
    """eqn:natural_gradient_alt: min_d gamma(d) = gamma* = 1/sqrt(g^T F^+ g) (Cauchy-Schwarz in the F-inner product,
    since g lies in range(F)), attained by F^+ g. No tested direction (SGD, iEF, EF, SF, random, CG iterate) is below
    it, and the oracle natural gradient attains it."""
    ref = reference(any_case.name)
    tol = rtol(any_case.name)
    g = ref.gradient
    projected = ref.null_basis.T @ g
    assert float(projected.norm()) <= 100 * tol * float(g.norm())  # g in range(F)
    assert ref.gamma(ref.natural_gradient) == pytest.approx(ref.gamma_star, rel=1e-8)
    candidates = dict(directions(any_case))
    candidates["hessian-free"] = _hf(any_case, 5)
    candidates["natural-gradient"] = ref.natural_gradient.to(model_dtype(any_case))
    for name, d in candidates.items():
        got = ief.gamma(any_case.model, any_case.inputs, any_case.targets, d, loss=any_case.loss)
        assert got >= ref.gamma_star * (1 - 100 * tol), name
        assert ref.gamma(d) >= ref.gamma_star * (1 - 1e-8), name
    # the gradient (SGD) is strictly worse than the natural gradient on these problems
    assert ref.gamma(g) > 1.01 * ref.gamma_star


def test_zero_iterations_returns_zeros():
    case = mlp_case()
    ref = reference("mlp")
    x = _hf(case, 0)
    assert x.shape == (num_params(case),) and x.dtype == torch.float64
    assert torch.count_nonzero(x) == 0
    res = _hf(case, 0, return_gammas=True)
    assert torch.count_nonzero(res.solution) == 0
    assert res.gammas == []
    assert res.residual_norms == [pytest.approx(float(ref.gradient.norm()), rel=1e-12)]


@pytest.mark.parametrize("bad", [-1, 2.5, True, False, None, "3", 3.0])
def test_invalid_iterations(bad):
    case = mlp_case()
    with pytest.raises(ValueError):
        _hf(case, bad)


@pytest.mark.parametrize("bad", [-1e-3, float("nan")])
def test_invalid_tolerance(bad):
    case = mlp_case()
    with pytest.raises(ValueError):
        _hf(case, 3, tolerance=bad)


def test_tolerance_stops_early():
    """tolerance=t stops at the first iterate whose residual is <= t ||grad L||; the run is otherwise unchanged."""
    case = mlp_case()
    tol = 1e-2
    res = _hf(case, 50, return_gammas=True, tolerance=tol)
    r0 = res.residual_norms[0]
    m = len(res.gammas)
    assert len(res.residual_norms) == m + 1 < 51
    assert res.residual_norms[-1] <= tol * r0
    assert all(r > tol * r0 for r in res.residual_norms[:-1])
    full = _hf(case, m, return_gammas=True)
    assert torch.allclose(res.solution, full.solution, rtol=0, atol=0)
    assert res.gammas == full.gammas
    # a tolerance >= 1 stops before the first step
    assert torch.count_nonzero(_hf(case, 5, tolerance=1.0)) == 0


def test_float32_model_follows_dtype():
    case = mlp_case()
    ref = reference("mlp")
    model32 = case.model.float()
    res = ief.hessian_free(model32, case.inputs.float(), case.targets, 6, return_gammas=True)
    assert res.solution.dtype == torch.float32
    full = _hf(mlp_case(), 6, return_gammas=True)
    assert _rel(res.solution, full.solution) < 1e-3
    assert res.gammas[-1] == pytest.approx(ref.gamma(full.solution), rel=1e-4)


# --------------------------------------------------------------------------- iterating past convergence
# mse-mlp: P = 38, rank(F) = 10, ||g|| = 6.19. In exact arithmetic CG reaches F^+ g within rank(F) steps; in floating
# point the residual reaches rounding level (8e-16 after 19 steps) and further iterations would run on noise: search
# directions leak into null(F), where v^T F v is rounding-level but positive, and alpha explodes (an earlier version
# returned ||x|| = 8.8e17 after 60 iterations, with "free" gammas below gamma* and finally 0.0). hessian_free must
# stop at rounding level instead.
ITERATIONS_PAST_CONVERGENCE = 60


def test_iterating_past_convergence_keeps_the_natural_gradient():
    """More CG iterations than needed must not destroy a converged solution: the result stays at F^+ grad L and the
    residual stays tiny."""
    case = mse_case()
    ref = reference("mse-mlp")
    assert ref.rank < ITERATIONS_PAST_CONVERGENCE
    res = _hf(case, ITERATIONS_PAST_CONVERGENCE, return_gammas=True)
    assert res.residual_norms[-1] <= 1e-8 * res.residual_norms[0]
    assert _rel(res.solution, ref.natural_gradient) < 1e-6


def test_reported_gammas_stay_valid_past_convergence():
    """Past convergence the reported gammas remain non-increasing (sec:app-CG-gamma), never fall below gamma*
    (eqn:natural_gradient_alt) and equal the gamma of the returned iterate."""
    case = mse_case()
    ref = reference("mse-mlp")
    res = _hf(case, ITERATIONS_PAST_CONVERGENCE, return_gammas=True)
    gammas = res.gammas
    assert min(gammas) >= ref.gamma_star * (1 - 1e-8), f"min reported gamma {min(gammas)} < gamma* {ref.gamma_star}"
    assert all(b <= a * (1 + 1e-8) for a, b in zip(gammas, gammas[1:]))
    true_last = ief.gamma(case.model, case.inputs, case.targets, res.solution, loss="mse")
    assert gammas[-1] == pytest.approx(true_last, rel=1e-6)
    assert math.isfinite(true_last)
