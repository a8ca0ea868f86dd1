"""Jacobian-vector products of a model's logits, ``J_z v`` (Appendix F.1.1), by two methods.

- ``"forward"``: forward-mode AD. The trainable parameters are made dual (primal ``theta``, tangent ``v``) through
  ``torch.func.functional_call``; one forward gives ``z`` and ``J_z v`` together (:func:`dual_forward`).
  :func:`batched_jvps` pushes ``K`` tangents through one forward (``torch.func.vmap`` over ``torch.func.jvp``: the
  primal is computed once, the tangents as one batch).
- ``"double_backward"``: the paper's double-differentiation trick: a backward with ``create_graph`` gives
  ``u -> J_z^T u``; its derivative w.r.t. ``u`` along ``v`` is ``J_z v``. Needs reverse mode only.

PyTorch's own forward-mode rules for the bilinear operations (``linear``, ``matmul``, ``mm``, ``bmm``) replace a
missing tangent by a zero tensor and still multiply by it: ``linear(x, W)`` with a frozen ``W`` (a LoRA base layer)
or an input without tangent (the first layer) costs two products instead of one, and while the primal is recorded
for a backward every tangent product is recorded too. :class:`LeanTangents` computes the tangents of these
operations itself, from the defined terms only (``d(x W^T + b) = dx W^T + x dW^T + db``, ``d(A B) = dA B + A dB``)
and unrecorded (every consumer detaches ``J_z v``): the same function as PyTorch's rule. It does the same for
``dropout`` on CPU, where ATen's composite (``noise = bernoulli(1 - p) / (1 - p)``, ``x * noise``) makes the noise a
dual tensor with a zero tangent and pays for a zero-tensor product and sum per layer (it was half the cost of the
tangents on the tiny T5-LoRA): the same steps on the primal draw the same mask from the same generator, and the tangent
is ``dx * noise``. Elementwise ``*``, ``+``, ``-``, ``/`` likewise: PyTorch's generated rules stand a zero tensor
in for the missing tangent of a frozen operand (a LayerNorm weight, a mask, a scalar) and run its arithmetic through
Python reference decompositions. Every other operation keeps PyTorch's rule; where one has none, PyTorch raises and
:class:`ForwardModeUnsupported` names the module (never a silently wrong tangent).

Some forwards forward mode cannot take without an exception: a module that re-casts itself inside its forward
(``self.classifier = self.classifier.to(dtype)``, HF SwitchTransformers' router) assigns ``param.data``, and the dual
forward then dies with a segmentation fault. :func:`forward_mode_hazard` looks for that (and for rebound parameters,
buffers and submodules) in one plain forward per model before any dual tensor exists; such a model raises
:class:`ForwardModeUnsupported`, and the callers that switch by themselves take double backward.

Every pass runs inside :func:`differentiable_kernels`: scaled-dot-product attention restricted to the MATH kernel
(forward-mode AD has no rule for the fused CPU kernels, and double backward through them fails once a padding mask is
passed), torch's fused inference fast path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` switched off
(``_native_multi_head_attention`` and ``_transformer_encoder_layer_fwd``, taken in ``eval()`` mode, have no
forward-mode rule) and oneDNN (mkldnn) switched off (its float32 RNN kernel ``mkldnn_rnn_layer`` has none either). The
three compute the same function as the kernels they replace.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch
from torch.autograd import forward_ad
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from .model_call import (ReplayableForward, call_model, forward_signature, modules_of,
                         non_reentrant_checkpointing)

JVP_METHODS = ("forward", "double_backward")

F = torch.nn.functional


def _reference_kernels_set() -> bool:
    """Whether the settings :func:`differentiable_kernels` makes are in force (an outer block's, unchanged since)."""
    cuda = torch.backends.cuda
    return (not torch.backends.mha.get_fastpath_enabled() and not torch.backends.mkldnn.enabled
            and cuda.math_sdp_enabled() and not cuda.flash_sdp_enabled() and not cuda.mem_efficient_sdp_enabled()
            and not cuda.cudnn_sdp_enabled())


_KERNELS = threading.local()  # .depth: how many differentiable_kernels() blocks this thread is inside


@contextlib.contextmanager
def differentiable_kernels() -> Iterator[None]:
    """Reference kernels that support every AD mode: MATH attention, no fused transformer fast path, no oneDNN.

    Nested inside another such block of the same thread (a Fisher-vector product enters it at several levels) it
    changes nothing: the settings are the outer block's, and entering them again cost ~50 us per level (``sdpa_kernel``
    alone), a fixed cost that showed on small models."""
    depth = getattr(_KERNELS, "depth", 0)
    if depth and _reference_kernels_set():
        _KERNELS.depth = depth + 1
        try:
            yield
        finally:
            _KERNELS.depth = depth
        return
    fastpath, mkldnn = torch.backends.mha.get_fastpath_enabled(), torch.backends.mkldnn.enabled
    torch.backends.mha.set_fastpath_enabled(False)
    torch.backends.mkldnn.enabled = False  # not mkldnn.flags(): it also sets (and warns about) TF32
    _KERNELS.depth = depth + 1
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        _KERNELS.depth = depth
        torch.backends.mha.set_fastpath_enabled(fastpath)
        torch.backends.mkldnn.enabled = mkldnn


class ForwardModeUnsupported(NotImplementedError):
    """An operation of the model has no forward-mode AD rule (the message names the module and the way out).

    Raised by :func:`ief.fisher_vp` and :class:`ief.FisherOperator` with an explicit ``method="forward"`` when a layer
    has no forward-mode rule (e.g. a custom ``autograd.Function`` without ``jvp``); use ``method="double_backward"``.
    ``fisher_vp``'s default ``"auto"``, :func:`ief.gamma` and ``check="exact"`` switch to double backward by
    themselves. A ``NotImplementedError``.
    """


def _split(x: object) -> tuple[object, torch.Tensor | None]:
    """``(primal, tangent or None)`` of a possibly dual tensor (a zero tangent counts as none)."""
    if not isinstance(x, torch.Tensor):
        return x, None
    primal, tangent = forward_ad.unpack_dual(x)
    if tangent is not None and tangent._is_zerotensor():
        tangent = None
    return primal, tangent


def _accumulate(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    return term if total is None else total + term


def _linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    (xp, xt), (wp, wt), (bp, bt) = _split(input), _split(weight), _split(bias)
    out = F.linear(xp, wp, bp)
    if xt is None and wt is None and bt is None:
        return out
    tangent = None
    with torch.no_grad():
        if xt is not None:
            tangent = F.linear(xt, wp)
        if wt is not None:
            tangent = _accumulate(tangent, F.linear(xp, wt))
        if bt is not None:
            tangent = _accumulate(tangent, bt.expand(out.shape))
    return forward_ad.make_dual(out, tangent)


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    xp, xt = _split(input)
    if xt is None or inplace or not training or xp.device.type != "cpu" or not 0 < p < 1 or xp.numel() == 0:
        return F.dropout(input, p, training, inplace)  # PyTorch's own rule (CUDA's fused kernel has a cheap one)
    # ATen's CPU dropout, step by step (same draws from the same generator): noise = bernoulli(1 - p) / (1 - p)
    noise = torch.empty_like(xp).bernoulli_(1 - p).div_(1 - p)
    out = xp * noise
    with torch.no_grad():
        tangent = xt * noise
    return forward_ad.make_dual(out, tangent)


def _product(op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    (ap, at), (bp, bt) = _split(a), _split(b)
    out = op(ap, bp)
    if at is None and bt is None:
        return out
    tangent = None
    with torch.no_grad():
        if at is not None:
            tangent = op(at, bp)
        if bt is not None:
            tangent = _accumulate(tangent, op(ap, bt))
    return forward_ad.make_dual(out, tangent)


def _arithmetic(kind: str, op, a: object, b: object) -> torch.Tensor | None:
    """``a * b``, ``a + b``, ``a - b``, ``a / b`` with the tangent from the defined terms (``None``: not handled).

    PyTorch's generated rules stand a zero tensor in for a missing tangent (a frozen LayerNorm weight, a mask, a
    scalar) and run its arithmetic through Python reference decompositions: most of the remaining tangent overhead on
    the transformers. A quotient whose divisor has a tangent keeps PyTorch's rule."""
    if not all(isinstance(x, (torch.Tensor, int, float, bool)) for x in (a, b)):
        return None
    (ap, at), (bp, bt) = _split(a), _split(b)
    if (at is None and bt is None) or (kind == "div" and bt is not None):
        return None
    out = op(ap, bp)
    with torch.no_grad():
        if kind == "mul":
            tangent = None if at is None else at * bp
            if bt is not None:
                tangent = _accumulate(tangent, ap * bt)
        elif kind == "div":
            tangent = at / bp
        elif at is not None and bt is not None:
            tangent = op(at, bt)
        elif at is not None:  # one tangent, broadcast to the result: a fresh tensor (an in-place op on the result
            tangent = at.expand(out.shape).to(out.dtype, copy=True)  # must not alter it), out of place (vmap)
        else:
            tangent = (-bt if kind == "sub" else bt).expand(out.shape).to(out.dtype, copy=True)
    return forward_ad.make_dual(out, tangent)


_ARITHMETIC = {torch.mul: "mul", torch.multiply: "mul", torch.Tensor.mul: "mul", torch.Tensor.multiply: "mul",
               torch.add: "add", torch.Tensor.add: "add", torch.sub: "sub", torch.subtract: "sub",
               torch.Tensor.sub: "sub", torch.Tensor.subtract: "sub", torch.div: "div", torch.divide: "div",
               torch.true_divide: "div", torch.Tensor.div: "div", torch.Tensor.divide: "div",
               torch.Tensor.true_divide: "div"}
_ARITHMETIC_OPS = {"mul": torch.mul, "add": torch.add, "sub": torch.sub, "div": torch.div}

_PRODUCTS = {torch.matmul: torch.matmul, torch.Tensor.matmul: torch.matmul, torch.Tensor.__matmul__: torch.matmul,
             torch.mm: torch.mm, torch.Tensor.mm: torch.mm, torch.bmm: torch.bmm, torch.Tensor.bmm: torch.bmm}


class LeanTangents(TorchFunctionMode):
    """Inside a ``forward_ad.dual_level``: tangents of ``linear`` / ``matmul`` / ``mm`` / ``bmm`` from their defined
    terms only, of elementwise ``*`` / ``+`` / ``-`` / ``/`` with one operand without tangent from the defined term, and
    of CPU ``dropout`` from its mask, all outside the autograd graph (see the module docstring). Everything else runs
    unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) + len(kwargs) <= 3 and "out" not in kwargs:
            return _linear(*args, **kwargs)
        if func in _PRODUCTS and len(args) == 2 and not kwargs:
            return _product(_PRODUCTS[func], *args)
        if func is F.dropout and len(args) + len(kwargs) <= 4:
            return _dropout(*args, **kwargs)
        kind = _ARITHMETIC.get(func)
        if kind is not None and len(args) == 2 and not kwargs:
            out = _arithmetic(kind, _ARITHMETIC_OPS[kind], *args)
            if out is not None:
                return out
        return func(*args, **kwargs)



class _Rebinds(TorchFunctionMode):
    """Notes what a forward does to tensors in place of their identity: ``t.data = ...`` (``Module.to`` / ``float``
    / ``half`` inside a forward: ``_apply`` sets ``param.data``) and ``t.set_(...)``."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        owner = getattr(func, "__self__", None)
        if getattr(func, "__name__", "") == "__set__" and getattr(owner, "__name__", "") == "data":
            self.seen.append("assigns a tensor's .data (e.g. a module's .to(dtype) inside its forward)")
        elif func is torch.Tensor.set_:
            self.seen.append("calls Tensor.set_")
        return func(*args, **(kwargs or {}))


# Per model, per forward signature (ief.model_call.forward_signature), why its forward rebinds parameters or tensor
# storage (see forward_mode_hazard), None when it does not; the last HAZARD_RECORDS signatures of each model.
_HAZARDS: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()
HAZARD_RECORDS = 16


def forward_mode_hazard(forward: ReplayableForward) -> str | None:
    """Why forward-mode AD must not run this model's forward, or ``None``: one plain forward (no gradients, RNG left
    as it was; once per model signature, below) watched for what forward mode and ``torch.func`` cannot take and do
    not always refuse with an exception: an assignment to a tensor's ``.data`` or a ``set_`` (a module that re-casts
    itself with ``.to(dtype)`` inside its forward: HF SwitchTransformers' router does, and the dual forward then dies
    with a segmentation fault in ``unpack_dual``, a ``torch.func.jvp`` with an internal assert), or a parameter,
    buffer or submodule of the model rebound during the forward. Such models take double backward (reverse mode
    only). The verdict is kept per model signature (:func:`ief.model_call.forward_signature` without the inputs): a
    changed module, hook, parameter or dtype is watched again; a new input shape is not (a forward that rebinds its
    parameters at some shapes only is not seen at the others)."""
    model = forward.model
    signature = forward_signature(model, None)
    known = _HAZARDS.setdefault(model, OrderedDict())
    if signature in known:
        known.move_to_end(signature)
        return known[signature]

    def state():
        return {(name, kind, key): id(value) for name, module in model.named_modules()
                for kind, table in (("parameter", module._parameters), ("buffer", module._buffers),
                                    ("submodule", module._modules)) for key, value in table.items()}

    before = state()
    watch = _Rebinds()
    buffers = [(b, b.clone()) for b in model.buffers()]
    try:
        # the model called directly, not the replayable forward: its first call must stay the one that draws
        with torch.random.fork_rng(devices=forward._devices), torch.no_grad(), differentiable_kernels(), \
                non_reentrant_checkpointing(model), watch:
            call_model(model, forward.inputs)
    finally:
        for b, saved in buffers:  # e.g. batch-norm running statistics: as they were
            if not torch.equal(b, saved):
                b.data.copy_(saved)
    after = state()
    moved = sorted({f"{kind} {name + '.' if name else ''}{key}" for (name, kind, key), i in before.items()
                    if after.get((name, kind, key)) != i} | {f"{kind} {name + '.' if name else ''}{key} (new)"
                                                              for (name, kind, key) in after.keys() - before.keys()})
    why = None
    if watch.seen:
        why = f"its forward {watch.seen[0]}"
    elif moved:
        why = f"its forward rebinds {', '.join(moved[:3])}{' ...' if len(moved) > 3 else ''}"
    known[signature] = known[forward_signature(model, None)] = why  # as found, and as left (rebound)
    while len(known) > HAZARD_RECORDS:
        known.popitem(last=False)
    return why


def _refuse_hazards(forward: ReplayableForward) -> None:
    """:class:`ForwardModeUnsupported` (before any dual tensor exists) where :func:`forward_mode_hazard` finds one."""
    why = forward_mode_hazard(forward)
    if why is not None:
        raise ForwardModeUnsupported(
            f"forward-mode AD is not run on this {type(forward.model).__name__}: {why}, which forward mode cannot "
            "take (PyTorch can crash the process on it rather than raise). Use method='double_backward' "
            "(FisherOperator, hessian_free), which needs reverse mode only; fisher_vp's default method='auto', "
            "gamma and check='exact' switch to it by themselves")


def dual_forward(
    forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str], tangents: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(z, J_z v)`` from one dual-number forward (``J_z v`` is ``None`` when the logits do not depend on params).

    ``z`` keeps the autograd graph of ``params`` when grad mode is on; ``J_z v`` is computed outside it. The dual
    parameters stand in the modules' parameter tables for the one call (every module holding a parameter: a tied
    weight in each), put back when it returns or raises; :class:`LeanTangents` is active around the model's own call
    only (every tensor method called inside a ``TorchFunctionMode`` goes through its Python handler, and
    ``torch.func.functional_call``'s reparametrisation, the RNG replay and this setup made most of what it saw on an
    MLP). ``names`` are kept for the callers' signature (the substitution is by identity).
    """
    with forward_ad.dual_level():
        # a tangent that is a view into a longer vector (ief.model_call.split_vector) would be copied into a zero-filled
        # buffer by make_dual; a plain copy is cheaper
        duals = {id(p): forward_ad.make_dual(p, t.clone() if t.storage_offset() or t.untyped_storage().nbytes()
                                             != t.numel() * t.element_size() else t)
                 for p, t in zip(params, tangents)}
        with _substituted(forward.model, duals):
            logits = forward(around=LeanTangents)
        return tuple(forward_ad.unpack_dual(logits))


@contextlib.contextmanager
def _substituted(model: torch.nn.Module, tensors: dict[int, torch.Tensor]) -> Iterator[None]:
    """``tensors`` (by the ``id`` of the parameter each replaces) in the parameter tables of every module of ``model``
    holding that parameter, put back on exit (also when the body raises)."""
    swapped = []
    try:
        for module in modules_of(model):
            table = module._parameters
            for key, p in table.items():
                if p is not None and id(p) in tensors:
                    swapped.append((table, key, p))
        for table, key, p in swapped:
            table[key] = tensors[id(p)]
        yield
    finally:
        for table, key, p in swapped:
            table[key] = p


def unsupported_message(forward: ReplayableForward, params, names, tangents, err: NotImplementedError) -> str:
    """Re-run the failing dual forward with hooks that track the running modules: name the innermost one."""
    running: list[str] = []

    def leave(module, args, output) -> None:  # returns None: the output is left as it is
        running.pop()

    handles = []
    for name, module in forward.model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda mod, args, n=name: running.append(n)))
        handles.append(module.register_forward_hook(leave))
    try:
        dual_forward(forward, params, names, tangents)
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
        f"forward-mode AD is not available in {where}: {reason}. Use method='double_backward' (FisherOperator, "
        "hessian_free), which needs reverse mode only; fisher_vp's default method='auto', gamma and check='exact' "
        "switch to it by themselves"
    )


# Models whose forward has no forward-mode rule somewhere: gamma and the exact check go straight to double backward.
NO_FORWARD_MODE: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def jvp_any_mode(
    forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str], tangents: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, J_z v)`` by forward mode, or by double backward where the model has no forward-mode rule (same value);
    logits detached."""
    if forward.model not in NO_FORWARD_MODE:
        try:
            with torch.no_grad():
                logits, jv = logits_and_jvp(forward, params, names, tangents, "forward")
            return logits.detach(), jv
        except ForwardModeUnsupported:
            NO_FORWARD_MODE[forward.model] = True
    with torch.enable_grad():
        logits, jv = logits_and_jvp(forward, params, names, tangents, "double_backward")
    return logits.detach(), jv


# Models on which the batched forward-mode pass failed once (no batching rule, data-dependent control flow).
NO_BATCHED_JVP: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def jvps_any_mode(
    forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str], tangents: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, [J_z v_1, ..., J_z v_K])`` for ``K`` tangents given per parameter (``tangents[i]`` shaped
    ``[K, *params[i].shape]``): one batched forward-mode pass (:func:`batched_tangent_jvps`), or, where the model
    supports no batched forward mode (remembered per model), one forward, one backward with ``create_graph`` and one
    backward-type pass per tangent (:func:`double_backward_jvps`, the same values). Logits detached, ``[K, *z.shape]``
    detached."""
    model = forward.model
    # a vmapped replay draws CUDA dropout masks unlike the forward it replays (draws_cuda_random): not the same
    # function, so such a forward takes the double-backward passes, which replay it exactly
    if not forward.draws_cuda_random and model not in NO_FORWARD_MODE and model not in NO_BATCHED_JVP:
        try:
            return batched_tangent_jvps(forward, params, names, tangents)
        except (RuntimeError, NotImplementedError):  # the fallback is exact; a real error recurs there
            NO_BATCHED_JVP[model] = True
    tangent_sets = [[t[k] for t in tangents] for k in range(tangents[0].shape[0])]
    with differentiable_kernels(), torch.inference_mode(False), torch.enable_grad():
        logits = forward()
        jvs = double_backward_jvps(logits, params, tangent_sets)
    return logits.detach(), torch.stack(jvs)


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
            _refuse_hazards(forward)
            try:
                primal, tangent = dual_forward(forward, params, names, tangents)
            except NotImplementedError as err:
                raise ForwardModeUnsupported(unsupported_message(forward, params, names, tangents, err)) from err
            if tangent is None:  # the logits do not depend on params (inference mode is switched off above)
                tangent = torch.zeros_like(primal)
            return primal, tangent.detach()
        logits = forward()
        (jv,) = double_backward_jvps(logits, params, [tangents])
        return logits, jv


def double_backward_jvps(
    logits: torch.Tensor, params: Sequence[torch.Tensor], tangent_sets: Sequence[Sequence[torch.Tensor]]
) -> list[torch.Tensor]:
    """``[J_z v_k]`` (detached) for several tangents from one graph of ``u -> J_z^T u`` (the double-differentiation
    trick): one backward with ``create_graph``, then one backward-type pass per tangent. ``logits`` must be attached
    to the autograd graph of ``params``."""
    probe = torch.zeros_like(logits, requires_grad=True)
    vjp = torch.autograd.grad(logits, params, probe, create_graph=True, allow_unused=True)
    used = [k for k, g in enumerate(vjp) if g is not None and g.requires_grad]
    if not used:
        return [torch.zeros_like(logits) for _ in tangent_sets]
    out = []
    for i, tangents in enumerate(tangent_sets):
        (jv,) = torch.autograd.grad(
            [vjp[k] for k in used], probe, [tangents[k] for k in used], retain_graph=i < len(tangent_sets) - 1
        )
        out.append(jv.detach())
    return out


def batched_jvps(
    forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str], directions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, [J_z d_1, ..., J_z d_K])`` for the rows of ``directions [K, P]`` from one forward-mode pass: the primal
    forward runs once and the ``K`` tangents as one batch (``torch.func.vmap`` over ``torch.func.jvp``, dropout masks
    shared by the ``K`` tangents; on the CPU drawn as one plain forward would draw them, on CUDA not:
    :attr:`ReplayableForward.draws_cuda_random`). Returns the logits (detached) and
    ``[K, *z.shape]``.

    Raises what ``vmap`` or forward mode raise where the model does not support them (an operation without a batching
    or forward-mode rule, data-dependent control flow): callers fall back to :func:`double_backward_jvps`.
    """
    sizes = [p.numel() for p in params]
    tangents = [c.reshape(-1, *p.shape).to(p) for c, p in zip(torch.split(directions, sizes, dim=1), params)]
    return batched_tangent_jvps(forward, params, names, tangents)


def batched_tangent_jvps(
    forward: ReplayableForward, params: Sequence[torch.Tensor], names: Sequence[str], tangents: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`batched_jvps` with the ``K`` tangents given per parameter, ``tangents[i]`` shaped
    ``[K, *params[i].shape]`` in the parameter's dtype (no ``[K, P]`` matrix)."""

    _refuse_hazards(forward)

    def logits(*primals: torch.Tensor) -> torch.Tensor:
        with LeanTangents():
            return forward(substitute=dict(zip(names, primals)))

    def one(*tangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.func.jvp(logits, tuple(params), tangent)

    with differentiable_kernels(), torch.inference_mode(False), torch.no_grad():
        z, jvs = torch.func.vmap(one, randomness="same", out_dims=(None, 0))(*tangents)
    return z.detach(), jvs.detach()
