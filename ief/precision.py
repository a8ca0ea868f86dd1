"""The precision contract: what runs in the forward's precision, what is accumulated and solved wider, and how the
checks learn the precision the forward actually ran in.

**What runs where** (every ief entry that runs a forward: :func:`ief.per_sample`, :func:`ief.sampled_jacobian`, the
exact optimisers :class:`ief.optim.IEF` / ``EF`` / ``SF`` and :class:`ief.hf.IEFTrainer`):

- *Forward's precision*: the forward and the per-sample backward run as the user's model runs them: bfloat16 weights,
  or float32 weights under ``torch.autocast`` (entered by the caller, or inside ``model.forward`` as accelerate does
  for ``TrainingArguments(bf16=True)``). The per-sample rows are formed from the hooked layers' inputs and output
  gradients in that precision.
- *J's storage*: ``J`` (``form="dense"``, and a factored form's materialised column blocks) is stored in the trainable
  parameters' dtype: float32 for float32 adapters on a bfloat16 base or under autocast, bfloat16 for bfloat16
  parameters. J is not kept in bfloat16 for float32 parameters: ``form="auto"`` (the optimisers' default) already
  never forms ``[M, P]`` for ``nn.Linear`` weights, whose factors are the activations the forward kept anyway.
- *Accumulated wider*: the per-sample losses and ``s_iEF = ||dl_n/dz_n||^2`` from the logits upcast to at least
  float32 (16-bit logits are never summed in 16 bits); the Gram matrix ``J J^T``, ``J^T c`` and ``J v`` in float64
  (:mod:`ief.rows`).
- *Solved in float64*: the damped Gram system (:mod:`ief.directions`; ``torch.linalg`` refuses 16-bit solves, and a
  16-bit Gram would break its small eigenvalues). Its eigenvalues below ``J``'s own rounding are dropped
  (:func:`ief.directions.rounding_floor`) at the rounding of ``J``'s dtype, also for a float32 ``J`` of a bfloat16
  forward: bfloat16's floor (then ``(10 eps)^2 tr(J J^T)``, ``6e-3 tr``; now ``u^2 tr``, ``1.5e-5 tr``, for a
  bfloat16 ``J``) dropped real eigenvalues (minilm-lora's at ``3e-7 tr``, which the bfloat16 ``J`` has within 20 %
  of the float64 oracle's) and stalled its training at its first loss, where float32's trains. The price: a Gram
  matrix singular in exact arithmetic (``P < M``) gets spurious eigenvalues from bfloat16's rounding
  (``linear-p15-m32``: up to ``2.4e-7 tr``), so its directions err by about ``1e-4 tr / lambda`` (1 % at
  ``lambda = 1e-2 tr``, 88 % at ``1e-4 tr``): such a problem needs a damping above the forward's rounding.
- *The update*: the direction is returned in ``J``'s dtype; a float32 parameter (a float32 adapter on a bfloat16 base,
  a float32 model under autocast) is updated in float32; a 16-bit parameter's update
  ``(1 - eta wd) theta - eta d`` is computed in float32 and rounded to the parameter's dtype once. The update clears
  autocast's cache of bfloat16 weight casts (``torch.clear_autocast_cache``), so steps in a loop inside one
  ``torch.autocast`` region each run their forward with the updated weights.

**Supported or refused, one sentence each**:

- Pure bfloat16 parameters: supported; there is no float32 master copy, so a change smaller than half a bfloat16
  spacing of a weight is lost, as with any bfloat16 optimiser without one.
- Float32 adapters (peft LoRA) on a bfloat16 base: supported, the adapters are updated in float32.
- Autocast bfloat16 (``torch.autocast(device, torch.bfloat16)``, ``IEFTrainer(bf16=True)``): supported.
- float16 (float16 parameters, or autocast to float16, ``IEFTrainer(fp16=True)``): refused with ``ValueError``
  (:func:`refuse_float16`), because float16's per-sample gradients underflow (below 6e-8, and lose precision below
  6.1e-5) without a dynamic loss scale, which ief does not apply; use bfloat16.
- Outside this contract: :class:`ief.optim.KFAC` steps under bfloat16 autocast (its update clears autocast's cache as
  the exact optimisers' does), but its capture records no formats, so float16 is not refused there;
  :mod:`ief.woodfisher` keeps ``J``'s dtype for its rounding floor.

**Checks that know the precision.** :class:`ForwardFormats` records, during the forward, the floating formats it ran
in: the autocast dtype whenever autocast is enabled for the model's device (at the call and inside every module call),
the dtype of every module's floating outputs, the logits' and all of the model's floating parameters' (trainable or
frozen) dtypes. :func:`lowest_format` is the one with the largest unit roundoff. The exact check's tolerance
(:func:`mismatch_tolerance`) is derived from it:

    ``u = eps / 2`` is the format's unit roundoff (bfloat16 ``2^-8 = 3.9e-3``, float16 ``2^-11 = 4.9e-4``, float32
    ``2^-24 = 6.0e-8``). A row ``J_n`` and its exact directional derivatives are each the result of a forward and a
    backward in which every layer's output is rounded to the format once (matrix products accumulate in float32 on
    every backend). With ``r`` roundings along a path whose errors are independent, the relative error of each side is
    ``~sqrt(r) u`` (the probabilistic bound of Higham and Mary, SIAM J. Sci. Comput. 2019); ``r = 64`` roundings on
    each of the two sides gives ``2 sqrt(64) u = 16 u``. The tolerance is ``max(1.2e-3, 16 u)``: ``1.2e-3`` is the
    float32 floor that held before (``1e4`` float32 units: models compute parts in float32 whatever their parameters'
    dtype), so float32 and float64 forwards keep it, a bfloat16 forward gets ``0.0625``.

That bound is not the check's tolerance in 16 bits: a sample-mixing layer (``h + c h.mean(0)``) errs by ``~c / 3`` of
the row, and ``16 u`` let ``c = 0.2`` through while a correct bfloat16 model's products differ by 1-3 % (the ``r = 64``
of the bound is not a property of every model: T5 + LoRA under bfloat16 autocast has rows within 2-5 % of the float64
oracle's but check products 7-17 % apart). The exact check is about structure (which sample a row belongs to), which
does not depend on the precision, so a 16-bit forward's check runs in float32 (``ief.jacobian.api``): autocast disabled,
bfloat16 parameters, buffers and inputs as a float32 copy for the check (:func:`float32_copy`; the model's own tensors
put back untouched), at float32's tolerance, catching ``c = 0.005`` as a float32 model does; the 16-bit rows are then
held against the float32 ones within ``16 u`` in the samples' median and ``64 u`` in one sample
(:func:`ief.jacobian.guard.check_rounding`: with no rounding on the float32 side, margins of 5.7 and 3.6 over the
differences measured on 35 correct models). The copy costs 4 bytes per 16-bit parameter and buffer element while the
check runs (on the optimisers' first step). Where no float32 forward is to be had (autocast entered inside the model's
own code: accelerate's wrapper is set aside; a sharded or quantised 16-bit parameter; a copy that does not fit), the
check's tolerance is the rounding of its products measured on the batch (the same products by double backward with
rescaled tangents), catching ``c = 0.1``. The smallest mixing caught at each precision is stated and tested
(``tests/ief/test_precision.py``).
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping

import torch

FLOAT32_FLOOR = 1e4 * torch.finfo(torch.float32).eps  # 1.2e-3: the exact check's tolerance for float32 / float64
ROUNDINGS_PER_SIDE = 64  # r of the module docstring's derivation: 2 sqrt(r) u = 16 u
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff ``u = eps / 2`` of a floating format.

    Args:
        dtype: a floating dtype.

    Returns:
        ``torch.finfo(dtype).eps / 2`` (bfloat16 ``3.9e-3``, float16 ``4.9e-4``, float32 ``6.0e-8``).
    """
    return torch.finfo(dtype).eps / 2


def lowest_format(formats) -> torch.dtype | None:
    """The floating format with the largest unit roundoff among ``formats`` (``None`` when there is none).

    Args:
        formats: an iterable of dtypes (non-floating ones are ignored).

    Returns:
        The least precise floating dtype, or ``None``.
    """
    floating = [d for d in formats if d.is_floating_point]
    return max(floating, key=unit_roundoff) if floating else None


def mismatch_tolerance(forward_format: torch.dtype | None, jac_dtype: torch.dtype) -> float:
    """The exact check's bound on a row's relative error, ``max(1.2e-3, 16 u)`` (derivation: module docstring).

    Args:
        forward_format: the lowest format the forward ran in (:func:`lowest_format` of :class:`ForwardFormats`), or
            ``None`` when unknown (then ``jac_dtype`` alone).
        jac_dtype: the dtype ``J`` is stored in (a 16-bit ``J`` rounds the rows once more).

    Returns:
        ``1.2e-3`` for float32 / float64 forwards and rows, ``0.0625`` when bfloat16 is the lowest, ``7.8e-3`` for
        float16.
    """
    low = lowest_format([jac_dtype] + ([forward_format] if forward_format is not None else []))
    return max(FLOAT32_FLOOR, 2 * math.sqrt(ROUNDINGS_PER_SIDE) * unit_roundoff(low))


def outside_use_tolerance(forward_format: torch.dtype | None, jac_dtype: torch.dtype) -> float:
    """The structural guard's bound on ``||o|| / (sqrt(M) ||J_block||_F)`` (:func:`ief.jacobian.check_no_outside_use`):
    ``50 sqrt(eps)`` of ``J``'s dtype, 32-bit at least (``1.7e-2`` for float32 rows), and at least the exact check's
    ``16 u`` of the forward's lowest format (``0.0625`` for bfloat16).

    Args:
        forward_format: as :func:`mismatch_tolerance`.
        jac_dtype: the dtype ``J`` is stored in.

    Returns:
        The relative tolerance.
    """
    eps = torch.finfo(jac_dtype).eps if jac_dtype.itemsize >= 4 else torch.finfo(torch.float32).eps
    return max(50 * math.sqrt(eps), mismatch_tolerance(forward_format, jac_dtype))


def describe(dtype: torch.dtype | None) -> str:
    """``'bfloat16'`` for ``torch.bfloat16`` (``'unknown'`` for ``None``)."""
    return "unknown" if dtype is None else str(dtype).replace("torch.", "")


def refuse_float16(formats) -> None:
    """Refuse a forward that ran in float16 (the contract's one refused mode).

    Args:
        formats: the formats the forward ran in (:class:`ForwardFormats`, or any iterable of dtypes).

    Returns:
        ``None`` when float16 is not among them (the forward's results may be used).

    Raises:
        ValueError: float16 is among them; the sentence says why and what to use.
    """
    if torch.float16 in set(formats):
        raise ValueError(
            "float16 is refused (float16 parameters, outputs or autocast to float16, e.g. TrainingArguments(fp16=True)"
            "): per-sample gradients underflow in float16 (below 6e-8, with lost precision below 6.1e-5) without a "
            "dynamic loss scale, which ief does not apply; use bfloat16 (torch.autocast(device, torch.bfloat16), "
            "bf16=True, or bfloat16 weights), whose range is float32's")


def _floating(value) -> Iterator[torch.Tensor]:
    """The floating tensors of a module's output, one level deep (a tensor, a tuple / list, a dict or ModelOutput)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        yield from (v for v in value if isinstance(v, torch.Tensor) and v.is_floating_point())
    elif isinstance(value, Mapping):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


class ForwardFormats(set):
    """The floating formats one forward ran in: a ``set`` of dtypes, filled by :meth:`watch` and :meth:`add_model`.

    Example::

        formats = ForwardFormats()
        with formats.watch("cuda"):
            logits = model(x)
        formats.add_model(model, logits)
        tol = mismatch_tolerance(formats.lowest, torch.float32)
    """

    @property
    def lowest(self) -> torch.dtype | None:
        """The least precise format seen (:func:`lowest_format`), ``None`` when none was."""
        return lowest_format(self)

    def add_autocast(self, device_type: str) -> None:
        """Add the autocast dtype if autocast is enabled for ``device_type`` now.

        Args:
            device_type: ``"cpu"``, ``"cuda"``, ...
        """
        if torch.is_autocast_enabled(device_type):
            self.add(torch.get_autocast_dtype(device_type))

    def add_model(self, model: torch.nn.Module, logits: torch.Tensor | None = None) -> None:
        """Add the dtypes of all the model's floating parameters (frozen ones too: a bfloat16 base) and the logits'.

        Args:
            model: the model the forward ran.
            logits: its logits, if any.
        """
        self.update(p.dtype for p in model.parameters() if p.is_floating_point())
        if isinstance(logits, torch.Tensor) and logits.is_floating_point():
            self.add(logits.dtype)

    @contextlib.contextmanager
    def watch(self, device_type: str, model: torch.nn.Module | None = None,
              signature: Hashable = None) -> Iterator["ForwardFormats"]:
        """Record, during the ``with`` block, the autocast dtype at entry and inside every module call (autocast
        entered inside ``model.forward``, as accelerate does, is seen there) and every module's floating outputs'
        dtypes (a global forward hook, removed on exit).

        Given the ``model`` and the ``signature`` of its forward (:func:`ief.model_call.forward_signature`: modules,
        hooks, parameters' and inputs' dtypes and shapes), a forward is watched once: the formats it recorded are
        kept (per model, for the last :data:`RECORDS` signatures, with the autocast state and the default dtype at
        entry) and a later forward of the same key adds them instead of being watched (the global hook sends every
        module call of the model down torch's slow path: ~7 % of a backward on a small BERT). A changed dtype,
        shape, module, hook or autocast state is watched again.

        Args:
            device_type: the model's device type (``"cpu"``, ``"cuda"``).
            model: the model the block runs (optional, with ``signature``).
            signature: its forward's signature (``None``: watched every time).

        Yields:
            ``self``.
        """
        found = ForwardFormats()  # what this forward runs in (self may hold more already)
        found.add_autocast(device_type)
        self.update(found)
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        key = None if model is None or signature is None else (signature, autocast, torch.get_default_dtype())
        records = _RECORDED.setdefault(model, OrderedDict()) if key is not None else None
        if records is not None and key in records:
            records.move_to_end(key)
            self.update(records[key])
            yield self
            return

        def hook(module, args, output):
            found.add_autocast(device_type)
            found.update(t.dtype for t in _floating(output))

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            yield self
        finally:
            handle.remove()
            self.update(found)
        if records is not None:  # a forward that completed
            records[key] = frozenset(found)
            while len(records) > RECORDS:
                records.popitem(last=False)


# The formats watched forwards recorded, per model and key (ForwardFormats.watch), the last RECORDS keys of each.
_RECORDED: "weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict]" = weakref.WeakKeyDictionary()
RECORDS = 64


@contextlib.contextmanager
def float32_copy(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor] | None]:
    """The model with every 16-bit floating parameter and buffer replaced by a float32 copy for the ``with`` block,
    the originals put back on exit (they are never written: nothing is rounded twice; a bfloat16 value is exact in
    float32). The copies are new tensors (new :class:`torch.nn.Parameter` objects for parameters, same
    ``requires_grad``), not ``p.data`` swaps: autograd keeps a parameter's gradient accumulator with the dtype it was
    made for and would round a float32 gradient back to 16 bits. A tensor tied between modules gets one copy.

    Args:
        model: the module (changed in place for the block, restored on exit, also on an exception).

    Yields:
        ``id(original) -> float32 copy`` of every tensor replaced, or ``None`` (nothing replaced) when a 16-bit
        parameter or buffer is a tensor subclass (an FSDP2 ``DTensor`` shard, a quantised weight), whose float32
        forward cannot be had this way.

    Memory: 4 bytes per element of the 16-bit parameters and buffers while the block runs.
    """
    slots = [(store, name, t) for module in model.modules() for store in (module._parameters, module._buffers)
             for name, t in store.items() if t is not None and t.dtype in SIXTEEN_BIT]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for _, _, t in slots):
        yield None
        return
    copies: dict[int, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for store, name, t in slots:
                if id(t) not in copies:
                    wide = t.detach().float()
                    copies[id(t)] = (torch.nn.Parameter(wide, requires_grad=t.requires_grad)
                                     if isinstance(t, torch.nn.Parameter) else wide)
                store[name] = copies[id(t)]
        yield copies
    finally:
        for store, name, t in slots:
            store[name] = t


def widen(value):
    """``value`` with its 16-bit floating tensors as float32 (a tensor, or tuples, lists and mappings of them, nested;
    a mapping comes back a ``dict``); ``value`` itself when it holds none (the inputs of a :func:`float32_copy`
    forward: bfloat16 pixels fed to float32 weights)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in SIXTEEN_BIT else value
    if not _holds_sixteen_bit(value):
        return value
    if isinstance(value, Mapping):
        return {k: widen(v) for k, v in value.items()}
    items = [widen(v) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def _holds_sixteen_bit(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype in SIXTEEN_BIT
    if isinstance(value, Mapping):
        return any(_holds_sixteen_bit(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_holds_sixteen_bit(v) for v in value)
    return False


ROUNDING_ATTRIBUTE = "_ief_rounding_dtype"


def mark_rounding(jacobian, forward_format: torch.dtype | None) -> None:
    """Record on ``J`` (a tensor or a :class:`~ief.rows.FactoredJacobian`) the forward's lowest format when it is
    narrower than ``J``'s dtype (cleared otherwise: the optimisers reuse one buffer across steps).
    :func:`ief.per_sample` marks every ``J`` it returns; the mark says what rounding ``J`` carries (the solves' floor
    keeps ``J``'s dtype: module docstring). A copy of ``J`` (``.clone()``, ``.to()``) does not carry it.

    Args:
        jacobian: the per-sample Jacobian as :func:`ief.per_sample` returns it.
        forward_format: the lowest format the forward ran in (:attr:`ForwardFormats.lowest`).
    """
    narrower = forward_format is not None and unit_roundoff(forward_format) > unit_roundoff(jacobian.dtype)
    setattr(jacobian, ROUNDING_ATTRIBUTE, forward_format if narrower else None)


def rounding_dtype(rows) -> torch.dtype:
    """The format whose rounding ``J`` carries: its dtype, or the narrower one :func:`mark_rounding` recorded.

    Args:
        rows: a tensor, a :class:`~ief.rows.FactoredJacobian`, or :class:`~ief.rows.Rows` (a dense one's
            ``matrix`` is read).

    Returns:
        The dtype.
    """
    marked = getattr(rows, ROUNDING_ATTRIBUTE, None) or getattr(getattr(rows, "matrix", None), ROUNDING_ATTRIBUTE,
                                                                 None)
    return marked or rows.dtype


def device_type(model: torch.nn.Module) -> str:
    """The device type of the model's first parameter (``"cpu"`` for a model without parameters).

    Args:
        model: a module.

    Returns:
        ``"cpu"``, ``"cuda"``, ...
    """
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else first.device.type


__all__ = ["ForwardFormats", "device_type", "float32_copy", "lowest_format", "mark_rounding", "mismatch_tolerance",
           "outside_use_tolerance", "refuse_float16", "rounding_dtype", "unit_roundoff", "describe", "widen"]
