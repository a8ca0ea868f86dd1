"""companion.demos.toy against hand-derived closed forms (sec:app-toy-lls-2pt, fig:logistic-regression) and the
notebook.

Least squares, data {(0, 0), (1, 0)}: with X = [[1, 0], [1, 1]] (rows [1, x_n]) and residuals r = X theta,
grad L = X^T r, F = X^T X = [[2, 1], [1, 1]], NGD = F^{-1} X^T r = theta (one step with eta = 1 reaches theta* = 0),
iEF = NGD (eqn:lls-F-equal), EF = J^{-1} 1 = X^{-1} [1/r_0, 1/r_1] (eqn:EF_lsq), so kappa_n = 1/||grad l_n||
(eqn:kappa_EF). Logistic regression, x = (0, 2), y = (0, 1), e_n = sigma(z_n) - y_n: grad L = X^T e,
F = X^T diag(sigma(1 - sigma)) X, iEF = 2 X^{-1} e (twice the Gauss-Newton direction, see
companion.demos.toy.logistic_problem).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

import companion.demos.toy as toy
from companion.chapters import toy_problems as plots
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


@pytest.mark.parametrize("labels", [(1, 0), (0, 1)])
def test_logistic_closed_forms_and_ngd_differs_from_ief(labels):
    p = toy.logistic_problem(labels)
    xl = torch.tensor([[1.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.float64)
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
    point = (0.0, -2.0) if labels == (0, 1) else (0.0, 2.0)  # one point of the picture: labels swap theta -> -theta
    a, b = toy.direction(p, "NGD", point), toy.direction(p, "iEF", point)
    assert math.degrees(math.acos(float(a @ b / (a.norm() * b.norm())))) > 20  # not even parallel


@pytest.mark.parametrize("name", ["lls", "logistic"])
@pytest.mark.parametrize("method", ["SGD", "NGD", "iEF"])
def test_trajectories_decrease_the_loss(name, method):
    p = toy.lls_problem() if name == "lls" else toy.logistic_problem()
    start = (1.4, -0.4) if name == "lls" else (-2.5, 1.0)
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


@pytest.mark.parametrize("name", ["lls", "logistic"])
def test_closed_form_direction_equals_the_package_direction(name):
    """:func:`toy.closed_form_direction` (the trajectories' route) against :func:`toy.direction` (the package's
    autograd and solves), every method, off and on the dashed lines (where it may defer: ``None``), to float64
    rounding: the package's kernels may fuse multiply-adds, and its NGD solves by ``pinv``."""
    p = toy.lls_problem() if name == "lls" else toy.logistic_problem()
    for theta in POINTS + [(0.0, 0.7), (0.4, -0.4), (0.0, 0.0), (2.5, -2.9)]:
        for method in toy.METHODS:
            fast = toy.closed_form_direction(p, method, *theta)
            if fast is not None:
                _close(fast, toy.direction(p, method, theta), 1e-13)
    assert toy.closed_form_direction(p, "EF", *POINTS[0]) is not None


# the starts of the figures' trajectories and two more; on the least squares, EF steps until L < 1e-3 or the cap
_ROUTE_CASES = [("lls", s, 1e-3) for s in (toy.LLS_STARTS[1], toy.LLS_STARTS[2], (0.0, 0.8))] + [
    ("logistic", s, None) for s in (toy.LOGISTIC_STARTS[0], toy.LOGISTIC_STARTS[2], (0.0, 0.0))]


@pytest.mark.parametrize("method", toy.METHODS)
@pytest.mark.parametrize("name, start, stop", _ROUTE_CASES)
@pytest.mark.parametrize("normalise", [True, False])
def test_trajectory_equals_the_stepwise_package_route(name, start, stop, method, normalise):
    """The fast trajectory (closed-form directions and losses in Python floats) against the reference route: the
    package's autograd per-sample gradients, Fisher products and Gram solves at every step, float64. The same number
    of steps and the same points to float64 rounding (1e-12 relative: the two differ in the order of a few
    operations and in NGD's pinv), from starts on and off the dashed lines, normalised and plain steps."""
    p = toy.lls_problem() if name == "lls" else toy.logistic_problem()
    box = (-4.5, 4.5) if name == "lls" else (-3.0, 3.0)
    eta, steps = (1e-2, 400) if normalise else ((0.3 if method == "SGD" else 1e-2 if method == "EF" else 1.0), 60)
    fast = toy.trajectory(p, method, start, eta, steps, normalise, stop_loss=stop, bounds=(box, box))
    slow = toy._trajectory_stepwise(p, method, start, eta, steps, normalise, stop, (box, box))
    assert fast.shape == slow.shape, (fast.shape, slow.shape)
    _close(fast, slow, 1e-12)


def test_closed_form_defers_where_the_package_leaves_its_cholesky_solve():
    """``None`` (use the package) where a per-sample gradient is zero for iEF (a singular Gram, solved by ``eigh``),
    for a model the closed form does not know, and on a Gram the package would rescale (``max|J| < 1e-100``)."""
    lls = toy.lls_problem()
    assert toy.closed_form_direction(lls, "iEF", 0.0, 0.7) is None
    assert toy.closed_form_direction(lls, "EF", 0.0, 0.7) is not None  # damped: Cholesky, as the package
    assert toy.closed_form_direction(lls, "EF", 1e-120, 0.0) is None
    other = toy.ToyProblem("three", toy.TwoParameterModel(), torch.zeros(3, dtype=torch.float64),
                           torch.ones(3, 2, dtype=torch.float64), torch.zeros(3, 1, dtype=torch.float64), "mse", ())
    assert toy.closed_form_direction(other, "SGD", 0.1, 0.2) is None
    path = toy.trajectory(other, "SGD", (0.1, 0.2), 1e-2, 3)  # the stepwise route
    _close(path, toy._trajectory_stepwise(other, "SGD", (0.1, 0.2), 1e-2, 3, True, None, None), 0.0)
    with pytest.raises(ValueError, match="unknown method"):
        toy.closed_form_direction(lls, "Adam", 0.1, 0.2)


@pytest.mark.slow
def test_notebook_runs_and_saves_every_figure(tmp_path):
    fig_dir = tmp_path / "fig"
    run_notebook("toy_problems.ipynb", tmp_path, scale="smoke", out_dir=str(fig_dir), resolution=7, steps=30)
    for name in ("lls_visual_tour", "lls_distance_to_minimum", "logistic_regression"):
        for ext in ("png", "svg"):
            path = fig_dir / f"{name}.{ext}"
            assert path.is_file() and path.stat().st_size > 1000, path


# ------------------------------------------------------------------------- fig:logistic-regression's orientation
def test_logistic_labels_put_the_lowest_loss_in_the_papers_corner():
    """fig:logistic-regression: "the model achieves lower loss when moving further down the bottom-right corner" with
    theta_0 horizontal; the default labels (y_0, y_1) = (1, 0) do that, the opposite labels turn the picture by 180
    degrees (L_{(0,1)}(theta) = L_{(1,0)}(-theta))."""
    paper, turned = toy.logistic_problem(), toy.logistic_problem((0, 1))
    assert paper.targets.tolist() == [1, 0]
    assert plots.lowest_point(paper, (-3.0, 3.0)) == "(3, -3), the bottom-right corner"
    assert plots.lowest_point(turned, (-3.0, 3.0)) == "(-3, 3), the top-left corner"
    _, _, thetas = toy.grid((-3.0, 3.0), (-2.0, 2.5), 9)
    _close(turned.loss_at(thetas), paper.loss_at(-thetas), 1e-12)
    along = torch.tensor([[a, -a] for a in (0.0, 1.0, 2.0, 4.0)], dtype=torch.float64)  # down and to the right
    assert bool((paper.loss_at(along).diff() < 0).all())
    assert plots.lowest_point(toy.lls_problem(), (-1.5, 1.5)) == "(0, 0), inside the box"


@pytest.mark.parametrize("labels", [(2, 0), (1,), (1, 0, 1), (True, False), (-1, 1)])
def test_logistic_rejects_bad_labels(labels):
    with pytest.raises(ValueError, match=r"labels must be two classes in \{0, 1\}.*got"):
        toy.logistic_problem(labels)


@functools.cache
def _logistic_study(resolution=5, steps=1500):
    """The logistic-regression study of the figure tests, computed once per process (the figures only read it; under
    ``--dist loadfile`` the tests of this file share a worker)."""
    return plots.study(toy.logistic_problem(), (-3.0, 3.0), resolution, toy.LOGISTIC_STARTS, 1e-2, steps)


@pytest.mark.slow
def test_logistic_figure_is_in_the_papers_orientation():
    """theta_0 on the horizontal axis, neither axis inverted, and the trajectories of SGD, NGD and iEF (the paper:
    "SGD, NGD and iEF update approaches the optimal decision boundary consistently") leave the box through its
    bottom or right edge, towards the bottom-right corner, with a lower loss than where they started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = _logistic_study()
    fig = plots.logistic_figure(s)
    try:
        panels = [ax for ax in fig.axes if ax.get_title() in toy.METHODS]
        assert [ax.get_title() for ax in panels] == list(toy.METHODS)
        for ax in panels:
            assert (ax.get_xlabel(), ax.get_ylabel()) == (r"$\theta_0$", r"$\theta_1$")
            assert ax.get_xlim() == (-3.0, 3.0) and ax.get_ylim() == (-3.0, 3.0)  # increasing: not inverted
        assert "$y_0=1$" in fig._suptitle.get_text() and "$y_1=0$" in fig._suptitle.get_text()
    finally:
        plt.close(fig)
    for m in ("SGD", "NGD", "iEF"):
        for start, path in zip(s.starts, s.trajectories[m]):
            end = path[-1]
            assert float(end[0]) > 3.0 or float(end[1]) < -3.0, (m, start, end)  # out through the right or bottom
            assert float(end[0]) > start[0] and float(end[1]) < start[1], (m, start, end)
            assert float(s.problem.loss_at(end)[0]) < float(s.problem.loss_at(path[0])[0])


# ------------------------------------------------------------------------------------------------------ colours
def test_same_hue():
    assert plots.same_hue("#d62728", "#e6194b")  # the two reds the book used to draw on each other
    assert plots.same_hue("#ff0000", "#ff1a00") and plots.same_hue((1.0, 0.0, 0.05), "#ff0000")  # across 360 -> 0
    assert not plots.same_hue("#d62728", "#3cb44b")
    assert not plots.same_hue("#d62728", "#8c8c8c") and not plots.same_hue("#000000", "#000000")  # greys: no hue
    assert not any(plots.same_hue(c, "#4363d8") for c in plots.FIELD_COLORS.values())


def _figure_colour_clashes(fig):
    """(panel, field colour, line colour) where a drawn line shares the hue of a vector field on the same panel."""
    from matplotlib.colors import to_hex
    from matplotlib.quiver import Quiver

    clashes = []
    for ax in fig.axes:
        fields = {to_hex(c) for q in ax.collections if isinstance(q, Quiver) for c in q.get_facecolor()}
        lines = {to_hex(line.get_color()) for line in ax.lines}
        clashes += [(ax.get_title(), f, c) for f in fields for c in lines if plots.same_hue(f, c)]
    return clashes, fields


@pytest.mark.slow
def test_no_trajectory_is_drawn_in_the_hue_of_its_field():
    """Red trajectories were once drawn on the red EF field and blue ones on the blue iEF field."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lls = toy.lls_problem()  # the colours do not depend on how far the trajectories run: 40 steps draw every line
    s = plots.study(lls, (-1.5, 1.5), 5, toy.LLS_STARTS, 1e-2, 40, stop_loss=1e-3, box=(-4.5, 4.5))
    for fig in (plots.least_squares_figure(s, plots.ef_zoom(s), 5), plots.logistic_figure(_logistic_study())):
        try:
            clashes, fields = _figure_colour_clashes(fig)
            assert fields, "no vector field found: the check would pass vacuously"
            assert not clashes, clashes
        finally:
            plt.close(fig)


# ---------------------------------------------------------------- fig:visual_tour: does EF reach the minimum?
@pytest.mark.slow
def test_ef_reaches_the_minimum_under_normalised_steps_but_slowly():
    """sec:app-toy-lls-2pt: "the EF training trajectories managed to converge because we normalised every update to
    a small norm of 1e-2". From (0.6, -1.3) EF gets to L < 1e-3 (|theta| < 0.05) in a few thousand steps; NGD in
    ~140; plain (un-normalised) EF steps of 1e-2 do not converge in as many steps: they zigzag and end far from the
    minimum. Not "never below 1e-3": a zigzag iterate may pass through that ball once by chance, and whether one does
    depends on the machine's rounding (on one machine it did at step 441, then jumped to L = 0.34), so the statistic
    is where the run settles, its last 100 iterates."""
    p = toy.lls_problem()
    path = toy.trajectory(p, "EF", (0.6, -1.3), steps=5000, stop_loss=1e-3)  # steps_to_loss's iteration, kept
    below = (p.loss_at(path) < 1e-3).nonzero().flatten().tolist()
    ef = below[0] if below else None  # = steps_to_loss(p, "EF", (0.6, -1.3), 1e-3, max_steps=5000)
    ngd = toy.steps_to_loss(p, "NGD", (0.6, -1.3), 1e-3, max_steps=5000)
    assert ef is not None and ngd is not None and ef > 10 * ngd
    assert ef == len(path) - 1  # the run stopped at its first point below 1e-3, the point of step ef
    assert float(path[ef].norm()) < 0.05
    plain = p.loss_at(toy.trajectory(p, "EF", (0.6, -1.3), steps=ef, normalise=False))
    assert float(plain[-100:].min()) > 100 * 1e-3, plain[-100:]


def _synthetic_study(ends, lengths):
    """A least-squares Study whose EF trajectories are straight lines ending at ``ends`` after ``lengths`` steps (the
    other methods: one step onto theta*)."""
    lls = toy.lls_problem()
    starts = [(1.0, 1.0)] * len(ends)
    line = [torch.stack([torch.linspace(1.0, e[0], n + 1), torch.linspace(1.0, e[1], n + 1)], 1).double()
            for e, n in zip(ends, lengths)]
    onto = [torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)] * len(ends)
    trajectories = {"SGD": onto, "NGD": onto, "iEF": onto, "EF": line}
    return plots.Study(lls, (-1.5, 1.5), torch.zeros(0, 2), {}, trajectories, starts, steps=max(lengths))


def test_reach_summary_states_what_happened():
    stop = 1e-3
    every = _synthetic_study([(0.0, 0.0), (0.01, 0.0)], [40, 7])
    assert plots.reach_summary(every, "EF", stop) == \
        "all 2 EF trajectories reached L < 0.001, after 7 to 40 normalised steps"
    assert plots.reach_summary(every, "NGD", stop) == \
        "all 2 NGD trajectories reached L < 0.001, after 1 normalised steps"
    none = _synthetic_study([(0.5, 0.5), (0.0, 0.9)], [60, 60])
    assert plots.reach_summary(none, "EF", stop) == \
        "none of the 2 EF trajectories reached L < 0.001: they end after 60 steps, at distance 0.71, 0.9 from θ*"
    mixed = _synthetic_study([(0.0, 0.0), (0.0, 0.9), (0.3, 0.0)], [30, 60, 20])  # L = 2.5 (1 - k/30)^2
    assert plots.reach_summary(mixed, "EF", stop) == ("1 of 3 EF trajectories reached L < 0.001, after 30 normalised "
                                                      "steps; the other 2 end at distance 0.9 (after 60 steps), 0.3 "
                                                      "(after 20 steps) from θ*")
    assert plots.reach_verdict(every, "EF", stop) == "holds in this run: every EF trajectory reached L < 0.001"
    assert plots.reach_verdict(mixed, "EF", stop) == ("is not confirmed in this run: 2 of 3 EF trajectories did not "
                                                      "reach L < 0.001 (at most 60 steps)")
    assert plots.steps_to_stop(mixed, "EF", stop) == [30, None, None]
    table = plots.normalised_steps_table(mixed, stop)
    assert table["EF"].tolist() == ["30", "not in 60 (|θ − θ*| = 0.9)", "not in 20 (|θ − θ*| = 0.3)"]
    with pytest.raises(ValueError, match="unknown method 'Adam'"):
        plots.reach_summary(mixed, "Adam", stop)
    with pytest.raises(ValueError, match="no minimum"):
        plots.distances(_logistic_study(steps=3))
