"""Exact Fisher(=GGN)-vector products and the paper's indicator gamma, without ever forming a ``P x P`` matrix.

For softmax cross-entropy the Fisher equals the generalised Gauss-Newton matrix (``sec:app-eval-complexity``)::

    F v = sum_n J_{z_n}^T H_n J_{z_n} v,   H_n = diag(p) - p p^T at every kept position of sample n,

and for ``loss="mse"`` ``H_n = I``. ``J_z v`` is a Jacobian-vector product of the logits. By default it comes from
forward-mode AD (dual numbers through ``torch.func.functional_call``), which yields the logits *and* ``J_z v`` in one
forward; a reverse pass then gives ``J_z^T (H J_z v)``. So ``F v`` costs one dual forward and one backward, against
the paper's 2 forward + 2 backward passes of the double-differentiation trick (available as
``method="double_backward"``). ``gamma`` needs no backward at all: ``d^T F d`` and ``d^T grad L`` both follow from
``J_z d``.

Both methods run inside ``sdpa_kernel(SDPBackend.MATH)``: forward-mode AD has no rule for the fused CPU
scaled-dot-product attention kernels, and double backward through them fails once a padding mask is passed.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

from .losses import Loss, get_loss
from .model_call import Inputs, ReplayableForward, flatten, param_names, resolve_params, split_vector

JVP_METHODS = ("forward", "double_backward")


@contextlib.contextmanager
def differentiable_attention() -> Iterator[None]:
    """Restrict scaled-dot-product attention to the reference (MATH) kernel, which supports every AD mode."""
    with sdpa_kernel(SDPBackend.MATH):
        yield


def logits_and_jvp(
    forward: ReplayableForward,
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    tangents: Sequence[torch.Tensor],
    method: str = "forward",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, J_z v)``: logits still attached to the autograd graph of ``params``, and their JVP (detached)."""
    if method not in JVP_METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join(map(repr, JVP_METHODS))}")
    # inference mode drops forward-mode tangents: leave it for these passes, keeping the caller's grad mode
    grad_mode = torch.is_grad_enabled()
    with differentiable_attention(), torch.inference_mode(False), torch.set_grad_enabled(grad_mode):
        if method == "forward":
            with forward_ad.dual_level():
                duals = {n: forward_ad.make_dual(p, t) for n, p, t in zip(names, params, tangents)}
                primal, tangent = forward_ad.unpack_dual(forward(substitute=duals))
            if tangent is None:  # the logits do not depend on params (inference mode is switched off above)
                tangent = torch.zeros_like(primal)
            return primal, tangent.detach()
        logits = forward()
        probe = torch.zeros_like(logits, requires_grad=True)
        vjp = torch.autograd.grad(logits, params, probe, create_graph=True, allow_unused=True)
        pairs = [(g, t) for g, t in zip(vjp, tangents) if g is not None and g.requires_grad]
        if not pairs:
            return logits, torch.zeros_like(logits)
        (jv,) = torch.autograd.grad([g for g, _ in pairs], probe, [t for _, t in pairs])
        return logits, jv.detach()


def fisher_vp(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    vector: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    method: str = "forward",
) -> torch.Tensor:
    """Exact Fisher (= GGN) times ``vector``, summed over samples and kept positions, ``[P]``.

    One forward-mode pass for ``J_z v`` and one backward for ``J_z^T H J_z v`` (``sec:app-eval-complexity``).
    """
    loss_fn = get_loss(loss)
    params = resolve_params(model, params)
    tangents = split_vector(vector, params)
    forward = ReplayableForward(model, inputs)
    with torch.enable_grad():
        return _fisher_vp_at(forward, params, param_names(model, params), tangents, loss_fn, targets, method)


def _fisher_vp_at(forward, params, names, tangents, loss_fn: Loss, targets, method: str) -> torch.Tensor:
    logits, jv = logits_and_jvp(forward, params, names, tangents, method)
    loss_fn.check(logits, targets)
    hjv = loss_fn.hessian_vp(logits.detach(), targets, jv)
    with differentiable_attention():
        grads = torch.autograd.grad(logits, params, hjv, allow_unused=True)
    return flatten(grads, params)


def gradient_at(forward: ReplayableForward, params: Sequence[torch.Tensor], loss_fn: Loss, targets) -> torch.Tensor:
    """``grad L`` (flat, detached) from one forward and backward of ``forward``."""
    with torch.enable_grad():
        logits = forward()
        loss_fn.check(logits, targets)
        grads = torch.autograd.grad(loss_fn.per_sample(logits, targets).sum(), params, allow_unused=True)
    return flatten(grads, params).detach()


def gamma(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    direction: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    method: str = "forward",
) -> float:
    """The indicator ``gamma(d) = sqrt(d^T F d) / |d^T grad L|`` (Section ``sec:eval_framework``).

    Smaller is a better approximation of the natural gradient direction; it is invariant to the scale and sign of
    ``d``. ``inf`` when ``d`` is orthogonal to the gradient. Raises ``ValueError`` for a zero direction.
    """
    loss_fn = get_loss(loss)
    params = resolve_params(model, params)
    tangents = split_vector(direction, params)
    if not any(bool(t.ne(0).any()) for t in tangents):
        raise ValueError("gamma of a zero direction is undefined (0/0)")
    forward = ReplayableForward(model, inputs)
    with torch.no_grad() if method == "forward" else torch.enable_grad():
        logits, jd = logits_and_jvp(forward, params, param_names(model, params), tangents, method)
    logits = logits.detach()
    loss_fn.check(logits, targets)
    jd64, z64 = jd.to(torch.float64), logits.to(torch.float64)
    curvature = float((jd64 * loss_fn.hessian_vp(z64, targets, jd64)).sum())
    slope = float((loss_fn.logit_grad(z64, targets) * jd64).sum())
    return gamma_from(curvature, slope)


def gamma_from(curvature: float, slope: float) -> float:
    """``sqrt(d^T F d) / |d^T g|`` from its two scalars; ``inf`` for zero slope."""
    curvature = max(curvature, 0.0)  # PSD up to rounding
    if slope == 0.0:
        return math.inf
    return math.sqrt(curvature) / abs(slope)
