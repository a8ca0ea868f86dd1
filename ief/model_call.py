"""How the package calls a user's model: inputs, logits, trainable parameters and reproducible randomness.

- ``model(inputs)``, or ``model(**inputs)`` when ``inputs`` is a dict (HuggingFace / peft models), returns logits
  with the class dimension last, or an object with ``.logits``.
- The parameters are the model's trainable ones (``requires_grad=True``) in ``model.parameters()`` order, unless
  ``params=`` is given. Frozen weights are never differentiated.
- A ``torch.compile``d model is run as its original module (``_orig_mod``) and an ``nn.DataParallel`` /
  ``DistributedDataParallel`` wrapper as its ``.module`` (:func:`unwrap_model`): the per-sample hooks and forward-mode
  AD need the eager module, whose parameters are the very same tensors.
- :class:`ReplayableForward` records the RNG state once and restores it before every forward, so that repeated
  evaluations at the same point (the Fisher-vector products of a CG solve, a per-sample backward and a Fisher
  product in the same step) see the same dropout masks: the curvature they measure is that of one well-defined
  function.
- Activation checkpointing: reentrant ``torch.utils.checkpoint`` (``use_reentrant=True``) runs its block under
  ``no_grad`` and differentiates it inside ``.backward()`` only; ``torch.autograd.grad(..., inputs=params)``, which
  every pass here uses, never enters it, so the block's parameters would silently get zero gradients. HuggingFace
  layers checkpointed that way (``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
  True})``) are run non-reentrantly inside this package's forwards (:func:`non_reentrant_checkpointing`: same values,
  same memory saving, the user's setting restored after the call); any other reentrant checkpoint raises
  :class:`ReentrantCheckpointError` naming the fix.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils.checkpoint

Inputs = Any  # a tensor, a tuple of tensors or a dict of keyword arguments


class ReentrantCheckpointError(RuntimeError):
    """The model checkpoints activations with reentrant ``torch.utils.checkpoint``, which ``autograd.grad`` cannot
    differentiate through (the message names the fix)."""


def _reentrant(func: object) -> bool:
    """Whether a HuggingFace ``_gradient_checkpointing_func`` is ``partial(checkpoint, use_reentrant=True)`` (torch's
    default when ``use_reentrant`` is not given)."""
    if not isinstance(func, functools.partial):
        return False
    if "use_reentrant" in func.keywords:
        return func.keywords["use_reentrant"] is not False
    return func.func is torch.utils.checkpoint.checkpoint


REENTRANT_MESSAGE = (
    "the model checkpoints activations with torch.utils.checkpoint(..., use_reentrant=True), whose block "
    "autograd.grad and forward-mode AD do not differentiate (its parameters would get zero gradients and tangents); "
    "checkpoint with use_reentrant=False instead (HuggingFace layers are switched to it by this package; "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}) does it for good), "
    "or disable checkpointing"
)


class _RefuseReentrant:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (the reentrant checkpoint's ``autograd.Function``,
    looked up by ``checkpoint()`` at every call) inside this package's forwards."""

    @staticmethod
    def apply(*args) -> None:
        raise ReentrantCheckpointError(REENTRANT_MESSAGE)


@contextlib.contextmanager
def non_reentrant_checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every HuggingFace layer checkpointed reentrantly (``gradient_checkpointing`` on, its
    ``_gradient_checkpointing_func`` a ``partial`` with ``use_reentrant=True``) checkpoints with
    ``use_reentrant=False`` instead: the same values and memory saving, and a graph that ``autograd.grad`` and
    forward-mode AD differentiate. A backward after the block recomputes with the function recorded in the forward,
    so restoring the user's setting on exit is safe. Any other reentrant ``torch.utils.checkpoint`` call raises
    :class:`ReentrantCheckpointError` (the reentrant ``autograd.Function`` is swapped for a refusal meanwhile)."""
    swapped = []
    for module in modules_of(model):
        attributes = module.__dict__  # not getattr: nn.Module's __getattr__ fallback is slow on a miss
        func = attributes.get("_gradient_checkpointing_func")
        if func is not None and attributes.get("gradient_checkpointing") is True and _reentrant(func):
            keywords = {**func.keywords, "use_reentrant": False}
            module._gradient_checkpointing_func = functools.partial(func.func, *func.args, **keywords)
            swapped.append((module, func))
    reentrant = torch.utils.checkpoint.CheckpointFunction
    torch.utils.checkpoint.CheckpointFunction = _RefuseReentrant
    try:
        yield
    finally:
        torch.utils.checkpoint.CheckpointFunction = reentrant
        for module, func in swapped:
            module._gradient_checkpointing_func = func


def graph_nodes(roots: Iterable) -> Iterator:
    """Every autograd node the graphs behind ``roots`` reach, each once (depth first; ``None`` roots skipped).

    Args:
        roots: autograd nodes (``tensor.grad_fn``).

    Returns:
        An iterator over the nodes; a caller may stop early.
    """
    stack = [r for r in dict.fromkeys(roots) if r is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        yield node
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)


def scan_graph(tensor: torch.Tensor, watch: Mapping[int, int]) -> set[int]:
    """The values of ``watch`` (``id`` of a leaf tensor -> index) whose leaves the autograd graph behind ``tensor``
    reaches (their gradient accumulators are in it): one walk over the graph's nodes."""
    reached: set[int] = set()
    if tensor.grad_fn is None or not watch:
        return reached
    for node in graph_nodes([tensor.grad_fn]):
        if type(node).__name__ == "AccumulateGrad":
            index = watch.get(id(node.variable))
            if index is not None:
                reached.add(index)
    return reached


_SAID_EAGER: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # compiled models already told they run eagerly


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The eager module behind ``torch.compile`` (``_orig_mod``) and ``nn.DataParallel`` / DDP (``.module``)."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    while True:
        if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            if model not in _SAID_EAGER:
                _SAID_EAGER.add(model)
                warnings.warn(f"the model is a torch.compile'd {type(model._orig_mod).__name__}: ief runs its eager "
                              "module (model._orig_mod), since per-sample hooks and forward-mode products need the "
                              "eager graph, so compilation does not speed up ief's passes (said once per model)",
                              UserWarning, stacklevel=3)
            model = model._orig_mod
        elif isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def modules_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``list(model.modules())`` (the same modules in the same order: depth first, each once), without building the
    dotted names: ``modules()`` walks ``named_modules`` generators (a cost paid several times per Fisher-vector
    product: ``benchmarks/README.md``)."""
    out, seen, stack = [], set(), [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return out


def parameters_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``list(model.parameters())`` (same order, each once) from :func:`modules_of`."""
    out, seen = [], set()
    for module in modules_of(model):
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class ResolvedParams(list):
    """The list :func:`resolve_params` returns: it remembers the model it was resolved for, so that a public entry
    that resolves ``params`` once can pass the list down to the others it calls without each walking the model again
    (only ``requires_grad`` is checked again). Pickled and copied as a plain list."""

    def __init__(self, items: Iterable[torch.Tensor], model: torch.nn.Module):
        super().__init__(items)
        self._model = weakref.ref(model)

    def __reduce__(self):
        return list, (list(self),)


def resolve_params(model: torch.nn.Module, params: Iterable[torch.nn.Parameter] | None) -> list[torch.Tensor]:
    """The trainable parameters, in ``model.parameters()`` order, or the given ones (deduplicated, in order).

    Every given tensor must be a parameter of ``model`` that requires grad (``ValueError`` naming it otherwise). The
    result is a :class:`ResolvedParams`: passed again with the same ``model``, it is returned as it is (resolved once
    per public call, then passed down).
    """
    if type(params) is ResolvedParams and params._model() is model and all(p.requires_grad for p in params):
        return params
    if params is None:
        chosen = [p for p in parameters_of(model) if p.requires_grad]
    else:
        if isinstance(params, torch.Tensor):
            raise ValueError("params must be an iterable of parameters (e.g. [layer.weight]), got a single tensor")
        owned = {id(p) for p in parameters_of(model)}
        chosen, seen = [], set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"params must be tensors, got {type(p).__name__} at params[{i}]")
            if id(p) not in owned:
                raise ValueError(
                    f"params[{i}] (a {type(p).__name__} of shape {tuple(p.shape)}) is not a parameter of the model: "
                    "pass tensors from model.parameters() (a Parameter that is not registered in the model cannot "
                    "be named, hooked or substituted)"
                )
            if not p.requires_grad:
                raise ValueError(f"params[{i}] (shape {tuple(p.shape)}) has requires_grad=False")
            if id(p) not in seen:
                seen.add(id(p))
                chosen.append(p)
    if not chosen and params is not None:
        raise ValueError(
            f"params= was given but holds no parameter (got {type(params).__name__} of length 0): pass a non-empty "
            "iterable of the model's parameters (e.g. [layer.weight] or the LoRA weights), or leave params=None for "
            "every trainable parameter"
        )
    if not chosen:
        raise ValueError(
            "the model has no trainable parameters (none with requires_grad=True) and no params= were given; "
            "unfreeze the parameters to precondition (e.g. the LoRA or prompt weights)"
        )
    return ResolvedParams(chosen, model)


def param_names(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    """Names of ``params`` in ``model``; raises if one is not a parameter of the model."""
    by_id: dict[int, str] = {}  # as {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}: last wins
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        for n, p in module._parameters.items():
            if p is not None:
                by_id[id(p)] = prefix + n
        stack.extend((f"{prefix}{n}.", child) for n, child in reversed(module._modules.items()) if child is not None)
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"params[{missing[0]}] is not a parameter of the model")
    return [by_id[id(p)] for p in params]


def split_vector(vector: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut a flat ``[P]`` vector into tensors shaped like ``params``."""
    total = sum(p.numel() for p in params)
    if not isinstance(vector, torch.Tensor) or vector.dim() != 1 or vector.shape[0] != total:
        shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else type(vector).__name__
        raise ValueError(f"vector must have shape [{total}] (one entry per trainable parameter), got {shape}")
    if not all_finite(vector):
        raise ValueError("vector contains non-finite values")
    chunks = torch.split(vector, [p.numel() for p in params])
    return [c.reshape(p.shape).to(dtype=p.dtype, device=p.device) for c, p in zip(chunks, params)]


def flatten(tensors: Iterable[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if t is None else t).reshape(-1) for t, p in zip(tensors, params)])


COLUMN_CHUNK = 1 << 16  # columns of an [M, P] matrix processed at a time by column-wise reductions


DEVICE_CHUNK_ENTRIES = 1 << 24  # entries of one block on a GPU: 128 MiB in float64, a few kernel launches per block


def column_chunk(matrix: torch.Tensor) -> int:
    """Columns per block of :func:`column_chunks`: :data:`COLUMN_CHUNK` on a CPU (blocks that stay in its caches),
    and on a GPU blocks of about :data:`DEVICE_CHUNK_ENTRIES` entries, since there each block costs kernel launches
    (GPT-2 small's ``[8, 124M]`` J took ~1,900 blocks of 65,536 columns, each a float64 copy, a product and a
    finiteness check: ~5,700 launches a step) while memory bandwidth, not cache, bounds the work."""
    if matrix.device.type == "cpu":
        return COLUMN_CHUNK
    return max(COLUMN_CHUNK, DEVICE_CHUNK_ENTRIES // max(1, matrix.shape[0]))


def column_chunks(matrix: torch.Tensor, chunk: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """``(start, matrix[:, start:start+chunk])`` blocks: column-wise reductions over a row-major ``[M, P]`` matrix are
    far faster by blocks (a dim-0 reduction over all of it is strided, and a temporary of its size page-faults);
    ``chunk`` defaults to :func:`column_chunk` of the matrix's device."""
    chunk = column_chunk(matrix) if chunk is None else chunk
    for lo in range(0, matrix.shape[1], chunk):
        yield lo, matrix[:, lo : lo + chunk]


HUGE_PAGE = 1 << 21  # bytes of a transparent huge page on x86-64 and arm64 Linux
_MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>


@functools.cache
def _madvise() -> Callable | None:
    """libc's ``madvise`` on Linux, else ``None``."""
    if sys.platform != "linux":
        return None
    try:
        advise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    advise.argtypes, advise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return advise


def large_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)``, on Linux CPUs with its memory advised for transparent huge pages before it is touched.

    A fresh allocation of many MiB comes from the operating system, and the first write to each 4 KiB page faults;
    with the advice the pages are 2 MiB, 512 times fewer faults (what it saves on a full-parameter BERT's ``J``:
    ``benchmarks/README.md``). This is what torch's own ``THP_MEM_ALLOC_ENABLE=1`` does for
    every large allocation, which an already running process cannot switch on. The advice is a hint only: values
    are the same, and where the kernel refuses it (huge pages "never") nothing changes.
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    advise = _madvise() if out.device.type == "cpu" and nbytes >= 2 * HUGE_PAGE else None
    if advise is not None:  # the whole huge pages inside the tensor's own memory
        lo = -(-out.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        hi = (out.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            advise(lo, hi - lo, _MADV_HUGEPAGE)
    return out


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, via one reduction (no tensor-sized temporary unless the sum is not finite)."""
    if bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())  # the sum may overflow although every entry is finite


ROWS_REFUSED = "per-sample gradients are refused rather than returned as non-finite rows"


def nonfinite_message(what: str, bad: Sequence[int], m: int, refused: str = ROWS_REFUSED) -> str:
    """The package's one message for a non-finite result of a batch (the optimisers', :func:`ief.per_sample`'s,
    the indicator's, the Fisher-vector product's): what is not finite, for which samples, the likely causes, and what
    is refused instead of being returned.

    Args:
        what: what is not finite (``"per-sample gradient"``, ``"J_z d"``, ...).
        bad: the samples it is not finite for (empty: not known).
        m: the batch size.
        refused: what is refused (``"<the result> is refused rather than returned as ..."``).

    Returns:
        The message.
    """
    which = f"samples {list(bad[:10])}{' ...' if len(bad) > 10 else ''}" if len(bad) else "samples not known"
    return (f"non-finite {what} for {which} (of {m}): a NaN or inf in those samples' inputs, logits or targets, or "
            f"in the parameters; {refused} (drop or fix those samples)")


def nonfinite_samples(rows: torch.Tensor | None, inputs: Any, m: int) -> list[int]:
    """The samples whose rows of ``rows`` (``[M, ...]``) are not finite, else those whose floating inputs (every
    tensor of ``inputs`` with leading dimension ``m``) hold a NaN or inf; ``[]`` if neither tells.

    Args:
        rows: a per-sample result (``J_z v``), or ``None``.
        inputs: the batch's inputs (a tensor, or a tuple, list or dict of them).
        m: the batch size.

    Returns:
        The sample indices, sorted.
    """
    if rows is not None and rows.dim() >= 1 and rows.shape[0] == m:
        bad = ~torch.isfinite(rows.detach().reshape(m, -1)).all(dim=1)
        if bool(bad.any()):
            return torch.nonzero(bad).flatten().tolist()
    found = torch.zeros(m, dtype=torch.bool)
    stack = [inputs]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor) and item.is_floating_point() and item.dim() >= 1 and item.shape[0] == m:
            found |= ~torch.isfinite(item.detach().reshape(m, -1)).all(dim=1).cpu()
    return torch.nonzero(found).flatten().tolist()


def extract_logits(output: Any) -> torch.Tensor:
    """``output.logits`` if present, ``output[0]`` for tuples, else the output itself."""
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)):
        if not output:
            raise ValueError(f"the model returned an empty {type(output).__name__}; expected logits [M, C] / [M, T, C]")
        logits = output[0]
    if logits is None:
        logits = output
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"the model returned {type(output).__name__}; expected logits or an object with .logits")
    return logits


def check_batch(batch: Any, index: int) -> tuple[Inputs, torch.Tensor]:
    """One element of a ``batches`` iterable as the ``(inputs, targets)`` pair every batched function takes.

    Args:
        batch: the element.
        index: its position, named in the error.

    Returns:
        ``(inputs, targets)``.

    Raises:
        ValueError: ``batch`` is not a pair, in one sentence saying what it is and what to pass instead (a Hugging
            Face style mapping with ``labels``; a bare tensor, as when one ``(x, y)`` pair is passed for the batches).
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    accepted = "batches must be an iterable of (inputs, targets) pairs"
    if isinstance(batch, Mapping):
        keys = ", ".join(repr(k) for k in batch)
        hint = ("; split it: ({k: v for k, v in b.items() if k != 'labels'}, b['labels'])" if "labels" in batch
                else "")
        raise ValueError(f"{accepted}; batches[{index}] is a mapping with keys {keys}{hint}")
    if isinstance(batch, torch.Tensor):
        raise ValueError(f"{accepted}; batches[{index}] is a tensor of shape {list(batch.shape)} (for one batch "
                         "(x, y), pass [(x, y)])")
    size = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    raise ValueError(f"{accepted}; batches[{index}] is a {type(batch).__name__}{size}")


def call_model(model: torch.nn.Module, inputs: Inputs) -> torch.Tensor:
    """Run the model on ``inputs`` and return its logits (the calling convention of ``ief``'s package docstring).

    Args:
        model: the model.
        inputs: a tensor (``model(inputs)``), a tuple (``model(*inputs)``) or a mapping (``model(**inputs)``).

    Returns:
        The logits, class dimension last: the model's output, or its ``.logits`` (or first element).

    Raises:
        ValueError: an output with no logits to take.
    """
    if isinstance(inputs, Mapping):
        out = model(**inputs)
    elif isinstance(inputs, tuple):
        out = model(*inputs)
    else:
        out = model(inputs)
    return extract_logits(out)


def batch_size(logits: torch.Tensor) -> int:
    if logits.dim() < 2:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)}: expected [M, C] or [M, T, C] with the class dimension last"
        )
    if logits.shape[0] == 0:
        raise ValueError(f"logits of shape {tuple(logits.shape)}: the batch holds no samples (M = 0)")
    return int(logits.shape[0])


def check_targets(targets: torch.Tensor) -> int:
    """``M`` from ``targets [M, ...]``, before any forward: a tensor with at least one sample (``ValueError``)."""
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"targets must be a tensor, got {type(targets).__name__}")
    if targets.dim() == 0:
        raise ValueError("targets must have a sample dimension first ([M] or [M, T]), got a scalar tensor")
    if targets.shape[0] == 0:
        raise ValueError(f"targets of shape {tuple(targets.shape)}: the batch holds no samples (M = 0); M must be >= 1")
    return int(targets.shape[0])


def take_first(inputs: Inputs, m: int) -> Inputs:
    """The batch's first sample (every tensor whose leading dimension is ``m``, cut to 1), for shape probes."""
    if isinstance(inputs, Mapping):
        return {k: take_first(v, m) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(take_first(v, m) for v in inputs)
    if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1 and inputs.shape[0] == m:
        return inputs[:1]
    return inputs


def shapes_of(inputs: Inputs) -> tuple:
    """The shape, dtype and device of every tensor in ``inputs`` (a hashable summary)."""
    if isinstance(inputs, Mapping):
        return tuple((k, shapes_of(v)) for k, v in inputs.items())
    if isinstance(inputs, (tuple, list)):
        return tuple(shapes_of(v) for v in inputs)
    if isinstance(inputs, torch.Tensor):
        return (*inputs.shape, inputs.dtype, inputs.device)
    if inputs is None or isinstance(inputs, (bool, int, float, str)):
        return (repr(inputs),)
    return (type(inputs).__name__,)


_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
# Global hooks from torch's own module trackers (ModTracker, under MemTracker and FlopCounterMode, and
# torch.utils.module_tracker): they record which module runs and return nothing, so a forward's outputs do not depend
# on them. Left out of the key, a step measured under a memory tracker reuses its proofs (a probe forward there is
# refused: MemTracker does not track a module called twice in one iteration).
_OBSERVER_MODULES = ("torch.distributed._tools.", "torch.utils.module_tracker")


def _global_hooks(table: Mapping) -> tuple:
    """The handles of a table of global hooks that may change a forward (:data:`_OBSERVER_MODULES`' left out)."""
    return tuple(k for k, hook in table.items()
                 if not str(getattr(hook, "__module__", "") or "").startswith(_OBSERVER_MODULES))


def _tensors_signature(table: Mapping) -> tuple:
    return tuple((k, id(t), t.dtype, t.device, t.shape, t.requires_grad) if t is not None else k
                 for k, t in table.items()) if table else ()


def forward_signature(model: torch.nn.Module, inputs: Inputs) -> tuple:
    """What a proof about one forward of ``model`` on ``inputs`` rests on, as a hashable summary compared by equality
    (the key of the proofs a steady call reuses: the sample axes, the precision record, the forward-mode hazard).

    It holds every submodule (identity, class, training flag, a ``forward`` set on the instance), the hooks on each
    and the global module hooks (by handle: a hook removed and another registered differ; torch's module trackers'
    hooks, which only observe, left out), every parameter and
    buffer (identity, dtype, device, shape, ``requires_grad``), and the inputs' shapes, dtypes and devices
    (:func:`shapes_of`). A changed shape, dtype, module or hook changes it; Python state a forward reads besides
    these (a flag set on a module between calls) does not. Cost: one walk of the modules, no tensor read.

    Args:
        model: the module called.
        inputs: its inputs.

    Returns:
        The signature.
    """
    hooks = torch.nn.modules.module
    parts = [shapes_of(inputs), tuple(_global_hooks(getattr(hooks, name, {})) for name in _GLOBAL_HOOKS)]
    stack, seen = [model], set()
    while stack:  # model.modules() without its generators: a third of the cost
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        parts.append((id(module), type(module), module.training, id(module.__dict__.get("forward")),
                      tuple(module._forward_pre_hooks), tuple(module._forward_hooks),
                      tuple(module._backward_pre_hooks), tuple(module._backward_hooks),
                      _tensors_signature(module._parameters), _tensors_signature(module._buffers)))
        stack.extend(child for child in reversed(module._modules.values()) if child is not None)
    return tuple(parts)


class ReplayableForward:
    """Calls ``model`` on fixed inputs with the same RNG state every time (same dropout masks).

    The first call draws from the global generators as an ordinary forward would (so training that interleaves
    curvature computations still advances the RNG); every later call replays that first call's RNG state.
    """

    def __init__(self, model: torch.nn.Module, inputs: Inputs):
        self.model = model
        self.inputs = inputs
        self._devices = _cuda_devices(model)
        self._cpu_state = torch.get_rng_state()
        self._cuda_states = [torch.cuda.get_rng_state(d) for d in self._devices]
        self._calls = 0
        # whether the first call drew random numbers on a CUDA device (None: not called yet); see draws_cuda_random
        self._draws_cuda_random: bool | None = None
        self.watch: Mapping[int, int] | None = None  # leaves whose presence in the graph is reported in ``reached``
        self.reached: set[int] = set()

    @contextlib.contextmanager
    def _replayed_rng(self) -> Iterator[None]:
        self._calls += 1
        if self._calls == 1:
            yield
            self._draws_cuda_random = any(not torch.equal(torch.cuda.get_rng_state(d), state)
                                          for d, state in zip(self._devices, self._cuda_states))
            return
        with torch.random.fork_rng(devices=self._devices):
            torch.set_rng_state(self._cpu_state)
            for d, s in zip(self._devices, self._cuda_states):
                torch.cuda.set_rng_state(s, d)
            yield

    def rewind_rng(self) -> None:
        """Set the global generators to the state this forward's first call drew from, so that a new forward of the
        same model constructed now draws the same dropout masks (the exact check's float32 forward; call it inside
        ``torch.random.fork_rng``, which puts the generators back)."""
        torch.set_rng_state(self._cpu_state)
        for d, s in zip(self._devices, self._cuda_states):
            torch.cuda.set_rng_state(s, d)

    @property
    def draws_cuda_random(self) -> bool:
        """Whether the forward draws random numbers on a CUDA device (dropout in train mode): measured on the first
        call (the CUDA generators' states before and after); before it, assumed for a CUDA model in train mode.

        ``torch.func.vmap(randomness="same")`` draws such numbers with other kernels than a plain forward, so on a
        CUDA device ``F.dropout``'s mask under vmap need not be the plain forward's from the same generator state (it
        was not on the GPU observed, ``benchmarks/README.md``; on the CPU they agree), and a vmapped replay of this
        forward would not be the same function."""
        if self._draws_cuda_random is None:
            return bool(self._devices) and any(m.training for m in self.model.modules())
        return self._draws_cuda_random

    def __call__(self, substitute: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits, optionally with some parameters substituted (``torch.func.functional_call``).

        HuggingFace layers checkpointed reentrantly run non-reentrantly, any other reentrant checkpoint raises
        :class:`ReentrantCheckpointError` (:func:`non_reentrant_checkpointing`). With ``watch`` set and gradients on,
        ``reached`` is filled from it (:func:`scan_graph`)."""
        with self._replayed_rng(), non_reentrant_checkpointing(self.model):
            if substitute is None:
                logits = call_model(self.model, self.inputs)
            else:
                logits = _functional_logits(self.model, substitute, self.inputs)
        self.reached = scan_graph(logits, self.watch) if self.watch and torch.is_grad_enabled() else set()
        return logits


def _functional_logits(model: torch.nn.Module, substitute: Mapping[str, torch.Tensor], inputs: Inputs) -> torch.Tensor:
    if isinstance(inputs, Mapping):
        out = torch.func.functional_call(model, dict(substitute), args=(), kwargs=dict(inputs))
    else:
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        out = torch.func.functional_call(model, dict(substitute), args=args)
    return extract_logits(out)


def _cuda_devices(model: torch.nn.Module) -> list[int]:
    if not torch.cuda.is_initialized():  # a CUDA tensor initialises CUDA: none exists, and the walk over the
        return []                         # parameters (once per Fisher-vector product) is skipped
    devices = {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}
    return sorted(devices)
