"""The per-sample logit Jacobian ``J_z`` of a batch, and every evaluation quantity that follows from it exactly
(Algorithm 4, Appendix F.1): the algebraic shortcut of the evaluation jobs.

Every quantity of the evaluation framework is a function of ``J_z`` (the Jacobian of the kept logit entries with
respect to the trainable parameters, ``[N, P]`` with ``N`` = kept positions x classes) and the logits ``z``:

- the per-sample gradients for any labels: ``J[n] = sum_{(t,c) of n} (grad_z l_n)[t,c] J_z[(n,t,c)]`` (true labels:
  EF / iEF / SGD; labels drawn from the model: SF), and ``s_iEF = ||grad_z l_n||^2``;
- ``gamma(d)``: ``d^T F d = u^T H u`` and ``d^T grad L = r^T u`` with ``u = J_z d`` (``H`` the loss's logit Hessian,
  ``r = grad_z L``), as :func:`ief.gamma` computes them from one forward-mode pass;
- Fisher-vector products ``F v = J_z^T H J_z v`` for Hessian-free CG.

``J_z`` costs one per-sample backward per (kept position, class) of the largest sample (``C`` passes for a
classifier), instead of one full-batch forward-mode pass per ``gamma``, two passes per CG step and ``2M`` passes for a
damping sweep. It pays when a sample has few logit entries (a classifier: 3 classes for the cpu tweets setups, 10
for digits) and ``N x P`` fits in memory; :func:`logit_jacobian` returns ``None`` otherwise (a T5 vocabulary of
32 128 classes), and the callers use the per-pass route. Both routes are the same mathematics; the tests compare them
to ~1e-10 in float64.

Rows are formed by :func:`ief.per_sample` with a linear "loss" that picks one logit entry per sample, so they inherit
its hooks, its exact fallbacks and its guard (the rows of every pass must sum to the autograd gradient).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from .jacobian import per_sample
from .losses import IGNORE_INDEX, Loss, get_loss, logit_sqnorm
from .model_call import Inputs, ReplayableForward, check_targets, resolve_params, unwrap_model

DEFAULT_MAX_BYTES = 1 << 30  # J_z held in float64 up to 1 GiB


class _LogitEntry:
    """A linear "loss" ``l_n = <S_n, z_n>`` (``S`` one-hot on one logit entry per sample, or zero): its per-sample
    gradients are rows of the logit Jacobian. Implements the :class:`ief.losses.Loss` protocol."""

    name = "logit_entry"

    def __init__(self, selector: torch.Tensor):
        self.selector = selector  # [logits shape], 0/1

    def check(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        if tuple(logits.shape) != tuple(self.selector.shape):
            raise ValueError(f"logits of shape {tuple(logits.shape)}; expected {tuple(self.selector.shape)}")

    def check_finite(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        pass

    def per_sample(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return (logits * self.selector.to(logits.dtype)).reshape(logits.shape[0], -1).sum(dim=1)

    def logit_grad(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.selector.to(logits.dtype)

    def hessian_vp(self, logits: torch.Tensor, targets: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(v)

    def sample_targets(self, logits, targets, generator):  # pragma: no cover - never sampled
        raise NotImplementedError("a logit entry has no predictive distribution")


def _kept(logits: torch.Tensor, targets: torch.Tensor, loss: Loss) -> torch.Tensor:
    """``[M, T...]`` bool over the logits' leading dims: positions that enter the loss."""
    if loss.name == "cross_entropy":
        return targets != IGNORE_INDEX
    return torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)


class LogitJacobian:
    """``J_z`` of one batch: ``rows [N, P]`` float64, ``entries [N, ndim]`` (the logit index of every row) and the
    detached float64 ``logits``; see the module docstring for what it gives."""

    def __init__(self, rows: torch.Tensor, entries: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                 loss: Loss, dtype: torch.dtype):
        self.rows, self.entries, self.logits, self.targets, self.loss = rows, entries, logits, targets, loss
        self.dtype = dtype  # the parameters' dtype: directions handed out in it
        self.m = logits.shape[0]
        self._index = tuple(entries.T)

    def _scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[R, N] -> [R, *logits.shape]`` (zeros at the logit entries that are not rows)."""
        out = values.new_zeros((values.shape[0], *self.logits.shape))
        out[(slice(None), *self._index)] = values
        return out

    def jvp(self, directions: torch.Tensor) -> torch.Tensor:
        """``J_z d`` for every row ``d`` of ``directions [R, P]``: ``[R, *logits.shape]`` float64."""
        return self._scatter(directions.to(torch.float64) @ self.rows.T)

    def per_sample_gradients(self, targets: torch.Tensor) -> torch.Tensor:
        """``[M, P]`` float64: ``grad_theta l_n`` for the given labels, ``sum (grad_z l_n) J_z``."""
        coef = self.loss.logit_grad(self.logits, targets)[self._index]  # [N]
        out = torch.zeros(self.m, self.rows.shape[1], dtype=torch.float64, device=self.rows.device)
        out.index_add_(0, self.entries[:, 0], coef.unsqueeze(1) * self.rows)
        return out

    def logit_sqnorm(self, targets: torch.Tensor) -> torch.Tensor:
        """``s_iEF [M]`` for the given labels (the unnumbered equation after Eq. (8))."""
        return logit_sqnorm(self.loss, self.logits, targets)

    def sample_targets(self, generator: torch.Generator | None) -> torch.Tensor:
        """Labels drawn from the model at every kept position, exactly as :func:`ief.sampled_jacobian` draws them
        (the same function on the same logits, cast back to the model's dtype)."""
        return self.loss.sample_targets(self.logits.to(self.dtype), self.targets, generator)

    def curvature_and_slope(self, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(d^T F d [R], d^T grad L [R])`` for every row of ``directions [R, P]``."""
        u = self.jvp(directions)
        z = self.logits.unsqueeze(0).expand_as(u)
        y = self.targets.unsqueeze(0).expand(u.shape[0], *self.targets.shape)
        hu = self.loss.hessian_vp(z.reshape(-1, *z.shape[2:]), y.reshape(-1, *y.shape[2:]),
                                  u.reshape(-1, *u.shape[2:])).reshape(u.shape)
        r = self.loss.logit_grad(self.logits, self.targets)
        return (u * hu).reshape(u.shape[0], -1).sum(1), (u * r).reshape(u.shape[0], -1).sum(1)

    def fisher_vp(self, v: torch.Tensor) -> torch.Tensor:
        """``F v = J_z^T H J_z v`` ``[P]`` (the exact Fisher / GGN of the batch, as :class:`ief.FisherOperator`)."""
        u = self.jvp(v.reshape(1, -1))[0]
        hu = self.loss.hessian_vp(self.logits, self.targets, u)
        return (hu[self._index] @ self.rows).to(v.dtype)


def logit_jacobian(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    max_entries: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> LogitJacobian | None:
    """``J_z`` of the batch, or ``None`` when it would take more than ``max_entries`` per-sample backward passes
    (default: the batch size ``M``, the break-even with ``M`` forward-mode passes) or more than ``max_bytes``."""
    loss_fn = get_loss(loss)
    model = unwrap_model(model)
    m = check_targets(targets)
    params = resolve_params(model, params)
    n_params = sum(p.numel() for p in params)
    with torch.no_grad():
        logits = ReplayableForward(model, inputs)().detach()
    loss_fn.check(logits, targets)
    keep = _kept(logits, targets, loss_fn).reshape(m, -1)  # [M, T]
    per_sample_kept = keep.sum(dim=1)
    passes = int(per_sample_kept.max()) * logits.shape[-1]
    n_rows = int(per_sample_kept.sum()) * logits.shape[-1]
    if passes > (m if max_entries is None else max_entries) or n_rows * n_params * 8 > max_bytes:
        return None
    positions = [torch.nonzero(keep[n]).flatten() for n in range(m)]  # kept positions of every sample
    flat_shape = (m, keep.shape[1], logits.shape[-1])
    rows, entries = [], []
    for j in range(int(per_sample_kept.max())):
        owners = [n for n in range(m) if len(positions[n]) > j]
        for c in range(logits.shape[-1]):
            selector = torch.zeros(flat_shape, dtype=logits.dtype, device=logits.device)
            for n in owners:
                selector[n, positions[n][j], c] = 1
            selector = selector.reshape(logits.shape)
            jac = per_sample(model, inputs, targets, params, loss=_LogitEntry(selector)).jacobian
            rows.append(jac[owners].to(torch.float64))
            for n in owners:
                flat = torch.tensor([n, int(positions[n][j]), c])
                entries.append(_unflatten(flat, logits.shape))
    return LogitJacobian(torch.cat(rows), torch.stack(entries), logits.to(torch.float64), targets, loss_fn,
                         params[0].dtype if params else torch.float32)


def logit_route(model, inputs, targets, params, loss, logit_space) -> LogitJacobian | None:
    """The batch's ``J_z`` when the logit-space route is chosen, else ``None``: the one rule of the evaluation.

    ``logit_space``: a :class:`LogitJacobian` (reused as it is), ``False`` (never), ``True`` (always; ``ValueError``
    when ``J_z`` is too large) or ``None`` (when the model is in eval mode, so that every pass sees the same function,
    and ``J_z`` is small: see :func:`logit_jacobian`).
    """
    if isinstance(logit_space, LogitJacobian):
        return logit_space
    if logit_space is False:
        return None
    if logit_space is None and any(mod.training for mod in model.modules()):
        return None  # dropout would draw different masks in every pass: one pass per quantity instead
    lj = logit_jacobian(model, inputs, targets, params, loss=loss)
    if lj is None and logit_space is True:
        raise ValueError("logit_space=True, but the batch's logit Jacobian is too large (more logit entries per "
                         "sample than samples, or over ief.logit_space.DEFAULT_MAX_BYTES); use logit_space=None")
    return lj


def _unflatten(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``(n, flat position, class)`` -> that entry's index in logits of ``shape`` (``[M, C]`` or ``[M, ..., C]``)."""
    n, t, c = (int(x) for x in flat)
    middle = list(torch.unravel_index(torch.tensor(t), tuple(shape[1:-1]))) if len(shape) > 2 else []
    return torch.tensor([n, *[int(x) for x in middle], c])


__all__ = ["LogitJacobian", "logit_jacobian", "logit_route"]
