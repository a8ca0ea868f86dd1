"""Exact Fisher(=GGN)-vector products and the paper's indicator gamma, without ever forming a ``P x P`` matrix.

For softmax cross-entropy the Fisher equals the generalised Gauss-Newton matrix (Appendix F.1.1)::

    F v = sum_n J_{z_n}^T H_n J_{z_n} v,   H_n = diag(p) - p p^T at every kept position of sample n,

and for ``loss="mse"`` ``H_n = I``. ``J_z v``, the logits' Jacobian-vector product, comes from :mod:`ief.logit_jvp`
by one of two methods:

- ``"double_backward"`` (the default of :class:`FisherOperator`): the paper's double-differentiation trick. One
  forward, one backward with ``create_graph`` giving ``u -> J_z^T u``, its derivative w.r.t. ``u`` giving ``J_z v``, and
  a final backward for ``J_z^T (H J_z v)``. :class:`FisherOperator` keeps both graphs, so further products at the same
  point cost two backward-type passes each, and the graph-building backward also yields ``grad L``.
- ``"forward"``: one fused dual-number forward gives the logits and ``J_z v`` together, then one backward of
  ``J_z^T (H J_z v)`` through the primal graph (the floor: one forward with its tangents, one backward). It is what
  :func:`fisher_vp`'s default ``"auto"`` takes for a single product (double backward where a layer has no forward-mode
  rule), the default for :func:`gamma`, which then needs no backward at all (``d^T F d`` and ``d^T grad L`` both follow
  from ``J_z d``), and for :func:`gammas`, which rates ``K`` directions from one forward carrying ``K`` tangents.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch.utils.weak import WeakIdKeyDictionary

from .logit_jvp import (
    JVP_METHODS,
    NO_FORWARD_MODE,
    ForwardModeUnsupported,
    batched_jvps,
    differentiable_kernels,
    double_backward_jvps,
    jvp_any_mode,
    logits_and_jvp,
)
from .losses import CrossEntropy, Loss, MeanSquaredError, get_loss, require_finite
from .model_call import (
    Inputs,
    ReplayableForward,
    all_finite,
    check_targets,
    nonfinite_message,
    nonfinite_samples,
    flatten,
    param_names,
    resolve_params,
    split_vector,
    unwrap_model,
)

def check_logits(loss: Loss, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """The loss's shape checks, then ``FloatingPointError`` for logits the loss cannot use (NaN, ...).

    For the package's own losses (whose checks depend only on the targets' values and the logits' shape, and which
    accept every finite logit) a passed targets check is remembered per targets tensor, its version counter (any
    in-place change bumps it) and the logits' shape and dtype, and finite logits are accepted by one reduction: a
    Fisher-vector product otherwise pays, on every call, for checks it has already passed (on a small model a
    visible share of the call: ``benchmarks/README.md``)."""
    own = type(loss) in _OWN_LOSSES and not targets.is_inference()  # an inference tensor has no version counter
    key = (targets._version, tuple(logits.shape), logits.dtype, type(loss)) if own else None
    if not (own and _CHECKED_TARGETS.get(targets) == key):
        loss.check(logits, targets)
        if own:
            _CHECKED_TARGETS[targets] = key
    if own and bool(torch.isfinite(logits).all()):
        return
    check_finite = getattr(loss, "check_finite", None)  # a user-defined Loss may not have it
    check_finite(logits, targets) if check_finite is not None else require_finite(logits)


# The package's losses: their check() depends on the targets and the logits' shape only; every finite logit passes
# their check_finite().
_OWN_LOSSES = (CrossEntropy, MeanSquaredError)
# targets -> (version, logits shape, logits dtype, loss type) of its last passed check (see check_logits).
_CHECKED_TARGETS: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


class FisherOperator:
    """The exact Fisher (= GGN) at one point, as a linear operator ``v -> F v`` that never forms ``P x P``.

    Built once per point (model, batch). ``.gradient`` is the batch gradient ``grad L`` at the same point (same
    dropout masks), computed when first read. Per product:

    - ``method="double_backward"`` (default; the paper's double-differentiation trick, Appendix F.1.1):
      the forward graph and the graph of ``u -> J_z^T u`` are built once, at construction; every product then costs
      two backward-type passes (``J_z v`` by differentiating ``J_z^T u`` w.r.t. ``u``, then ``J_z^T (H J_z v)``), so
      repeated products (a CG solve) never repeat the forward. The probe ``u`` is given the value of the logit
      gradient ``dL/dz``: ``J_z^T u`` is linear in ``u``, so ``J_z v`` does not depend on that value, and the pass
      that builds the graph yields ``grad L = J_z^T dL/dz`` for free.
    - ``method="forward"``: one fused dual-number forward gives the logits and ``J_z v`` together, then one backward
      of ``J_z^T (H J_z v)`` through the primal graph; nothing is built at construction. Every product replays the
      same dropout masks. Raises :class:`ForwardModeUnsupported` (naming the module) where a layer has no
      forward-mode rule. Under activation checkpointing (the backward's recomputation cannot replay a dual forward:
      ``CheckpointError``) the tangents come from a dual forward without graph and the graph from a plain forward,
      remembered per model.

    What Hessian-free CG (:func:`ief.hessian_free`, Algorithm 5) multiplies by.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (the package's conventions, :mod:`ief`).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored, or float targets (``loss="mse"``).
        params: the parameters ``theta`` of ``F`` (default ``None``: the model's trainable ones).
        loss: ``"cross_entropy"`` (default) or ``"mse"`` (``F`` is then the Gauss-Newton matrix).
        method: ``"double_backward"`` (default) or ``"forward"``, as above.

    Raises:
        ValueError: an unknown ``method`` or ``loss``, or a bad batch (as :func:`ief.per_sample`).
        FloatingPointError: a logit that is NaN or ``+inf``, or a position whose every class is ``-inf``.
        ForwardModeUnsupported: ``method="forward"`` on a layer without a forward-mode rule.
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
        self._gradient: torch.Tensor | None = None
        self._checked = False
        self.last_jv: torch.Tensor | None = None
        if method == "double_backward":
            self._build_double_backward()

    def _build_double_backward(self) -> None:
        """The forward graph and the graph of ``u -> J_z^T u`` (the first forward draws the dropout masks, every later
        one replays them: a switch from the forward method keeps the point)."""
        self.method = "double_backward"
        with _autograd_on():
            self.logits = self._forward()
            self._check(self.logits)
            # u = dL/dz: J_z^T u is then grad L (free), and d(J_z^T u)/du does not depend on u's value
            self._probe = self.loss.logit_grad(self.logits.detach(), self.targets).requires_grad_(True)
            vjp = torch.autograd.grad(self.logits, self.params, self._probe, create_graph=True, allow_unused=True)
            self._gradient = flatten([None if g is None else g.detach() for g in vjp], self.params)
            self._vjp = [(k, g) for k, g in enumerate(vjp) if g is not None and g.requires_grad]

    def _check(self, logits: torch.Tensor) -> None:
        if not self._checked:
            check_logits(self.loss, logits.detach(), self.targets)
            self._checked = True

    @property
    def gradient(self) -> torch.Tensor:
        """``grad L`` at this point, ``[P]`` (the same dropout masks as every product)."""
        if self._gradient is None:
            with _autograd_on():
                logits = self._forward()
                self._check(logits)
                grad_z = self.loss.logit_grad(logits.detach(), self.targets)
                grads = torch.autograd.grad(logits, self.params, grad_z, allow_unused=True)
            self._gradient = flatten(grads, self.params)
        return self._gradient

    def matvec(self, vector: torch.Tensor) -> torch.Tensor:
        """``F v``, ``[P]``: two backward-type passes (``method="double_backward"``) or one dual forward and one
        backward (``method="forward"``).

        Args:
            vector: ``v`` ``[P]``, in the order of the operator's parameters.

        Returns:
            ``F v`` ``[P]`` in the parameters' dtype.

        Raises:
            ValueError: ``vector`` not ``[P]``.
        """
        tangents = split_vector(vector, self.params)
        with _autograd_on():
            if self.method == "forward":
                logits, jv = self._forward_jvp(tangents)
            else:
                logits = self.logits
                if self._vjp:
                    (jv,) = torch.autograd.grad(
                        [g for _, g in self._vjp], self._probe, [tangents[k] for k, _ in self._vjp], retain_graph=True
                    )
                else:
                    jv = torch.zeros_like(logits)
            self.last_jv = jv.detach()  # J_z v of the last product: its non-finite rows name the samples
            hjv = self.loss.hessian_vp(logits.detach(), self.targets, jv.detach())
            retain = self.method == "double_backward"  # the forward method's graph serves this one product only
            try:
                grads = torch.autograd.grad(logits, self.params, hjv, retain_graph=retain, allow_unused=True)
            except torch.utils.checkpoint.CheckpointError:
                if self.method != "forward" or self._forward.model in _RECOMPUTES_FORWARD:
                    raise
                # activation checkpointing recomputed the block outside the dual forward: one plain forward instead
                _RECOMPUTES_FORWARD[self._forward.model] = True
                logits = self._forward()
                grads = torch.autograd.grad(logits, self.params, hjv, allow_unused=True)
        return flatten(grads, self.params)

    def _forward_jvp(self, tangents: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z attached to the graph of params, J_z v)`` by forward mode: one dual forward; for a model that
        checkpoints activations (:data:`_RECOMPUTES_FORWARD`) the tangents from a dual forward without graph and the
        graph from a plain forward (same dropout masks), since the backward's recomputation of a checkpointed block
        runs outside the dual forward and would not match what it saved."""
        if self._forward.model in _RECOMPUTES_FORWARD:
            with torch.no_grad():
                _, jv = logits_and_jvp(self._forward, self.params, self.names, tangents, "forward")
            logits = self._forward()
        else:
            logits, jv = logits_and_jvp(self._forward, self.params, self.names, tangents, "forward")
        self._check(logits)
        return logits, jv

    __matmul__ = matvec


# Models whose activation checkpointing cannot replay a dual forward's saved tensors (``CheckpointError`` in the
# backward): FisherOperator's forward method takes its graph from a plain forward for them.
_RECOMPUTES_FORWARD: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Reverse-mode AD on, inference mode off, reference kernels (:func:`differentiable_kernels`)."""
    with differentiable_kernels(), torch.inference_mode(False), torch.enable_grad():
        yield


FVP_METHODS = ("auto", *JVP_METHODS)


def fisher_vp(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    vector: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    method: str = "auto",
) -> torch.Tensor:
    """Exact Fisher (= GGN) times ``vector``, summed over samples and kept positions, ``[P]``.

    ``F v = sum_n J_{z_n}^T H_n J_{z_n} v`` (Appendix F.1.1). Methods:

    - ``"forward"``: one dual-number forward gives ``z`` and ``J_z v`` together, then one backward of
      ``J_z^T (H J_z v)``: forward + tangents + backward. Raises :class:`ForwardModeUnsupported` (naming the module)
      where a layer has no forward-mode rule.
    - ``"double_backward"``: the paper's double-differentiation trick with the forward graph shared: one forward, one
      backward with ``create_graph`` (``u -> J_z^T u``), one backward-type pass through it for ``J_z v``, one
      backward for ``J_z^T (H J_z v)``: forward + 3 backward-type passes, reverse mode only.
    - ``"auto"`` (default): ``"forward"``, and ``"double_backward"`` (same dropout masks, same value) on a model
      where a layer has no forward-mode rule (remembered per model). One product by forward mode was cheaper on
      every benchmark model; for many products at one point (a CG solve), build a :class:`FisherOperator` once
      (double backward: two backward-type passes per further product).

    Cost model, against one gradient ``G = F + B`` (forward with graph ``F``, backward ``B``). Forward mode costs
    ``F + T + B``, and the tangents ``T`` cost about what the backward costs (a layer's ``dW x + W dx`` are the
    products of its ``dW`` and ``dx``), so its floor is ``(F + 2B) / G``; double backward costs ``F`` plus three
    backward-type passes, floor ``(F + 3B) / G``. A model whose frozen forward dominates (LoRA, ``F >> B``) gets
    close to one gradient; a small fully trainable MLP (``B ~ 2F``) cannot go below ``~1.67 G``. The measured ratios,
    per model and machine, are in ``benchmarks/results/step-*.json`` (``python -m benchmarks.step``), and beside the
    bound in ``benchmarks/results/fvp-*.json`` (``python -m benchmarks fvp``). What stands between them: the tangent
    GEMMs cost what the backward's do, but the dual forward also writes the ``[P]`` tangent copies ``make_dual`` needs
    (and the product its ``[P]`` result) into fresh memory every call, pays forward-AD bookkeeping per operation, and
    runs PyTorch's elementwise tangent rules (attention, normalisation, dropout), so ``T`` exceeds ``B``.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (the package's conventions, :mod:`ief`).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored, or float targets (``loss="mse"``).
        vector: ``v`` ``[P]``, in the order of ``params``.
        params: the parameters of ``F`` (default ``None``: the model's trainable ones).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        method: ``"auto"`` (default), ``"forward"`` or ``"double_backward"``, as above.

    Returns:
        ``F v`` ``[P]`` in the parameters' dtype.

    Raises:
        ValueError: ``vector`` not ``[P]``, an unknown ``method`` or ``loss``, or a bad batch (as
            :func:`ief.per_sample`).
        FloatingPointError: a logit that is NaN or ``+inf``, or a position whose every class is ``-inf`` (masking
            some classes with ``-inf`` is fine); a non-finite product (an inf input behind finite logits), naming
            the samples, with the optimisers' message (:func:`ief.model_call.nonfinite_message`).
        ForwardModeUnsupported: ``method="forward"`` on a layer without a forward-mode rule (e.g. a custom
            ``autograd.Function`` without ``jvp``), naming the module; ``"auto"`` switches by itself.
    """
    if method not in FVP_METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join(map(repr, FVP_METHODS))}")
    automatic = method == "auto"
    if automatic:
        method = "double_backward" if unwrap_model(model) in NO_FORWARD_MODE else "forward"
    operator = FisherOperator(model, inputs, targets, params, loss=loss, method=method)
    try:
        product = operator.matvec(vector)
    except ForwardModeUnsupported:
        if not automatic:
            raise
        NO_FORWARD_MODE[operator._forward.model] = True
        operator._build_double_backward()  # replays the masks the failed dual forward drew
        product = operator.matvec(vector)
    refuse_nonfinite_product(product, inputs, targets.shape[0], "Fisher-vector product",
                             "the product is refused rather than returned as a non-finite vector", operator.last_jv)
    return product


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
    """The indicator ``gamma(d) = sqrt(d^T F d) / |d^T grad L|`` (Section Sec. 6).

    Smaller is a better approximation of the natural gradient direction; it is invariant to the scale and sign of
    ``d``. ``inf`` when ``d`` is orthogonal to the gradient.
    The default ``method="forward"`` needs a single dual-number forward and no backward: ``d^T F d`` and
    ``d^T grad L`` both follow from ``J_z d`` (where a layer has no forward-mode rule, e.g. a custom
    ``autograd.Function`` without ``jvp``, the same ``J_z d`` comes from double backward).

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (the package's conventions, :mod:`ief`).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored, or float targets (``loss="mse"``).
        direction: ``d`` ``[P]`` (e.g. :func:`ief.ief_direction`'s), in the order of ``params``.
        params: the parameters (default ``None``: the model's trainable ones).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        method: ``"forward"`` (default) or ``"double_backward"``.

    Returns:
        ``gamma(d)`` as a float, ``>= 0``; ``inf`` when ``d^T grad L = 0``.

    Raises:
        ValueError: a zero or non-finite ``direction``, one not shaped ``[P]``, or a bad batch.
        FloatingPointError: logits the loss cannot use (NaN, ``+inf``, or a position whose every class is
            ``-inf``); ``-inf`` masking of some classes is fine; a non-finite ``J_z d`` (an inf input behind finite
            logits), naming the samples, with the optimisers' message (:func:`ief.model_call.nonfinite_message`).
    """
    loss_fn = get_loss(loss)
    model = unwrap_model(model)
    check_targets(targets)
    params = resolve_params(model, params)
    tangents = split_vector(direction, params)
    if not bool(direction.any()):  # one reduction over [P], no temporary
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
    return _gammas_of_jvps(loss_fn, logits.detach(), targets, [jd], inputs)[0]


def gammas(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    directions: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    method: str = "forward",
) -> list[float]:
    """The indicator ``gamma(d_k) = sqrt(d_k^T F d_k) / |d_k^T grad L|`` (Sec. 6, Algorithm 4) of the
    ``K`` rows of ``directions [K, P]`` at one point, in one batched pass: ``K`` values equal to ``K`` calls of
    :func:`gamma` (to rounding), for the cost of about one forward plus ``K`` tangent propagations.

    ``method="forward"`` (default): one forward-mode pass carries all ``K`` tangents (``torch.func.vmap`` over
    ``torch.func.jvp``; the primal forward runs once, in train mode with one set of dropout masks, drawn as one
    plain forward would draw them). Where the model does not support that (an operation without a forward-mode or
    batching rule, data-dependent control flow), it says so with a ``RuntimeWarning`` once per model and computes
    the same values by double backward: one forward, one backward with ``create_graph`` and one backward-type pass
    per direction. ``method="double_backward"`` takes that path directly.

    Used by the evaluation (Algorithm 4) to rate every method's direction at a checkpoint from one batched pass.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (the package's conventions, :mod:`ief`).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored, or float targets (``loss="mse"``).
        directions: ``[K, P]``, one direction per row.
        params: the parameters (default ``None``: the model's trainable ones).
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        method: ``"forward"`` (default) or ``"double_backward"``.

    Returns:
        ``K`` floats, ``gamma`` of each row, in row order.

    Raises:
        ValueError: ``directions`` not shaped ``[K, P]`` (``K >= 1``), non-finite, or with a zero row (``gamma`` of
            a zero direction is ``0/0``).
        FloatingPointError: as :func:`gamma`.
    """
    loss_fn = get_loss(loss)
    model = unwrap_model(model)
    check_targets(targets)
    params = resolve_params(model, params)
    total = sum(p.numel() for p in params)
    if not isinstance(directions, torch.Tensor) or directions.dim() != 2 or directions.shape[0] < 1 \
            or directions.shape[1] != total:
        shape = tuple(directions.shape) if isinstance(directions, torch.Tensor) else type(directions).__name__
        raise ValueError(f"directions must have shape [K, {total}] (K >= 1 rows, one entry per trainable parameter), "
                         f"got {shape}")
    if not all_finite(directions):
        raise ValueError("directions contain non-finite values")
    zero = ~directions.any(dim=1)
    if bool(zero.any()):
        raise ValueError(f"directions[{int(zero.nonzero()[0])}] is zero: its gamma is undefined (0/0)")
    if method not in JVP_METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join(map(repr, JVP_METHODS))}")
    forward = ReplayableForward(model, inputs)
    names = param_names(model, params)
    jds = None
    if method == "forward" and model not in _NOT_BATCHABLE:
        try:
            logits, jds = batched_jvps(forward, params, names, directions)
        except (RuntimeError, NotImplementedError) as err:  # the fallback below is exact; a real error recurs there
            _NOT_BATCHABLE[model] = True
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            warnings.warn(f"ief.gammas: the batched forward-mode pass is not available for this "
                          f"{type(model).__name__} ({reason}); using double backward (same values, one backward-type "
                          "pass per direction)", RuntimeWarning, stacklevel=2)
    if jds is None:
        tangent_sets = [split_vector(d, params) for d in directions]
        with _autograd_on():
            logits = forward()
            jds = double_backward_jvps(logits, params, tangent_sets)
        logits = logits.detach()
    return _gammas_of_jvps(loss_fn, logits, targets, list(jds), inputs)


# Models on which the batched forward-mode pass of ``gammas`` failed once: later calls go straight to double backward.
_NOT_BATCHABLE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _gammas_of_jvps(loss: Loss, logits: torch.Tensor, targets: torch.Tensor, jds: list[torch.Tensor],
                    inputs: Inputs = None) -> list[float]:
    """``gamma`` of each direction from ``J_z d`` alone: ``d^T F d = (J_z d)^T H (J_z d)``, ``d^T grad L =
    (dL/dz)^T J_z d``, in float64. A non-finite ``J_z d`` (an inf input behind finite logits: a saturated ``tanh``
    gives ``0 * inf``) raises ``FloatingPointError`` naming its samples (:func:`ief.model_call.nonfinite_message`)."""
    check_logits(loss, logits, targets)
    for jd in jds:
        refuse_nonfinite_product(jd, inputs, logits.shape[0], "J_z d (the direction's change of the logits)",
                                 "gamma is refused rather than returned as NaN")
    z64 = logits.to(torch.float64)
    grad_z = loss.logit_grad(z64, targets)
    out = []
    for jd in jds:
        jd64 = jd.to(torch.float64)
        curvature = float((jd64 * loss.hessian_vp(z64, targets, jd64)).sum())
        slope = float((grad_z * jd64).sum())
        out.append(gamma_from(curvature, slope))
    return out


def refuse_nonfinite_product(result: torch.Tensor, inputs: Inputs, m: int, what: str, refused: str,
                             per_sample: torch.Tensor | None = None) -> None:
    """``FloatingPointError`` with the package's message (:func:`ief.model_call.nonfinite_message`) if ``result`` is
    not finite, naming the samples whose rows of ``per_sample`` (default ``result``, when it is per sample) or whose
    inputs are not finite. One reduction and one host read when finite.

    Args:
        result: what is about to be returned (``F v``, ``J_z d``).
        inputs: the batch's inputs.
        m: the batch size.
        what: what is not finite, in words.
        refused: what is refused instead of returned.
        per_sample: a per-sample intermediate (``[M, ...]``) that shows which samples, or ``None``.

    Raises:
        FloatingPointError: ``result`` holds a NaN or inf.
    """
    if all_finite(result):
        return
    rows = per_sample if per_sample is not None else result
    raise FloatingPointError(nonfinite_message(what, nonfinite_samples(rows, inputs, m), m, refused))


def gamma_from(curvature: float, slope: float) -> float:
    """``sqrt(d^T F d) / |d^T g|`` from its two scalars; ``inf`` for zero slope (a primitive: the evaluation checks
    what it returns with :func:`check_gamma`)."""
    curvature = max(curvature, 0.0)  # PSD up to rounding
    if slope == 0.0:
        return math.inf
    return math.sqrt(curvature) / abs(slope)


class DegenerateIndicator(FloatingPointError):
    """An evaluation's ``gamma`` is 0, ``inf`` or NaN, or its direction is zero: never recorded (see
    :func:`check_gamma`).

    Raised by :func:`ief.evaluate` and :func:`ief.damping_sweep` (through :func:`check_gamma`), naming the batch and
    the method: the value is rounding (a saturated softmax, a direction orthogonal to the gradient), not a measurement.
    """


def check_gamma(value: float, method: str, where: str = "batch") -> float:
    """``value`` if it is a usable indicator (finite and > 0), else :class:`DegenerateIndicator` naming ``where`` (the
    batch) and ``method``: the rule by which :func:`ief.evaluate` and :func:`ief.damping_sweep` never hand 0, ``inf``
    or NaN to a chapter, nor divide by one (``ratio = gamma / gamma_SGD``).

    In exact arithmetic ``gamma(d) = sqrt(d^T F d) / |d^T grad L|`` of a non-zero EF / iEF / SF / SGD direction with
    ``grad L != 0`` is finite and positive (``d^T F d = 0`` forces ``J_z d`` into the logit Hessian's null space,
    which ``grad_z L`` is orthogonal to, so ``d^T grad L = 0`` too). A 0 therefore means ``d^T F d`` rounded or
    underflowed to zero (e.g. a saturated softmax, weights x 1e4), ``inf`` that ``d^T grad L`` did: the value is
    rounding, not a measurement.
    """
    if math.isfinite(value) and value > 0.0:
        return value
    why = {0.0: "d^T F d rounded or underflowed to zero (a saturated softmax?)",
           math.inf: "d^T grad L rounded to zero (a saturated batch, or a direction orthogonal to the gradient)"}
    reason = "it is NaN" if math.isnan(value) else why.get(value, "it is negative")
    raise DegenerateIndicator(f"{where}: gamma of the {method} direction is {value} ({reason}); an evaluation records "
                              "only finite, positive gammas: evaluate other batches or a larger damping")
