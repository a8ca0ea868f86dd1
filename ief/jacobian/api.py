"""The public entries: :func:`per_sample`, :func:`sampled_jacobian`, :func:`gradient_and_sampled_jacobian` and
their result :class:`PerSample`, over one hooked forward (:class:`_HookedForward`)."""
from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..logit_jvp import differentiable_kernels
from ..losses import Loss, get_loss, logit_sqnorm
from ..model_call import (
    Inputs,
    ReplayableForward,
    batch_size,
    call_model,
    check_targets,
    flatten,
    forward_signature,
    non_reentrant_checkpointing,
    param_names,
    resolve_params,
    take_first,
    unwrap_model,
)
from ..precision import (SIXTEEN_BIT, ForwardFormats, describe, device_type, float32_copy, mark_rounding,
                         refuse_float16, widen)
from ..rows import FactoredJacobian, check_form
from ..sharded import ROW_AGREEMENT
from ..streamed import check_memory_budget, rows_budget
from . import assemble
from .assemble import _batch_gradient, _summed
from .capture import PerSampleCapture
from .errors import PerSampleGradientMismatch
from .guard import (_check_mode, _refuse_nonfinite, _refuse_sample_mixing, check_directional_derivatives,
                    check_no_outside_use, check_rounding)
from .loop import LOOPED_ATTRIBUTE, _warn_slow_path


_F = torch.nn.functional
_DROPOUTS = {_F.dropout, _F.dropout1d, _F.dropout2d, _F.dropout3d, _F.alpha_dropout, _F.feature_alpha_dropout,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}


def _fill(value):
    def fill(t, *args, **kwargs):
        return t.fill_(value(*args, **kwargs) if callable(value) else value)

    return fill


# in-place draws, each filled with a constant instead (uniform: the middle of its range, normal: its mean)
_DRAWS = {torch.Tensor.uniform_: _fill(lambda a=0.0, b=1.0, **kw: (kw.get("from", a) + kw.get("to", b)) / 2),
          torch.Tensor.normal_: _fill(lambda mean=0.0, std=1.0, **_: mean),
          torch.Tensor.bernoulli_: _fill(1.0), torch.Tensor.exponential_: _fill(1.0)}


class _Quiet(torch.overrides.TorchFunctionMode):
    """Randomness switched off: every functional dropout returns its input, attention runs with ``dropout_p=0``, an
    in-place draw (``uniform_``, ``normal_``, ``bernoulli_``, ``exponential_``: e.g. a router's jitter noise) fills its
    tensor with a constant. The sample-axis proof's forwards, which must compute the same function twice, the second
    time on the batch in reverse order (:meth:`PerSampleCapture.prove_axes`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func in _DRAWS:
            kwargs.pop("generator", None)
            with torch.no_grad():
                return _DRAWS[func](*args, **kwargs)
        if func is _F.scaled_dot_product_attention:
            if len(args) > 4:  # dropout_p is its fifth argument
                args = (*args[:4], 0.0, *args[5:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


def _reversed(inputs, m: int):
    """The batch in reverse sample order (every tensor whose leading dimension is ``m``, flipped), for the proof."""
    if isinstance(inputs, dict):
        return {k: _reversed(v, m) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_reversed(v, m) for v in inputs)
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1 and inputs.shape[0] == m:
        return inputs.flip(0)
    return inputs


@dataclass
class PerSample:
    """Per-sample quantities at one point (Eq. (1)), returned by :func:`per_sample`.

    Attributes:
        losses: ``[M]``, ``l_n``.
        jacobian: ``[M, P]``, row ``n`` is ``grad_theta l_n`` (a tensor, or a :class:`~ief.rows.FactoredJacobian` with
            ``per_sample(..., form="auto")``).
        logit_sqnorm: ``[M]``, ``||grad_{z_n} l_n||^2`` (``s_iEF``, the unnumbered equation after Eq. (8)).
        gradient: ``[P]``, the batch gradient ``grad_theta L``.
        counted: ``K``, the batch's counted targets (:func:`ief.count_targets`), read with the loss's range check of
            the targets (no read of its own); ``None`` for a loss whose check does not return it.

    From :func:`per_sample`, ``gradient`` is computed on first access: the hooked parameters' rows summed
    (``J^T 1``, the batch backward does not compute their batch gradients) plus any use outside their hooked
    modules, autograd's batch gradient for the others. It reads ``jacobian``: with ``out=``, read it before the
    buffer is reused.
    """

    losses: torch.Tensor
    jacobian: torch.Tensor | FactoredJacobian
    logit_sqnorm: torch.Tensor
    gradient: torch.Tensor
    counted: int | None = None

    def __getstate__(self) -> dict:  # pickling and deep copies hold the gradient, not the way to compute it
        self.gradient
        return self.__dict__


class _Deferred:
    """A value computed on first use (:attr:`PerSample.gradient`)."""

    def __init__(self, compute: Callable[[], torch.Tensor]):
        self.compute = compute


def _get_gradient(self: PerSample) -> torch.Tensor:
    if isinstance(self._gradient, _Deferred):
        self._gradient = self._gradient.compute()
    return self._gradient


def _set_gradient(self: PerSample, value) -> None:
    self._gradient = value


PerSample.gradient = property(_get_gradient, _set_gradient, doc="``grad_theta L``, ``[P]``")


@contextlib.contextmanager
def _original_forward(model: torch.nn.Module):
    """The model's forward without accelerate's mixed-precision wrapper for the block: accelerate (``bf16=True``)
    sets the instance's ``forward`` to one that enters autocast, keeping the original as ``_original_forward`` (as its
    ``extract_model_from_parallel(keep_fp32_wrapper=False)`` unwraps it); that one is called, and the wrapper put
    back on exit. Other models are left as they are."""
    wrapped, original = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield
        return
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


class _HookedForward:
    """One forward through the capture hooks; per-sample backward passes of any loss of its logits.

    ``check``: ``True`` (~free: no sample-mixing batch norm, and no hooked parameter used outside its hooked calls
    that the graph search missed, see :func:`check_no_outside_use`), ``"exact"`` (additionally every row against
    exact per-sample directional derivatives, :func:`check_directional_derivatives`: catches a custom layer that
    mixes samples), or ``False``. A weight tied between hooked layers (an embedding table and an ``nn.Linear``
    head) is hooked in each and its rows summed; one also used outside hooked calls takes the exact loop, whatever
    ``check``.

    Precision (:mod:`ief.precision`): the forward records the floating formats it ran in (``self.formats``: autocast,
    module outputs, parameters, logits); float16 is refused (``ValueError``), the checks' tolerances come from the
    lowest format, and the losses and ``s_iEF`` are computed from the logits upcast to at least float32
    (:meth:`wide_logits`).
    """

    def __init__(self, model, inputs, targets, params, loss, check):
        self.mode = _check_mode(check)
        self.loss = get_loss(loss)
        model = unwrap_model(model)
        m = check_targets(targets)
        self.params = resolve_params(model, params)
        if self.mode is not None:
            _refuse_sample_mixing(model)
        self.capture = PerSampleCapture(model, self.params, stand_ins=True)
        self.capture.batch_size = m
        self.forward = ReplayableForward(model, inputs)
        self._given = (model, inputs, params, loss)  # for the exact check in float32 (_checked_in_float32)
        # which hooked parameters the graph reaches outside their hooked calls (they ran with stand-ins)
        self.forward.watch = {id(self.params[i]): i for i in self.capture.hooked}
        # The exact check replays this forward with the reference kernels (forward-mode AD needs them); fused kernels
        # draw attention-dropout masks differently, so with the exact check on, this forward uses them too, and so do
        # the backward passes (activation checkpointing recomputes the forward inside them: same kernels, same graph).
        kernels = differentiable_kernels if self.mode == "exact" else contextlib.nullcontext
        self.kernels = kernels
        self.formats = ForwardFormats()
        # what the proofs of this forward rest on (the precision record here, the sample axes below): a steady call
        # of the same signature reuses them
        signature = (forward_signature(model, inputs), self.mode == "exact")
        # an FSDP2 step taking its rows layer by layer: the ranks agree before a rank's own batch makes it run other
        # forwards or backwards than the others' (ief.sharded.RowAgreement); None otherwise
        agreement = ROW_AGREEMENT.get()
        with self.capture, torch.enable_grad(), kernels(), self.formats.watch(device_type(model), model, signature):
            self.logits = self.forward()
        try:
            self.formats.add_model(model, self.logits)
            refuse_float16(self.formats)
            self.counted = self.loss.check(self.logits, targets)  # K, read with the range check (None: not read)
            if batch_size(self.logits) != m:
                raise ValueError(f"the model returned logits of shape {tuple(self.logits.shape)} for {m} targets")
        except Exception as err:
            if agreement is not None:
                agreement.agree(err, False)
            raise
        if agreement is not None:
            agreement.agree(None, self.capture.will_probe(m, model, signature))

        def run_on(batch, rows: int, quiet: bool = False):  # a side forward: RNG and buffers left as they were
            buffers = [(b, b.clone()) for b in model.buffers()]  # e.g. batch-norm running statistics
            try:
                with torch.random.fork_rng(devices=self.forward._devices), torch.enable_grad(), kernels(), \
                        non_reentrant_checkpointing(model), _Quiet() if quiet else contextlib.nullcontext():
                    logits = call_model(model, batch)
            finally:  # restored through .data: no version bump for the batch forward's saved tensors
                for b, saved in buffers:
                    if not torch.equal(b, saved):
                        b.data.copy_(saved)
            if tuple(logits.shape) != (rows, *self.logits.shape[1:]):
                raise ValueError(f"the probe's logits have shape {tuple(logits.shape)}")

        def probe() -> tuple | str:  # the hooked calls' input shapes when the first sample runs alone
            return self.capture.probe_shapes(lambda: run_on(take_first(inputs, m), 1))

        def prove(reverse: bool, quiet: bool) -> tuple | str:  # the hooked calls' inputs, the batch (reversed)
            batch = _reversed(inputs, m) if reverse else inputs
            return self.capture.call_inputs(lambda: run_on(batch, m, quiet), batch)

        try:
            self.capture.establish_axes(m, model, signature, probe, prove)
            names = param_names(model, self.params)
            self.capture.names = names
            self.capture.demote_outside_uses(self.forward.reached, names)
            _warn_slow_path(model, self.capture, names, m)
        except Exception as err:
            if agreement is not None:
                agreement.agree(err, False)
            raise
        if agreement is not None:  # a looped parameter's backward passes, one per sample
            agreement.agree(None, len(self.capture.hooked) < len(self.params))
        self.targets = targets
        self.names = names if self.mode is not None else None

    def jacobian(
        self, targets: torch.Tensor, retain_graph: bool = False, out: torch.Tensor | None = None, form: str = "dense",
        budget: float = math.inf, last_use: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | FactoredJacobian, _Deferred]:
        """``(losses, J, grad)`` for the given targets (``J`` in the given form, ``budget`` the bytes of rows
        ``"auto"`` may keep, see :func:`per_sample`; ``grad`` computed on first use, see :class:`PerSample`). Raises
        ``FloatingPointError`` naming the samples whose loss or row of ``J`` is not finite. ``last_use``: nothing
        reads the logits after this call, so that, outside the exact check, they are let go before the backward, as
        a first-order step lets them go (a causal LM's ``[M, T, vocabulary]`` logits are its largest tensor)."""
        logit_grads: list[torch.Tensor] = []  # dL/dz as the batch backward computed it (for the exact check)
        with torch.enable_grad(), self.kernels():
            losses = self.loss.per_sample(self.wide_logits(), targets)  # refused below with J if not finite
            handle = self.logits.register_hook(lambda g: logit_grads.append(g) if not logit_grads else None) \
                if self.mode == "exact" and self.logits.requires_grad else None
            if last_use and self.mode != "exact":
                self.logits = None  # the loss's graph keeps what its backward needs
            try:
                jac, autograd = assemble._backward_jacobian(self.capture, losses, self.params, retain_graph, out,
                                                            form, budget)
            finally:
                if handle is not None:
                    handle.remove()
        _refuse_nonfinite(losses, jac)
        mark_rounding(jac, self.formats.lowest)  # the rounding J carries (ief.precision)
        # which parameters' rows took the per-sample loop (ief.optim.report's routes)
        setattr(jac, LOOPED_ATTRIBUTE, tuple(i for i in range(len(self.params)) if i not in self.capture.hooked))
        try:
            if self.mode is not None:
                check_no_outside_use(self.capture, jac, autograd, self.names, self.formats.lowest)
            wide = self._checked_in_float32(targets, form, budget) if self.mode == "exact" else None
            if wide is not None:  # the structure proven in float32; J's own rounding against those rows
                check_rounding(jac, wide, self.params, self.names, self.formats.lowest)
            elif self.mode == "exact":
                grad_z = logit_grads[0] if logit_grads else self.loss.logit_grad(self.logits.detach(), targets)
                check_directional_derivatives(self.forward, self.params, self.names, jac, grad_z,
                                              self.formats.lowest)
        except PerSampleGradientMismatch:  # what the proven axes promised is disproved: the next call proves again
            self.capture.forget_axes(self._given[0])
            raise
        # the records are not kept alive; a broadcast parameter's autograd gradient is its whole batch gradient
        offsets, hooked = self.capture.offsets, frozenset(self.capture.hooked - set(self.capture.broadcast))
        return losses.detach(), jac, _Deferred(lambda: _batch_gradient(jac, autograd, offsets, hooked))

    def _checked_in_float32(self, targets: torch.Tensor, form: str,
                            budget: float) -> torch.Tensor | FactoredJacobian | None:
        """The exact check of a 16-bit forward, run in float32: the float32 rows when it ran (and passed), ``None``
        when it does not apply (a float32 forward; a 16-bit parameter that is a tensor subclass, e.g. an FSDP2 shard;
        autocast entered inside the model's own code, or a model that casts to 16 bits itself, so that no float32
        forward is to be had; a float32 forward that fails, out of memory or on a 16-bit tensor the model keeps
        outside its parameters and buffers, with a ``RuntimeWarning``): the 16-bit check then runs
        (:func:`check_directional_derivatives`). Accelerate's autocast wrapper (``bf16=True``) is set aside for it
        (:func:`_original_forward`).

        The check is about structure (which sample a row belongs to), which does not depend on the precision, while
        both sides of a 16-bit check carry the forward's rounding (bfloat16 weights: the tiny MLP's rows within 3e-3
        of the float64 oracle's, the check's own bfloat16 products 1e-2 apart; T5 + LoRA under autocast: rows within
        2-5 %, products 7-17 %), which hides a sample-mixing layer that errs by less. So the same forward and check run
        with autocast disabled and every 16-bit parameter, buffer and input as a float32 copy
        (:func:`ief.precision.float32_copy`: the model's own tensors are put back untouched, RNG state and buffers
        left as they were), at float32's tolerance: a sample mixing is caught as in a float32 model. The 16-bit
        ``J`` is kept; the caller holds it against these float32 rows within the format's bound
        (:func:`ief.jacobian.guard.check_rounding`). Cost, on the steps that run the exact check: one float32
        forward and backward more (and the check's forward-mode pass in float32 instead of bfloat16), no double
        backward; memory: a float32 copy of the 16-bit parameters and buffers (4 bytes an element), float32
        activations and the float32 rows (in ``form``) while it runs.

        Args:
            targets: the targets the check runs with.
            form: the rows' form (:func:`per_sample`).
            budget: the bytes of rows ``"auto"`` may keep.

        Returns:
            The float32 rows (checked), or ``None``.

        Raises:
            PerSampleGradientMismatch: the float32 check's.
        """
        model, inputs, _, loss = self._given
        if self.formats.lowest not in SIXTEEN_BIT:
            return None
        buffers = [(b, b.clone()) for b in model.buffers()]
        try:
            with torch.random.fork_rng(devices=self.forward._devices), _original_forward(model), \
                    torch.autocast(device_type(model), enabled=False), float32_copy(model) as copies:
                if copies is None:
                    return None
                self.forward.rewind_rng()  # the float32 forward draws this forward's dropout masks
                wide_params = [copies.get(id(p), p) for p in self.params]
                wide = _HookedForward(model, widen(inputs), widen(targets), wide_params, loss, "exact")
                if wide.formats.lowest in SIXTEEN_BIT:  # autocast inside the model: no float32 forward to be had
                    return None
                return wide.jacobian(widen(targets), form=form, budget=budget)[1]
        except PerSampleGradientMismatch:
            raise
        except RuntimeError as err:  # out of memory, or a model that cannot run in float32 (a 16-bit tensor kept
            # outside its parameters and buffers): the 16-bit check runs, and the user is told what it cannot see
            first = (str(err).splitlines() or [""])[0][:200]
            why = "did not fit in memory" if isinstance(err, torch.OutOfMemoryError) else \
                f"failed ({type(err).__name__}: {first})"
            warnings.warn(f"the exact check's float32 forward {why}; the check ran in {describe(self.formats.lowest)}, "
                          "whose rounding hides a sample mixing that moves the rows by less than about 2 % "
                          "(ief.jacobian.guard.check_directional_derivatives)", RuntimeWarning, stacklevel=4)
            return None
        finally:
            for b, saved in buffers:
                if not torch.equal(b, saved):
                    b.data.copy_(saved)

    def gradient(self, targets: torch.Tensor, retain_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(losses, grad)`` only: a plain backward (the hooks' records are not turned into a Jacobian); it asks
        for the hooked calls' stand-ins too, so that autograd gives every parameter its whole batch gradient."""
        owners, leaves = self.capture.leaves(self.params, range(len(self.params)))
        n = len(self.params)
        with torch.enable_grad(), self.kernels():
            losses = self.loss.per_sample(self.wide_logits(), targets)
            _refuse_nonfinite(losses, None)
            grads = torch.autograd.grad(losses.sum(), leaves, retain_graph=retain_graph, allow_unused=True)
        return losses.detach(), flatten(_summed(grads[:n], owners[n:], grads[n:]), self.params)

    def wide_logits(self) -> torch.Tensor:
        """The logits, upcast to float32 when narrower (differentiably: the backward casts ``dL/dz`` back), so that
        the losses and ``s_iEF`` are never summed in 16 bits."""
        if self.logits.is_floating_point() and self.logits.dtype.itemsize < 4:
            return self.logits.float()
        return self.logits

    def sampled_targets(self, generator: torch.Generator | None) -> torch.Tensor:
        return self.loss.sample_targets(self.logits, self.targets, generator)

    def logit_sqnorm(self, targets: torch.Tensor) -> torch.Tensor:
        return logit_sqnorm(self.loss, self.wide_logits(), targets)


def per_sample(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    check: bool | str = True,
    out: torch.Tensor | None = None,
    form: str = "dense",
    memory_budget: float | None = None,
) -> PerSample:
    """Per-sample losses, Jacobian ``grad_theta l`` and ``s_iEF`` from one forward and one backward.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]`` (or an object with ``.logits``).
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: class indices ``[M]`` / ``[M, T]`` with ``-100`` ignored (cross-entropy), or float targets shaped
            like the logits (``loss="mse"``).
        params: parameters to differentiate; default: the model's trainable ones.
        loss: ``"cross_entropy"`` (default) or ``"mse"``.
        check: ``True`` (default, ~free): refuse batch norm with batch statistics and verify that no hooked
            parameter is used outside its hooked module, so that the rows of ``J`` sum to the batch gradient (see
            :func:`check_no_outside_use`; a weight tied between hooked layers is hooked in each, one used outside them
            is found before and takes the exact loop); ``"exact"``:
            that, and every row against exact per-sample directional derivatives along 8 random tangents (one
            batched forward-mode pass, :func:`check_directional_derivatives`); ``False``: no guard.
        out: optional ``[M, P]`` buffer of the parameters' dtype and device to write ``J`` into (overwritten; used
            when its shape matches; for a factored ``form``, the buffer of its materialised columns, whose first
            columns are used when it is wider). The optimisers reuse one across steps.
        form: how ``J`` is returned. ``"dense"`` (default): the ``[M, P]`` tensor. ``"auto"``: a
            :class:`~ief.rows.FactoredJacobian` that never forms ``[M, P]``: each ``nn.Linear`` weight is kept as its
            layer's inputs and output gradients (the "ghost" Gram, cost ``M^2 T^2 (I + O)``) where that is the
            fewest flops, else as per-sample rows (``M I O``) while the rows kept fit ``memory_budget``, else
            streamed (its rows formed a block at a time for each product, never kept: :mod:`ief.streamed`, whose
            docstring states the rule and the cost model); an ``nn.Embedding`` table as the rows the batch uses
            (``[M, U D]``, exact: its other rows are zero in every sample's gradient); every other parameter as its
            (small) column block.
            ``"ghost"`` / ``"rows"`` / ``"streamed"`` force one form for every Linear weight. ``ief_direction``,
            ``ef_direction`` and ``sf_direction`` take either form; ``.materialize()`` gives the tensor.
        memory_budget: with ``form="auto"``, the bytes of per-sample rows the result may keep (the columns of the
            parameters without factors counted first, then the weights' rows, smallest first); default ``None``:
            2 times the bytes of ``model``'s parameters (:data:`ief.streamed.MODEL_MULTIPLE`), what AdamW's
            moments would hold, and at least 8 MiB (:data:`ief.streamed.FLOOR_BYTES`).

    Returns:
        :class:`PerSample` (``losses``, ``jacobian``, ``logit_sqnorm``, ``gradient``, ``counted``).

    Raises:
        ValueError: a bad value, named with the accepted ones: no trainable parameters, a ``params=`` tensor that is
            not a parameter of the model, an empty batch (``M = 0``), a model returning ``()``, logits/targets shape
            mismatch, float targets for cross-entropy, a class index out of range, an unknown ``loss``, ``check`` or
            ``form``, a ``memory_budget`` that is not a number ``>= 0`` or comes with another form than ``"auto"``.
        FloatingPointError: naming the samples whose loss or row of ``J`` is not finite (never NaN rows).
        PerSampleGradientMismatch: from the guard / the exact check (naming the parameter or the samples).
        ief.model_call.ReentrantCheckpointError: a reentrant ``torch.utils.checkpoint`` outside HuggingFace layers
            (pass ``use_reentrant=False``; HuggingFace's reentrant layers are run non-reentrantly by ``ief``).
    """
    form = check_form(form)
    budget = rows_budget(model, check_memory_budget(memory_budget, form))
    fwd = _HookedForward(model, inputs, targets, params, loss, check)
    sqnorm = fwd.logit_sqnorm(targets)  # before the backward, which may then let the logits go
    losses, jac, gradient = fwd.jacobian(targets, out=out, form=form, budget=budget, last_use=True)
    return PerSample(losses=losses, jacobian=jac, logit_sqnorm=sqnorm, gradient=gradient, counted=fwd.counted)


def sampled_jacobian(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    generator: torch.Generator | None = None,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    check: bool | str = True,
    form: str = "dense",
    memory_budget: float | None = None,
) -> torch.Tensor | FactoredJacobian:
    """``[M, P]`` per-sample gradients for labels drawn from the model's predictive distribution (SF, Algorithm 3).

    A label is drawn at every non-ignored position of every sample (``targets`` only supply the ignore mask and
    shapes); ``E[J^T J]`` over the draws is the exact Fisher (Appendix E). Cost: one forward and one
    backward, as :func:`per_sample`.

    Args:
        model: returns logits ``[M, C]`` / ``[M, T, C]``, as :func:`per_sample`.
        inputs: tensor, tuple, or dict of keyword arguments for ``model``.
        targets: ``[M]`` / ``[M, T]``; only their ``-100`` mask and shape are used.
        generator: the ``torch.Generator`` the labels are drawn with (default ``None``: the global RNG).
        params: parameters to differentiate; default: the model's trainable ones.
        loss: ``"cross_entropy"`` (default) or ``"mse"`` (labels drawn from ``N(z, I)``).
        check: the per-sample guard, as :func:`per_sample` (default ``True``).
        form: ``"dense"`` (default), ``"auto"``, ``"ghost"``, ``"rows"`` or ``"streamed"``, as :func:`per_sample`.
        memory_budget: the bytes of rows ``form="auto"`` may keep, as :func:`per_sample`.

    Returns:
        The sampled per-sample Jacobian ``[M, P]``: a tensor, or a :class:`~ief.rows.FactoredJacobian` for a factored
        ``form``.

    Raises:
        ValueError: as :func:`per_sample`.
        FloatingPointError: logits the labels cannot be drawn from (NaN, ``+inf``, or every class ``-inf``).
    """
    form = check_form(form)
    budget = rows_budget(model, check_memory_budget(memory_budget, form))
    fwd = _HookedForward(model, inputs, targets, params, loss, check)
    return fwd.jacobian(fwd.sampled_targets(generator), form=form, budget=budget)[1]


def gradient_and_sampled_jacobian(
    model: torch.nn.Module,
    inputs: Inputs,
    targets: torch.Tensor,
    params: Iterable[torch.nn.Parameter] | None = None,
    *,
    loss: str | Loss = "cross_entropy",
    generator: torch.Generator | None = None,
    check: bool | str = True,
    form: str = "dense",
    memory_budget: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | FactoredJacobian]:
    """``(losses [M], grad [P], sampled J [M, P])`` from one forward and two backward passes, as in Algorithm 3
    (``form`` and ``memory_budget`` as in :func:`per_sample`)."""
    form = check_form(form)
    budget = rows_budget(model, check_memory_budget(memory_budget, form))
    fwd = _HookedForward(model, inputs, targets, params, loss, check)
    losses, gradient = fwd.gradient(targets, retain_graph=True)
    sampled = fwd.jacobian(fwd.sampled_targets(generator), form=form, budget=budget)[1]
    return losses, gradient, sampled
