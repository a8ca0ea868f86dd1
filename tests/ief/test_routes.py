"""Differential tests: every fast route of ``ief`` against its reference route, over one matrix.

Routes (fast -> reference; "oracle" is the dense float64 brute force of ``tests/oracle.py`` / ``route_models.py``):

- ``sweep``: :func:`ief.damping_sweep` -> :func:`ief.evaluate` (per-pass route) and the oracle ``gamma`` of the
  exact directions (``sec:exp-damping``);
- ``logit``: :func:`ief.evaluate` with ``logit_space=True`` (``J_z`` algebra) -> ``logit_space=False`` and the oracle;
- ``gammas``: :func:`ief.gammas` (one batched forward, and its double-backward method) -> :func:`ief.gamma` per
  direction and the oracle (``sec:eval_framework``);
- ``fvp``: :func:`ief.fisher_vp` (default: forward mode) and ``method="double_backward"`` -> the dense ``F v``
  (``sec:app-eval-complexity``), ``v`` the oracle iEF direction at the damping;
- ``forms``: :func:`ief.per_sample` / :func:`ief.sampled_jacobian` with ``form`` dense / ghost / rows / streamed /
  auto, and the EF / iEF / SF directions computed from each form -> the oracle (``eqn:EF_lsq``, ``eqn:iEF_lsq``,
  ``eqn:SF-smw``);
- ``kfac``: :func:`ief.kfac_direction` for each kind -> the damped solve of ``G (x) A`` with the dense factors built
  by explicit per-sample passes (through their eigendecompositions; at ``lambda = 1`` also the dense solve of the
  Kronecker block itself), ``sec:app-iEF-eNGDopt``;
- ``optim``: one step of ``ief.optim.IEF`` / ``EF`` / ``SF`` -> the direction functions on the oracle Jacobian;
- ``steady``: the same step as a steady one takes it (``check=False``, the per-sample finiteness deferred: asked of
  the rows after the solve, read off the Gram's diagonal for a float32 ``J``; the direction combined straight into
  the model's dtype) -> the oracle directions, and its finiteness flag -> the pass over ``J`` (``_finite_flag``);
- ``streamed``: the ``optim`` step with ``form="streamed"`` (:mod:`ief.streamed`: no weight's rows kept).

Models: ``route_models.MODELS`` (the cpu setups at smoke size, a P < M linear model, a prompt-only T5, T5-LoRA, a CNN,
a GRU, a token table the batch uses only partly; a sample with every target ignored in all but the P < M one);
float32 and float64 with the same parameter values; damping ``lambda`` in {0, 1e-10, 1e-6, 1}. One parametrised test per
(route, model, dtype, lambda), id ``route-model-dtype-lamX``, and a Hypothesis test of the sweep on random linear models
(P above and below M, duplicated samples).

Tolerances (relative): float64 1e-6, float32 1e-2 for ``gamma``-like quantities and directions, tighter where both
routes run the same arithmetic (``J`` itself, ``gammas`` vs ``gamma``, the two FVP methods). Where the problem is
ill-conditioned at the model's precision, a tolerance grows to 10x the reference's *sensitivity*: how much it moves
when its inputs are rounded at the dtype's epsilon (and the Gram matrices at float64's), :class:`Sensitivity`. No
route can beat that, whatever its arithmetic. It matters for ``lambda = 1e-10`` on a singular ``J J^T`` (P < M; the
classifier head's ``G`` factor, singular because ``sum_c g_c = 0``), where rounding in the null space is amplified by
``1/lambda``: in float32 these problems are not determined at all (sensitivity > 1: linear-p15-m32 directions and
the head blocks of K-FAC on linear-p15-m32, cnn and gru at ``lambda = 1e-10``), in float64 to ~1e-4. ``gamma`` is
far better conditioned than the directions (the noise lies in the Fisher's null space).

A failure lists every mismatch of its case as ``route=... model=... dtype=... lambda=...: what: got ..., reference
...: relative error ... > tolerance``, or the exception a route raised, under the same name.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import ief
import oracle
import route_models as rm
from ief.evaluation import batch_generator
from tiny_models import Case

DTYPES = {"float32": torch.float32, "float64": torch.float64}
DAMPINGS = (0.0, 1e-10, 1e-6, 1.0)
RTOL = {torch.float64: 1e-6, torch.float32: 1e-2}  # gamma-like quantities and directions
# The random direction's gamma against the oracle, float64, where a model's measured gap exceeds RTOL: llama-dora
# differs by 0.9e-6 (AVX2) and 1.34e-6 (ATEN_CPU_CAPABILITY=default), while gammas and gamma agree to 1e-9 and the
# iEF/EF/SF directions' gammas to 1e-6; the cause (a float32-level step in peft DoRA's forward-mode or oracle path)
# is not found yet: an open question, bounded here at 5x the measured gap, not hidden.
RANDOM_GAMMA_RTOL64 = {"llama-dora": 7e-6}
MARGIN = 10.0  # a tolerance is at least MARGIN x the problem's sensitivity to rounding (see Sensitivity)
SEED = 0  # SF / K-FAC labels: manual_seed(SEED), which is also evaluate's batch_generator(SEED, 0) for SEED = 0
ORACLE_RCOND = 1e-6  # lambda = 0: singular values of J below this fraction of the largest are zero (the models'
# smallest non-zero ones are above 3e-5 of the largest, their zero ones below 1e-7 even in float32)
EPS64 = torch.finfo(torch.float64).eps


# ------------------------------------------------------------------------------------------------- comparisons
def rel_error(got, ref) -> float:
    """``|got - ref| / |ref|`` for numbers (equal infinities and NaN pairs count as equal), ``||got - ref|| / ||ref||``
    for tensors (``||got||`` where ``ref`` is zero)."""
    if isinstance(ref, torch.Tensor):
        got, ref = got.detach().to(torch.float64).reshape(-1), ref.detach().to(torch.float64).reshape(-1)
        if got.shape != ref.shape:
            return math.inf
        if not bool(torch.isfinite(got).all()):
            return math.inf
        scale = float(ref.norm())
        return float((got - ref).norm()) / scale if scale > 0 else float(got.norm())
    got, ref = float(got), float(ref)
    if math.isnan(got) or math.isnan(ref):
        return 0.0 if math.isnan(got) and math.isnan(ref) else math.inf
    if got == ref:
        return 0.0
    return abs(got - ref) / abs(ref) if ref != 0 and math.isfinite(ref) else math.inf


def _show(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"[norm {float(x.detach().double().norm()):.6g}]"
    return f"{float(x):.6g}"


class Checker:
    """Collects the mismatches of one case; :meth:`done` fails with all of them, each naming the case.

    A comparison passes when the relative error is at most ``max(rtol, MARGIN * sensitivity)``: ``rtol`` is the
    dtype's (``RTOL``) unless given, ``sensitivity`` the relative change of the reference under rounding of its
    inputs at the model's dtype (:class:`Sensitivity`; 0 where the comparison is not a solve)."""

    def __init__(self, route: str, model: str, dtype: torch.dtype, damping: float | None):
        name = str(dtype).replace("torch.", "")
        self.where = f"route={route} model={model} dtype={name}" + ("" if damping is None else f" lambda={damping:g}")
        self.dtype = dtype
        self.failures: list[str] = []
        self.count = 0

    def close(self, what: str, got, ref, rtol: float | None = None, sensitivity: float = 0.0) -> None:
        base = RTOL[self.dtype] if rtol is None else rtol
        tol = max(base, MARGIN * sensitivity)
        err = rel_error(got, ref)
        self.count += 1
        if not err <= tol:
            why = f"{tol:.1e}" + (f" (= {MARGIN:g} x sensitivity)" if tol > base else "")
            self.failures.append(f"{self.where}: {what}: got {_show(got)}, reference {_show(ref)}: relative error "
                                 f"{err:.2e} > {why}")

    def done(self) -> None:
        assert self.count > 0, f"{self.where}: nothing was compared"
        assert not self.failures, "\n".join(self.failures)


# ------------------------------------------------------------------------------------------------- oracles
def _svd(jac: torch.Tensor):
    return torch.linalg.svd(jac.to(torch.float64), full_matrices=False)


def oracle_woodbury(jac: torch.Tensor, weights: torch.Tensor, damping: float) -> torch.Tensor:
    """``J^T (J J^T + lambda I)^{-1} w = (J^T J + lambda I)^{-1} J^T w`` from the SVD of ``J`` (``J J^T`` is never
    formed, so its rounding is not amplified by ``1/lambda``); ``lambda = 0``: the minimum-norm ``J^+ w``."""
    u, s, vh = _svd(jac)
    if damping == 0:
        keep = s > ORACLE_RCOND * s.max()
        f = torch.where(keep, 1.0 / torch.where(keep, s, torch.ones_like(s)), torch.zeros_like(s))
    else:
        f = s / (s * s + damping)
    return vh.T @ (f * (u.T @ weights.to(torch.float64)))


def oracle_sf(sampled: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """``(A^T A + lambda I)^{-1} g`` from the SVD of ``A``: the row space part ``V diag(1/(s^2 + lambda)) V^T g`` plus
    ``(g - V V^T g) / lambda`` (absent when ``A`` has full column rank)."""
    _, s, vh = _svd(sampled)
    g = grad.to(torch.float64)
    coeff = vh @ g
    out = vh.T @ (coeff / (s * s + damping))
    if vh.shape[0] < vh.shape[1]:
        out = out + (g - vh.T @ coeff) / damping
    return out


def exact_directions(o: rm.Oracle, sampled: torch.Tensor | None, damping: float) -> dict[str, torch.Tensor]:
    """The exact SGD / EF / iEF (/ SF from the sampled Jacobian, for lambda > 0) directions, float64."""
    out = {"sgd": o.gradient, "ef": oracle_woodbury(o.jacobian, torch.ones(o.jacobian.shape[0]), damping),
           "ief": oracle_woodbury(o.jacobian, o.logit_sqnorm, damping)}
    if damping > 0:
        out["sf"] = oracle_sf(sampled, o.gradient, damping)
    return out


def _sampled(name: str, dtype: torch.dtype, damping: float) -> torch.Tensor | None:
    return rm.sampled_oracle(name, dtype, SEED) if damping > 0 else None


def oracle_directions(name: str, dtype: torch.dtype, damping: float) -> dict[str, torch.Tensor]:
    """:func:`exact_directions` of a model of the matrix (SF: the labels the package draws in ``dtype`` with
    ``SEED``)."""
    return exact_directions(rm.dense_oracle(name), _sampled(name, dtype, damping), damping)


# ------------------------------------------------------------------------------------------------- sensitivity
class Sensitivity:
    """How much a reference moves when its inputs carry the rounding of a computation at the model's dtype: the
    per-sample quantities (``J``, ``s``, ``g``, ``A``, K-FAC's factors) rounded at the dtype's epsilon and the
    ``M x M`` Gram matrices at float64's (where the package solves them). The maximum over two roundings.

    A route that rounds only this much cannot be more accurate than this, whatever its arithmetic: the tolerances
    grow to ``MARGIN`` times it (e.g. float32 with ``lambda = 1e-10`` below the rounding of ``J J^T``, or ``lambda =
    1e-10`` on a singular ``J J^T``, where rounding in its null space is amplified by ``1 / lambda``)."""

    SEEDS = (11, 12)

    def __init__(self, o: rm.Oracle, sampled: torch.Tensor | None, dtype: torch.dtype, damping: float):
        self.o, self.sampled, self.dtype, self.damping = o, sampled, dtype, damping
        self.eps = torch.finfo(dtype).eps

    @classmethod
    def of(cls, name: str, dtype: torch.dtype, damping: float) -> "Sensitivity":
        """For a model of the matrix."""
        return cls(rm.dense_oracle(name), _sampled(name, dtype, damping), dtype, damping)

    def rounded(self, t: torch.Tensor, seed: int, eps: float | None = None) -> torch.Tensor:
        noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        return t.to(torch.float64) * (1 + (self.eps if eps is None else eps) * noise)

    def _gram(self, rows: torch.Tensor, seed: int) -> torch.Tensor:
        norms = rows.norm(dim=1)
        noise = torch.randn(rows.shape[0], rows.shape[0], generator=torch.Generator().manual_seed(seed),
                            dtype=torch.float64)
        return rows @ rows.T + EPS64 * torch.outer(norms, norms) * 0.5 * (noise + noise.T)

    def _solve(self, gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        e, q = torch.linalg.eigh(gram)
        if self.damping == 0:
            keep = e > ORACLE_RCOND**2 * e.max()
            inv = torch.where(keep, 1.0 / torch.where(keep, e, torch.ones_like(e)), torch.zeros_like(e))
        else:
            inv = 1.0 / (e.clamp_min(0) + self.damping)
        return q @ (inv * (q.T @ rhs))

    def directions(self, seed: int) -> dict[str, torch.Tensor]:
        """EF / iEF / SF by Gram solves from rounded inputs."""
        o = self.o
        jac = self.rounded(o.jacobian, seed)
        gram = self._gram(jac, seed + 100)
        ones = torch.ones(jac.shape[0], dtype=torch.float64)
        out = {"sgd": self.rounded(o.gradient, seed + 200),
               "ef": jac.T @ self._solve(gram, ones),
               "ief": jac.T @ self._solve(gram, self.rounded(o.logit_sqnorm, seed + 300))}
        if self.damping > 0:
            a = self.rounded(self.sampled, seed + 400)
            g = out["sgd"]
            out["sf"] = (g - a.T @ self._solve(self._gram(a, seed + 500), a @ g)) / self.damping
        return out

    def of_directions(self) -> dict[str, float]:
        """``{method: relative change of the exact direction}``."""
        exact = exact_directions(self.o, self.sampled, self.damping)
        out = {m: 0.0 for m in exact}
        for seed in self.SEEDS:
            for m, d in self.directions(seed).items():
                out[m] = max(out[m], rel_error(d, exact[m]))
        return out

    def gamma(self, d: torch.Tensor) -> float:
        """Rounding of ``gamma(d)`` itself at the dtype: ``d^T g`` to ``eps ||d|| ||g|| / |d^T g|`` and
        ``sqrt(d^T F d)`` to ``eps`` times the condition of ``J_z d``, ``sqrt(||F|| ||d||^2 / d^T F d)``."""
        o = self.o
        d = d.to(torch.float64)
        slope, curvature = abs(float(d @ o.gradient)), float(d @ o.fisher @ d)
        if slope == 0 or curvature <= 0:
            return math.inf
        spread = float(torch.linalg.matrix_norm(o.fisher)) * float(d @ d) / curvature
        return self.eps * (float(d.norm() * o.gradient.norm()) / slope + math.sqrt(spread))

    def of_gammas(self) -> dict[str, float]:
        """``{method: relative change of the oracle gamma of the exact direction}`` (directions and gamma)."""
        o = self.o
        exact = exact_directions(o, self.sampled, self.damping)
        out = {m: self.gamma(d) for m, d in exact.items()}
        for seed in self.SEEDS:
            for m, d in self.directions(seed).items():
                out[m] = max(out[m], rel_error(o.gamma(d), o.gamma(exact[m])) + self.gamma(exact[m]))
        return out

    def of_kfac(self, name: str, kind: str) -> float:
        """Relative change of the K-FAC oracle direction of model ``name`` (its factors' rows and gradient rounded)."""
        exact = rm.kfac_oracle_direction(name, self.dtype, kind, SEED, self.damping)
        return max(rel_error(rm.kfac_oracle_direction(name, self.dtype, kind, SEED, self.damping,
                                                      lambda t, salt, s=seed: self.rounded(t, s * 1000 + salt)),
                             exact) for seed in self.SEEDS)


def _methods(damping: float) -> list[str]:
    return ["sgd", "ef", "ief"] + (["sf"] if damping > 0 else [])


# ------------------------------------------------------------------------------------------------- the routes
def route_sweep(chk: Checker, name: str, c, damping: float) -> None:
    methods = _methods(damping)[1:]
    gen = batch_generator(SEED, 0)  # what evaluate's batch 0 draws with
    sweep = {r["method"]: r for r in ief.damping_sweep(c.model, c.inputs, c.targets, [damping], methods,
                                                         loss=c.loss, generator=gen)}
    slow = {r["method"]: r for r in ief.evaluate(c.model, [(c.inputs, c.targets)], methods, damping, loss=c.loss,
                                                 seed=SEED, logit_space=False)}
    o = rm.dense_oracle(name)
    dirs = oracle_directions(name, chk.dtype, damping)
    sens = Sensitivity.of(name, chk.dtype, damping).of_gammas()
    for m in ["sgd", *methods]:
        chk.close(f"{m} gamma, sweep vs evaluate", sweep[m]["gamma"], slow[m]["gamma"], sensitivity=sens[m])
        chk.close(f"{m} gamma, sweep vs oracle", sweep[m]["gamma"], o.gamma(dirs[m]), sensitivity=sens[m])
        chk.close(f"{m} ratio, sweep vs evaluate", sweep[m]["ratio"], slow[m]["ratio"],
                  sensitivity=sens[m] + sens["sgd"])


def route_logit(chk: Checker, name: str, c, damping: float) -> None:
    methods = _methods(damping)[1:] + (["kfac", "ekfac", "iekfac"] if rm.MODELS[name].kfac_params == "all" else [])
    methods.append("hf")
    kwargs = dict(loss=c.loss, seed=SEED, cg_iterations=3)
    fast = {r["method"]: r for r in ief.evaluate(c.model, [(c.inputs, c.targets)], methods, damping,
                                                 logit_space=True, **kwargs)}
    slow = {r["method"]: r for r in ief.evaluate(c.model, [(c.inputs, c.targets)], methods, damping,
                                                 logit_space=False, **kwargs)}
    o = rm.dense_oracle(name)
    dirs = oracle_directions(name, chk.dtype, damping)
    sens = Sensitivity.of(name, chk.dtype, damping).of_gammas()
    for m in ["sgd", *methods]:
        chk.close(f"{m} gamma, logit space vs per-pass", fast[m]["gamma"], slow[m]["gamma"],
                  sensitivity=sens.get(m, 0.0))
        if m in dirs:
            chk.close(f"{m} gamma, logit space vs oracle", fast[m]["gamma"], o.gamma(dirs[m]), sensitivity=sens[m])
    chk.close("imbalance, logit space vs per-pass", fast["sgd"]["imbalance"], slow["sgd"]["imbalance"])


def route_gammas(chk: Checker, name: str, c, damping: float) -> None:
    o = rm.dense_oracle(name)
    dirs = oracle_directions(name, chk.dtype, damping)
    dirs["random"] = torch.randn(o.gradient.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = list(dirs)
    stacked = torch.stack([dirs[k] for k in labels]).to(chk.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a model without batched forward mode says so once
        batched = ief.gammas(c.model, c.inputs, c.targets, stacked, loss=c.loss)
    double = ief.gammas(c.model, c.inputs, c.targets, stacked, loss=c.loss, method="double_backward")
    tight = 1e-9 if chk.dtype == torch.float64 else 1e-4  # the same J_z d, two ways of computing it
    rounding = Sensitivity.of(name, chk.dtype, damping)
    for k, label in enumerate(labels):
        single = ief.gamma(c.model, c.inputs, c.targets, stacked[k], loss=c.loss)
        sens = rounding.gamma(stacked[k])
        chk.close(f"{label} gamma, gammas vs gamma", batched[k], single, tight, sens)
        chk.close(f"{label} gamma, gammas(double_backward) vs gamma", double[k], single, tight, sens)
        rtol = RANDOM_GAMMA_RTOL64.get(name) if label == "random" and chk.dtype == torch.float64 else None
        chk.close(f"{label} gamma, gammas vs oracle", batched[k], o.gamma(stacked[k]), rtol, sensitivity=sens)


def route_fvp(chk: Checker, name: str, c, damping: float) -> None:
    o = rm.dense_oracle(name)
    v = oracle_directions(name, chk.dtype, damping)["ief"].to(chk.dtype)
    reference = o.fisher @ v.to(torch.float64)
    auto = ief.fisher_vp(c.model, c.inputs, c.targets, v, loss=c.loss)
    double = ief.fisher_vp(c.model, c.inputs, c.targets, v, loss=c.loss, method="double_backward")
    v64 = v.to(torch.float64)  # F v to eps times its condition ||F|| ||v|| / ||F v||
    sens = torch.finfo(chk.dtype).eps * float(torch.linalg.matrix_norm(o.fisher) * v64.norm() / reference.norm())
    chk.close("F v along the iEF direction, fisher_vp (forward mode) vs oracle", auto, reference, sensitivity=sens)
    chk.close("F v along the iEF direction, fisher_vp(double_backward) vs oracle", double, reference,
              sensitivity=sens)
    tight = 1e-9 if chk.dtype == torch.float64 else 1e-4
    chk.close("F v, forward mode vs double backward", auto, double, tight, sens)


def _dense(jac) -> torch.Tensor:
    return jac.materialize() if hasattr(jac, "materialize") else jac


def route_forms(chk: Checker, name: str, c, damping: float) -> None:
    o = rm.dense_oracle(name)
    dirs = oracle_directions(name, chk.dtype, damping)
    sens = Sensitivity.of(name, chk.dtype, damping).of_directions()
    exact = 1e-10 if chk.dtype == torch.float64 else 1e-5  # J itself: one backward, no solve
    for form in ("dense", "ghost", "rows", "streamed", "auto"):
        ps = ief.per_sample(c.model, c.inputs, c.targets, loss=c.loss, form=form)
        sampled = ief.sampled_jacobian(c.model, c.inputs, c.targets, torch.Generator().manual_seed(SEED),
                                       loss=c.loss, form=form) if damping > 0 else None
        chk.close(f"form={form}: J vs oracle", _dense(ps.jacobian), o.jacobian, exact)
        chk.close(f"form={form}: s_iEF vs oracle", ps.logit_sqnorm, o.logit_sqnorm, exact)
        chk.close(f"form={form}: gradient vs oracle", ps.gradient, o.gradient, exact)
        chk.close(f"form={form}: ef_direction vs oracle", ief.ef_direction(ps.jacobian, damping), dirs["ef"],
                  sensitivity=sens["ef"])
        chk.close(f"form={form}: ief_direction vs oracle", ief.ief_direction(ps.jacobian, ps.logit_sqnorm, damping),
                  dirs["ief"], sensitivity=sens["ief"])
        if sampled is not None:
            chk.close(f"form={form}: sampled J vs oracle", _dense(sampled), rm.sampled_oracle(name, chk.dtype, SEED),
                      exact)
            chk.close(f"form={form}: sf_direction vs oracle", ief.sf_direction(sampled, ps.gradient, damping),
                      dirs["sf"], sensitivity=sens["sf"])


def route_kfac(chk: Checker, name: str, c, damping: float) -> None:
    params = rm.kfac_params(name, c)
    for kind in ("kfac", "ekfac", "iekfac"):
        d = ief.kfac_direction(c.model, c.inputs, c.targets, kind, damping, params,
                               torch.Generator().manual_seed(SEED), loss=c.loss)
        chk.close(f"{kind} direction vs dense block oracle", d,
                  rm.kfac_oracle_direction(name, chk.dtype, kind, SEED, damping),
                  sensitivity=Sensitivity.of(name, chk.dtype, damping).of_kfac(name, kind))
        if damping == 1.0:  # well conditioned: the dense solve of G (x) A + lambda I itself
            chk.close(f"{kind} direction vs dense solve of G (x) A + lambda I", d,
                      rm.kfac_dense_direction(name, chk.dtype, kind, SEED, damping))


def route_optim(chk: Checker, name: str, c, damping: float, check: bool = True, form: str = "auto") -> None:
    o = rm.dense_oracle(name)
    jac = o.jacobian
    expected = {"IEF": ief.ief_direction(jac, o.logit_sqnorm, damping), "EF": ief.ef_direction(jac, damping)}
    if damping > 0:
        expected["SF"] = ief.sf_direction(rm.sampled_oracle(name, chk.dtype, SEED), o.gradient, damping)
    sens = Sensitivity.of(name, chk.dtype, damping).of_directions()
    for kind, direction in expected.items():
        model = copy.deepcopy(c.model)
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).clone()
        norm = float(direction.norm())
        if kind == "IEF":  # un-normalised: lr scaled to an update of norm 1 (clear of the parameters' rounding)
            opt = ief.optim.IEF(model, lr=1.0 / norm, damping=damping, normalize=False, check=check,
                                form=form)
        elif kind == "EF":  # normalised update of norm lr
            opt = ief.optim.EF(model, lr=1.0, damping=damping, normalize=True, check=check, form=form)
        else:
            opt = ief.optim.SF(model, lr=1.0, damping=damping, normalize=True, check=check,
                               generator=torch.Generator().manual_seed(SEED), form=form)
        found = []  # the step's record of its direction (the rows the solve used)
        direction_of = opt._direction
        opt._direction = lambda *args, _of=direction_of: found.append(_of(*args)) or found[-1]
        loss = opt.step(c.inputs, c.targets)
        if check is False:  # the steady step's finiteness, asked of the rows after the solve, as the pass over J says
            rows = found[-1].rows
            reference = ief.rows._finite_flag([rows.matrix] if isinstance(rows, ief.rows.DenseRows) else
                                              [rows.dense, *(t for _, a, g in rows.ghosts for t in (a, g))],
                                              rows.device)
            chk.close(f"{kind} step: finiteness asked after the solve vs the pass over J",
                      float(rows.finite_flag()), float(reference), 0.0)
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
        chk.close(f"{kind} step: loss vs oracle", loss, o.losses.sum(), 1e-10 if chk.dtype == torch.float64 else 1e-5)
        chk.close(f"{kind} step: update vs lr x direction function", before - after, direction / norm,
                  sensitivity=sens[kind.lower()])


ROUTES = {
    "sweep": (route_sweep, lambda m: True),
    "logit": (route_logit, lambda m: m.classifier),
    "gammas": (route_gammas, lambda m: True),
    "fvp": (route_fvp, lambda m: True),
    "forms": (route_forms, lambda m: True),
    "kfac": (route_kfac, lambda m: m.kfac_params != ()),
    "optim": (route_optim, lambda m: True),
    "steady": (lambda chk, name, c, damping: route_optim(chk, name, c, damping, check=False), lambda m: True),
    # every factored weight's rows formed a block at a time for the Gram and again for J^T c, never kept
    "streamed": (lambda chk, name, c, damping: route_optim(chk, name, c, damping, form="streamed"), lambda m: True),
}

# the slow tier (make test runs it, make test-lib leaves it out): the one case that costs ~10x its siblings, the
# undamped float32 sweep of a fully trained T5 (~57 CPU-s against ~5; a cost to look into, not a reason to drop it)
SLOW_CASES = {("sweep", "t5-full", "float32", 0.0)}

MATRIX = [
    pytest.param(route, model, dtype, lam, id=f"{route}-{model}-{dtype}-lam{lam:g}",
                 marks=[pytest.mark.slow] if (route, model, dtype, lam) in SLOW_CASES else [])
    for route, (_, applies) in ROUTES.items()
    for model, spec in rm.MODELS.items() if applies(spec)
    for dtype in DTYPES
    for lam in DAMPINGS
]


assert batch_generator(SEED, 0).initial_seed() == SEED  # evaluate's labels are the oracle's


@pytest.mark.parametrize("route, model, dtype, damping", MATRIX)
def test_route(route: str, model: str, dtype: str, damping: float) -> None:
    run, _ = ROUTES[route]
    c = rm.case(model, DTYPES[dtype])
    chk = Checker(route, model, DTYPES[dtype], damping)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ief.SlowPathWarning)  # the CNN's and GRU's loops, by design
            run(chk, model, c, damping)
    except Exception as err:  # noqa: BLE001 - the case's name goes with whatever the route raised
        raise AssertionError(f"{chk.where}: raised {type(err).__name__}: {err}") from err
    chk.done()


# ------------------------------------------------------------------------------------- property: the sweep
# no shrinking: a failure is reported as found (shrinking a failing sweep costs ~50 s of model passes)
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(
    st.integers(1, 5), st.integers(2, 4), st.integers(2, 40), st.integers(0, 3),
    st.sampled_from([0.0, 1e-12, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1.0, 100.0]), st.integers(0, 2**16),
)
def test_sweep_on_random_linear_models(features, classes, m, duplicates, damping, seed):
    """``damping_sweep`` = ``evaluate`` (per-pass) = the dense oracle for linear classifiers of every shape, P above
    and below M, with duplicated samples (``J J^T`` singular), float64."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(features, classes).double()
    x = torch.randn(m, features, dtype=torch.float64)
    x[: min(duplicates, m - 1)] = x[m - 1]
    y = torch.randint(0, classes, (m,))
    methods = ["ef", "ief"] + (["sf"] if damping > 0 else [])
    sweep = {r["method"]: r["gamma"] for r in ief.damping_sweep(model, x, y, [damping], methods,
                                                                generator=batch_generator(SEED, 0))}
    slow = {r["method"]: r["gamma"] for r in ief.evaluate(model, [(x, y)], methods, damping, seed=SEED,
                                                          logit_space=False)}
    losses, jac, sq = oracle.per_sample(model, x, y)
    o = rm.Oracle(losses.detach(), jac.detach(), sq.detach(), jac.detach().sum(0), oracle.fisher(model, x, y))
    sampled = None
    if damping > 0:
        labels = rm.draw_labels(Case("linear", model, x, y), SEED)
        sampled = oracle.per_sample(model, x, labels)[1].detach()
    exact = exact_directions(o, sampled, damping)
    sens = Sensitivity(o, sampled, torch.float64, damping).of_gammas()
    chk = Checker("sweep", f"linear({features},{classes}) P={(features + 1) * classes} M={m} duplicates={duplicates} "
                  f"seed={seed}", torch.float64, damping)
    for method in ["sgd", *methods]:
        chk.close(f"{method} gamma, sweep vs evaluate", sweep[method], slow[method], sensitivity=sens[method])
        chk.close(f"{method} gamma, sweep vs oracle", sweep[method], o.gamma(exact[method]), sensitivity=sens[method])
    chk.done()


def test_the_fast_module_walks_equal_torchs_own():
    """``ief.model_call.modules_of`` / ``parameters_of`` / ``param_names`` (walks without generators, a fixed cost of
    every Fisher-vector product) against ``model.modules()``, ``model.parameters()`` and
    ``named_parameters(remove_duplicate=False)`` (the last name of a tied parameter), on a model with a submodule
    shared by two parents, a tied weight, a ``None`` child and a ``None`` parameter, and on a T5-LoRA."""
    from ief.model_call import modules_of, param_names, parameters_of

    torch.manual_seed(0)
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(
        torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.Linear(3, 4, bias=False)),
        torch.nn.ModuleDict({"b": torch.nn.Sequential(torch.nn.Linear(4, 3), shared), "none": None}),
        torch.nn.Linear(3, 3),
    )
    model[2].weight = shared.weight  # tied: one tensor under three names
    model[0][1].register_parameter("nothing", None)
    import peft
    from transformers import T5Config, T5ForConditionalGeneration
    t5 = peft.get_peft_model(T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32,
                                                                 num_layers=2, num_heads=2, decoder_start_token_id=0)),
                             peft.LoraConfig(r=2, target_modules=["q", "v"]))
    for m in (model, t5):
        assert [id(x) for x in modules_of(m)] == [id(x) for x in m.modules()]
        assert [id(p) for p in parameters_of(m)] == [id(p) for p in m.parameters()]
        by_id = {id(p): n for n, p in m.named_parameters(remove_duplicate=False)}
        params = list(m.parameters())
        assert param_names(m, params) == [by_id[id(p)] for p in params]
    assert len(modules_of(model)) < len(list(model.named_modules(remove_duplicate=False)))  # shared: listed once


# ------------------------------------------------------------------------------ the HF decoders: what takes the loop
@pytest.mark.parametrize("model", ["llama", "qwen2-tied"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_hf_decoders_leave_no_rule_covered_parameter_to_the_loop(model: str, dtype: str) -> None:
    """Full fine-tuning of the matrix's Llama and Qwen2: the RMS norms are hooked by their rule, and Qwen2's tied
    table / head in both its modules (its rows the sum of theirs): no SlowPathWarning for either."""
    c = rm.case(model, DTYPES[dtype])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", ief.SlowPathWarning)
        ief.per_sample(copy.deepcopy(c.model), c.inputs, c.targets, check=False)
    slow = [str(w.message) for w in record if issubclass(w.category, ief.SlowPathWarning)]
    assert not slow, slow
