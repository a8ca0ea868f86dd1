"""companion.demos.theory: the paper's convergence analysis (sec:app-convergence) and the iEF / GN / NGD relations
(sec:app-ief-gn-ngd), measured on small real networks; and notebooks/convergence.ipynb at its smoke scale.

- lemma:dln_dt: finite differences along the un-damped iEF velocity converge to -||grad_z l_n||^2 (order 1 forward,
  order 2 central); not so when N > P (the Gram matrix is singular).
- theorem:sublinear-convergence: p_n(t) > 1 - 2/(t + C_0 + 1) at every recorded time, by far more than the
  integration error (no tolerance).
- theorem:linear-convergence: for the squared error (m = 1) the bound is an equality in continuous time (the PL
  inequality is tight for 1/2 ||z - y||^2), so the measured margin is the integration error: it must stay above
  minus the measured integration-error tolerance, and that tolerance must be small.
- eqn:iEF_mat vs GN vs Fisher: equal (1e-10) where the paper says so, proportional for binary cross-entropy
  through a 2-class softmax, different for a 3-class softmax.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import ief
from companion.demos import theory
from nbrun import run_notebook



@pytest.fixture(scope="module")
def cls():
    return theory.classification_problem(n_samples=7, seed=0)


@pytest.fixture(scope="module")
def reg():
    return theory.regression_problem(n_samples=7, seed=0)


# ------------------------------------------------------------------------------------------------------- lemma
@pytest.mark.parametrize("which", ["cls", "reg"])
def test_lemma_error_falls_with_the_step(which, request):
    pb = request.getfixturevalue(which)
    res = theory.lemma_check(pb.model, pb.inputs, pb.targets, [1e-1, 1e-2, 1e-3, 1e-4], loss=pb.loss)
    assert res.n_samples <= res.n_params
    assert bool((res.forward_error[1:] < res.forward_error[:-1]).all()), res.forward_error
    assert bool((res.central_error[1:] < res.central_error[:-1]).all()), res.central_error
    assert res.forward_order == pytest.approx(1.0, abs=0.1)
    assert res.central_order == pytest.approx(2.0, abs=0.1)
    assert float(res.central_error[-1]) < 1e-5
    assert res.identity_residual < 1e-12  # J v = -s exactly when the Gram matrix is invertible
    assert res.gram_min_eig_normalised > 1e-3


def test_lemma_fails_without_a_full_rank_gram_matrix():
    """With N > P the Gram matrix is singular (ass:full_rank_covariance fails): the minimum-norm iEF velocity gives
    J v != -s, and the finite-difference error stops falling at that residual."""
    over = theory.classification_problem(n_samples=60, seed=0)
    assert over.n_samples > over.n_params
    res = theory.lemma_check(over.model, over.inputs, over.targets, [1e-3, 1e-4, 1e-5])
    assert res.identity_residual > 0.1
    assert float(res.forward_error.min()) > 0.5 * res.identity_residual


# -------------------------------------------------------------------------------------------------------- flow
def test_flow_uses_the_package_direction_and_leaves_the_model_alone(cls):
    """One Euler step of the flow is theta - dt * ief_direction(J, s, 0); the caller's model does not move."""
    before = [p.detach().clone() for p in cls.model.parameters()]
    dt = 0.1
    res = theory.ief_flow(cls.model, cls.inputs, cls.targets, dt, dt, method="euler", error_estimate=False)
    for p, q in zip(cls.model.parameters(), before):
        assert torch.equal(p, q)
    ps = ief.per_sample(cls.model, cls.inputs, cls.targets)
    d = ief.ief_direction(ps.jacobian, ps.logit_sqnorm, 0.0)
    moved = theory.private_copy(cls.model, cls.inputs, cls.targets)[0]
    theory.set_vector(list(moved.parameters()), theory.get_vector(list(moved.parameters())) - dt * d)
    expected = ief.per_sample(moved, cls.inputs, cls.targets).losses
    assert torch.allclose(res.losses[-1], expected, rtol=1e-13, atol=0)
    assert torch.allclose(res.losses[0], ps.losses, rtol=1e-13, atol=0)
    assert res.times.tolist() == [0.0, dt]


def test_fixed_step_rk4_error_is_fourth_order(cls):
    """The step-doubling estimate of fixed-step RK4 falls ~16x when dt halves."""
    coarse = theory.ief_flow(cls.model, cls.inputs, cls.targets, 2.0, 0.2, method="rk4")
    fine = theory.ief_flow(cls.model, cls.inputs, cls.targets, 2.0, 0.1, method="rk4", record_every=2)
    assert torch.allclose(coarse.times, fine.times)
    ratio = float(coarse.loss_error[-1].max() / fine.loss_error[-1].max())
    assert 8 < ratio < 32, ratio


def test_sublinear_bound_holds_at_every_recorded_time(cls):
    res = theory.ief_flow(cls.model, cls.inputs, cls.targets, 20.0, 0.5, rtol=1e-7)
    sub = theory.sublinear_bound(res)
    assert bool(sub.valid[1:].all())  # here C_0 > -1 for every sample, so the bound applies for all t > 0
    assert not bool(sub.valid[0].any())  # the theorem states t > max(-1 - C_0, 0)
    margins = sub.margin[sub.valid]
    assert bool((margins > 0).all())
    assert sub.min_margin == pytest.approx(float(margins.min()))
    assert sub.min_margin > 100 * sub.discretisation_error  # no tolerance needed: the flow beats the bound by far
    assert bool((sub.tight_margin[1:] > 0).all()) and sub.min_tight_margin > 0
    assert sub.holds
    # lemma along the whole flow: every sample's loss falls monotonically
    assert bool((res.losses[1:] < res.losses[:-1]).all())
    # C_0 from its definition
    p0 = res.target_prob[0]
    assert torch.allclose(sub.c0, 1 / (1 - p0) + torch.log(p0 / (1 - p0)), rtol=1e-12)
    assert float(res.gram_min_eig_normalised.min()) > 1e-3  # ass:full_rank_covariance along the flow


def test_linear_bound_is_attained_for_the_squared_error(reg):
    """l_n(t) = e^{-2t} l_n(0) for the continuous flow (PL with equality at m = 1): the margin is zero up to the
    integration error, so it is asserted against the measured tolerance, which itself must be small."""
    res = theory.ief_flow(reg.model, reg.inputs, reg.targets, 2.0, 0.05, loss="mse", rtol=1e-6)
    lin = theory.linear_bound(res, m=1.0)
    assert lin.tolerance < 1e-5
    assert lin.min_relative_margin >= -(lin.tolerance + 1e-12)
    assert lin.holds
    assert lin.attained < 1e-5  # the bound is attained
    assert torch.allclose(lin.bound[-1], math.exp(-4.0) * res.losses[0], rtol=1e-14)
    assert float(res.gram_min_eig_normalised.min()) > 1e-3
    # with slack (m = 1/2) the margin is genuinely positive at every t > 0
    assert float(theory.linear_bound(res, m=0.5).relative_margin[1:].min()) > 0.04


def test_theory_validates_its_arguments(cls):
    with pytest.raises(ValueError, match="integer"):
        theory.ief_flow(cls.model, cls.inputs, cls.targets, 1.0, 0.3)
    with pytest.raises(ValueError, match="method"):
        theory.ief_flow(cls.model, cls.inputs, cls.targets, 1.0, 0.5, method="midpoint")
    mse = theory.ief_flow(*[getattr(theory.regression_problem(n_samples=3), k) for k in ("model", "inputs", "targets")],
                          0.5, 0.5, loss="mse", error_estimate=False)
    with pytest.raises(ValueError, match="cross-entropy"):
        theory.sublinear_bound(mse)
    with pytest.raises(ValueError, match="positive"):
        theory.linear_bound(mse, m=0.0)


# ---------------------------------------------------------------------------------------------- equivalences
def test_ief_gn_fisher_equivalences():
    rows = {(r.setting, r.comparison): r for r in theory.gn_equivalence(n_samples=6, seed=0)}
    assert all(r.as_expected for r in rows.values()), [r for r in rows.values() if not r.as_expected]
    lsq = "scalar output, least squares"
    for comparison in ("iEF vs GN", "iEF vs Fisher", "GN vs Fisher"):
        assert rows[(lsq, comparison)].rel_diff < 1e-10
    binary = "scalar output, binary CE (logits [0, z])"
    assert rows[(binary, "iEF vs GN(z)")].rel_diff == pytest.approx(0.5, abs=1e-10)  # s_n = 2 (dl/dz)^2
    assert rows[(binary, "iEF vs GN(z)")].scale_free_diff < 1e-10
    assert rows[(binary, "iEF with s_n = (dl_n/dz_n)^2 vs GN(z)")].rel_diff < 1e-10
    assert rows[("scalar output, binary CE (logits [-z/2, z/2])", "iEF vs GN of the logits")].rel_diff < 1e-10
    assert rows[(binary, "iEF vs Fisher")].scale_free_diff > 1e-2
    contrast = "3-class softmax (contrast)"
    for comparison in ("iEF vs GN", "iEF vs Fisher", "GN vs Fisher"):
        assert rows[(contrast, comparison)].scale_free_diff > 0.1


# --------------------------------------------------------------------------------------------------- notebook
FIGURES = ("lemma_dln_dt", "sublinear_convergence", "linear_convergence", "gram_min_eigenvalue")


def test_convergence_notebook_smoke(tmp_path):
    fig_dir = tmp_path / "fig"
    run_notebook("convergence.ipynb", tmp_path, scale="smoke", out_dir=str(fig_dir))
    for name in FIGURES:
        for ext in ("png", "svg"):
            path = fig_dir / f"{name}.{ext}"
            assert path.is_file() and path.stat().st_size > 1000, path
    assert (fig_dir / "equivalence.csv").is_file()
    margins = json.loads((fig_dir / "margins.json").read_text())
    assert margins["scale"] == "smoke"
    sub, lin, lemma = margins["sublinear"], margins["linear"], margins["lemma"]
    assert sub["min_margin"] >= 0 and sub["min_relative_margin"] >= 0 and sub["min_tight_margin"] >= 0
    assert sub["min_margin"] > sub["discretisation_error"]
    assert lin["min_relative_margin"] >= -lin["tolerance"] and lin["tolerance"] < 1e-4
    assert sub["holds"] and lin["holds"]
    errors = lemma["forward_error"]
    assert all(b < a for a, b in zip(errors, errors[1:]))
    assert all(e["as_expected"] for e in margins["equivalence"])
    assert min(margins["gram_min_eig_normalised"].values()) > 0


def test_chapter_settings_take_the_scale_and_the_notebook_overrides():
    from companion.chapters.convergence import SETTINGS, chapter_settings

    assert chapter_settings("cpu") == SETTINGS["cpu"]
    cfg = chapter_settings("smoke", t_end=3.0, rtol=1e-9)
    assert cfg["t_end"] == 3.0 and cfg["rtol"] == cfg["rtol_linear"] == 1e-9 and cfg["dt"] == SETTINGS["smoke"]["dt"]
    with pytest.raises(ValueError, match="scale must be one of"):
        chapter_settings("gpu")
