"""ief.toy against hand-derived closed forms (sec:app-toy-lls-2pt, fig:logistic-regression) and the notebook.

Least squares, data {(0, 0), (1, 0)}: with X = [[1, 0], [1, 1]] (rows [1, x_n]) and residuals r = X theta,
grad L = X^T r, F = X^T X = [[2, 1], [1, 1]], NGD = F^{-1} X^T r = theta (one step with eta = 1 reaches theta* = 0),
iEF = NGD (eqn:lls-F-equal), EF = J^{-1} 1 = X^{-1} [1/r_0, 1/r_1] (eqn:EF_lsq), so kappa_n = 1/||grad l_n||
(eqn:kappa_EF). Logistic regression, x = (0, 2), y = (0, 1), e_n = sigma(z_n) - y_n: grad L = X^T e,
F = X^T diag(sigma(1 - sigma)) X, iEF = 2 X^{-1} e (twice the Gauss-Newton direction, see ief.toy.logistic_problem).
"""
from __future__ import annotations

import math

import pytest
import torch

import ief.toy as toy
from nbrun import run_notebook

X = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
POINTS = [(0.5, 0.3), (-1.2, 0.7), (1.3, -0.4), (-0.2, -1.1)]  # off both dashed lines


def _close(a, b, tol=1e-10):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max())), (a, b)


@pytest.mark.parametrize("theta", POINTS)
def test_lls_gradient_fisher_and_ngd_closed_forms(theta):
    p = toy.lls_problem()
    t = torch.tensor(theta, dtype=torch.float64)
    r = X @ t
    _close(p.loss_at(t), 0.5 * (r**2).sum())
    _close(toy.direction(p, "SGD", t), X.T @ r)
    _close(toy.fisher_matrix(p, t), [[2.0, 1.0], [1.0, 1.0]])
    _close(toy.direction(p, "NGD", t), t)  # theta - theta*
    _close(toy.direction(p, "iEF", t), t)  # iEF = NGD on least squares, to 1e-10
    _close(toy.direction(p, "EF", t), torch.linalg.solve(X, 1 / r))


def test_lls_ngd_and_ief_reach_the_minimum_in_one_plain_step():
    p = toy.lls_problem()
    for method in ("NGD", "iEF"):
        path = toy.trajectory(p, method, (1.2, 1.0), step_size=1.0, steps=1, normalise=False)
        _close(path[-1], [0.0, 0.0], 1e-12)
        assert toy.steps_to_loss(p, method, (1.2, 1.0), 1e-6, 1.0, 5, normalise=False) == 1


def test_ief_equals_ngd_over_a_grid_off_the_dashed_lines():
    p = toy.lls_problem()
    _, _, thetas = toy.grid((-1.4, 1.6), (-1.3, 1.7), 6)  # no grid point on theta_0 = 0 or theta_0 + theta_1 = 0
    assert float(p.per_sample_losses(thetas).min()) > 1e-4
    diff = toy.update_field(p, "NGD", thetas) - toy.update_field(p, "iEF", thetas)
    assert float(diff.abs().max()) < 1e-10


def test_ef_projection_is_inversely_scaled():
    """eqn:kappa_EF: d_EF^T grad l_n / ||grad l_n|| = 1 / ||grad l_n||; ||d_EF|| blows up like sqrt(2)/|theta_0|
    approaching sample 1's optimum theta_0 = 0, while NGD/iEF stay bounded."""
    p = toy.lls_problem()
    deltas = torch.tensor([1.0, 1e-1, 1e-2, 1e-3], dtype=torch.float64)
    probe = torch.stack([deltas, torch.full_like(deltas, 0.75)], dim=1)
    facts = toy.ef_inverse_scaling(p, probe)
    for n in (0, 1):
        _close(facts[f"ef_kappa_{n}"] * facts[f"grad_norm_{n}"], torch.ones(4), 1e-9)
    _close(facts["grad_norm_0"], deltas)
    ratio = facts["ef_norm"] * deltas
    assert abs(float(ratio[-1]) - math.sqrt(2)) < 1e-2 and float(facts["ef_norm"][-1]) > 1e3
    assert float(facts["ngd_norm"].max()) < 1.3
    _close(facts["ief_norm"], facts["ngd_norm"])


def test_ef_damping_only_where_a_per_sample_gradient_is_zero():
    p = toy.lls_problem()
    jac = torch.tensor([[0.0, 0.0], [0.8, 0.8]], dtype=torch.float64)
    assert toy.ef_damping(jac) == pytest.approx(1e-4 * 0.64)
    assert toy.ef_damping(torch.tensor([[1e-8, 0.0], [0.8, 0.8]], dtype=torch.float64)) == 0.0
    # on theta_0 = 0: J = [[0, 0], [r, r]], lambda = 1e-4 r^2, d = r [1, 1] / (2 r^2 + lambda)
    r = 0.8
    expected = torch.tensor([r, r], dtype=torch.float64) / (2 * r**2 + 1e-4 * r**2)
    _close(toy.direction(p, "EF", (0.0, r)), expected, 1e-12)
    # off the lines the undamped closed form holds exactly (checked above), and at theta* the direction is 0
    assert float(toy.direction(p, "EF", (0.0, 0.0)).abs().max()) == 0.0


def test_logistic_closed_forms_and_ngd_differs_from_ief():
    p = toy.logistic_problem()
    xl = torch.tensor([[1.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([0.0, 1.0], dtype=torch.float64)
    for theta in [(0.5, 0.3), (2.0, -1.5), (-2.0, -2.0), (0.0, -2.0)]:
        t = torch.tensor(theta, dtype=torch.float64)
        z = xl @ t
        sig = torch.sigmoid(z)
        e = sig - y
        _close(p.per_sample_losses(t)[0], -(y * torch.log(sig) + (1 - y) * torch.log1p(-sig)))
        _close(toy.direction(p, "SGD", t), xl.T @ e)
        fisher = xl.T @ torch.diag(sig * (1 - sig)) @ xl
        _close(toy.fisher_matrix(p, t), fisher)
        ngd, ief_d = toy.direction(p, "NGD", t), toy.direction(p, "iEF", t)
        _close(ngd, torch.linalg.solve(fisher, xl.T @ e))
        _close(ief_d, 2 * torch.linalg.solve(xl, e))
        _close(toy.direction(p, "EF", t), torch.linalg.solve(xl, 1 / e))
        assert float((ngd - ief_d).norm()) > 0.5 * float(ngd.norm())  # NGD != iEF for logistic regression
    a, b = toy.direction(p, "NGD", (0.0, -2.0)), toy.direction(p, "iEF", (0.0, -2.0))
    assert math.degrees(math.acos(float(a @ b / (a.norm() * b.norm())))) > 20  # not even parallel


@pytest.mark.parametrize("name", ["lls", "logistic"])
@pytest.mark.parametrize("method", ["SGD", "NGD", "iEF"])
def test_trajectories_decrease_the_loss(name, method):
    p = toy.lls_problem() if name == "lls" else toy.logistic_problem()
    start = (1.4, -0.4) if name == "lls" else (2.5, -1.0)
    path = toy.trajectory(p, method, start, step_size=1e-2, steps=150, stop_loss=1e-3)
    steps = (path[1:] - path[:-1]).norm(dim=1)
    _close(steps, torch.full_like(steps, 1e-2), 1e-12)  # every step normalised to 1e-2
    loss = p.loss_at(path)
    assert bool((loss[1:] < loss[:-1]).all())
    assert float(loss[-1]) < (0.5 if name == "lls" else 0.8) * float(loss[0])


def test_ef_trajectory_is_attracted_to_a_dashed_line():
    """fig:visual_tour: from (1.4, -0.4) EF reaches sample 2's optimum theta_0 + theta_1 = 0 and then oscillates
    across it, crawling towards theta*, while NGD is at theta* within the same number of steps."""
    p = toy.lls_problem()
    ef = toy.trajectory(p, "EF", (1.4, -0.4), steps=300)
    r2 = ef[-50:].sum(dim=1)  # sample 2's residual theta_0 + theta_1
    assert float(r2.abs().max()) < 2e-2  # on the line ...
    assert bool((r2 > 0).any() and (r2 < 0).any())  # ... crossing it back and forth
    assert float(p.loss_at(ef[-1])[0]) > 0.3  # far from the minimum
    assert toy.steps_to_loss(p, "NGD", (1.4, -0.4), 1e-3, max_steps=300) is not None


def test_update_field_matches_pointwise_directions():
    p = toy.logistic_problem()
    thetas = torch.tensor(POINTS, dtype=torch.float64)
    for method in toy.METHODS:
        field = toy.update_field(p, method, thetas)
        assert field.shape == (len(POINTS), 2)
        _close(field[2], toy.direction(p, method, thetas[2]), 0.0)
    with pytest.raises(ValueError, match="unknown method"):
        toy.direction(p, "Adam", (0.0, 0.0))


@pytest.mark.slow
def test_notebook_runs_and_saves_every_figure(tmp_path):
    fig_dir = tmp_path / "fig"
    run_notebook("toy_problems.ipynb", tmp_path, scale="smoke", out_dir=str(fig_dir), resolution=7, steps=30)
    for name in ("lls_visual_tour", "logistic_regression"):
        for ext in ("png", "svg"):
            path = fig_dir / f"{name}.{ext}"
            assert path.is_file() and path.stat().st_size > 1000, path
