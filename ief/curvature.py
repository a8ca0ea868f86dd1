"""Exact Fisher(=GGN)-vector products and the paper's indicator gamma, without ever forming a ``P x P`` matrix.

For softmax cross-entropy the Fisher equals the generalised Gauss-Newton matrix (``sec:app-eval-complexity``)::

    F v = sum_n J_{z_n}^T H_n J_{z_n} v,   H_n = diag(p) - p p^T at every kept position of sample n,

and for ``loss="mse"`` ``H_n = I``. ``J_z v`` is a Jacobian-vector product of the logits, by one of two methods:

- ``"double_backward"`` (default for products): the paper's double-differentiation trick. One forward, one
  backward with ``create_graph`` giving ``u -> J_z^T u``, its derivative w.r.t. ``u`` giving ``J_z v``, and a final
  backward for ``J_z^T (H J_z v)``. :class:`FisherOperator` keeps both graphs, so further products at the same point
  cost two backward-type passes each.
- ``"forward"``: forward-mode AD (dual numbers through ``torch.func.functional_call``), which yields the logits and
  ``J_z v`` in one forward. It is the default for ``gamma``, which then needs no backward at all (``d^T F d`` and
  ``d^T grad L`` both follow from ``J_z d``). For products it was measured slower than double backward
  (``benchmarks/step.py``): when the primal must also be differentiated in reverse mode, PyTorch records the tangent
  computation in the autograd graph too.

Every pass runs inside :func:`differentiable_kernels`: scaled-dot-product attention restricted to the MATH kernel
(forward-mode AD has no rule for the fused CPU kernels, and double backward through them fails once a padding mask is
passed), torch's fused inference fast path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` switched off
(``_native_multi_head_attention`` and ``_transformer_encoder_layer_fwd``, taken in ``eval()`` mode, have no
forward-mode rule) and oneDNN (mkldnn) switched off (its float32 RNN kernel ``mkldnn_rnn_layer`` has none either). The
three compute the same function as the kernels they replace.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel

from .losses import Loss, get_loss, require_finite
from .model_call import (
    Inputs,
    ReplayableForward,
    check_targets,
    flatten,
    param_names,
    resolve_params,
    split_vector,
    unwrap_model,
)

JVP_METHODS = ("forward", "double_backward")


@contextlib.contextmanager
def differentiable_kernels() -> Iterator[None]:
    """Reference kernels that support every AD mode: MATH attention, no fused transformer fast path, no oneDNN."""
    fastpath, mkldnn = torch.backends.mha.get_fastpath_enabled(), torch.backends.mkldnn.enabled
    torch.backends.mha.set_fastpath_enabled(False)
    torch.backends.mkldnn.enabled = False  # not mkldnn.flags(): it also sets (and warns about) TF32
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        torch.backends.mkldnn.enabled = mkldnn


def check_logits(loss: Loss, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """The loss's shape checks, then ``FloatingPointError`` for logits the loss cannot use (NaN, ...)."""
    loss.check(logits, targets)
    check_finite = getattr(loss, "check_finite", None)  # a user-defined Loss may not have it
    check_finite(logits, targets) if check_finite is not None else require_finite(logits)


class ForwardModeUnsupported(NotImplementedError):
    """An operation of the model has no forward-mode AD rule (the message names the module and the way out)."""


def _dual_forward(forward, params, names, tangents):
    with forward_ad.dual_level():
        duals = {n: forward_ad.make_dual(p, t) for n, p, t in zip(names, params, tangents)}
        return forward_ad.unpack_dual(forward(substitute=duals))


def _unsupported_message(forward, params, names, tangents, err: NotImplementedError) -> str:
    """Re-run the failing dual forward with hooks that track the running modules: name the innermost one."""
    running: list[str] = []

    def leave(module, args, output) -> None:  # returns None: the output is left as it is
        running.pop()

    handles = []
    for name, module in forward.model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda mod, args, n=name: running.append(n)))
        handles.append(module.register_forward_hook(leave))
    try:
        _dual_forward(forward, params, names, tangents)
    except NotImplementedError:
        pass
    finally:
        for h in handles:
            h.remove()
    where = "the model's own forward (outside any submodule)"
    if running and running[-1]:
        module = forward.model.get_submodule(running[-1])
        where = f"module {running[-1]!r} ({type(module).__name__})"
    reason = str(err).splitlines()[0].rstrip(".") if str(err) else type(err).__name__
    return (
        f"forward-mode AD is not available in {where}: {reason}. Use method='double_backward' (fisher_vp, "
        "FisherOperator, hessian_free), which needs reverse mode only; gamma and check='exact' switch to it by "
        "themselves"
    )


# Models whose forward has no forward-mode rule somewhere: gamma and the exact check go straight to double backward.
_NO_FORWARD_MODE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def jvp_any_mode(
    forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str], tangents: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, J_z v)`` by forward mode, or by double backward where the model has no forward-mode rule (same value);
    logits detached."""
    if forward.model not in _NO_FORWARD_MODE:
        try:
            with torch.no_grad():
                logits, jv = logits_and_jvp(forward, params, names, tangents, "forward")
            return logits.detach(), jv
        except ForwardModeUnsupported:
            _NO_FORWARD_MODE[forward.model] = True
    with torch.enable_grad():
        logits, jv = logits_and_jvp(forward, params, names, tangents, "double_backward")
    return logits.detach(), jv


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
    with differentiable_kernels(), torch.inference_mode(False), torch.set_grad_enabled(grad_mode):
        if method == "forward":
            try:
                primal, tangent = _dual_forward(forward, params, names, tangents)
            except NotImplementedError as err:
                raise ForwardModeUnsupported(_unsupported_message(forward, params, names, tangents, err)) from err
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


class FisherOperator:
    """The exact Fisher (= GGN) at one point, as a linear operator ``v -> F v`` that never forms ``P x P``.

    Built once per point (model, batch); ``.gradient`` is the batch gradient from the same forward. With
    ``method="double_backward"`` (default) the forward graph and the graph of ``u -> J_z^T u`` are built once and
    every product costs two backward-type passes (``J_z v`` by differentiating ``J_z^T u`` w.r.t. ``u``, then
    ``J_z^T (H J_z v)``), so repeated products (a CG solve) do not repeat the forward. With ``method="forward"``
    every product is a fresh dual-number forward plus a backward, replaying the same dropout masks.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: Inputs,
        targets: torch.Tensor,
        params: Iterable[torch.nn.Parameter] | None = None,
        *,
        loss: str | Loss = "cross_entropy",
        method: str = "double_backward",
    ):
        if method not in JVP_METHODS:
            raise ValueError(f"unknown method {method!r}; accepted: {', '.join(map(repr, JVP_METHODS))}")
        self.loss = get_loss(loss)
        model = unwrap_model(model)
        check_targets(targets)
        self.params = resolve_params(model, params)
        self.names = param_names(model, self.params)
        self.targets = targets
        self.method = method
        self._forward = ReplayableForward(model, inputs)
        with _autograd_on():
            self.logits = self._forward()
            check_logits(self.loss, self.logits, targets)
            losses = self.loss.per_sample(self.logits, targets)
            grads = torch.autograd.grad(losses.sum(), self.params, retain_graph=True, allow_unused=True)
            self.gradient = flatten(grads, self.params).detach()
            if method == "double_backward":
                self._probe = torch.zeros_like(self.logits, requires_grad=True)
                vjp = torch.autograd.grad(self.logits, self.params, self._probe, create_graph=True, allow_unused=True)
                self._vjp = [(k, g) for k, g in enumerate(vjp) if g is not None and g.requires_grad]

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        """``F v``, ``[P]``."""
        tangents = split_vector(vector, self.params)
        with _autograd_on():
            if self.method == "forward":
                logits, jv = logits_and_jvp(self._forward, self.params, self.names, tangents, "forward")
            else:
                logits = self.logits
                if self._vjp:
                    (jv,) = torch.autograd.grad(
                        [g for _, g in self._vjp], self._probe, [tangents[k] for k, _ in self._vjp], retain_graph=True
                    )
                else:
                    jv = torch.zeros_like(logits)
            hjv = self.loss.hessian_vp(logits.detach(), self.targets, jv.detach())
            grads = torch.autograd.grad(logits, self.params, hjv, retain_graph=True, allow_unused=True)
        return flatten(grads, self.params)

    __matmul__ = matvec


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Reverse-mode AD on, inference mode off, reference kernels (:func:`differentiable_kernels`)."""
    with differentiable_kernels(), torch.inference_mode(False), torch.enable_grad():
        yield


def fisher_vp(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    vector: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    method: str = "double_backward",
) -> torch.Tensor:
    """Exact Fisher (= GGN) times ``vector``, summed over samples and kept positions, ``[P]``.

    ``F v = sum_n J_{z_n}^T H_n J_{z_n} v`` (``sec:app-eval-complexity``). ``method="double_backward"`` (default):
    the double-differentiation trick, 1 forward + 3 backward-type passes; ``method="forward"``: a dual-number
    forward for ``J_z v`` + 1 backward. The default is the one measured faster (``benchmarks/step.py``): PyTorch's
    forward-mode AD also records the tangent computation in the autograd graph when the primal needs a backward.
    For many products at one point, build a :class:`FisherOperator` once.
    """
    return FisherOperator(model, inputs, targets, params, loss=loss, method=method).matvec(vector)


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
    The default ``method="forward"`` needs a single dual-number forward and no backward: ``d^T F d`` and
    ``d^T grad L`` both follow from ``J_z d`` (where a layer has no forward-mode rule, e.g. a custom
    ``autograd.Function`` without ``jvp``, the same ``J_z d`` comes from double backward). Raises
    ``FloatingPointError`` for logits the loss cannot use (NaN, ``+inf``, or a position whose every class is
    ``-inf``); ``-inf`` masking of some classes is fine.
    """
    loss_fn = get_loss(loss)
    model = unwrap_model(model)
    check_targets(targets)
    params = resolve_params(model, params)
    tangents = split_vector(direction, params)
    if not any(bool(t.ne(0).any()) for t in tangents):
        raise ValueError("gamma of a zero direction is undefined (0/0)")
    if method not in JVP_METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join(map(repr, JVP_METHODS))}")
    forward = ReplayableForward(model, inputs)
    names = param_names(model, params)
    if method == "forward":  # falls back to double backward where a layer has no forward-mode rule
        logits, jd = jvp_any_mode(forward, params, names, tangents)
    else:
        with torch.enable_grad():
            logits, jd = logits_and_jvp(forward, params, names, tangents, method)
    logits = logits.detach()
    check_logits(loss_fn, logits, targets)
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
