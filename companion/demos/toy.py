"""The paper's two-parameter toy problems (``fig:visual_tour``, ``fig:logistic-regression``); no plotting here.

Both problems are tiny float64 torch models with ``theta = [theta_0, theta_1]`` stored as the weight of one
``nn.Linear(2, 1, bias=False)`` applied to the features ``[1, x_n]``, so ``theta^T [1, x_n] = theta_0 + theta_1 x_n``.
Every update direction is computed by the package itself, exactly as for the large models:

- SGD: ``ief.per_sample(...).gradient`` (``grad_theta L``);
- NGD: ``(F + lambda I)^+ grad L`` with ``F = [F e_0, F e_1]`` from two :class:`ief.FisherOperator` products;
- iEF: ``ief.ief_direction(J, s_iEF, 0)`` (``eqn:iEF_lsq``);
- EF: ``ief.ef_direction(J, lambda_EF)`` (``eqn:EF_lsq``) with the damping rule of ``sec:app-toy-lls-2pt``.

A direction ``d`` is the preconditioned gradient and the update is ``theta <- theta - eta * d``.

The fields are the package's own directions (:func:`direction`). The trajectories take :func:`closed_form_direction`:
the same algorithm in Python floats for these two 2 x 2 problems (the package's route costs ~1 ms a step in autograd
and tensor overhead, and the cpu-scale figures take ~150,000 steps), held to the package's route by the tests to
float64 rounding, and deferring to :func:`direction` wherever the package would leave its Cholesky solve (a zero
per-sample gradient, a Gram outside float64's range).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ief import ef_direction, FisherOperator, get_loss, ief_direction, per_sample

METHODS: tuple[str, ...] = ("SGD", "NGD", "iEF", "EF")
EF_DAMPING_FACTOR = 1e-4  # lambda_EF = 1e-4 * max(diag(F~)) where a per-sample gradient is zero (sec:app-toy-lls-2pt)
DTYPE = torch.float64
# The 5 starting points of the trajectories (the paper does not give its own: "5 initial parameters", black octagons).
LLS_STARTS: tuple[tuple[float, float], ...] = ((1.2, 1.0), (-1.0, 0.6), (0.6, -1.3), (-1.3, -0.8), (1.4, -0.4))
# Logistic regression: away from the bottom-right corner where the loss falls (see logistic_problem).
LOGISTIC_STARTS: tuple[tuple[float, float], ...] = ((-2.5, 1.0), (-1.0, 2.5), (-2.5, -1.5), (1.5, 2.5), (-0.5, -0.5))


class TwoParameterModel(torch.nn.Module):
    """``z_n = theta_0 + theta_1 x_n`` from the features ``[1, x_n]``; with ``binary=True`` the logits are
    ``[0, z_n]``, so that the 2-class softmax is ``[1 - sigma(z_n), sigma(z_n)]``."""

    def __init__(self, binary: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1, bias=False, dtype=DTYPE)
        torch.nn.init.zeros_(self.linear.weight)  # theta = (0, 0) until set_theta
        self.binary = binary

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        z = self.linear(features)  # [M, 1]
        return torch.cat([torch.zeros_like(z), z], dim=-1) if self.binary else z


@dataclass
class ToyProblem:
    """One toy problem: model, data, loss and the dashed lines drawn on its figure.

    ``lines``: ``(a, b, c, label)`` for each dashed line ``a theta_0 + b theta_1 = c``; ``minimum``: ``theta*``
    (``None`` where the loss has no minimiser, as in the logistic regression).
    """

    name: str
    model: TwoParameterModel
    x: torch.Tensor  # [M] raw inputs x_n
    features: torch.Tensor  # [M, 2] rows [1, x_n]
    targets: torch.Tensor
    loss: str
    lines: tuple[tuple[float, float, float, str], ...]
    minimum: tuple[float, float] | None = None  # theta*, where the problem has one

    @property
    def theta(self) -> torch.Tensor:
        """The current ``[theta_0, theta_1]`` (a detached copy)."""
        return self.model.linear.weight.detach()[0].clone()

    def set_theta(self, theta: Sequence[float] | torch.Tensor) -> None:
        with torch.no_grad():
            self.model.linear.weight.copy_(torch.as_tensor(theta, dtype=DTYPE).reshape(1, 2))

    def per_sample_losses(self, thetas: torch.Tensor) -> torch.Tensor:
        """``l_n(theta)`` for many ``theta`` at once, ``[G, 2] -> [G, M]``: the model evaluated with
        ``torch.func.functional_call`` (vmapped over ``theta``) and the package's loss."""
        thetas = torch.as_tensor(thetas, dtype=DTYPE).reshape(-1, 2)
        loss = get_loss(self.loss)

        def one(theta: torch.Tensor) -> torch.Tensor:
            logits = torch.func.functional_call(self.model, {"linear.weight": theta.reshape(1, 2)}, (self.features,))
            return loss.per_sample(logits, self.targets)

        with torch.no_grad():
            return torch.vmap(one)(thetas)

    def loss_at(self, thetas: torch.Tensor) -> torch.Tensor:
        """``L(theta) = sum_n l_n(theta)``, ``[G, 2] -> [G]`` (for contours and stopping rules)."""
        return self.per_sample_losses(thetas).sum(dim=-1)


def lls_problem() -> ToyProblem:
    """The 2-parameter 2-datum linear least squares of ``fig:visual_tour`` (``sec:app-toy-lls-2pt``).

    Data ``{(0, 0), (1, 0)}``, model ``theta_0 + theta_1 x``, ``L = sum_n 1/2 (y_n - f(x_n))^2`` (``loss="mse"``),
    global minimum ``theta* = (0, 0)``. Dashed lines: ``theta_0 = 0`` (sample 1 at its optimum) and
    ``theta_0 + theta_1 = 0`` (sample 2). Here ``F = F~* = G = sum_n [1, x_n][1, x_n]^T`` (``eqn:lls-F-equal``).
    """
    x = torch.tensor([0.0, 1.0], dtype=DTYPE)
    lines = (
        (1.0, 0.0, 0.0, r"sample 1 optimal: $\theta_0=0$"),
        (1.0, 1.0, 0.0, r"sample 2 optimal: $\theta_0+\theta_1=0$"),
    )
    return ToyProblem("lls", TwoParameterModel(), x, _features(x), torch.zeros(2, 1, dtype=DTYPE), "mse", lines,
                      minimum=(0.0, 0.0))


def logistic_problem(labels: tuple[int, int] = (1, 0)) -> ToyProblem:
    """The 2-datum logistic regression of ``fig:logistic-regression``: ``x_0 = 0``, ``x_1 = 2``,
    ``p(y=1|x) = sigma(theta_0 + theta_1 x)``, CE loss.

    The paper does not state the labels; its caption does: "the model achieves lower loss when moving further down the
    bottom-right corner" with ``theta_0`` horizontal (the caption of ``fig:visual_tour``), i.e. ``theta_0 -> +inf``,
    ``theta_1 -> -inf``. That is ``sigma(theta_0) -> 1`` at ``x_0 = 0`` and ``sigma(theta_0 + 2 theta_1) -> 0`` at
    ``x_1 = 2``, so the default labels are ``y_0 = 1``, ``y_1 = 0``. ``labels=(0, 1)`` gives the same problem under
    ``theta -> -theta`` (``sigma(-u) = 1 - sigma(u)``): the picture turned by 180 degrees, lowest loss top-left.

    Implemented as the package's softmax cross-entropy (``sec:sl-softmax-setup``) on the two-class logits
    ``[0, theta_0 + theta_1 x]``: ``softmax([0, u]) = [1 - sigma(u), sigma(u)]``, so the per-sample losses and the
    Fisher equal those of the sigmoid/binary-CE model. ``s_iEF = ||grad_z l_n||^2 = 2 (sigma - y_n)^2`` is twice the
    scalar-output value, which rescales the iEF direction by 2 and leaves its direction unchanged. The dashed line
    ``theta_0 + theta_1 = 0`` holds the parameters whose decision boundary ``-theta_0 / theta_1`` is ``x = 1``.

    Args:
        labels: ``(y_0, y_1)``, each 0 or 1.

    Returns:
        The :class:`ToyProblem` (``loss="cross_entropy"``, integer targets).

    Raises:
        ValueError: ``labels`` is not two values in ``{0, 1}``, naming it.
    """
    if len(labels) != 2 or any(y not in (0, 1) or isinstance(y, bool) for y in labels):
        raise ValueError(f"labels must be two classes in {{0, 1}}, e.g. (1, 0); got {labels!r}")
    x = torch.tensor([0.0, 2.0], dtype=DTYPE)
    lines = ((1.0, 1.0, 0.0, r"decision boundary at $x=1$: $\theta_0+\theta_1=0$"),)
    targets = torch.tensor([int(y) for y in labels], dtype=torch.long)
    return ToyProblem("logistic", TwoParameterModel(binary=True), x, _features(x), targets, "cross_entropy", lines)


def _features(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.ones_like(x), x], dim=1)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """2 x 2 problems: intra-op threads are pure overhead (a threaded 2 x 2 Cholesky was measured at ~10 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ directions
def ef_damping(jacobian: torch.Tensor) -> float:
    """``lambda_EF`` of ``sec:app-toy-lls-2pt``: 0, unless a per-sample gradient has norm exactly 0, then
    ``1e-4 * max(diag(F~))`` with ``F~ = J^T J`` (``eqn:covEF``)."""
    if bool((jacobian.norm(dim=1) == 0).any()):
        return EF_DAMPING_FACTOR * float(jacobian.square().sum(dim=0).max())
    return 0.0


def fisher_matrix(problem: ToyProblem, theta: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
    """The exact Fisher ``[[F e_0, F e_1]]`` (``eqn:FIM``) at ``theta`` from two :class:`ief.FisherOperator`
    products, ``[2, 2]``."""
    if theta is not None:
        problem.set_theta(theta)
    op = FisherOperator(problem.model, problem.features, problem.targets, loss=problem.loss)
    return torch.stack([op.matvec(e) for e in torch.eye(2, dtype=DTYPE)], dim=1)


def direction(
    problem: ToyProblem, method: str, theta: Sequence[float] | torch.Tensor, damping: float = 0.0
) -> torch.Tensor:
    """The update direction ``d`` of ``method`` at ``theta`` (the update is ``theta - eta d``), ``[2]``.

    ``damping`` is ``lambda`` for NGD and iEF (the paper's toy figures use 0); EF always uses :func:`ef_damping`.
    """
    problem.set_theta(theta)
    if method == "NGD":
        op = FisherOperator(problem.model, problem.features, problem.targets, loss=problem.loss)
        fisher = torch.stack([op.matvec(e) for e in torch.eye(2, dtype=DTYPE)], dim=1)
        fisher = 0.5 * (fisher + fisher.T) + damping * torch.eye(2, dtype=DTYPE)
        return torch.linalg.pinv(fisher, hermitian=True) @ op.gradient  # = solve() where F + lambda I is regular
    ps = per_sample(problem.model, problem.features, problem.targets, loss=problem.loss)
    if method == "SGD":
        return ps.gradient
    if method == "iEF":
        return ief_direction(ps.jacobian, ps.logit_sqnorm, damping)
    if method == "EF":
        return ef_direction(ps.jacobian, ef_damping(ps.jacobian))
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def grid(xlim: tuple[float, float], ylim: tuple[float, float], resolution: int) -> tuple[torch.Tensor, ...]:
    """``(T0, T1, thetas)``: meshgrid ``[R, R]`` of ``theta_0`` (columns) and ``theta_1`` (rows) and ``[R*R, 2]``."""
    t0 = torch.linspace(*xlim, resolution, dtype=DTYPE)
    t1 = torch.linspace(*ylim, resolution, dtype=DTYPE)
    big0, big1 = torch.meshgrid(t0, t1, indexing="xy")
    return big0, big1, torch.stack([big0.reshape(-1), big1.reshape(-1)], dim=1)


def update_field(problem: ToyProblem, method: str, thetas: torch.Tensor) -> torch.Tensor:
    """Directions ``d(theta)`` at every row of ``thetas`` ``[G, 2]`` (the vector fields of ``fig:visual_tour``),
    ``[G, 2]``. The arrows drawn on the figures are ``-d`` (the update).

    Cost: one :func:`direction` per row, the package's own route (~1 ms of autograd and solves; ~5 s for the
    cpu-scale chapter's 3,500 arrows), so that the fields and the numbers read from them (the NGD - iEF gap, a
    rounding-level difference between two of the package's solves) are the package's."""
    thetas = torch.as_tensor(thetas, dtype=DTYPE).reshape(-1, 2)
    with _one_thread():
        return torch.stack([direction(problem, method, t) for t in thetas])


# ------------------------------------------------------------------------------------- closed-form directions
def closed_form_direction(
    problem: ToyProblem, method: str, theta0: float, theta1: float, damping: float = 0.0
) -> tuple[float, float] | None:
    """:func:`direction` at ``(theta0, theta1)`` in Python float64 arithmetic, or ``None`` where it defers to it.

    The same algorithm as the package's route, operation by operation: the logits ``z_n = theta_0 + theta_1 x_n``,
    the per-sample gradients ``J_n = e_n [1, x_n]`` with ``e_n = dl_n/dz_n`` (``z_n - y_n``, or ``sigma(z_n) - y_n``
    from the softmax of ``[0, z_n]``), the ``2 x 2`` Gram (EF, iEF) or Fisher (NGD) system factored by Cholesky and
    solved, ``d = J^T c``. It returns ``None`` wherever the package's route leaves that Cholesky solve (a Gram
    scaled because ``max|J|`` is outside ``[1e-100, 1e100]``; a pivot not well above rounding, where the package
    solves by ``eigh`` / ``pinv``) or the loss is not one of the two toy models, so the caller can fall back to
    :func:`direction`. Agreement with :func:`direction` is to float64 rounding (the package's kernels may fuse
    multiply-adds), tested on every method.

    Cost: ~40 float operations and no tensor: ~2 microseconds against :func:`direction`'s ~1 ms of per-sample autograd.

    Args:
        problem: an :func:`lls_problem` or :func:`logistic_problem`.
        method: one of :data:`METHODS`.
        theta0: ``theta_0``.
        theta1: ``theta_1``.
        damping: ``lambda`` for NGD and iEF, as in :func:`direction`.

    Returns:
        ``(d_0, d_1)``, or ``None`` (use :func:`direction`).

    Raises:
        ValueError: an unknown ``method``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    kind = _closed_form_kind(problem)
    if kind is None:
        return None
    xs, ys = _data(problem)
    e, s, h = [], [], []
    for x, y in zip(xs, ys):
        z = theta0 + theta1 * x
        if kind == "mse":
            e.append(z - y)
            h.append(1.0)
            s.append(e[-1] * e[-1])
        else:  # softmax([0, z]) as torch computes it: exp(v - max) / sum
            m = max(0.0, z)
            e0, e1 = math.exp(0.0 - m), math.exp(z - m)
            total = e0 + e1
            p0, p1 = e0 / total, e1 / total
            e.append(p1 - y)
            h.append(p1 * (1.0 - p1))
            g0 = p0 - (1.0 - y)
            s.append(g0 * g0 + e[-1] * e[-1])
    jac = [(en, en * x) for en, x in zip(e, xs)]
    if method == "SGD":
        return jac[0][0] + jac[1][0], jac[0][1] + jac[1][1]
    if method == "NGD":
        f00, f01, f11 = h[0] + h[1], h[0] * xs[0] + h[1] * xs[1], h[0] * xs[0] * xs[0] + h[1] * xs[1] * xs[1]
        grad = (jac[0][0] + jac[1][0], jac[0][1] + jac[1][1])
        return _cholesky_solve_2x2(f00, f01, f11, damping, grad)
    scale = max(abs(v) for row in jac for v in row)
    if scale == 0.0:
        return 0.0, 0.0
    if not 1e-100 <= scale <= 1e100 or any(0.0 < abs(v) < 1e-100 for row in jac for v in row):
        return None  # the package rescales the Gram (or a row's norm may underflow): its own route decides
    if method == "EF":
        damping = 0.0
        if any(row[0] == 0.0 and row[1] == 0.0 for row in jac):  # ef_damping: 1e-4 max(diag(J^T J))
            damping = EF_DAMPING_FACTOR * max(jac[0][0] * jac[0][0] + jac[1][0] * jac[1][0],
                                              jac[0][1] * jac[0][1] + jac[1][1] * jac[1][1])
        s = [1.0, 1.0]
    (a0, a1), (b0, b1) = jac
    coeff = _cholesky_solve_2x2(a0 * a0 + a1 * a1, a0 * b0 + a1 * b1, b0 * b0 + b1 * b1, damping, s)
    if coeff is None:
        return None
    return a0 * coeff[0] + b0 * coeff[1], a1 * coeff[0] + b1 * coeff[1]


def _closed_form_kind(problem: ToyProblem) -> str | None:
    """``"mse"`` (a scalar-output least squares), ``"binary"`` (cross-entropy on ``[0, z]``) or ``None``."""
    if len(problem.x) != 2 or tuple(problem.features.shape) != (2, 2):
        return None
    if problem.loss == "mse" and not problem.model.binary and tuple(problem.targets.shape) == (2, 1):
        return "mse"
    if problem.loss == "cross_entropy" and problem.model.binary and tuple(problem.targets.shape) == (2,):
        return "binary"
    return None


def _data(problem: ToyProblem) -> tuple[list[float], list[float]]:
    return problem.x.tolist(), [float(y) for y in problem.targets.reshape(-1).tolist()]


def _cholesky_solve_2x2(g00: float, g01: float, g11: float, damping: float,
                        rhs: Sequence[float]) -> tuple[float, float] | None:
    """``(G + lambda I)^{-1} rhs`` by Cholesky, or ``None`` where the package would not trust its Cholesky (a pivot
    ``l^2 <= 1e3 * 2 eps max(diag G)``, the test of ``ief.directions``): it then solves by ``eigh`` or ``pinv``."""
    tiny = 2 * 2.220446049250313e-16 * max(g00, g11, 1e-300)
    a00, a11 = g00 + damping, g11 + damping
    if not a00 > 0.0:
        return None
    l00 = math.sqrt(a00)
    l10 = g01 / l00
    rest = a11 - l10 * l10
    if not rest > 0.0:
        return None
    l11 = math.sqrt(rest)
    if not min(l00, l11) ** 2 > 1e3 * tiny:
        return None
    y0 = rhs[0] / l00
    y1 = (rhs[1] - l10 * y0) / l11
    c1 = y1 / l11
    return (y0 - l10 * c1) / l00, c1


def _step_direction(problem: ToyProblem, method: str, theta0: float, theta1: float) -> tuple[float, float]:
    """:func:`closed_form_direction`, or :func:`direction` where that defers."""
    d = closed_form_direction(problem, method, theta0, theta1)
    if d is None:
        d0, d1 = direction(problem, method, torch.tensor([theta0, theta1], dtype=DTYPE)).tolist()
        return d0, d1
    return d


# ---------------------------------------------------------------------------------------------- trajectories
def trajectory(
    problem: ToyProblem,
    method: str,
    start: Sequence[float],
    step_size: float = 1e-2,
    steps: int = 500,
    normalise: bool = True,
    stop_loss: float | None = None,
    bounds: tuple[tuple[float, float], tuple[float, float]] | None = None,
) -> torch.Tensor:
    """Points ``theta_0 .. theta_K`` (``[K+1, 2]``, ``K <= steps``) of the iteration ``theta <- theta - eta u``.

    ``normalise=True`` (the trajectories of ``fig:visual_tour``): ``u = d / ||d||``, every step has length
    ``step_size``. ``normalise=False``: ``u = d``, ``step_size`` is a plain learning rate. Stops early at a zero
    direction, at a non-finite point, once ``L(theta) < stop_loss``, or after the first point outside
    ``bounds = ((theta_0 min, max), (theta_1 min, max))``.

    Cost: per step, one :func:`closed_form_direction` and one closed-form loss in Python float64 (a few
    microseconds; the 130,000 steps of the cpu-scale least-squares EF trajectories take ~1.5 s), or one
    :func:`direction` (~3 ms) at a point where the closed form defers to the package; a problem that is not one of
    the two toy models takes :func:`direction` and the package's loss at every step.
    """
    if _closed_form_kind(problem) is None:
        return _trajectory_stepwise(problem, method, start, step_size, steps, normalise, stop_loss, bounds)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    t0, t1 = (float(v) for v in torch.as_tensor(start, dtype=DTYPE).reshape(2).tolist())
    points = [(t0, t1)]
    with _one_thread():
        for _ in range(steps):
            if stop_loss is not None and _closed_form_loss(problem, t0, t1) < stop_loss:
                break
            if bounds is not None and not (bounds[0][0] <= t0 <= bounds[0][1] and bounds[1][0] <= t1 <= bounds[1][1]):
                break
            d0, d1 = _step_direction(problem, method, t0, t1)
            norm = math.sqrt(d0 * d0 + d1 * d1)
            if norm == 0.0:
                break
            if normalise:
                d0, d1 = d0 / norm, d1 / norm
            t0, t1 = t0 - step_size * d0, t1 - step_size * d1
            if not (math.isfinite(t0) and math.isfinite(t1)):
                break
            points.append((t0, t1))
    return torch.tensor(points, dtype=DTYPE)


def _trajectory_stepwise(problem, method, start, step_size, steps, normalise, stop_loss, bounds) -> torch.Tensor:
    """:func:`trajectory` by the package's route at every step (:func:`direction`, the package's loss): the
    reference the closed form is tested against, and the route of any other problem."""
    theta = torch.as_tensor(start, dtype=DTYPE).clone()
    points = [theta.clone()]
    with _one_thread():
        for _ in range(steps):
            if stop_loss is not None and _current_loss(problem, theta) < stop_loss:
                break
            if bounds is not None and not all(lo <= float(t) <= hi for t, (lo, hi) in zip(theta, bounds)):
                break
            d = direction(problem, method, theta)
            norm = float(d.norm())
            if norm == 0.0:
                break
            theta = theta - step_size * (d / norm if normalise else d)
            if not bool(torch.isfinite(theta).all()):
                break
            points.append(theta.clone())
    return torch.stack(points)


def _closed_form_loss(problem: ToyProblem, theta0: float, theta1: float) -> float:
    """``L(theta)`` in Python floats, as the package's losses compute it (``1/2 r^2``; ``-log_softmax([0, z])_y``)."""
    xs, ys = _data(problem)
    total = 0.0
    for x, y in zip(xs, ys):
        z = theta0 + theta1 * x
        if problem.loss == "mse":
            r = z - y
            total += 0.5 * (r * r)
        else:
            m = max(0.0, z)
            log_sum = math.log(math.exp(0.0 - m) + math.exp(z - m))
            total += -(((z if y == 1.0 else 0.0) - m) - log_sum)
    return total


def _current_loss(problem: ToyProblem, theta: torch.Tensor) -> float:
    """``L(theta)`` from one plain forward (cheaper than the vmapped :meth:`ToyProblem.loss_at` for one point)."""
    problem.set_theta(theta)
    with torch.no_grad():
        return float(get_loss(problem.loss).per_sample(problem.model(problem.features), problem.targets).sum())


def steps_to_loss(
    problem: ToyProblem,
    method: str,
    start: Sequence[float],
    threshold: float = 1e-6,
    step_size: float = 1e-2,
    max_steps: int = 1000,
    normalise: bool = True,
) -> int | None:
    """Number of updates after which ``L(theta) < threshold`` first holds (0 if it holds at ``start``), or ``None``
    if it does not within ``max_steps``. Same iteration as :func:`trajectory`."""
    path = trajectory(problem, method, start, step_size, max_steps, normalise, stop_loss=threshold)
    below = torch.nonzero(problem.loss_at(path) < threshold).flatten()
    return int(below[0]) if len(below) else None


# ---------------------------------------------------------------------------------------- inverse scaling facts
def ef_inverse_scaling(problem: ToyProblem, thetas: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inversely-scaled projection of EF updates (``eqn:kappa_EF``) at each row of ``thetas`` ``[G, 2]``.

    Returns ``[G]`` tensors ``loss``, ``grad_norm_{n}`` (``||grad l_n||``), ``ef_norm`` / ``ief_norm`` / ``ngd_norm``
    (``||d||``) and ``ef_kappa_{n}`` ``= d_EF^T grad l_n / ||grad l_n||``, the projection of the EF direction onto
    sample ``n``'s gradient: ``eqn:kappa_EF`` predicts ``1 / ||grad l_n||`` (with ``eta = 1``, ``lambda = 0``).
    """
    thetas = torch.as_tensor(thetas, dtype=DTYPE).reshape(-1, 2)
    rows: list[dict[str, float]] = []
    with _one_thread():
        for theta in thetas:
            problem.set_theta(theta)
            jac = per_sample(problem.model, problem.features, problem.targets, loss=problem.loss).jacobian
            d_ef = direction(problem, "EF", theta)
            row = {"loss": float(problem.loss_at(theta)[0]), "ef_norm": float(d_ef.norm())}
            row["ief_norm"] = float(direction(problem, "iEF", theta).norm())
            row["ngd_norm"] = float(direction(problem, "NGD", theta).norm())
            for n, g in enumerate(jac):
                gn = float(g.norm())
                row[f"grad_norm_{n}"] = gn
                row[f"ef_kappa_{n}"] = float(d_ef @ g) / gn if gn > 0 else float("nan")
            rows.append(row)
    return {k: torch.tensor([r[k] for r in rows], dtype=DTYPE) for k in rows[0]}
